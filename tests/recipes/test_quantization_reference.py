"""``quantize_experts`` against a literal reference (``tests/quantization_reference.py``): codes, scales and int4
packing bit for bit, the dequantized weights, and the experts' output (exact against the reference weights, within
the bound the quantization step allows against the full-precision weights)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ompmoe
from ompmoe.engine.tiny import TINY_CONFIGS, tiny_model
from quantization_reference import f32, group_size_used, reference_quantize


def expert_weights(model: torch.nn.Module) -> dict[tuple[torch.nn.Module, str], torch.Tensor]:
    """``(experts module, name) -> copy`` of every fused 3-D routed-expert weight (before quantizing: afterwards
    the weights are parametrized and ``find_moe_layers`` no longer lists them)."""
    return {(layer.experts, name): p.detach().clone() for layer in ompmoe.find_moe_layers(model)
            for name, p in layer.experts.named_parameters(recurse=False) if p.dim() == 3}


def stored(experts: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, scales, dense weight as the experts read it)`` of a quantized weight."""
    parametrization = experts.parametrizations[name]
    return parametrization.original0, parametrization.original1, getattr(experts, name)


def bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (0.0 and -0.0 told apart)."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    if actual.is_floating_point():
        return torch.equal(actual.view(torch.int32), expected.view(torch.int32))
    return torch.equal(actual, expected)


# Groups of 8 along one 32-wide row, each written out with its codes: exact scales, exact halves (rounded to even),
# a group of zeros, a scale that is not a power of two (1/7 rounds up in float32, so 0.5 / scale is just under 3.5),
# and large values.
INT4_ROW = ([1.75, -1.75, 0.875, 0.625, -0.625, 0.125, 0.25, 0.0]  # scale 0.25: codes 7 -7 4 2 -2 0 1 0
            + [0.0] * 8  # scale 0: codes 0
            + [-1.0, 0.5, 0.25, -0.125, 0.75, -0.6, 0.1, 0.0]  # scale f32(1/7): codes -7 3 2 -1 5 -4 1 0
            + [100.0, -50.0, 25.0, -12.5, 6.25, 0.0, -100.0, 50.0])  # scale f32(100/7): codes 7 -4 2 -1 0 0 -7 4
INT4_BYTES = [0x1F, 0xAC, 0x86, 0x89,  # (7+8) | (-7+8) << 4 = 0x1F, (4+8) | (2+8) << 4 = 0xAC, ...
              0x88, 0x88, 0x88, 0x88,
              0xB1, 0x7A, 0x4D, 0x89,
              0x4F, 0x7A, 0x88, 0xC1]
INT4_SCALES = [0.25, 0.0, f32(1 / 7), f32(100 / 7)]
INT8_ROW = [63.5, -63.5, 31.75, 31.25, -0.25, 0.75, 1.25, 0.0, 1.5, -1.5] + [0.0] * 22  # scale 63.5 / 127 = 0.5
INT8_CODES = [127, -127, 64, 62, 0, 2, 2, 0, 3, -3] + [0] * 22  # 63.5 and 62.5 rounded to even; -0.5 to 0


def test_int4_codes_scales_and_weights_written_out():
    model = tiny_model("qwen3_moe")
    experts = ompmoe.find_moe_layers(model)[0].experts
    with torch.no_grad():
        experts.gate_up_proj[3, 5] = torch.tensor(INT4_ROW)
    ompmoe.quantize_experts(model, bits=4, group_size=8)
    codes, scales, dense = stored(experts, "gate_up_proj")
    assert codes.dtype == torch.uint8 and codes.shape == (16, 32, 16) and scales.shape == (16, 32, 4)
    assert codes[3, 5].tolist() == INT4_BYTES
    assert scales[3, 5].tolist() == INT4_SCALES
    written = ([7, -7, 4, 2, -2, 0, 1, 0], [0] * 8, [-7, 3, 2, -1, 5, -4, 1, 0], [7, -4, 2, -1, 0, 0, -7, 4])
    assert dense[3, 5].tolist() == [f32(q * s) for group, s in zip(written, INT4_SCALES) for q in group]
    reference = reference_quantize(torch.tensor([INT4_ROW]), 4, 8)  # the reference says the same
    assert reference[0][0].tolist() == INT4_BYTES and reference[1][0].tolist() == INT4_SCALES
    # Read as little-endian int32 words, each group of 8 is GPTQ's sequential order: value i at bits 4i.
    words = codes[3, 5].contiguous().view(torch.int32).tolist()
    assert [[(word >> 4 * i) & 0xF for i in range(8)] for word in words] == [[q + 8 for q in g] for g in written]


def test_int8_codes_scale_and_weights_written_out():
    model = tiny_model("qwen3_moe")
    experts = ompmoe.find_moe_layers(model)[1].experts
    with torch.no_grad():
        experts.gate_up_proj[0, 31] = torch.tensor(INT8_ROW)
    ompmoe.quantize_experts(model, bits=8)
    codes, scales, dense = stored(experts, "gate_up_proj")
    assert codes.dtype == torch.int8 and codes.shape == (16, 32, 32) and scales.shape == (16, 32, 1)  # one per row
    assert codes[0, 31].tolist() == INT8_CODES and scales[0, 31].tolist() == [0.5]
    assert dense[0, 31].tolist() == [q * 0.5 for q in INT8_CODES]


CASES = [(8, 32), (4, 32), (4, 16), (4, 8), (4, 2), (4, 12), (4, 0)]  # 12 and 0 divide no row: one group per row


@pytest.mark.parametrize(("bits", "group_size"), CASES, ids=[f"int{b}-g{g}" for b, g in CASES])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_codes_scales_and_weights_are_the_reference_bit_for_bit(model_type, bits, group_size):
    """gpt_oss stores its experts transposed (groups run along the hidden size), mixtral has 48- and 24-wide rows."""
    model = tiny_model(model_type)
    originals = expert_weights(model)
    ompmoe.quantize_experts(model, bits=bits, group_size=group_size)
    for (experts, name), weight in originals.items():
        codes, scales, dense = stored(experts, name)
        expected_codes, expected_scales, expected_dense = reference_quantize(weight, bits, group_size)
        where = f"{model_type} {type(experts).__name__}.{name} {tuple(weight.shape)}"
        size = group_size_used(bits, group_size, weight.shape[-1])
        assert scales.shape == (*weight.shape[:-1], weight.shape[-1] // size), where
        assert bits_equal(codes, expected_codes), where
        assert bits_equal(scales, expected_scales), where
        assert bits_equal(dense, expected_dense), where
        # The quantization step: no value moves by more than half its group's scale (float32 slack only).
        step = expected_scales.repeat_interleave(size, dim=-1)
        assert bool(((dense - weight).abs() <= step * (0.5 + 1e-6)).all()), where
        assert bool((dense != weight).any()), where  # something was quantized


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_every_architecture_quantizes_as_the_reference(model_type):
    model = tiny_model(model_type)
    originals = expert_weights(model)
    ompmoe.quantize_experts(model, bits=4, group_size=8)
    for (experts, name), weight in originals.items():
        codes, scales, dense = stored(experts, name)
        expected = reference_quantize(weight, 4, 8)
        assert bits_equal(codes, expected[0]) and bits_equal(scales, expected[1]) and bits_equal(dense, expected[2])


@pytest.mark.parametrize("bits", [8, 4])
def test_the_defaults_are_int8_per_row_and_int4_groups_of_32(bits):
    """On 64-wide rows (the tiny models' rows are at most 32 wide: one group whatever the default)."""
    model = tiny_model("qwen3_moe", hidden_size=64, moe_intermediate_size=64)
    originals = expert_weights(model)
    ompmoe.quantize_experts(model) if bits == 8 else ompmoe.quantize_experts(model, bits=4)
    for (experts, name), weight in originals.items():
        codes, scales, dense = stored(experts, name)
        assert scales.shape == (*weight.shape[:-1], 1 if bits == 8 else 2)
        expected = reference_quantize(weight, bits, 32)
        assert bits_equal(codes, expected[0]) and bits_equal(scales, expected[1]) and bits_equal(dense, expected[2])


def test_an_odd_int4_group_and_a_negative_group_size_are_refused_naming_the_group():
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError) as error:
        ompmoe.quantize_experts(model, bits=4, group_size=1)
    assert str(error.value) == ("int4 packing needs an even group size; model.layers.1.mlp.experts.gate_up_proj would "
                                "use groups of 1 (group_size=1, rows of 32).")
    for bad in (-2, 2.0, True):
        with pytest.raises(ValueError) as error:
            ompmoe.quantize_experts(model, bits=4, group_size=bad)
        assert str(error.value) == f"group_size must be an int >= 0 (0: one group per row); got {bad!r}."
    assert not any(p.dtype in (torch.int8, torch.uint8) for p in model.parameters())  # refused before any change


SILU_LIPSCHITZ = 1.1  # max |silu'(x)| = 1.0998 (x = 2.40)


def step_bound(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, gate_up_step: torch.Tensor, down_step: torch.Tensor) -> torch.Tensor:
    """Worst-case change of a Qwen3-MoE experts output (fixed routing) when every weight moves by at most half its
    quantization step ``s``: per expert, with ``a = (s_gate_up / 2) @ |x|`` bounding the gate and up changes,
    ``|silu(g') u' - silu(g) u| <= L a_g (|u| + a_u) + |silu(g)| a_u =: c``, then
    ``|W_d' h' - W_d h| <= (|W_d| + s_d / 2) @ c + (s_d / 2) @ |h|``, weighted by the routing weights."""
    intermediate = down.shape[-1]
    bound = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(index.shape[1]):
            expert = int(index[token, slot])
            a = (gate_up_step[expert] / 2) @ x[token].abs()
            gate, up = (gate_up[expert] @ x[token]).split(intermediate)
            a_gate, a_up = a.split(intermediate)
            hidden = F.silu(gate) * up
            c = SILU_LIPSCHITZ * a_gate * (up.abs() + a_up) + F.silu(gate).abs() * a_up
            change = (down[expert].abs() + down_step[expert] / 2) @ c + (down_step[expert] / 2) @ hidden.abs()
            bound[token] += weights[token, slot] * change
    return bound


@pytest.mark.parametrize(("bits", "group_size"), [(8, 32), (4, 8)])
def test_experts_output_is_the_reference_weights_output_within_the_step_bound(bits, group_size):
    """The MoE block's experts (routing fixed, so only the experts are compared), in every implementation: the
    quantized experts give the output of the reference's dequantized weights, and differ from the full-precision
    output by no more than the quantization step allows. With int8 that bound is below the output itself, so
    experts that output zeros fail it as well."""
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe")
    block = model.model.layers[1].mlp
    x = torch.randn(48, model.config.hidden_size)
    with torch.no_grad():
        _, routing, index = block.gate(x)
    gate_up, down = block.experts.gate_up_proj.detach().clone(), block.experts.down_proj.detach().clone()
    expected_gate_up = reference_quantize(gate_up, bits, group_size)
    expected_down = reference_quantize(down, bits, group_size)
    full = copy.deepcopy(model)  # the full-precision experts
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.model.layers[1].mlp.experts.gate_up_proj.copy_(expected_gate_up[2])
        reference.model.layers[1].mlp.experts.down_proj.copy_(expected_down[2])
    gate_up_step = expected_gate_up[1].repeat_interleave(group_size_used(bits, group_size, gate_up.shape[-1]), -1)
    down_step = expected_down[1].repeat_interleave(group_size_used(bits, group_size, down.shape[-1]), -1)
    bound = step_bound(x, index, routing, gate_up, down, gate_up_step, down_step)
    ompmoe.quantize_experts(model, bits=bits, group_size=group_size)
    for implementation in ("eager", "grouped_mm", "batched_mm"):
        for m in (model, reference, full):
            m.set_experts_implementation(implementation)
        with torch.no_grad():
            exact = full.model.layers[1].mlp.experts(x, index, routing)
            quantized = model.model.layers[1].mlp.experts(x, index, routing)
            dequantized = reference.model.layers[1].mlp.experts(x, index, routing)
        torch.testing.assert_close(quantized, dequantized, atol=1e-7, rtol=1e-5, msg=implementation)
        slack = 1e-5 * exact.abs().max()  # float rounding of the two computations
        excess = (quantized - exact).abs() - bound
        assert bool((excess <= slack).all()), (implementation, float(excess.max()))
        assert bool(((quantized - exact).abs() > 0).any()), implementation
        if bits == 8:  # the bound is tight enough to tell the experts' output from zeros
            assert bool((exact.abs() > bound + slack).any()), implementation
