"""ExpertPruning(reroute=True): the rerouting-aware Grams in a Lightning fit, across ranks and checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import ompmoe
from ompmoe import PruningStrategy
from ompmoe.callbacks import ExpertPruning
from ompmoe.engine.tiny import tiny_model
from ompmoe.lightning.calibration_module import CalibrationModule

from reference import batches, trainer

TESTS = Path(__file__).resolve().parents[1]


def assert_stats_equal(a: ompmoe.MoEStats, b: ompmoe.MoEStats, rtol: float) -> None:
    assert a.num_tokens == b.num_tokens
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert la.tensors().keys() == lb.tensors().keys()
        for key, value in la.tensors().items():
            torch.testing.assert_close(value, lb.tensors()[key], rtol=rtol, atol=rtol * float(value.abs().max()))


def test_reroute_fit_equals_collect_stats_and_plans_omp_reroute():
    data = batches(4)
    callback = ExpertPruning(PruningStrategy(ratio=0.5, method="omp_reroute"), reroute=True)
    trainer(callbacks=[callback]).fit(CalibrationModule("tiny:qwen3_moe"), DataLoader(data, batch_size=2))
    expected = ompmoe.collect_stats(tiny_model("qwen3_moe"), DataLoader(data, batch_size=2), reroute=True)
    assert callback.stats.layers[0].gram_reroute is not None
    assert_stats_equal(callback.stats, expected, rtol=1e-9)
    assert callback.plan.kept_by_layer() == ompmoe.plan_pruning(expected, 0.5, method="omp_reroute").kept_by_layer()
    assert set(callback.state_dict()["states"]) >= {"reroute.gram_reroute_0", "reroute.gram_reroute_normalized_0"}


def test_omp_reroute_without_reroute_statistics_is_refused_before_calibration():
    callback = ExpertPruning(PruningStrategy(ratio=0.5, method="omp_reroute"))
    with pytest.raises(ValueError) as error:
        trainer(callbacks=[callback]).fit(CalibrationModule("tiny:qwen3_moe"), DataLoader(batches(2), batch_size=2))
    assert str(error.value) == (
        "The strategy's method 'omp_reroute' needs rerouting-aware statistics, which this calibration would not "
        "collect: pass ExpertPruning(..., reroute=True)."
    )
    assert callback.stats is None


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_reroute_statistics_equal_single_process(tmp_path):
    """Two DDP ranks (one padding duplicate left out) sum to the rerouting-aware Grams of one process."""
    out = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(TESTS / "distributed_fit.py"), str(out), "ddp", "5", "qwen3_moe", "reroute"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sys.path.insert(0, str(TESTS))
    from distributed_fit import calibration_batches

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = ompmoe.collect_stats(tiny_model("qwen3_moe"), calibration_batches(5), reroute=True)
    finally:
        torch.set_num_threads(threads)
    got = ompmoe.MoEStats.load(out / "stats.safetensors")
    assert got.layers[0].gram_reroute is not None
    assert_stats_equal(got, expected, rtol=1e-9)
