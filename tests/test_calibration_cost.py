"""benchmarks/calibration_cost.py and the calibration-cost column of benchmarks/quality.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import calibration_cost  # noqa: E402
import quality  # noqa: E402
import quality_report  # noqa: E402


def test_peak_memory_sees_an_allocation_freed_before_the_end():
    """The peak of a pass that allocates and frees 256 MiB is counted (above what was resident before)."""
    def allocate() -> None:
        block = torch.ones(64, 1024, 1024)  # 256 MiB, written so it is resident
        del block

    result = calibration_cost.measure_peak_memory(allocate)
    assert result["memory_method"] == "peak RSS mark (VmHWM) reset before the pass"
    assert 250 <= result["extra_mib"] <= 300
    assert calibration_cost.measure_peak_memory(lambda: None)["extra_mib"] < 16


def test_interleaved_medians_and_ratios():
    calls = []
    runs = {k: (lambda k=k: calls.append(k)) for k in calibration_cost.PASSES}
    times = calibration_cost.time_passes(runs, repeats=3, warmup=1)
    assert calls == list(calibration_cost.PASSES) * 4  # one warm-up round, then three rounds, interleaved
    assert calibration_cost.median([3.0, 1.0, 2.0]) == 2.0 and calibration_cost.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    wall = {"forward": 2.0, "forward_backward": 5.0, "stats": 2.5, "loss_stats": 5.25, "reroute_stats": 3.0}
    memory = {k: {"before_mib": 100.0, "extra_mib": v, "memory_method": "m"}
              for k, v in zip(calibration_cost.PASSES, (10.0, 40.0, 12.0, 44.0, 15.0))}
    report = calibration_cost.cost_report({"wall": wall, "cpu": wall}, memory)
    assert report["loss_stats_over_forward_backward"] == pytest.approx(1.05)
    assert report["stats_over_forward"] == pytest.approx(1.25)
    assert report["memory_over_forward"]["loss_stats"] == pytest.approx(4.4)
    assert report["peak_extra_mib"]["forward_backward"] == 40.0
    assert "auto_over_forward_backward" not in report  # no choice blocks, no auto pass
    with_auto = calibration_cost.cost_report({"wall": {**wall, "auto_choice": 0.5}, "cpu": {**wall, "auto_choice": 1.0}}, None)
    assert with_auto["auto_over_forward_backward"] == pytest.approx((5.25 + 0.5) / 5.0)
    assert with_auto["cpu_auto_over_forward_backward"] == pytest.approx((5.25 + 1.0) / 5.0)


def test_quality_cost_column_is_relative_to_the_forward_and_reads_old_timing_files():
    rows = [{"method": "omp", "allocation": "waterfill", "calib_cost": 1.0},
            {"method": "omp_normalized_seq", "allocation": "loss", "calib_cost": 3.0},
            {"method": "omp_reroute", "allocation": "uniform", "calib_cost": 1.5}]
    timing = {"stats_over_forward": 1.2, "memory_over_forward": {"stats": 1.1, "loss_stats": 4.0, "reroute_stats": 1.5}}
    cells = [quality_report.calibration_cost_cell(r) for r in quality.with_cost_vs_forward(rows, timing)]
    assert cells == ["1.20x / 1.10x", "3.60x / 4.00x", "1.80x / 1.50x"]
    old = quality.with_cost_vs_forward(rows, {"stats_over_forward": 1.2})  # timing.json before memory was measured
    assert quality_report.calibration_cost_cell(old[0]) == "1.20x / n/a"
    none = quality.with_cost_vs_forward(rows, {})
    assert math.isnan(none[0]["calib_time_vs_forward"]) and quality_report.calibration_cost_cell(none[0]) == "1.00x stats"
