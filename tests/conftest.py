"""Fixtures shared by the ompmoe tests (reference implementations live in ``reference.py``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

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
