"""Checkpoints whose experts are stored in MXFP4 (gpt-oss's release) pruned layer by layer: the statistics are those
of the checkpoint dequantized (literally, code by code), the written checkpoint is the source's format with the kept
experts' blocks and scales byte for byte, and what it reads back is exactly ``save_pruned`` of the dequantized model;
stock transformers loads it in a fresh process, and ``ompmoe.load_pruned`` reads the release resident. What ompmoe
cannot read right is refused before any work."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

import ompmoe
from ompmoe.engine.apply.compensation import Compensation
from ompmoe.engine.collect.layerwise import collect_stats_layerwise
from ompmoe.engine.export.streamed import save_pruned_from_files
from ompmoe.engine.mxfp4 import dequantize
from ompmoe.engine.names import shipped_model_path
from ompmoe.engine.quantized_files import QuantizedCheckpointError
from ompmoe.engine.tiny import tiny_model

from mxfp4_reference import dequantized_checkpoint, literal_dequantize, quantize, to_mxfp4
from quantized_checkpoints import (assert_both_commands_refuse_a_named_compensation,
                                   assert_pruned_layer_by_layer_as_resident,
                                   assert_stock_transformers_reads_it_pruned, read_tensors, rewrite)

BLOCKS = [torch.randint(3, 4000, (2, 16), generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
PROJECTIONS = ("experts.gate_up_proj", "experts.down_proj")


def _mxfp4_source(tmp_path: Path, **overrides) -> tuple[Path, Path]:
    """A tiny gpt-oss checkpoint as its release stores it (experts in MXFP4, the shipped tokenizer beside it), and the
    full-precision checkpoint it stands for."""
    settings = dict(hidden_size=64, intermediate_size=32, vocab_size=4096, num_local_experts=16, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_model("gpt_oss", dtype=torch.bfloat16, **settings).save_pretrained(tmp_path / "original")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shipped_model_path() / name, tmp_path / "original" / name)
    mxfp4 = to_mxfp4(tmp_path / "original", tmp_path / "mxfp4")
    return mxfp4, dequantized_checkpoint(mxfp4, tmp_path / "dequantized")


def test_dequantize_is_the_code_by_code_product_and_transformers_own_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    weight = torch.randn(3, 64, 40)  # [experts, in, out]: 2 groups of 32 per row
    blocks, scales = quantize(weight)
    assert blocks.shape == (3, 40, 2, 16) and scales.shape == (3, 40, 2)
    ours = dequantize(blocks, scales)
    literal = literal_dequantize(blocks, scales)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours.float(), literal)  # every such value is a bfloat16
    assert (literal - weight).abs().max() <= weight.abs().max() / 4  # e2m1 keeps 1 mantissa bit: a coarse copy
    codes = torch.randint(0, 256, (2, 8, 3, 16), dtype=torch.uint8)  # every code, and exponents to the extremes
    exponents = torch.randint(0, 256, (2, 8, 3), dtype=torch.uint8)
    exponents[0, :2] = torch.tensor([[0, 1, 2], [127, 254, 255]], dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(codes, exponents, dtype=torch.bfloat16)
    assert torch.equal(dequantize(codes, exponents).view(torch.int16), theirs.view(torch.int16))  # NaNs included


def test_an_mxfp4_checkpoint_prunes_layer_by_layer_into_its_own_format(tmp_path):
    mxfp4, dequantized = _mxfp4_source(tmp_path)
    stored = read_tensors(mxfp4)
    plan = assert_pruned_layer_by_layer_as_resident(mxfp4, dequantized, BLOCKS, tmp_path)
    assert len({len(kept) for kept in plan.kept_by_layer().values()}) > 1  # non-uniform: counts differ
    expected, written = read_tensors(tmp_path / "resident"), read_tensors(tmp_path / "streamed")
    quantized = {name for name in expected if name.endswith(PROJECTIONS)}
    assert len(quantized) == 2 * len(plan.layers)
    assert written.keys() == (expected.keys() - quantized) | {name + suffix for name in quantized
                                                              for suffix in ("_blocks", "_scales")}
    for name, tensor in expected.items():  # what the written checkpoint reads back is save_pruned's, bit for bit
        ours = written.get(name)
        if name in quantized:  # the source's blocks and scales of the kept experts, as stored
            layer = name.split(".mlp.")[0] + ".mlp"
            kept = torch.tensor(plan.kept_by_layer()[layer])
            for suffix in ("_blocks", "_scales"):
                assert written[name + suffix].dtype == torch.uint8
                assert torch.equal(written[name + suffix], stored[name + suffix][kept]), name + suffix
            ours = literal_dequantize(written[name + "_blocks"], written[name + "_scales"]).to(tensor.dtype)
        assert ours.dtype == tensor.dtype and torch.equal(ours, tensor), name
    row = ("| Weights dtype | MXFP4 experts (e2m1, one power-of-two scale per 32 values; the source's tensors as it "
           "stores them), the rest bfloat16 |")
    assert row in (tmp_path / "streamed" / "README.md").read_text()


def test_stock_transformers_reads_the_pruned_mxfp4_checkpoint_in_a_fresh_process(tmp_path):
    """Pruned uniformly and non-uniformly: stock ``from_pretrained`` (uniform) and with the remote code
    (non-uniform), in a process that never imported ompmoe, dequantize it (no GPU) to the logits of the pruned
    dequantized model."""
    mxfp4, dequantized = _mxfp4_source(tmp_path)
    ids = torch.randint(3, 4000, (2, 24), generator=torch.Generator().manual_seed(1))
    stats = collect_stats_layerwise(mxfp4, BLOCKS, progress=False)
    written = assert_stock_transformers_reads_it_pruned(mxfp4, dequantized, stats, ids, tmp_path)
    assert all(any(name.endswith("_blocks") for name in read_tensors(path)) for path in written.values())


def test_load_pruned_reads_an_mxfp4_release_dequantized(tmp_path):
    """The resident front doors load through ``ompmoe.load_pruned``: the release's uint8 blocks and scales are the
    format's, not wrong weights, and transformers dequantizes them (no GPU) to the literal values."""
    mxfp4, dequantized = _mxfp4_source(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, theirs = ompmoe.load_pruned(mxfp4).state_dict(), ompmoe.load_pruned(dequantized).state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_ompmoe_fit_layer_by_layer_prunes_an_mxfp4_checkpoint_and_says_what_auto_left_out(tmp_path, caplog, capsys):
    from ompmoe.cli import main

    from test_cli import tiny_config

    mxfp4, _ = _mxfp4_source(tmp_path)
    caplog.set_level("INFO")
    main(["fit", "-c", str(tiny_config(tmp_path)), "--trainer.enable_progress_bar=false", "--layer_by_layer", "true",
          "--model.model", str(mxfp4)])
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("ompmoe")]
    plan = ompmoe.PruningPlan.load(tmp_path / "run" / "plan.json")
    assert lines[2].startswith("ompmoe: auto's trial of its settings ran layer by layer in one more pass over the "
                               "layers: ")
    assert lines[3] == ("ompmoe: the checkpoint stores MXFP4 weights, written as stored: auto fits no compensation "
                        "(its refit would change them)")
    assert "compensation" not in plan.extra
    written = read_tensors(tmp_path / "run" / "model")
    assert sum(name.endswith("_blocks") for name in written) == 2 * len(plan.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ompmoe.load_pruned(tmp_path / "run" / "model", trust_remote_code=True)
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(model)] == [layer.num_kept for layer in plan.layers]

    # a compensation asked for by name is refused before any work, with the fix, by both commands and the API
    refusal = assert_both_commands_refuse_a_named_compensation(mxfp4, tmp_path / "run" / "stats.safetensors",
                                                               tmp_path, capsys, "MXFP4")
    plan = ompmoe.plan_pruning(ompmoe.MoEStats.load(tmp_path / "run" / "stats.safetensors"), 0.5)
    with pytest.raises(QuantizedCheckpointError) as refused:
        save_pruned_from_files(mxfp4, plan, tmp_path / "out", compensation=Compensation(scales={}, kept={}))
    assert str(refused.value) == refusal
    assert not (tmp_path / "out").exists()


WEIGHT = "model.layers.1.mlp.experts.down_proj"


def _no_quantization_config(tensors: dict, config: dict) -> None:
    del config["quantization_config"]


def _full_precision_files(tensors: dict, config: dict) -> None:
    for name in [name.removesuffix("_blocks") for name in tensors if name.endswith("_blocks")]:
        tensors[name] = literal_dequantize(tensors.pop(name + "_blocks"), tensors.pop(name + "_scales"))


def _bf16_scales(tensors: dict, config: dict) -> None:
    tensors[WEIGHT + "_scales"] = tensors[WEIGHT + "_scales"].to(torch.bfloat16)


def _without_scales(tensors: dict, config: dict) -> None:
    del tensors[WEIGHT + "_scales"]


def _short_scales(tensors: dict, config: dict) -> None:
    tensors[WEIGHT + "_scales"] = tensors[WEIGHT + "_scales"][..., :0].contiguous()


@pytest.mark.parametrize(("change", "message"), [
    (_no_quantization_config, "{source} stores 6 weights in MXFP4 (model.layers.0.mlp.experts.down_proj_blocks, ...) "
                              "but its config.json has no quantization_config with quant_method 'mxfp4'; they would "
                              "not be read as weights. Add the quantization_config the checkpoint was released with."),
    (_full_precision_files, "{source}'s config.json says its experts are MXFP4 (quantization_config), but its files "
                            "hold no <name>_blocks / <name>_scales pair; remove the quantization_config from "
                            "config.json if the weights are full precision."),
    (_bf16_scales, "{source} stores MXFP4 weights ompmoe cannot read: {w}_scales is BF16, not 8-bit codes or "
                   "exponents (U8). Its files are incomplete or in another MXFP4 layout (ompmoe reads gpt-oss's)."),
    (_without_scales, "{source} stores MXFP4 weights ompmoe cannot read: {w} has no {w}_scales. Its files are "
                      "incomplete or in another MXFP4 layout (ompmoe reads gpt-oss's)."),
    (_short_scales, "{source} stores MXFP4 weights ompmoe cannot read: {w}_blocks [16, 64, 1, 16] and {w}_scales "
                    "[16, 64, 0] are not [experts, rows, groups, 16] and [experts, rows, groups]. Its files are "
                    "incomplete or in another MXFP4 layout (ompmoe reads gpt-oss's)."),
], ids=lambda value: getattr(value, "__name__", "")[:24] or None)
def test_what_ompmoe_cannot_read_right_is_refused_by_name_before_any_layer_runs(change, message, tmp_path):
    mxfp4, _ = _mxfp4_source(tmp_path)
    rewrite(mxfp4, change)
    with pytest.raises(QuantizedCheckpointError) as refused:
        collect_stats_layerwise(mxfp4, BLOCKS, progress=False)
    assert str(refused.value) == message.format(source=mxfp4, w=WEIGHT)


def test_a_checkpoint_missing_a_tensor_is_refused_by_name_when_its_layer_is_read(tmp_path):
    """Not MXFP4 only: a parameter the files hold no tensor for would stay on the meta device and compute NaN
    statistics (and be left out of the written checkpoint); the fill refuses it by name."""
    _, dequantized = _mxfp4_source(tmp_path)
    rewrite(dequantized, lambda tensors, config: tensors.pop(WEIGHT))
    with pytest.raises(ValueError) as refused:
        collect_stats_layerwise(dequantized, BLOCKS, progress=False)
    assert str(refused.value) == (f"{dequantized} holds no tensor for 1 parameters of the model ({WEIGHT}): the "
                                  "checkpoint's files are incomplete. Copy or download the checkpoint again.")


def test_ompmoe_prune_writes_an_mxfp4_checkpoint_from_its_files_whatever_calibrated_it(tmp_path):
    """Statistics of a resident calibration (the dequantized model): ``ompmoe prune --model`` of the MXFP4 files
    still writes from them, in MXFP4, its held-out perplexity measured layer by layer (not the dequantized model in
    bf16, which a resident prune measuring it would write)."""
    from ompmoe.cli import main

    mxfp4, _ = _mxfp4_source(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats = ompmoe.collect_stats(ompmoe.load_pruned(mxfp4), BLOCKS, model_id=str(mxfp4), progress=False)
    stats.save(tmp_path / "stats.safetensors")
    main(["prune", "--stats", str(tmp_path / "stats.safetensors"), "--ratio", "0.5", "--model", str(mxfp4),
          "--output_dir", str(tmp_path / "pruned"), "--evaluate_on", "heldout:prose", "--evaluate_blocks", "2"])
    written = read_tensors(tmp_path / "pruned" / "model-0.5")
    assert sum(name.endswith("_blocks") for name in written) == 2 * len(stats.layers)
    assert not any(name.endswith(PROJECTIONS) for name in written)


def test_load_pruned_leaves_other_quantized_checkpoints_to_its_weight_checks(tmp_path):
    """A GPTQ checkpoint (a format ompmoe neither reads nor writes) gets the loader's own message about its
    integer tensors, not advice to prune another checkpoint."""
    from ompmoe.engine.export.weights import CheckpointWeightsError

    _, dequantized = _mxfp4_source(tmp_path)

    def as_gptq(tensors: dict, config: dict) -> None:
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
        tensors["model.layers.0.self_attn.q_proj.qweight"] = torch.zeros(4, 4, dtype=torch.int32)

    rewrite(dequantized, as_gptq)
    with pytest.raises(CheckpointWeightsError) as refused:
        ompmoe.load_pruned(dequantized)
    assert str(refused.value).startswith(f"{dequantized / 'model.safetensors'} stores 1 tensors in a non-floating "
                                         "dtype (I32): model.layers.0.self_attn.q_proj.qweight;")


def test_a_tied_head_stored_instead_of_its_embeddings_is_refused_with_the_fix(tmp_path):
    """transformers ties either side of a tied head; layer by layer reads the embeddings from their own tensor."""
    _, dequantized = _mxfp4_source(tmp_path, tie_word_embeddings=True)

    def head_only(tensors: dict, config: dict) -> None:
        tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")

    rewrite(dequantized, head_only)
    with pytest.raises(ValueError) as refused:
        collect_stats_layerwise(dequantized, BLOCKS, progress=False)
    assert str(refused.value) == (
        f"{dequantized} stores the tied lm_head.weight but not model.embed_tokens.weight, which layer-by-layer reads "
        "the embeddings from. Save the checkpoint again with save_pretrained (it stores the embeddings), or "
        "calibrate it resident.")


def test_ompmoe_prune_of_an_mxfp4_checkpoint_pruned_to_per_layer_counts_loads_it(tmp_path):
    """A skeleton cannot read per-layer counts: pruning ompmoe's own non-uniform MXFP4 output again loads it
    (dequantized), as before, rather than refusing the files it would otherwise write from."""
    from ompmoe.cli import main

    mxfp4, _ = _mxfp4_source(tmp_path)
    plan = ompmoe.plan_pruning(collect_stats_layerwise(mxfp4, BLOCKS, progress=False), 0.5, allocation="waterfill")
    assert len({len(kept) for kept in plan.kept_by_layer().values()}) > 1
    save_pruned_from_files(mxfp4, plan, tmp_path / "pruned")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stats = ompmoe.collect_stats(ompmoe.load_pruned(tmp_path / "pruned"), BLOCKS, model_id=str(tmp_path / "pruned"),
                                     progress=False)
    stats.save(tmp_path / "stats.safetensors")
    main(["prune", "--stats", str(tmp_path / "stats.safetensors"), "--ratio", "0.25", "--model",
          str(tmp_path / "pruned"), "--output_dir", str(tmp_path / "again"), "--quiet", "true"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = ompmoe.load_pruned(tmp_path / "again" / "model-0.25")
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(again)] == [
        len(kept) for kept in ompmoe.PruningPlan.load(tmp_path / "again" / "plan-0.25.json").kept_by_layer().values()]
