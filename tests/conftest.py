"""Fixtures shared by the ompmoe tests (reference implementations live in ``reference.py``)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Under pytest-xdist (``-n auto``) the workers share the cores: each test process already runs torch on one thread
# (reference.py), and the commands tests start get the same share instead of every core each.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# Test modules in sub-folders import the helpers of this folder (reference.py, make_*.py, ...).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ompmoe import MoELayer, MoEStats, collect_stats, find_moe_layers  # noqa: E402

from reference import ARCH_IDS, LiteralLayer, capture_block_inputs, literal_layer, make_model, random_ids  # noqa: E402


@dataclass
class Collected:
    """A model, its statistics from ``collect_stats`` and the literal per-layer reference."""

    case: str
    model: torch.nn.Module
    layers: list[MoELayer]
    stats: MoEStats
    literal: list[LiteralLayer]


@pytest.fixture(scope="session", params=ARCH_IDS)
def collected(request) -> Collected:
    """Statistics of one 2 x 16 batch, collected by ompmoe and rebuilt the slow way from block inputs."""
    model = make_model(request.param)
    layers = find_moe_layers(model)
    with capture_block_inputs(layers) as captured:
        stats = collect_stats(model, [random_ids(seed=1)])
    literal = [literal_layer(layer, inputs[0]) for layer, inputs in zip(layers, captured)]
    assert all(len(inputs) == 1 for inputs in captured)
    return Collected(request.param, model, layers, stats, literal)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, modules holding slow tests are handed out first (longest first): the workers start the long
    ones together and fill in with the short ones, instead of one worker finishing the last long module alone."""
    if not getattr(config.option, "numprocesses", None):
        return
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)  # stable: the order inside stays
