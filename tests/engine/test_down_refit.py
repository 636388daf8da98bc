"""The ``down`` compensation: the per-expert Gauss-Seidel refit equals the joint ridge least squares it stands for,
the intermediate activations it computes are the experts' own on every supported architecture, a huge ridge gives
back the ``linear`` map, and what it writes reloads in stock transformers."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import ompmoe
from ompmoe.engine.apply.compensation import CompensationError, compensate, compensated_view
from ompmoe.engine.apply.down_refit import (
    check_down_refit,
    compensate_down,
    expert_segments,
    gauss_seidel,
    refit_down,
)
from ompmoe.engine.tiny import tiny_config, tiny_model

from test_every_moe import REFUSED, TYPES

BLOCKS = torch.randint(3, 250, (8, 16), generator=torch.Generator().manual_seed(0))


def joint_ridge(target, inputs, tokens, experts, start, alphas_by_expert):
    """The literal joint solve: every expert's weights at once, the normal equations of
    ``sum_t ||target_t - sum_r W_{e_r} u_r||^2 + sum_e lam_e ||W_e - W0_e||^2`` over ``K * n`` unknowns per row."""
    count, d, n = start.shape
    design = torch.zeros(target.shape[0], count * n, dtype=torch.float64)
    for r in range(inputs.shape[0]):
        design[tokens[r], experts[r] * n:(experts[r] + 1) * n] += inputs[r].double()
    penalty = torch.diag(torch.cat([torch.full((n,), float(lam)) for lam in alphas_by_expert])).double()
    system = design.T @ design + penalty
    rhs = design.T @ target.double() + penalty @ start.double().permute(0, 2, 1).reshape(count * n, d)
    return torch.linalg.solve(system, rhs).reshape(count, n, d).permute(0, 2, 1)


def test_gauss_seidel_converges_to_the_joint_ridge_solve():
    generator = torch.Generator().manual_seed(3)
    tokens_count, top, count, d, n = 40, 2, 5, 6, 3
    experts = torch.stack([torch.randperm(count, generator=generator)[:top] for _ in range(tokens_count)]).reshape(-1)
    tokens = torch.arange(tokens_count).repeat_interleave(top)
    inputs = torch.randn(tokens_count * top, n, generator=generator, dtype=torch.float64)
    target = torch.randn(tokens_count, d, generator=generator, dtype=torch.float64)
    start = torch.randn(count, d, n, generator=generator, dtype=torch.float64)
    segments = expert_segments(experts, count)
    alpha = 0.3
    fitted = gauss_seidel(target, inputs, tokens, segments, start, [alpha], sweeps=1000)[alpha]
    scales = [alpha * float((inputs[rows].T @ inputs[rows]).trace()) / n for rows in segments]
    torch.testing.assert_close(fitted, joint_ridge(target, inputs, tokens, experts, start, scales), rtol=1e-7,
                               atol=1e-7)
    # a few sweeps already lower the objective monotonically from the start
    def objective(weights):
        predicted = torch.zeros_like(target).index_add_(0, tokens, torch.einsum("pn,pdn->pd", inputs, weights[experts]))
        return float((target - predicted).square().sum()) + sum(
            lam * float((weights[e] - start[e]).square().sum()) for e, lam in enumerate(scales))
    values = [objective(gauss_seidel(target, inputs, tokens, segments, start, [alpha], sweeps=s)[alpha])
              for s in (1, 2, 3)]
    assert objective(start) > values[0] >= values[1] >= values[2]


@pytest.mark.parametrize("model_type", [t for t in TYPES if t not in REFUSED])
def test_the_refit_runs_on_every_supported_architecture_and_does_not_raise_the_fitting_error(model_type):
    """The refit computes each expert's intermediate activation itself and refuses (relative difference over 1e-3)
    where its down projection of it is not the experts' own output: it runs on every type."""
    model = tiny_model(model_type)
    for layer in ompmoe.find_moe_layers(model):
        check_down_refit(layer)
    plan = ompmoe.plan_pruning(ompmoe.collect_stats(model, [BLOCKS], progress=False), 0.5, allocation="waterfill")
    linear, refits = refit_down(model, plan, BLOCKS, alphas=(0.1,))  # one batch of 8 as the statistics (Zaya's
    # router keeps state between calls of one batch size)
    record = refits[0.1].record
    assert record["granularity"] == "down" and record["ridge_alpha"] == 0.1 and record["num_tokens"] == BLOCKS.numel()
    assert record["routed_error_after"] <= max(record["routed_error_linear"], 0.0) + 1e-6


def test_the_refit_runs_on_experts_with_their_own_forward_that_clamp():
    """Step 3.7's experts compute their own forward, clamping gate and up (bound 7 on two released layers; 0.05 here,
    which most activations pass): the refit computes the activation as they do, or its check would refuse."""
    model = tiny_model("step3p7", text_config=dict(tiny_config("step3p5").to_dict(), swiglu_limits=[0, 0.05, 0.05]))
    layers = ompmoe.find_moe_layers(model)
    assert [layer.experts.limit for layer in layers] == [0.05, 0.05] and not hasattr(layers[0].experts, "has_gate")
    experts, hidden = layers[0].experts, torch.randn(64, model.config.text_config.hidden_size)
    gate, up = (hidden @ experts.gate_up_proj[0].T).chunk(2, dim=-1)
    assert not torch.allclose(experts._apply_gate(torch.cat([gate, up], -1)), experts.act_fn(gate) * up)  # it bites
    plan = ompmoe.plan_pruning(ompmoe.collect_stats(model, [BLOCKS], progress=False), 0.5, allocation="waterfill")
    linear, refits = refit_down(model, plan, BLOCKS, alphas=(0.1,))
    record = refits[0.1].record
    assert record["granularity"] == "down" and record["num_tokens"] == BLOCKS.numel()
    assert record["routed_error_after"] <= max(record["routed_error_linear"], 0.0) + 1e-6


def test_a_huge_ridge_gives_back_the_linear_map_and_the_map_is_compensates_own():
    model = tiny_model("qwen3_moe")
    plan = ompmoe.plan_pruning(ompmoe.collect_stats(model, BLOCKS.split(4), progress=False), 0.5,
                               min_kept_fraction=0.25)
    linear, refits = refit_down(model, plan, BLOCKS, alphas=(1e12,))
    own = compensate(copy.deepcopy(model), plan, BLOCKS, 4, granularity="linear", max_tokens=None)
    for name, matrix in own.scales.items():  # the same map as the linear compensation over the same tokens
        torch.testing.assert_close(linear.scales[name], matrix, rtol=1e-9, atol=1e-9)
    with torch.no_grad():
        with compensated_view(model, plan, linear):
            expected = model(input_ids=BLOCKS[:2]).logits
        with compensated_view(model, plan, refits[1e12]):
            actual = model(input_ids=BLOCKS[:2]).logits
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_experts_off_transformers_interface_are_refused_naming_the_fix():
    model = tiny_model("qwen3_moe")
    layer = ompmoe.find_moe_layers(model)[0]
    del layer.experts.has_gate
    check_down_refit(layer)  # gate_up_proj and _apply_gate or act_fn (experts with their own forward) say it gates
    layer.experts._apply_gate = layer.experts.act_fn = None
    with pytest.raises(CompensationError) as refused:
        check_down_refit(layer)
    assert str(refused.value) == (
        f"compensation='down' computes each expert's intermediate activation itself, for experts built on "
        f"transformers' experts interface (has_gate, gate_up_proj or up_proj); {layer.name}.experts "
        f"({type(layer.experts).__name__}) is not. Use compensation='linear'.")


def test_experts_whose_output_is_not_the_down_projection_of_their_activation_are_refused(monkeypatch):
    model = tiny_model("qwen3_moe")
    plan = ompmoe.plan_pruning(ompmoe.collect_stats(model, BLOCKS.split(4), progress=False), 0.5,
                               min_kept_fraction=0.25)
    layer = ompmoe.find_moe_layers(model)[0]
    import ompmoe.engine.apply.down_refit as down_refit

    own = down_refit.expert_intermediate
    monkeypatch.setattr(down_refit, "expert_intermediate", lambda *args: own(*args) * 1.01)  # 1 % off
    with pytest.raises(CompensationError) as refused:
        refit_down(model, plan, BLOCKS)
    message = str(refused.value)
    assert message.startswith(f"compensation='down': {layer.name}.experts computes something other than a down "
                              "projection of the intermediate activation its gate and up projections give (relative "
                              "difference ")
    assert message.endswith("); use compensation='linear'.")


@pytest.mark.parametrize("alphas, sweeps, message", [
    ((), 3, "alphas must be positive numbers; got []."),
    ((0.0,), 3, "alphas must be positive numbers; got [0.0]."),
    ((0.1,), 0, "sweeps must be a positive int; got 0."),
])
def test_bad_settings_are_refused_before_any_work(alphas, sweeps, message):
    model = tiny_model("qwen3_moe")
    plan = ompmoe.plan_pruning(ompmoe.collect_stats(model, BLOCKS.split(4), progress=False), 0.5,
                               min_kept_fraction=0.25)
    with pytest.raises(CompensationError) as refused:
        refit_down(model, plan, BLOCKS, alphas=alphas, sweeps=sweeps)
    assert str(refused.value) == message


def test_the_refit_model_saves_and_reloads_equal_in_stock_transformers(tmp_path):
    model = tiny_model("gpt_oss")  # down-projection biases, transposed experts
    plan = ompmoe.plan_pruning(ompmoe.collect_stats(model, BLOCKS.split(4), progress=False), 0.5,
                               allocation="waterfill")
    compensation = compensate_down(model, plan, BLOCKS, max_tokens=None)
    assert compensation.weights is not None and compensation.record["granularity"] == "down"
    pruned = compensation.apply(ompmoe.prune(model, plan))
    assert pruned.config.ompmoe["compensation"]["granularity"] == "down"
    ompmoe.save_pruned(pruned, tmp_path / "model", tokenizer=None)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=BLOCKS[:2]).logits, pruned(input_ids=BLOCKS[:2]).logits,
                                   rtol=1e-5, atol=1e-5)


def test_compensate_names_the_call_for_down():
    model = tiny_model("qwen3_moe")
    plan = ompmoe.plan_pruning(ompmoe.collect_stats(model, BLOCKS.split(4), progress=False), 0.5,
                               min_kept_fraction=0.25)
    with pytest.raises(CompensationError) as refused:
        compensate(model, plan, BLOCKS, granularity="down")
    assert str(refused.value) == ("granularity='down' is fitted in its own pass: ompmoe.engine.apply.down_refit."
                                  "compensate_down(model, plan, blocks) (a run: compensation='down').")


def test_batches_of_different_lengths_fit_as_their_tokens_unpadded():
    """A DataLoader's padded batches of different lengths run as one right-padded batch: the refit equals the one
    on the same tokens in one batch of their own length."""
    model = tiny_model("qwen3_moe")
    plan = ompmoe.plan_pruning(ompmoe.collect_stats(model, BLOCKS.split(4), progress=False), 0.5,
                               min_kept_fraction=0.25)
    short = {"input_ids": BLOCKS[4:, :12], "attention_mask": torch.ones(4, 12, dtype=torch.long)}
    padded = {"input_ids": torch.cat([BLOCKS[:4, :12], torch.zeros(4, 4, dtype=torch.long)], 1),
              "attention_mask": torch.cat([torch.ones(4, 12), torch.zeros(4, 4)], 1).long()}
    together = refit_down(model, plan, [{"input_ids": BLOCKS[:, :12]}], alphas=(0.1,))[1][0.1]
    joined = refit_down(model, plan, [padded, short], alphas=(0.1,))[1][0.1]
    assert joined.record["num_tokens"] == together.record["num_tokens"] == 96
    for name, (rows, _) in together.weights.items():
        torch.testing.assert_close(joined.weights[name][0], rows, rtol=1e-4, atol=1e-6)



def test_the_match_tolerance_allows_a_lower_precision_its_rounding_and_no_more():
    from ompmoe.engine.apply.down_refit import MATCH_TOLERANCE, match_tolerance

    assert match_tolerance(torch.float32) == MATCH_TOLERANCE == 1e-3
    assert match_tolerance(torch.bfloat16) == 4 * 2.0**-7  # bfloat16 outputs: about 2e-3 from float32's down(h)
    assert match_tolerance(torch.float16) == 4 * 2.0**-10
