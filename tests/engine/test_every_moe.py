"""Every causal-LM MoE of the installed transformers, generated from transformers itself (``moe_model_types``), and
every multimodal MoE container no causal-LM class loads: each is recognized by its modules and pruned (statistics
equal to literal atoms, a uniform and a per-layer plan saved, reloaded as the same class with the same logits, a
container's towers untouched), or refused with the one fact that could not be read, named here."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import ompmoe
from ompmoe.engine.adapters import UnsupportedModelError, moe_model_types
from ompmoe.engine.model_classes import text_config_attribute
from ompmoe.engine.tiny import tiny_model

from reference import assert_gram_close

REFUSED = {
    "dbrx": "no module holds a transformers-5 fused experts module",
    "jetmoe": "no module holds a transformers-5 fused experts module",
    "llama4": "Llama4ForConditionalGeneration: fails on every forward in transformers",
}
"""Types ompmoe refuses, with the reason it gives (docs/methods.md says what each would need)."""
MULTIMODAL_REFUSED = {
    "diffusion_gemma": "cannot tell how many experts DiffusionGemmaTextRouter picks per token",
    "ernie4_5_vl_moe": "model.language_model.layers.1.mlp holds 2 sparse blocks (text_moe, vision_moe)",
}
"""Multimodal-only containers ompmoe refuses, with the reason it gives."""
MULTIMODAL = moe_model_types(multimodal=True)
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
    if layer.input_weighted:
        return _literal_input_weighted_sums(layer, router_args[0])
    _, weights, index, *_ = layer.router(*router_args)  # (logits, weights, indices, ...)
    hidden = experts_args[0]
    atoms = torch.zeros(layer.num_experts, hidden.shape[0], hidden.shape[-1], dtype=torch.float64)
    mass = torch.zeros(layer.num_experts, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        for slot in range(index.shape[1]):
            expert, weight = int(index[token, slot]), float(weights[token, slot])
            if expert >= layer.num_experts:  # LongCat-Flash's identity experts: never measured, like shared experts
                continue
            if layer.identity_experts:  # its forward takes no single slot: the token's own slots, this one weighted
                alone = torch.zeros_like(weights[token][None]).index_fill_(1, torch.tensor([slot]), 1.0)
                output = layer.experts(hidden[token][None], index[token][None], alone.to(hidden.dtype))
            else:
                output = layer.experts(hidden[token][None], torch.tensor([[expert]]),
                                       torch.ones(1, 1, dtype=hidden.dtype))
            atoms[expert, token] += weight * output[0].double()
            mass[expert] += weight
    flat = atoms.reshape(layer.num_experts, -1)
    return flat @ flat.T, mass


@torch.no_grad()
def _literal_input_weighted_sums(layer, hidden):
    """Llama 4's sums the slow way: the router's scores of every expert, and each routed pair run alone through the
    stock experts call (``stock_atom``: a stack holding only the pair's scaled token)."""
    from test_input_weighted import stock_atom

    scores, logits = layer.router(hidden)
    count = layer.num_experts
    atoms = torch.zeros(count, hidden.shape[0], hidden.shape[-1], dtype=torch.float64)
    mass = torch.zeros(count, dtype=torch.float64)
    for token in range(hidden.shape[0]):
        for expert in torch.topk(logits[token], layer.top_k).indices.tolist():
            atoms[expert, token] = stock_atom(layer, hidden[token], expert, scores[token, expert])
            mass[expert] += float(scores[token, expert])
    flat = atoms.reshape(count, -1)
    return flat @ flat.T, mass


def _case(model_type: str) -> object:
    refused = model_type in REFUSED or model_type in MULTIMODAL_REFUSED
    return pytest.param(model_type, id=f"{model_type}-refused" if refused else model_type)


def test_the_matrix_covers_every_moe_type_of_transformers():
    assert len(TYPES) >= 60 and {"qwen3_moe", "mixtral", "minimax", "glm4_moe_lite", "gemma4"} <= set(TYPES)
    assert set(REFUSED) <= set(TYPES) and set(MULTIMODAL_REFUSED) <= set(MULTIMODAL)
    assert not set(MULTIMODAL) & set(TYPES) and {"qwen3_vl_moe", "aria"} <= set(MULTIMODAL)
    supported = [t for t in TYPES if t not in REFUSED]
    assert len(supported) >= 60, supported  # 2026-11-30, transformers 5.24: 60 of 63 causal-LM MoE types (95 %)
    containers = [t for t in MULTIMODAL if t not in MULTIMODAL_REFUSED]
    assert len(containers) >= 15 and len(MULTIMODAL) >= 17, containers  # 2026-11-30, transformers 5.24: 15 of 17
    # (and 4 containers among the causal-LM types: gemma4, ...)


@pytest.mark.parametrize("model_type", [_case(t) for t in TYPES + MULTIMODAL])
def test_each_moe_type_prunes_and_reloads_or_is_refused_by_name(model_type, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(model_type)
    reason = REFUSED.get(model_type) or MULTIMODAL_REFUSED.get(model_type)
    if reason is not None:
        with pytest.raises(UnsupportedModelError) as refused:
            ompmoe.find_moe_layers(model)
        assert str(refused.value).startswith(f"ompmoe cannot prune model_type={model_type!r}")
        assert reason in str(refused.value)
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
        assert type(reloaded) is type(model)  # a multimodal container stays one
        with torch.no_grad():
            expected, actual = pruned(IDS).logits, reloaded(IDS).logits
        torch.testing.assert_close(actual, expected, rtol=0, atol=NOT_BIT_EQUAL.get(model_type, 0))
    untouched = {name: tensor for name, tensor in model.state_dict().items()
                 if not name.startswith(tuple(f"{layer.name}." for layer in layers))}
    if model_type in MULTIMODAL:  # a container: its towers are among the untouched tensors
        assert text_config_attribute(model.config) is not None and any(not name.startswith(("model.language_model.", "lm_head.")) for name in untouched), model_type
    torch.testing.assert_close({name: reloaded.state_dict()[name] for name in untouched}, untouched, rtol=0, atol=0)


def test_the_stock_llama4_container_still_fails_on_every_forward():
    """``llama4`` is refused because transformers' own ``Llama4ForConditionalGeneration`` cannot run a forward
    (``TEXT_MODEL_INSTEAD``): when a transformers release fixes it, this fails and the entry goes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model("llama4")
    assert type(model).__name__ == "Llama4ForConditionalGeneration"
    with pytest.raises(AttributeError, match="image_outputs"), torch.no_grad():
        model(IDS)


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

    assert listed("recognized-types") == [t for t in TYPES if t not in {*REFUSED, *ARCHITECTURES}]
    assert listed("refused-types") == sorted(REFUSED)
    assert listed("multimodal-types") == [t for t in MULTIMODAL if t not in MULTIMODAL_REFUSED]


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


STOCK_LOAD = r'''
import json, os, sys, torch, transformers
torch.set_num_threads(int(os.environ["PARENT_TORCH_THREADS"]))
directory, auto_class, inputs, out = sys.argv[1:]
auto = getattr(transformers, auto_class)
ids, results = torch.load(inputs), {"ompmoe": any(m.split(".")[0] == "ompmoe" for m in sys.modules)}
for name in ("uniform", "waterfill"):
    model = auto.from_pretrained(f"{directory}/{name}", trust_remote_code=True)
    with torch.no_grad():
        torch.save(model(input_ids=ids).logits, f"{out}/{name}.pt")
    results[name] = type(model).__name__
    try:
        auto.from_pretrained(f"{directory}/{name}")
    except ValueError as error:
        results[name + "-refused"] = str(error)
json.dump(results, open(f"{out}/results.json", "w"))
'''


@pytest.mark.parametrize(("model_type", "auto_class"), [
    ("qwen3_vl_moe", "AutoModelForImageTextToText"),  # a multimodal container
    ("inkling_text", "AutoModelForCausalLM"),  # router rows past the experts (shared experts), kept whole
    ("deepseek_v4", "AutoModelForCausalLM"),  # a hash-routed layer left whole: per-layer counts, remote code
    ("llama4_text", "AutoModelForCausalLM"),  # routing weights scale the experts' input: pruned in the routed form
])
def test_a_pruned_checkpoint_loads_in_stock_transformers_in_a_fresh_process(model_type, auto_class, tmp_path):
    """Pruned, saved, and loaded by the type's own Auto class where ompmoe was never imported: a stock checkpoint of
    its own class, or with per-layer counts its remote code, with the logits ompmoe's model had; without remote code
    a per-layer checkpoint is refused by a message naming that Auto class, as its card does."""
    import json
    import os
    import subprocess
    import sys

    model = tiny_model(model_type)
    stats = ompmoe.collect_stats(model, [IDS], progress=False)
    expected, uniform = {}, {}
    for allocation in ("uniform", "waterfill"):
        pruned = ompmoe.prune(tiny_model(model_type), ompmoe.plan_pruning(stats, 0.5, allocation=allocation))
        uniform[allocation] = ompmoe.pruning_info(pruned)["uniform"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ompmoe.save_pruned(pruned, tmp_path / allocation)
        with torch.no_grad():
            expected[allocation] = pruned(IDS).logits
    assert not uniform["waterfill"] or model_type == "inkling_text"
    assert uniform["uniform"] == (model_type != "deepseek_v4")  # its hash layer keeps all experts
    torch.save(IDS, tmp_path / "ids.pt")
    (tmp_path / "script.py").write_text(STOCK_LOAD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PARENT_TORCH_THREADS=str(torch.get_num_threads()))
    done = subprocess.run([sys.executable, "-I", "script.py", str(tmp_path), auto_class, str(tmp_path / "ids.pt"),
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["ompmoe"] is False
    stock = type(model).__name__
    for allocation in ("uniform", "waterfill"):
        assert results[allocation] == (stock if uniform[allocation] else f"OmpmoePruned{stock}")
        torch.testing.assert_close(torch.load(tmp_path / f"{allocation}.pt"), expected[allocation], rtol=0, atol=0)
        card = (tmp_path / allocation / "README.md").read_text()
        if uniform[allocation]:
            assert f"{allocation}-refused" not in results
            assert f'{auto_class}.from_pretrained("path/to/this/directory")' in card
        else:
            assert f"Load it with transformers.{auto_class}.from_pretrained(path, trust_remote_code=True)" in \
                results[f"{allocation}-refused"]
            assert f'{auto_class}.from_pretrained("path/to/this/directory", trust_remote_code=True)' in card
        assert ("lm_eval --model hf-multimodal" in card) == (auto_class != "AutoModelForCausalLM")


@pytest.mark.parametrize("model_type", ["llama4_text", "phimoe"])
def test_a_per_layer_checkpoint_loaded_through_its_remote_code_is_recognized_and_calibrated_again(model_type,
                                                                                                  tmp_path,
                                                                                                  monkeypatch):
    """A type recognized by its modules, loaded with per-layer counts through the checkpoint's own remote code (each
    layer cut before ompmoe sees it; the config holds the largest count): the same facts, and statistics of it."""
    import transformers

    import ompmoe.engine.adapters as adapters

    model = tiny_model(model_type)
    stats = ompmoe.collect_stats(model, [IDS], progress=False)
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="waterfill")
    assert len(plan.layers[0].kept) < max(len(layer.kept) for layer in plan.layers)  # the first is not the largest
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ompmoe.save_pruned(ompmoe.prune(tiny_model(model_type), plan), tmp_path / "pruned")
        monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
        monkeypatch.setattr(adapters, "RECOGNIZED", {})
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True)
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(loaded)] == [len(layer.kept) for layer in plan.layers]
    again = ompmoe.collect_stats(loaded, [IDS], progress=False)
    assert [layer.routing["num_experts"] for layer in again.layers] == [len(layer.kept) for layer in plan.layers]


@pytest.mark.parametrize("model_type", [t for t in TYPES + MULTIMODAL
                                        if t not in {*REFUSED, *MULTIMODAL_REFUSED}])
def test_each_moe_type_is_recognized_on_its_skeleton_as_on_the_model(model_type, monkeypatch):
    """Layer by layer, a fresh process recognizes the architecture on the weightless skeleton (meta weights beside
    real buffers, which its router is probed with): the facts read off the model with weights."""
    import ompmoe.engine.adapters as adapters
    from ompmoe.engine.lazy_checkpoint import build_skeleton

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(model_type)
        monkeypatch.setattr(adapters, "RECOGNIZED", {})
        on_skeleton = adapters.architecture_of(build_skeleton(model.config))
        monkeypatch.setattr(adapters, "RECOGNIZED", {})
        assert on_skeleton == adapters.architecture_of(model)
