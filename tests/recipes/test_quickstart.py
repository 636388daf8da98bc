"""The README's main job and the calibration-block cutting it relies on."""

import json

import pytest
import torch

import ompmoe
from ompmoe.engine.planning.allocation import InfeasibleBudgetError
from ompmoe.data import byte_tokens, shipped_text, token_blocks
from ompmoe.engine.io import OutputExistsError
from ompmoe.recipes.quickstart import prune_tiny_model


def test_token_blocks_are_the_first_non_overlapping_blocks():
    stream = torch.arange(103)
    blocks = token_blocks(stream, seq_len=10, num_blocks=10)
    assert torch.equal(blocks, torch.arange(100).view(10, 10))


def test_token_blocks_refuse_short_text_with_counts():
    with pytest.raises(ValueError) as error:
        token_blocks(torch.arange(95), seq_len=10, num_blocks=10)
    assert str(error.value) == (
        "Calibration text has 95 tokens but 10 blocks of 10 need 100: "
        "add text, or lower num_blocks to 9 or seq_len to 9."
    )


def test_shipped_text_is_real_text():
    text = shipped_text()
    assert text.startswith("Assignment statements")
    assert byte_tokens(text).numel() >= 64 * 2048


def test_main_job_writes_stats_plan_and_a_model_that_reloads(tmp_path):
    """The default job prunes the trained shipped model, calibrated on both corpus domains."""
    out = tmp_path / "run"
    result = prune_tiny_model(output_dir=str(out), seq_len=64, num_blocks=4, batch_size=2)
    assert sorted(p.name for p in out.iterdir()) == [".ompmoe-output", "model", "plan.json", "stats.safetensors"]
    plan = ompmoe.PruningPlan.load(out / "plan.json")
    stats = ompmoe.MoEStats.load(out / "stats.safetensors")
    assert stats.num_tokens == 4 * 64
    assert stats.model_id == "shipped:tiny-moe"
    assert stats.sources == ["shipped:prose,code calibration splits"]
    assert result["achieved_ratio"] == pytest.approx(plan.achieved_ratio)
    # A trained model: far below the uniform perplexity of its 4096-token vocabulary, and pruning half
    # its experts costs some of it.
    assert result["perplexity_before"] < 200 < 4096
    assert result["perplexity_after"] > result["perplexity_before"]
    model = ompmoe.load_pruned(out / "model")
    kept = json.loads((out / "model" / "config.json").read_text())["ompmoe"]["kept_experts"]
    assert kept == plan.kept_by_layer()
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(model)] == [len(k) for k in kept.values()]
    assert model.config.vocab_size == 4096 and len(kept) == 6


def test_main_job_keeps_random_tiny_models_of_other_architectures(tmp_path):
    out = tmp_path / "run"
    prune_tiny_model(output_dir=str(out), model="tiny", model_type="gpt_oss", seq_len=64, num_blocks=4, batch_size=2)
    stats = ompmoe.MoEStats.load(out / "stats.safetensors")
    assert (stats.model_type, stats.model_id, stats.sources) == ("gpt_oss", "ompmoe.engine.tiny:gpt_oss", ["shipped:python-docs"])
    assert stats.num_tokens == 4 * 64


def test_main_job_names_the_models_it_accepts(tmp_path):
    with pytest.raises(ValueError) as error:
        prune_tiny_model(output_dir=str(tmp_path / "run"), model="Qwen/Qwen3-30B-A3B")
    assert str(error.value) == (
        "model must be 'shipped:tiny-moe' (the trained shipped model) or 'tiny' (a random tiny model of model_type); "
        "got 'Qwen/Qwen3-30B-A3B'. For other checkpoints use `ompmoe fit`."
    )
    assert not (tmp_path / "run").exists()


def test_main_job_refuses_existing_output_and_bad_ratio_before_work(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(OutputExistsError):
        prune_tiny_model(output_dir=str(out))
    assert list(out.iterdir()) == []
    fresh = tmp_path / "fresh"
    with pytest.raises(InfeasibleBudgetError, match=r"use a ratio in \[0.1250, 0.6250\]"):
        prune_tiny_model(output_dir=str(fresh), ratio=0.9)
    assert not fresh.exists()
    assert list(tmp_path.iterdir()) == [out]


def test_the_demo_refuses_an_output_its_disk_cannot_hold_before_calibrating(tmp_path, monkeypatch):
    """Its line names what the demo takes (it has no save_model), and nothing is left."""
    import collections
    import re
    import shutil

    from ompmoe.engine.disk_space import NotEnoughSpaceError

    monkeypatch.setattr(shutil, "disk_usage", lambda path: collections.namedtuple("Usage", "total used free")(
        2**40, 0, 2**20))
    with pytest.raises(NotEnoughSpaceError) as refused:
        prune_tiny_model(output_dir=str(tmp_path / "out"), seq_len=64, num_blocks=4, batch_size=2)
    assert re.fullmatch(rf"not enough disk space at {re.escape(str(tmp_path / 'out'))}: the pruned model needs at "
                        r"least [0-9.]+ MiB and its file system has 1 MiB free; free space there, or choose another "
                        r"output_dir", str(refused.value)), str(refused.value)
    assert list(tmp_path.iterdir()) == []
