"""benchmarks/calibration_cost.py and the calibration-cost column of benchmarks/quality.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import calibration_cost  # noqa: E402
import quality  # noqa: E402
import quality_report  # noqa: E402


def test_peak_memory_resets_the_mark_before_the_pass_and_reads_it_around_it(monkeypatch):
    """The order that makes a freed allocation count, without measuring this process's memory: the peak mark is
    reset, read (the resident size before), the pass runs, the mark is read again; extra = after - before."""
    events = []
    marks = iter([1000.0, 1256.5])
    monkeypatch.setattr(calibration_cost, "_reset_peak_rss", lambda: events.append("reset") or True)
    monkeypatch.setattr(calibration_cost, "_max_rss_mib", lambda: events.append("read") or next(marks))
    monkeypatch.setattr("gc.collect", lambda *args: events.append("gc") or 0)
    result = calibration_cost.measure_peak_memory(lambda: events.append("pass"))
    assert events == ["gc", "reset", "read", "pass", "read"]
    assert result == {"before_mib": 1000.0, "peak_mib": 1256.5, "extra_mib": 256.5,
                      "memory_method": "peak RSS mark (VmHWM) reset before the pass"}

    monkeypatch.setattr(calibration_cost, "_reset_peak_rss", lambda: False)  # no /proc/self/clear_refs
    monkeypatch.setattr(calibration_cost, "_max_rss_mib", iter([10.0, 12.0]).__next__)
    assert calibration_cost.measure_peak_memory(lambda: None)["memory_method"] == (
        "difference of peak RSS marks (the mark could not be reset: lower bound)")


def test_peak_rss_mark_is_vmhwm_else_ru_maxrss(monkeypatch):
    """``VmHWM`` of /proc/self/status in MiB (kB / 1024); ``ru_maxrss`` (kB on Linux) where the file cannot be read;
    the reset writes ``5`` to /proc/self/clear_refs and says whether it could."""
    import builtins
    import io
    import resource

    status = "Name:\tpython\nVmPeak:\t 9999 kB\nVmHWM:\t  262144 kB\nVmRSS:\t 1024 kB\n"
    written = []

    class ClearRefs(io.StringIO):
        def close(self):
            written.append(self.getvalue())
            super().close()

    def fake_open(path, mode="r", *args, **kwargs):
        if path == "/proc/self/status":
            return io.StringIO(status)
        if path == "/proc/self/clear_refs" and mode == "w":
            return ClearRefs()
        raise OSError(f"test: {path}")

    monkeypatch.setattr(builtins, "open", fake_open)
    assert calibration_cost._max_rss_mib() == 256.0
    assert calibration_cost._reset_peak_rss() is True and written == ["5"]

    def no_proc(path, *args, **kwargs):
        raise OSError(f"test: {path}")

    monkeypatch.setattr(builtins, "open", no_proc)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    monkeypatch.setattr(resource, "getrusage", lambda who: type(usage)((*usage[:2], 3072, *usage[3:])))
    assert calibration_cost._max_rss_mib() == 3.0
    assert calibration_cost._reset_peak_rss() is False


def test_interleaved_medians_and_ratios():
    calls = []
    runs = {k: (lambda k=k: calls.append(k)) for k in calibration_cost.PASSES}
    times = calibration_cost.time_passes(runs, repeats=3, warmup=1)
    assert calls == list(calibration_cost.PASSES) * 4  # one warm-up round, then three rounds, interleaved
    assert set(times) == {"wall", "cpu"} and all(set(times[kind]) == set(calibration_cost.PASSES) for kind in times)
    assert all(seconds >= 0.0 for kind in times.values() for seconds in kind.values())
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
