"""The flattened experts call under autograd (loss-aware statistics): same bits as one call, native gradients."""

from __future__ import annotations

import pytest
import torch

from ompmoe import find_moe_layers
from ompmoe.engine.collect.collector import _per_expert_forward, expose_expert_outputs

from reference import make_model, random_ids


def block_inputs(layer, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(40, layer.experts.gate_up_proj.shape[-1], generator=generator)
    scores = torch.randn(40, layer.num_experts, generator=generator)
    weights, ids = scores.softmax(-1).topk(layer.top_k, dim=-1)
    return hidden, ids, weights


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_per_expert_call_has_the_one_call_bits(implementation):
    model = make_model("qwen3_moe")
    model.set_experts_implementation(implementation)
    experts = find_moe_layers(model)[0].experts
    hidden, ids, weights = block_inputs(find_moe_layers(model)[0], seed=0)
    unit = torch.ones(ids.numel(), 1)
    with torch.no_grad():
        one_call = experts(hidden.repeat_interleave(ids.shape[1], dim=0), ids.reshape(-1, 1), unit)
        per_expert = _per_expert_forward(experts.forward, hidden, ids, unit.dtype)
    assert torch.equal(per_expert, one_call)


@pytest.mark.parametrize("frozen", [True, False])
def test_gradients_through_the_instrumented_experts_equal_the_native_ones(frozen):
    """Input, routing-weight and (unfrozen) weight gradients equal the native module's to float32 rounding."""
    model = make_model("qwen3_moe")
    model.set_experts_implementation("eager")
    model.requires_grad_(not frozen)
    layer = find_moe_layers(model)[0]
    hidden, ids, weights = block_inputs(layer, seed=1)
    direction = torch.randn(40, hidden.shape[1], generator=torch.Generator().manual_seed(2))
    params = [p for p in layer.experts.parameters() if p.requires_grad]

    def gradients(instrumented: bool) -> list[torch.Tensor]:
        h, w = hidden.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        seen = []
        if instrumented:
            with expose_expert_outputs([layer], lambda *args: seen.append(args)):
                out = layer.experts(h, ids, w)
            assert len(seen) == 1 and seen[0][4].shape == (40 * layer.top_k, hidden.shape[1])
        else:
            out = layer.experts(h, ids, w)
        return list(torch.autograd.grad((out * direction).sum(), [h, w, *params]))

    for got, expected in zip(gradients(True), gradients(False), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


def test_one_model_forward_backward_through_instrumented_experts():
    model = make_model("deepseek_v2_grouped")
    model.set_experts_implementation("eager")
    model.requires_grad_(False)
    ids = random_ids(seed=3)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    native = torch.autograd.grad(model(inputs_embeds=embeds, use_cache=False).logits.square().sum(), embeds)[0]
    with expose_expert_outputs(find_moe_layers(model), lambda *args: None):
        instrumented = torch.autograd.grad(model(inputs_embeds=embeds, use_cache=False).logits.square().sum(), embeds)[0]
    torch.testing.assert_close(instrumented, native, rtol=1e-4, atol=1e-5 * float(native.abs().max()))
