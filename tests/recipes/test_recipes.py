"""Recipes: pruning composed with fine-tuning (full and LoRA), weight-only quantization and GPTQ layout."""

from __future__ import annotations

import json
import warnings
from copy import deepcopy

import pytest
import torch
from safetensors import safe_open

import ompmoe
from ompmoe.data import byte_tokens, shipped_text, token_blocks
from ompmoe.recipes.finetune import capture_router_logits, causal_lm_loss, load_balancing_loss
from ompmoe.recipes.quantization import QuantizedModelError, model_size_bytes, quantization_summary, tensor_nbytes
from ompmoe.engine.tiny import TINY_CONFIGS, tiny_model
from quantization_reference import group_size_used, reference_quantize

from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

pl = pytest.importorskip("lightning.pytorch")

warnings.filterwarnings("ignore", message=".*does not have many workers.*")


@pytest.fixture(scope="module")
def blocks() -> torch.Tensor:
    return token_blocks(byte_tokens(shipped_text()), 64, 8)


@pytest.fixture(scope="module")
def stats(blocks):
    return ompmoe.collect_stats(tiny_model("qwen3_moe"), blocks.split(4))


def pruned_model(stats, allocation: str, **overrides) -> torch.nn.Module:
    """Tiny Qwen3-MoE (2 MoE layers x 16 experts) with half its experts removed."""
    model = tiny_model("qwen3_moe", **overrides)
    plan = ompmoe.plan_pruning(stats, 0.5, allocation=allocation)
    counts = [layer.num_kept for layer in plan.layers]
    assert (len(set(counts)) == 1) == (allocation == "uniform"), counts
    return ompmoe.prune(model, plan)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, output_router_logits=False).logits


# ----------------------------------------------------------------------------- load balancing
def test_pooled_aux_loss_equals_transformers_on_uniform_model(stats, blocks):
    model = pruned_model(stats, "uniform", output_router_logits=True)
    ids, mask = blocks[:2, :32], torch.ones(2, 32, dtype=torch.long)
    mask[1, :7] = 0
    with torch.no_grad(), capture_router_logits(model) as router_logits:
        output = model(ids, attention_mask=mask)
    ours = load_balancing_loss(router_logits, 4, mask, per_layer=False)
    torch.testing.assert_close(ours, output.aux_loss, rtol=1e-6, atol=0)
    # The whole fine-tuning loss too: LM loss + router_aux_loss_coef * aux, as the model computes it.
    labels = ids.masked_fill(mask == 0, -100)
    native = model(ids, attention_mask=mask, labels=labels).loss
    parts = causal_lm_loss(model, {"input_ids": ids, "attention_mask": mask}, aux_coef=0.001, per_layer=False)
    torch.testing.assert_close(parts.loss, native, rtol=1e-6, atol=0)


@pytest.mark.parametrize("allocation", ["uniform", "waterfill"])
def test_per_layer_aux_loss_is_transformers_formula_per_layer(stats, blocks, allocation):
    model = pruned_model(stats, allocation)
    ids, mask = blocks[:2, :32], torch.ones(2, 32, dtype=torch.long)
    mask[0, :5] = 0
    with torch.no_grad(), capture_router_logits(model) as router_logits:
        model(ids, attention_mask=mask)
    counts = [layer.num_experts for layer in ompmoe.find_moe_layers(model)]
    assert [t.shape[-1] for t in router_logits] == counts
    expected = torch.stack([load_balancing_loss_func((t,), t.shape[-1], 4, mask) for t in router_logits]).mean()
    torch.testing.assert_close(load_balancing_loss(router_logits, 4, mask), expected, rtol=1e-6, atol=0)
    # With a single MoE layer, per-layer and transformers' pooled value are the same thing.
    single = load_balancing_loss(router_logits[:1], 4, mask)
    torch.testing.assert_close(single, load_balancing_loss_func(tuple(router_logits[:1]), counts[0], 4, mask))
    if allocation != "uniform":
        with pytest.raises(ValueError, match="same number of experts in every layer"):
            load_balancing_loss(router_logits, 4, mask, per_layer=False)


# ----------------------------------------------------------------------------------- fine-tuning
def _fit(module, batch: dict[str, torch.Tensor], steps: int) -> None:
    rows = [{key: value[i] for key, value in batch.items()} for i in range(len(batch["input_ids"]))]
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=len(rows)))


@pytest.mark.parametrize(
    "allocation,lora_rank",
    [("uniform", 0), ("waterfill", 0), ("uniform", 4), ("waterfill", 4)],
    ids=["uniform-full", "nonuniform-full", "uniform-lora", "nonuniform-lora"],
)
def test_finetune_lowers_loss_then_save_and_reload(stats, blocks, tmp_path, allocation, lora_rank):
    pytest.importorskip("peft") if lora_rank else None
    model = pruned_model(stats, allocation, output_router_logits=True)
    batch = {"input_ids": blocks[:4], "attention_mask": torch.ones_like(blocks[:4])}
    with torch.no_grad():
        before = causal_lm_loss(model, batch, aux_coef=0.001).loss
    # Full fine-tunes save at the end of the fit (save_dir); LoRA ones are merged and saved after it.
    save_dir = None if lora_rank else str(tmp_path / "ft")
    module = ompmoe.FinetuneModule(model, learning_rate=1e-2, lora_rank=lora_rank, save_dir=save_dir)
    assert module.aux_coef == 0.001  # the model's router_aux_loss_coef, as output_router_logits is set
    _fit(module, batch, steps=5)
    if lora_rank:
        trainable = {name for name, p in module.model.named_parameters() if p.requires_grad}
        assert any("mlp.experts.lora_A" in name for name in trainable)  # the fused 3-D expert weights
        assert any("self_attn.q_proj.lora_A" in name for name in trainable)
        assert all(".lora_" in name for name in trainable)
        with torch.no_grad():
            adapted = module.model(input_ids=blocks[:2], output_router_logits=False).logits
        module.save_pruned(tmp_path / "ft")
        torch.testing.assert_close(logits(module.hf_model, blocks[:2]), adapted, atol=1e-4, rtol=0)
    tuned = module.merged_model().eval()
    assert type(tuned).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        after = causal_lm_loss(tuned, batch, aux_coef=0.001).loss
    assert after < before - 0.05, (before, after)
    reloaded = ompmoe.load_pruned(tmp_path / "ft")
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(reloaded)] == [
        layer.num_experts for layer in ompmoe.find_moe_layers(tuned)
    ]
    assert torch.equal(logits(reloaded, blocks[:2]), logits(tuned, blocks[:2]))


def test_finetune_cli_continues_from_pruned_checkpoint(stats, tmp_path):
    from ompmoe.lightning.finetune_module import main

    ompmoe.save_pruned(pruned_model(stats, "waterfill"), tmp_path / "pruned")
    main([
        "fit", "--model.model", str(tmp_path / "pruned"), "--model.save_dir", str(tmp_path / "ft"),
        "--model.learning_rate", "0.01", "--model.lora_rank", "0", "--model.aux_loss_coef", "0.01",
        "--data.source", "shipped", "--data.tokenizer", "bytes", "--data.seq_len", "64",
        "--data.num_blocks", "8", "--data.batch_size", "4", "--trainer.max_steps", "2",
        "--trainer.accelerator", "cpu", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "lightning"),
    ])
    before, after = ompmoe.load_pruned(tmp_path / "pruned"), ompmoe.load_pruned(tmp_path / "ft")
    info = ompmoe.pruning_info(after)
    (record,) = info.pop("finetune")  # the fine-tune is recorded beside the pruning it continued from
    assert (record["steps"], record["data"]["source"]) == (2, "shipped")
    assert info == ompmoe.pruning_info(before)
    assert not torch.equal(after.lm_head.weight, before.lm_head.weight)


# ----------------------------------------------------------------------------------- quantization
def test_torchao_quantize_touches_only_nn_linear(stats, blocks):
    quantization = pytest.importorskip("torchao.quantization")
    model = pruned_model(stats, "waterfill")
    full_precision = deepcopy(model)
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig(set_inductor_config=False))
    summary = quantization_summary(model)
    # 3 layers x q/k/v/o, the dense MLP of layer 0 (mlp_only_layers) and the LM head: 16 nn.Linear.
    assert (summary.linear_quantized, summary.linear) == (16, 16)
    assert (summary.expert_weights_quantized, summary.expert_weights) == (0, 4)  # fused 3-D nn.Parameter
    assert (summary.routers_quantized, summary.routers) == (0, 2)  # routers are not nn.Linear
    assert summary.embeddings_quantized == 0
    assert "model.layers.1.mlp.experts.gate_up_proj" not in summary.quantized_names
    assert {"lm_head.weight", "model.layers.0.mlp.down_proj.weight", "model.layers.2.self_attn.o_proj.weight"} <= set(
        summary.quantized_names
    )
    weight = model.lm_head.weight
    # int8 codes + float32 scale + int8 zero point per row.
    assert type(weight).__name__ == "Int8Tensor" and tensor_nbytes(weight) == 256 * 32 + 256 * 4 + 256
    # The logits are those of torchao's dequantized weights (a tolerance for float rounding, not for quantization).
    reference = deepcopy(full_precision)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                reference.get_submodule(name).weight.copy_(module.weight.dequantize())
    torch.testing.assert_close(logits(model, blocks[:2]), logits(reference, blocks[:2]), atol=1e-5, rtol=0)
    assert not torch.equal(logits(full_precision, blocks[:2]), logits(reference, blocks[:2]))  # quantized


EXPERTS_SCALE = 3.0  # tiny random experts barely move the logits (0.01); scaled by 3 they move them by about 0.2


def scale_experts(model: torch.nn.Module, factor: float = EXPERTS_SCALE) -> torch.nn.Module:
    """Multiply every fused routed-expert weight by ``factor``, so that the experts dominate the logits."""
    with torch.no_grad():
        for layer in ompmoe.find_moe_layers(model):
            for p in layer.experts.parameters(recurse=False):
                if p.dim() == 3:
                    p.mul_(factor)
    return model


def with_expert_weights(model: torch.nn.Module, weights) -> torch.nn.Module:
    """A full-precision copy of ``model`` whose fused routed-expert weights are ``weights(layer_index, name, w)``."""
    copy = deepcopy(model)
    with torch.no_grad():
        for i, layer in enumerate(ompmoe.find_moe_layers(copy)):
            for name, p in layer.experts.named_parameters(recurse=False):
                if p.dim() == 3:
                    p.copy_(weights(i, name, p.detach().clone()))
    return copy


def experts_effect(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """How far the logits move when every routed expert outputs zero (what a tolerance must stay well below)."""
    zeroed = with_expert_weights(model, lambda i, name, w: torch.zeros_like(w))
    return float((logits(zeroed, ids) - logits(model, ids)).abs().max())


@pytest.mark.parametrize(("bits", "group_size"), [(8, 32), (4, 32), (4, 8)])
def test_quantize_experts_all_implementations_and_generation(stats, blocks, bits, group_size):
    """The quantized model computes with the reference's dequantized expert weights (tests/quantization_reference.py)
    in every experts implementation: its logits are those of a full-precision copy that holds them, to float
    rounding, far below what the experts move."""
    model = scale_experts(pruned_model(stats, "waterfill"))
    ids = blocks[:2]
    assert experts_effect(model, ids) > 0.1
    reference = with_expert_weights(model, lambda i, name, w: reference_quantize(w, bits, group_size)[2])
    size = model_size_bytes(model)
    shapes = [tuple(p.shape) for layer in ompmoe.find_moe_layers(model) for p in layer.experts.parameters() if p.dim() == 3]
    names = ompmoe.quantize_experts(model, bits=bits, group_size=group_size)
    assert names == [f"model.layers.{i}.mlp.experts.{n}" for i in (1, 2) for n in ("gate_up_proj", "down_proj")]
    summary = quantization_summary(model)
    assert (summary.expert_weights_quantized, summary.expert_weights, summary.linear_quantized) == (4, 4, 0)
    # Exactly the float32 weights out, the codes (one byte, or half a byte, per value) and float32 scales in.
    saved = 0
    for experts, rows, width in shapes:
        groups = 1 if bits == 8 else width // group_size_used(bits, group_size, width)
        saved += experts * rows * (width * 4 - width * bits // 8 - groups * 4)
    assert size - model_size_bytes(model) == saved
    per_impl = {}
    for implementation in ("eager", "grouped_mm", "batched_mm"):
        model.set_experts_implementation(implementation)
        reference.set_experts_implementation(implementation)
        per_impl[implementation] = logits(model, ids)
        torch.testing.assert_close(per_impl[implementation], logits(reference, ids), atol=1e-5, rtol=0)
    torch.testing.assert_close(per_impl["eager"], per_impl["grouped_mm"], atol=1e-4, rtol=0)
    generated = model.generate(blocks[:1, :8], max_new_tokens=6, do_sample=False, output_router_logits=False)
    reference.set_experts_implementation("eager")
    model.set_experts_implementation("eager")
    expected = reference.generate(blocks[:1, :8], max_new_tokens=6, do_sample=False, output_router_logits=False)
    assert generated.shape == (1, 14) and torch.equal(generated, expected)
    layer = model.model.layers[1].mlp.experts
    assert layer.parametrizations.gate_up_proj[0].cached is None  # the dense copy lives only during a forward


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_quantize_experts_every_architecture(model_type, blocks):
    """Every architecture's logits after int8 quantization are those of its reference dequantized weights, with
    experts scaled so that they move the logits far more than the tolerance."""
    model = scale_experts(tiny_model(model_type))
    ids = blocks[:1, :16]
    tolerance = 1e-4 * float(logits(model, ids).abs().max())
    assert experts_effect(model, ids) > 100 * tolerance
    reference = with_expert_weights(model, lambda i, name, w: reference_quantize(w, 8, 32)[2])
    count = sum(p.dim() == 3 for layer in ompmoe.find_moe_layers(model) for p in layer.experts.parameters())
    assert len(ompmoe.quantize_experts(model)) == count
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=tolerance, rtol=0)


def test_torchao_int8_tensor_on_expert_parameters_with_eager_experts(stats, blocks):
    quantization = pytest.importorskip("torchao.quantization")
    model = scale_experts(pruned_model(stats, "uniform"))
    ids = blocks[:2]
    assert experts_effect(model, ids) > 0.1
    model.set_experts_implementation("eager")  # Int8Tensor has no transpose/bmm/_grouped_mm kernels
    full_precision = deepcopy(model)
    layers = [layer.name for layer in ompmoe.find_moe_layers(model)]
    config = quantization.FqnToConfig({r"re:.*\.experts\.(gate_up_proj|down_proj)$": quantization.Int8WeightOnlyConfig(set_inductor_config=False)})
    quantization.quantize_(model, config, filter_fn=None)
    summary = quantization_summary(model)
    assert (summary.expert_weights_quantized, summary.linear_quantized) == (4, 0)
    # The logits are those of torchao's own dequantized weights: the experts run on the quantized tensors.
    reference = with_expert_weights(
        full_precision, lambda i, name, w: getattr(model.get_submodule(f"{layers[i]}.experts"), name).dequantize())
    assert all(type(model.get_submodule(f"{name}.experts").down_proj).__name__ == "Int8Tensor" for name in layers)
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------ order
REFUSAL = (
    "ompmoe.prune refuses a quantized model: {reason}. Pruning after quantization is not supported: prune the "
    "full-precision model, save it with ompmoe.save_pruned, then quantize the pruned model (docs/recipes.md)."
)


def _refused(model, plan, reason: str) -> None:
    before = {name: tuple(p.shape) for name, p in model.named_parameters()}
    config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    with pytest.raises(QuantizedModelError) as error:
        ompmoe.prune(model, plan)
    assert str(error.value) == REFUSAL.format(reason=reason)
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == before  # nothing changed
    assert json.dumps(model.config.to_dict(), sort_keys=True, default=str) == config


def test_prune_refuses_quantized_experts(stats):
    plan = ompmoe.plan_pruning(stats, 0.5)
    model = tiny_model("qwen3_moe")
    ompmoe.quantize_experts(model, bits=4)
    _refused(model, plan, "model.layers.1.mlp.experts.gate_up_proj is quantized by ompmoe.quantize_experts (int4)")


def test_prune_refuses_torchao_tensors_and_quantization_config(stats):
    quantization = pytest.importorskip("torchao.quantization")
    plan = ompmoe.plan_pruning(stats, 0.5)
    model = tiny_model("qwen3_moe")
    config = quantization.FqnToConfig({r"re:.*\.experts\.down_proj$": quantization.Int8WeightOnlyConfig(set_inductor_config=False)})
    quantization.quantize_(model, config, filter_fn=None)
    _refused(model, plan, "model.layers.1.mlp.experts.down_proj is a torchao Int8Tensor")

    model = tiny_model("qwen3_moe")
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    _refused(model, plan, "config.quantization_config is set (quant_method='gptq')")


def test_prune_after_linear_only_quantization_equals_the_other_order(stats, blocks):
    quantization = pytest.importorskip("torchao.quantization")
    plan = ompmoe.plan_pruning(stats, 0.5)
    config = quantization.Int8WeightOnlyConfig(set_inductor_config=False)
    first = tiny_model("qwen3_moe")
    quantization.quantize_(first, config)  # experts and routers stay full precision: pruning is allowed
    ompmoe.prune(first, plan)
    second = ompmoe.prune(tiny_model("qwen3_moe"), plan)
    quantization.quantize_(second, config)
    assert torch.equal(logits(first, blocks[:2]), logits(second, blocks[:2]))


# ----------------------------------------------------------------------------------- GPTQ layout
def test_uniform_checkpoint_has_the_layout_gptq_tools_expect(stats, blocks, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = pruned_model(stats, "uniform")
    ompmoe.save_pruned(model, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    # transformers 5 writes Qwen3-MoE's count as num_local_experts (num_experts maps onto it).
    assert config.get("num_local_experts", config.get("num_experts")) == 8 and config["ompmoe"]["uniform"] is True
    assert AutoConfig.from_pretrained(tmp_path / "model").num_experts == 8
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in keys}
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp"
        experts = {key for key in keys if key.startswith(f"{prefix}.experts.")}
        assert experts == {f"{prefix}.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")}
        assert shapes[f"{prefix}.experts.7.gate_proj.weight"] == (16, 32)  # (moe_intermediate_size, hidden)
        assert shapes[f"{prefix}.experts.7.down_proj.weight"] == (32, 16)
        assert shapes[f"{prefix}.gate.weight"] == (8, 32)  # router rows == config num_experts
    assert not any(".experts.gate_up_proj" in key for key in keys)  # no fused tensors on disk
    plain, info = AutoModelForCausalLM.from_pretrained(tmp_path / "model", output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert torch.equal(logits(plain, blocks[:2]), logits(model, blocks[:2]))


def test_save_pruned_refuses_quantized_models(stats, tmp_path):
    model = pruned_model(stats, "uniform")
    ompmoe.quantize_experts(model)  # save_pretrained would write parametrization keys that reload ignores
    with pytest.raises(QuantizedModelError) as error:
        ompmoe.save_pruned(model, tmp_path / "q")
    assert str(error.value) == (
        "ompmoe.save_pruned refuses a quantized model: model.layers.1.mlp.experts.gate_up_proj is quantized by "
        "ompmoe.quantize_experts. Save the full-precision (pruned, fine-tuned) model and quantize it after loading "
        "(docs/recipes.md)."
    )
    assert not (tmp_path / "q").exists()
    quantization = pytest.importorskip("torchao.quantization")
    model = pruned_model(stats, "uniform")
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig(set_inductor_config=False))
    with pytest.raises(QuantizedModelError, match="model.layers.0.self_attn.q_proj.weight is a torchao Int8Tensor"):
        ompmoe.save_pruned(model, tmp_path / "q")
