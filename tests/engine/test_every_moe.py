"""Every causal-LM MoE of the installed transformers, generated from transformers itself (``moe_model_types``): each
is recognized by its modules and pruned (statistics equal to literal atoms, a uniform and a per-layer plan saved,
reloaded with the same logits), or refused with the one fact that could not be read, named here."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import ompmoe
from ompmoe.engine.adapters import UnsupportedModelError, moe_model_types
from ompmoe.engine.tiny import tiny_model

from reference import assert_gram_close

REFUSED = {
    "dbrx": "no module holds a transformers-5 fused experts module",
    "deepseek_v4": "DeepseekV4HashRouter.forward takes (hidden_states, input_ids)",
    "inkling_text": "InklingTopkRouter returns 4 values, not (logits, weights, expert indices)",
    "jetmoe": "no module holds a transformers-5 fused experts module",
    "llama4_text": "Llama4TextExperts.forward takes (hidden_states), not (hidden states, expert indices, routing weights)",
    "longcat_flash": "no module holds a transformers-5 fused experts module",
    "zaya": "ZayaRouter cannot route the hidden states alone",
}
"""Types ompmoe refuses, with the reason it gives (docs/methods.md says what each would need)."""
MULTIMODAL = {"dots3_note", "gemma4", "llama4", "qwen3_5_moe", "qwen4_exp"}
"""Containers whose text decoder holds the experts (each text decoder type is checked on its own)."""
NOT_BIT_EQUAL = {"minimax_m3_vl_text": 1e-6}
"""Reloaded logits equal only to float32 rounding (weights, buffers and kernels equal; 1.5e-7 apart)."""

TYPES = moe_model_types()
IDS = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(1))


@contextlib.contextmanager
def _router_and_experts_inputs(layer):
    """The hidden states the layer's router and its experts receive in the model's own forward (Gemma 4 normalizes
    them apart, so the block's input is neither); the router's extra arguments too."""
    seen: list = []
    hooks = [layer.router.register_forward_pre_hook(lambda module, args: seen.append(args)),
             layer.experts.register_forward_pre_hook(lambda module, args, kwargs: seen.append(args or tuple(
                 kwargs.values())), with_kwargs=True)]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def _literal_sums(layer, router_args, experts_args):
    """Gram and routing mass the slow way: route with the router's own call, run each (token, expert) pair alone."""
    _, weights, index = layer.router(*router_args)
    hidden = experts_args[0]
    atoms = torch.zeros(layer.num_experts, hidden.shape[0], hidden.shape[-1], dtype=torch.float64)
    mass = torch.zeros(layer.num_experts, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        for slot in range(index.shape[1]):
            expert, weight = int(index[token, slot]), float(weights[token, slot])
            output = layer.experts(hidden[token][None], torch.tensor([[expert]]), torch.ones(1, 1, dtype=hidden.dtype))
            atoms[expert, token] += weight * output[0].double()
            mass[expert] += weight
    flat = atoms.reshape(layer.num_experts, -1)
    return flat @ flat.T, mass


def _case(model_type: str) -> object:
    if model_type in MULTIMODAL:
        return pytest.param(model_type, id=f"{model_type}-multimodal-container-not-yet",
                            marks=pytest.mark.skip(reason="multimodal container: its text decoder type is checked"))
    return pytest.param(model_type, id=f"{model_type}-refused" if model_type in REFUSED else model_type)


def test_the_matrix_covers_every_moe_type_of_transformers():
    assert len(TYPES) >= 60 and {"qwen3_moe", "mixtral", "minimax", "glm4_moe_lite"} <= set(TYPES)
    assert set(REFUSED) | MULTIMODAL <= set(TYPES)
    supported = [t for t in TYPES if t not in REFUSED and t not in MULTIMODAL]
    assert len(supported) >= 51, supported  # 2026-11-28, transformers 5.24: 51 of 58 text decoders


@pytest.mark.parametrize("model_type", [_case(t) for t in TYPES])
def test_each_moe_type_prunes_and_reloads_or_is_refused_by_name(model_type, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(model_type)
    if model_type in REFUSED:
        with pytest.raises(UnsupportedModelError) as refused:
            ompmoe.find_moe_layers(model)
        assert str(refused.value).startswith(f"ompmoe cannot prune model_type={model_type!r}")
        assert REFUSED[model_type] in str(refused.value)
        return
    layers = ompmoe.find_moe_layers(model)
    with _router_and_experts_inputs(layers[0]) as inputs:
        stats = ompmoe.collect_stats(model, [IDS], progress=False)
    gram, mass = _literal_sums(layers[0], *inputs)
    assert_gram_close(stats.layers[0].gram, gram)
    torch.testing.assert_close(stats.layers[0].routing_mass, mass)
    for allocation in ("uniform", "waterfill"):  # a stock checkpoint, then one with per-layer counts
        plan = ompmoe.plan_pruning(stats, 0.5, allocation=allocation)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pruned = ompmoe.prune(tiny_model(model_type), plan)
            path = ompmoe.save_pruned(pruned, tmp_path / allocation)
            reloaded = ompmoe.load_pruned(path)
        assert ompmoe.pruning_info(reloaded)["kept_experts"] == plan.kept_by_layer()
        with torch.no_grad():
            expected, actual = pruned(IDS).logits, reloaded(IDS).logits
        torch.testing.assert_close(actual, expected, rtol=0, atol=NOT_BIT_EQUAL.get(model_type, 0))


def test_the_readme_lists_what_this_matrix_checks():
    """README's recognized and refused lists are this matrix's, from the installed transformers."""
    import re
    from pathlib import Path

    from ompmoe.engine.adapters import ARCHITECTURES

    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")

    def listed(name: str) -> list[str]:
        block = re.search(rf"<!-- {name}:start -->\n(.*?)\n<!-- {name}:end -->", readme, re.DOTALL)
        assert block, f"README.md has no {name} block"
        return re.findall(r"`([^`]+)`", block.group(1))

    assert listed("recognized-types") == [t for t in TYPES if t not in {*REFUSED, *MULTIMODAL, *ARCHITECTURES}]
    assert listed("refused-types") == sorted(REFUSED)


def test_a_routing_bias_kept_on_the_block_is_cut_with_the_router_in_every_step(tmp_path):
    """MiniMax-M2 keeps ``e_score_correction_bias`` on the block and passes it into the router: a trial view and
    compensation route exactly as the pruned model does (the bias cut to the kept experts everywhere)."""
    model = tiny_model("minimax_m2")
    stats = ompmoe.collect_stats(model, [IDS], progress=False)
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="waterfill")
    pruned = ompmoe.prune(tiny_model("minimax_m2"), plan)
    assert [tuple(layer.block.e_score_correction_bias.shape) for layer in ompmoe.find_moe_layers(pruned)] == \
        [(len(layer.kept),) for layer in plan.layers]
    with torch.no_grad():
        expected = pruned(IDS).logits
        with ompmoe.pruned_view(model, plan) as view:
            torch.testing.assert_close(view(IDS).logits, expected, rtol=0, atol=1e-6)
    blocks = torch.randint(3, 250, (4, 16), generator=torch.Generator().manual_seed(2))
    compensation = ompmoe.compensate(model, plan, blocks)  # on the unpruned model: its routers see the whole bias
    compensation.apply(pruned)
    with torch.no_grad():
        assert torch.isfinite(pruned(IDS).logits).all() and not torch.equal(pruned(IDS).logits, expected)
