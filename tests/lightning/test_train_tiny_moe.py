"""The training script of the shipped models (``benchmarks/train_tiny_moe.py``): its ``sorted`` experts kernel
computes the eager loop's function, and the shipped cards regenerate from their metrics with every training stage."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from ompmoe.data import shipped_model_path
from ompmoe.engine.tiny import tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_tiny_moe.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_tiny_moe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.register_experts_kernels()
    return module


@pytest.mark.parametrize("model_type", ["glm4_moe", "qwen3_moe"])
def test_sorted_experts_kernel_matches_the_eager_loop_in_outputs_and_gradients(script, model_type):
    results = {}
    for implementation in ("eager", "sorted"):
        model = tiny_model(model_type, seed=0).train()
        model.set_experts_implementation(implementation)
        ids = torch.randint(0, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        results[implementation] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    (eager_loss, eager_grads), (sorted_loss, sorted_grads) = results["eager"], results["sorted"]
    torch.testing.assert_close(sorted_loss, eager_loss, rtol=1e-6, atol=1e-6)
    assert sorted_grads.keys() == eager_grads.keys()
    assert any(".experts." in name for name in eager_grads)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(sorted_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-moe-64", "tiny-moe-a3b"])
def test_shipped_cards_regenerate_from_metrics_with_every_stage_and_command(script, name):
    directory = shipped_model_path(name)
    metrics = json.loads((directory / "metrics.json").read_text(encoding="utf-8"))
    card = (directory / "README.md").read_text(encoding="utf-8")
    assert script.model_card(metrics) == card
    stages = script.training_stages(metrics["training"])
    for stage in stages:  # each stage's command is in the card's reproduce block, in order
        assert script.stage_command(stage, metrics["architecture"]) in card
    positions = [card.index(script.stage_command(stage, metrics["architecture"])) for stage in stages]
    assert positions == sorted(positions)
    for earlier, later in zip(stages, stages[1:]):
        assert later["init_from"] == f"ompmoe/data/{name}"
        assert f"Then **{later['steps']} steps continued from that checkpoint**" in card
        assert later["previous_stage"] is earlier
