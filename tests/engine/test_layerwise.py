"""A model bigger than memory: statistics collected one decoder layer at a time equal the resident pass's (the same
plan), and a checkpoint written from its source files tensor by tensor equals ``save_pruned``'s, on every
architecture the matrix supports and on the shipped models."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ompmoe
from ompmoe.engine.collect.layerwise import LayerwiseUnsupportedError, collect_stats_layerwise
from ompmoe.engine.export.streamed import save_pruned_from_files
from ompmoe.engine.lazy_checkpoint import checkpoint_files
from ompmoe.engine.names import SHIPPED_MODELS, shipped_model_path
from ompmoe.engine.tiny import tiny_model

from test_every_moe import MULTIMODAL, MULTIMODAL_REFUSED, NO_TINY_CONFIG, REFUSED, TYPES

BLOCKS = [torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
PASS_STATE = {"glm_moe_dsa", "hy_v4", "hy_v4_vl", "zaya"}
"""Types whose decoder layers hand more than the hidden states to the next layer: refused layer by layer."""
SUPPORTED = [t for t in TYPES + MULTIMODAL if t not in {*REFUSED, *MULTIMODAL_REFUSED, *NO_TINY_CONFIG}]


def file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in checkpoint_files(directory):
        with safe_open(str(file), "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def assert_same_statistics(resident: ompmoe.MoEStats, layered: ompmoe.MoEStats) -> None:
    assert [layer.name for layer in layered.layers] == [layer.name for layer in resident.layers]
    assert layered.num_tokens == resident.num_tokens and layered.fingerprint == resident.fingerprint
    for ours, theirs in zip(layered.layers, resident.layers):
        for key, value in theirs.tensors().items():
            torch.testing.assert_close(ours.tensors()[key], value, rtol=1e-6, atol=0)


def assert_same_checkpoint(expected: Path, actual: Path) -> None:
    """Bit-identical tensors (names, dtypes, values), the same files and the same config.json."""
    assert sorted(path.name for path in actual.iterdir()) == sorted(path.name for path in expected.iterdir())
    ours, theirs = file_tensors(actual), file_tensors(expected)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    assert json.loads((actual / "config.json").read_text()) == json.loads((expected / "config.json").read_text())


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_layer_by_layer_statistics_and_the_streamed_checkpoint_equal_the_resident_ones(model_type, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(model_type, dtype=torch.bfloat16)
        model.save_pretrained(tmp_path / "source")
        resident = ompmoe.collect_stats(model, BLOCKS, model_id=str(tmp_path / "source"), progress=False)
        plan = ompmoe.plan_pruning(resident, 0.5, allocation="waterfill")
        tokenizer = str(shipped_model_path())  # the same tokenizer files in both
        ompmoe.save_pruned(ompmoe.prune(model, plan), tmp_path / "resident", tokenizer=tokenizer)
        save_pruned_from_files(tmp_path / "source", plan, tmp_path / "streamed", tokenizer=tokenizer)
    assert_same_checkpoint(tmp_path / "resident", tmp_path / "streamed")
    if model_type in PASS_STATE:
        with pytest.raises(LayerwiseUnsupportedError) as refused:  # the indexer's top-k, Zaya's router state
            collect_stats_layerwise(tmp_path / "source", BLOCKS, progress=False)
        assert str(refused.value).startswith(f"{type(model).__name__}'s decoder layers pass more than the hidden "
                                             "states on to the next layer (its forward failed after ")
        assert str(refused.value).endswith("layer-by-layer calibration cannot run them one at a time. Calibrate it "
                                           "resident instead.")
        return
    layered = collect_stats_layerwise(tmp_path / "source", BLOCKS, progress=False)
    assert_same_statistics(resident, layered)
    assert ompmoe.plan_pruning(layered, 0.5, allocation="waterfill").kept_by_layer() == plan.kept_by_layer()


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_the_shipped_models_calibrate_layer_by_layer_to_the_same_plan(name, tmp_path):
    import ompmoe.data
    from ompmoe.data import token_blocks

    source = shipped_model_path(name)
    model = ompmoe.load_pruned(source, dtype="auto")
    blocks = token_blocks(ompmoe.data.byte_tokens(ompmoe.data.shipped_text()), seq_len=64, num_blocks=4)
    resident = ompmoe.collect_stats(model, blocks, model_id=str(source), progress=False)
    layered = collect_stats_layerwise(source, blocks, progress=False)
    assert_same_statistics(resident, layered)
    plan = ompmoe.plan_pruning(layered, 0.5)
    assert plan.kept_by_layer() == ompmoe.plan_pruning(resident, 0.5).kept_by_layer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ompmoe.save_pruned(ompmoe.prune(model, plan), tmp_path / "resident")
    save_pruned_from_files(source, plan, tmp_path / "streamed")
    assert_same_checkpoint(tmp_path / "resident", tmp_path / "streamed")


def test_what_needs_the_whole_model_is_refused_layer_by_layer_before_any_work(tmp_path):
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    with pytest.raises(ValueError) as refused:
        collect_stats_layerwise(tmp_path, BLOCKS, statistics=["loss_aware"], progress=False)
    assert str(refused.value) == (
        "layer-by-layer calibration cannot collect 'loss_aware' statistics: loss-aware statistics need a backward "
        "through the whole model; collect them resident (or plan with the paper's setting, which needs none).")
