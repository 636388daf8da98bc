"""Block-FP8 checkpoints (DeepSeek-V3/R1, Kimi K2, MiniMax-M2, Qwen3's -FP8 releases) pruned layer by layer: the
statistics are those of the checkpoint dequantized (literally, block by block), the written checkpoint is the
source's format with the kept experts' FP8 tensors and scales byte for byte, and what it reads back is exactly
``save_pruned`` of the dequantized model; stock transformers loads it in a fresh process. What ompmoe cannot read
right is refused before any work."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import transformers

import ompmoe
from ompmoe.engine.block_fp8 import dequantize
from ompmoe.engine.quantized_files import QuantizedCheckpointError
from ompmoe.engine.collect.layerwise import collect_stats_layerwise
from ompmoe.engine.export.streamed import save_pruned_from_files
from ompmoe.engine.names import shipped_model_path
from ompmoe.engine.tiny import tiny_model

from block_fp8_reference import dequantized_checkpoint, literal_dequantize, quantize, quantized_in_release, to_block_fp8
from quantized_checkpoints import (assert_pruned_layer_by_layer_as_resident,
                                   assert_stock_transformers_reads_it_pruned, read_tensors, rewrite)

BLOCKS = [torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
RELEASED_IN_FP8 = ["deepseek_v3", "qwen3_moe", "minimax_m2", "glm4_moe", "qwen3_next", "gemma4_text", "longcat_flash"]
"""Types with block-FP8 releases (DeepSeek-V3 and Kimi K2, Qwen3 -FP8, MiniMax-M2, GLM-4.5 -FP8, Qwen3-Next -FP8,
LongCat-Flash -FP8, whose identity experts' rows are written after the kept ones), and gemma4_text, whose files store
fused experts tensors (their FP8 form has ``[experts, ...]`` scales)."""


def test_dequantize_is_the_block_by_block_product_partial_blocks_included():
    torch.manual_seed(0)
    weight = torch.randn(3, 70, 45)  # 3 experts; 70 x 45 in 32 x 16 blocks: the last ones partial
    values, scales = quantize(weight, (32, 16))
    assert scales.shape == (3, 3, 3)
    ours = dequantize(values, scales, (32, 16))
    assert ours.dtype == torch.float32 and torch.equal(ours, literal_dequantize(values, scales, (32, 16)))
    assert (ours - weight).abs().max() <= weight.abs().max() / 8  # e4m3 keeps 3 mantissa bits: a close copy


def _fp8_source(model_type: str, tmp_path: Path, block: tuple[int, int] = (32, 16)) -> tuple[Path, Path]:
    """A tiny ``model_type`` checkpoint in block FP8, and the full-precision checkpoint it stands for."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_model(model_type, dtype=torch.bfloat16).save_pretrained(tmp_path / "original")
    fp8 = to_block_fp8(tmp_path / "original", tmp_path / "fp8", block)
    return fp8, dequantized_checkpoint(fp8, tmp_path / "dequantized")


@pytest.mark.parametrize("model_type", RELEASED_IN_FP8)
def test_a_block_fp8_checkpoint_prunes_layer_by_layer_into_its_own_format(model_type, tmp_path):
    fp8, dequantized = _fp8_source(model_type, tmp_path)
    stored = read_tensors(fp8)
    assert any(tensor.dtype == torch.float8_e4m3fn for tensor in stored.values())
    plan = assert_pruned_layer_by_layer_as_resident(fp8, dequantized, BLOCKS, tmp_path, str(shipped_model_path()))
    expected, written = read_tensors(tmp_path / "resident"), read_tensors(tmp_path / "streamed")
    block = (32, 16)
    scales = {name for name in written if name.endswith("_scale_inv")}
    assert {name.removesuffix("_scale_inv") for name in scales} <= written.keys()
    assert written.keys() - scales == expected.keys()
    fp8_names = {name for name, tensor in written.items() if tensor.dtype == torch.float8_e4m3fn}
    assert fp8_names == {name.removesuffix("_scale_inv") for name in scales} == {
        name for name, tensor in expected.items() if quantized_in_release(name, tensor)}  # the source's format
    for name, tensor in expected.items():  # what the written checkpoint reads back is save_pruned's, bit for bit
        ours = written[name]
        if name + "_scale_inv" in written:
            assert ours.dtype == torch.float8_e4m3fn
            ours = literal_dequantize(ours, written[name + "_scale_inv"], block).to(tensor.dtype)
        assert ours.dtype == tensor.dtype and torch.equal(ours, tensor), name
    # and every FP8 tensor it holds is one of the source's, with the source's scales (kept experts as stored)
    source_fp8 = {(tensor.view(torch.uint8).numpy().tobytes(), stored[name + "_scale_inv"].numpy().tobytes())
                  for name, tensor in stored.items() if tensor.dtype == torch.float8_e4m3fn and tensor.dim() == 2}
    for name in scales:
        weight, scale = written[name.removesuffix("_scale_inv")], written[name]
        if weight.dim() == 2:
            assert (weight.view(torch.uint8).numpy().tobytes(), scale.numpy().tobytes()) in source_fp8, name
    for name, tensor in written.items():
        if tensor.dim() == 3 and tensor.dtype == torch.float8_e4m3fn:  # cut from the source's fused tensor
            kept = torch.tensor(plan.kept_by_layer()[next(layer for layer in plan.kept_by_layer()
                                                          if name.startswith(layer + "."))])
            assert torch.equal(tensor.view(torch.uint8), stored[name].view(torch.uint8)[kept]), name
            assert torch.equal(written[name + "_scale_inv"], stored[name + "_scale_inv"][kept]), name


def test_stock_transformers_reads_the_pruned_fp8_checkpoint_in_a_fresh_process(tmp_path):
    """The shipped model in 64 x 64 blocks (transformers dequantizes whole blocks only), pruned uniformly and
    non-uniformly: stock ``from_pretrained`` (uniform) and ``ompmoe.load_pruned`` (non-uniform, remote code) in a
    process that never imported ompmoe give the logits of the pruned dequantized model."""
    fp8 = to_block_fp8(shipped_model_path(), tmp_path / "fp8", (64, 64))
    dequantized = dequantized_checkpoint(fp8, tmp_path / "dequantized")
    ids = torch.randint(3, 4000, (2, 24), generator=torch.Generator().manual_seed(1))
    stats = collect_stats_layerwise(fp8, [ids], progress=False)
    written = assert_stock_transformers_reads_it_pruned(fp8, dequantized, stats, ids, tmp_path)
    for path in written.values():
        assert any(tensor.dtype == torch.float8_e4m3fn for tensor in read_tensors(path).values())
    row = ("| Weights dtype | FP8 (e4m3, one scale per 64x64 block; the source's tensors as it stores them), the rest "
           "bfloat16")
    assert f"{row} |" in (tmp_path / "waterfill" / "README.md").read_text()


def test_a_non_uniform_fp8_checkpoint_loads_each_layer_at_its_own_count_in_fp8(tmp_path, monkeypatch):
    """On a GPU, transformers keeps the FP8 weights and rebuilds every experts module for them from
    ``module.config``: the remote code and ``ompmoe.load_pruned`` give each a config with its own count (run here on
    CPU with the quantizer's device check bypassed: loading only; the FP8 kernels need a GPU)."""
    import transformers.quantizers.quantizer_finegrained_fp8 as fp8_quantizer

    fp8 = to_block_fp8(shipped_model_path(), tmp_path / "fp8", (64, 64))
    stats = collect_stats_layerwise(fp8, [torch.randint(3, 4000, (2, 24))], progress=False)
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="waterfill")
    counts = [len(kept) for kept in plan.kept_by_layer().values()]
    assert len(set(counts)) > 1
    save_pruned_from_files(fp8, plan, tmp_path / "pruned")
    stored = read_tensors(tmp_path / "pruned")
    monkeypatch.setattr(fp8_quantizer.FineGrainedFP8HfQuantizer, "validate_environment", lambda *args, **kwargs: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model in (ompmoe.load_pruned(tmp_path / "pruned", device_map="cpu"),
                      transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True,
                                                                        device_map="cpu")):
            experts = [layer.mlp.experts for layer in model.model.layers]
            assert [type(each).__name__ for each in experts] == ["FP8Experts"] * len(counts)
            assert [each.gate_up_proj.shape[0] for each in experts] == counts == [each.num_experts for each in experts]
            down = experts[0].down_proj[1]  # the second kept expert of the first layer, as stored
            assert torch.equal(down.view(torch.uint8),
                               stored["model.layers.0.mlp.experts.1.down_proj.weight"].view(torch.uint8))


def test_ompmoe_fit_layer_by_layer_prunes_and_compensates_a_block_fp8_checkpoint(tmp_path, caplog):
    from ompmoe.cli import main

    from quantized_checkpoints import fit_layer_by_layer

    fp8 = to_block_fp8(shipped_model_path(), tmp_path / "fp8", (64, 64))
    lines, plan = fit_layer_by_layer(fp8, tmp_path, caplog)
    assert lines[0].startswith(  # auto fits its compensation: the down projections it changes are quantized again
        f"ompmoe: method {plan.method}, allocation {plan.allocation}, compensation linear, risk_weight 3, "
        "min_kept_fraction 0.375, max_kept_fraction 0.875, zeta 1e-06 (method and allocation 'auto': chose ")
    assert lines[1] == f"ompmoe: {ompmoe.kept_summary(plan)}"
    assert lines[2].startswith("ompmoe: auto's trial of its settings ran layer by layer in one more pass over the "
                               "layers: ")
    assert lines[3].startswith("ompmoe: compensation and its check and held-out perplexity ran layer by layer in ")
    assert lines[4].startswith("ompmoe: compensation (linear, 256 tokens): held-out calibration loss ")
    assert lines[5].startswith("ompmoe: held-out perplexity on 512 tokens per set, original -> pruned: heldout:prose ")
    assert lines[6:] == [f"ompmoe: wrote statistics, plan and pruned model to {tmp_path / 'run'}"]
    record = plan.extra["compensation"]
    assert record["granularity"] == "linear" and "loss_with" in record
    written, stored = read_tensors(tmp_path / "run" / "model"), read_tensors(fp8)
    assert 0 < sum(tensor.dtype == torch.float8_e4m3fn for tensor in written.values()) == sum(
        name.endswith("_scale_inv") for name in written)
    down = [name for name in written if ".down_proj.weight" in name and ".experts." in name
            and not name.endswith("_scale_inv")]
    assert down and all(written[name].dtype == torch.float8_e4m3fn for name in down)
    assert sum(_requantized(written, stored, name, plan) for name in down) == (len(down) if record["applied"] else 0)
    card = (tmp_path / "run" / "model" / "README.md").read_text()
    row = ("| Weights dtype | FP8 (e4m3, one scale per 64x64 block; the kept experts' compensated down projections "
           "quantized again where the source quantizes them, the others the source's tensors as it stores them), the "
           "rest bfloat16 |")
    assert (row in card) == record["applied"]
    model = ompmoe.load_pruned(tmp_path / "run" / "model")
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(model)] == [layer.num_kept for layer in plan.layers]

    # ompmoe prune re-plans its statistics from the same files, FP8 in and out, compensated as the fit was
    main(["prune", "--stats", str(tmp_path / "run" / "stats.safetensors"), "--ratio", "0.25", "--model", str(fp8),
          "--output_dir", str(tmp_path / "pruned"), "--quiet", "true"])
    written = read_tensors(tmp_path / "pruned" / "model-0.25")
    replanned = ompmoe.PruningPlan.load(tmp_path / "pruned" / "plan-0.25.json")
    assert replanned.extra["compensation"]["num_tokens"] > 0  # refit as the fit's record says (auto's down)
    down = [name for name in written if ".down_proj.weight" in name and ".experts." in name
            and not name.endswith("_scale_inv")]
    changed = sum(_requantized(written, stored, name, replanned) for name in down)
    assert down and changed == (len(down) if replanned.extra["compensation"]["applied"] else 0)


def test_a_block_fp8_checkpoint_whose_multipliers_ompmoe_does_not_write_is_not_compensated(tmp_path, caplog,
                                                                                          capsys):
    """A ``scale_fmt`` :func:`~ompmoe.engine.block_fp8.quantize` does not write: its weights are read and written as
    stored, auto fits no compensation and says why, and one named is refused by both commands and the API before any
    work, with the fix."""
    from ompmoe.cli import main
    from ompmoe.engine.apply.compensation import Compensation

    from quantized_checkpoints import assert_both_commands_refuse_a_named_compensation
    from test_cli import tiny_config

    fp8 = to_block_fp8(shipped_model_path(), tmp_path / "fp8", (64, 64))
    rewrite(fp8, lambda tensors, config: config["quantization_config"].update(scale_fmt="e4m3"))
    caplog.set_level("INFO")
    main(["fit", "-c", str(tiny_config(tmp_path)), "--trainer.enable_progress_bar=false", "--layer_by_layer", "true",
          "--model.model", str(fp8)])
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("ompmoe")]
    assert ("ompmoe: the checkpoint stores block-FP8 weights, written as stored: auto fits no compensation (its refit "
            "would change them)") in lines
    plan = ompmoe.PruningPlan.load(tmp_path / "run" / "plan.json")
    assert "compensation" not in plan.extra
    written, stored = read_tensors(tmp_path / "run" / "model"), read_tensors(fp8)
    down = [name for name in written if ".experts." in name and name.endswith("down_proj.weight")]
    assert down and not any(_requantized(written, stored, name, plan) for name in down)

    refusal = assert_both_commands_refuse_a_named_compensation(fp8, tmp_path / "run" / "stats.safetensors",
                                                               tmp_path, capsys, "block-FP8")
    with pytest.raises(QuantizedCheckpointError) as refused:
        save_pruned_from_files(fp8, plan, tmp_path / "out", compensation=Compensation(scales={}, kept={}))
    assert str(refused.value) == refusal
    assert not (tmp_path / "out").exists()


def _requantized(written: dict, stored: dict, name: str, plan: ompmoe.PruningPlan) -> bool:
    """Whether the written FP8 weight ``name`` (or its scales) is not its source's as stored."""
    source = _source_name(name, plan)
    return not (torch.equal(written[name].view(torch.uint8), stored[source].view(torch.uint8))
                and torch.equal(written[name + "_scale_inv"], stored[source + "_scale_inv"]))


def _source_name(name: str, plan: ompmoe.PruningPlan) -> str:
    """The source's file tensor of a written per-expert tensor (its kept expert renumbered)."""
    layer, _, rest = name.partition(".experts.")
    number, _, tail = rest.partition(".")
    return f"{layer}.experts.{plan.kept_by_layer()[layer][int(number)]}.{tail}"


def test_quantize_is_transformers_fp8_quantizer_bit_for_bit_partial_blocks_one_by_one():
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    from ompmoe.engine.block_fp8 import quantize as ours

    def theirs(block: torch.Tensor, size: tuple[int, int], scale_fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        config = SimpleNamespace(weight_block_size=size, scale_fmt=scale_fmt)
        out = Fp8Quantize(SimpleNamespace(quantization_config=config))._quantize_one("w.weight", block)
        return out["w.weight"], out["w.weight_scale_inv"].float()

    torch.manual_seed(0)
    weight = torch.randn(3, 70, 45, dtype=torch.bfloat16) * 0.02
    weight[0, :32, :16] = 0  # a block of zeros keeps multiplier 1
    for scale_fmt in (None, "ue8m0"):
        values, scales = ours(weight, (32, 16), scale_fmt)
        assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32 and scales.shape == (3, 3, 3)
        for i in range(3):
            for j in range(3):
                rows, cols = slice(32 * i, 32 * (i + 1)), slice(16 * j, 16 * (j + 1))
                block = weight[:, rows, cols]
                expected_values, expected_scales = theirs(block, tuple(block.shape[-2:]), scale_fmt)
                assert torch.equal(values[:, rows, cols].view(torch.uint8), expected_values.view(torch.uint8))
                assert torch.equal(scales[:, i, j], expected_scales.reshape(3))
        assert torch.equal(scales[0, 0, 0], torch.tensor(1.0))
    for values, scales in (ours(weight, (32, 16), "float"),):  # FineGrainedFP8Config's default: float32 ones
        assert torch.equal(values.view(torch.uint8), ours(weight, (32, 16))[0].view(torch.uint8))
        assert torch.equal(scales, ours(weight, (32, 16))[1])
    with pytest.raises(QuantizedCheckpointError, match=r"^scale_fmt='e4m3': ompmoe writes block-FP8 multipliers as "):
        ours(weight, (32, 16), "e4m3")


def _scale_fmt_float(tensors: dict, config: dict) -> None:
    """The ``quantization_config`` transformers' ``FineGrainedFP8Config`` writes (``scale_fmt: float``)."""
    config["quantization_config"]["scale_fmt"] = "float"


def _full_precision_layer(tensors: dict, config: dict) -> None:
    """Layer 2's routed experts' down projections kept in bf16 (a block-FP8 checkpoint quantizes what it names)."""
    for name in [name for name in tensors if name.startswith("model.layers.2.mlp.experts.")
                 and name.endswith("down_proj.weight")]:
        tensors[name] = literal_dequantize(tensors[name], tensors.pop(name + "_scale_inv"), (32, 16)).to(
            torch.bfloat16)


@pytest.mark.parametrize(("model_type", "granularity", "change"), [
    ("deepseek_v3", "linear", None), ("qwen3_moe", "down", None), ("gemma4_text", "expert", None),
    ("deepseek_v3", "down", _full_precision_layer), ("qwen3_moe", "linear", _scale_fmt_float)],
    ids=["deepseek_v3", "qwen3_moe", "gemma4_text", "one_layer_in_bf16", "scale_fmt_float"])
def test_a_compensated_block_fp8_checkpoint_is_written_as_the_run_measured_it(model_type, granularity, change,
                                                                              tmp_path):
    """The layer-by-layer pass fits the compensation and measures the pruned model with its corrected down
    projections as they will be written (quantized again); the streamed writer quantizes the same values as
    transformers' FP8 quantizer does: the written checkpoint, read back literally, has the perplexity the run
    reported, its compensated down projections are the resident compensated model's quantized, and every other
    tensor is the source's as stored (gemma4_text: fused experts tensors in the files)."""
    from ompmoe.engine.perplexity import perplexity

    from quantized_checkpoints import compensated_layer_by_layer

    block = (32, 16)
    fp8, _ = _fp8_source(model_type, tmp_path, block)
    if change is not None:
        rewrite(fp8, change)
    dequantized = dequantized_checkpoint(fp8, tmp_path / "dequantized-again")
    plan, heldout, measured = compensated_layer_by_layer(fp8, BLOCKS, granularity, tmp_path)
    written, stored = read_tensors(tmp_path / "written"), read_tensors(fp8)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        read_back = ompmoe.load_pruned(dequantized_checkpoint(tmp_path / "written", tmp_path / "read"))
        resident = measured.compensation.apply(ompmoe.prune(ompmoe.load_pruned(dequantized), plan))
    assert perplexity(read_back, heldout) == pytest.approx(measured.heldout["set"][1], rel=1e-6)
    expected = {name: tensor for name, tensor in read_tensors(_saved(resident, tmp_path / "resident")).items()}
    down = {name for name in written if ".experts." in name and "down_proj" in name and written[name].dtype ==
            torch.float8_e4m3fn}
    assert down
    if change is _full_precision_layer:  # written as computed, where the files keep them in full precision
        kept_bf16 = [name for name in written if name.startswith("model.layers.2.mlp.experts.")
                     and name.endswith("down_proj.weight")]
        assert kept_bf16 and all(torch.equal(written[name], expected[name]) for name in kept_bf16)
    for name in down:  # the resident compensated rows, quantized as transformers' Fp8Quantize quantizes them
        values, scales = quantize_like_transformers(expected[name], block)
        assert torch.equal(written[name].view(torch.uint8), values.view(torch.uint8)), name
        assert torch.equal(written[name + "_scale_inv"], scales), name
        assert not torch.equal(written[name + "_scale_inv"], _kept_rows(stored, name, plan, "_scale_inv")), name
    for name, tensor in written.items():  # the rest: the source's, as stored
        weight = name.removesuffix("_scale_inv")
        if tensor.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv"):
            if weight not in down:
                assert torch.equal(tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor,
                                   _kept_rows(stored, name, plan, "", uint8=tensor.dtype == torch.float8_e4m3fn)), name


def _saved(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def _kept_rows(stored: dict, name: str, plan, suffix: str, uint8: bool = False) -> torch.Tensor:
    """The source's tensor a written ``name`` was cut from (a per-expert one renumbered, a fused one's kept rows)."""
    base = name.removesuffix(suffix) if suffix else name
    layer = next((layer for layer in plan.kept_by_layer() if base.startswith(layer + ".")), None)
    if layer is not None and ".experts." in base and base.split(".experts.")[1].split(".")[0].isdigit():
        source = _source_name(base, plan) + suffix
        tensor = stored[source]
    elif layer is not None and ".experts." in base and stored[name.removesuffix(suffix) + suffix].dim() == 3:
        tensor = stored[name][torch.tensor(plan.kept_by_layer()[layer])]
    else:
        tensor = stored[name.removesuffix(suffix) + suffix]
    return tensor.view(torch.uint8) if uint8 else tensor


def quantize_like_transformers(values: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` quantized by transformers' ``Fp8Quantize``, block by block (each partial block as a whole)."""
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    rows, cols = values.shape[-2:]
    out = torch.empty(values.shape, dtype=torch.float8_e4m3fn)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scales = torch.empty((*values.shape[:-2], *grid), dtype=torch.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = values[..., i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            config = SimpleNamespace(weight_block_size=tuple(part.shape[-2:]), scale_fmt=None)
            quantized = Fp8Quantize(SimpleNamespace(quantization_config=config))._quantize_one("w.weight", part)
            out[..., i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = quantized["w.weight"]
            scales[..., i, j] = quantized["w.weight_scale_inv"].reshape(scales[..., i, j].shape)
    return out, scales


def test_a_transposed_experts_block_fp8_checkpoint_is_not_compensated(tmp_path, capsys):
    """gpt-oss keeps its experts' down projection transposed (no block-FP8 release does): auto fits no compensation
    and says why; one asked for is refused when the run starts, before calibrating."""
    from ompmoe.engine.apply.compensation import CompensationError
    from ompmoe.engine.export.config import load_stock_config
    from ompmoe.engine.lazy_checkpoint import build_skeleton

    fp8, _ = _fp8_source("gpt_oss", tmp_path)
    why = ("model.layers.0.mlp.experts stores its down projection transposed; ompmoe quantizes compensated down "
           "projections again only in the files' layout")
    run = ompmoe.PruningRun(ompmoe.RunOptions(plots=False, layer_by_layer=True))
    run.start(build_skeleton(load_stock_config(fp8)), ompmoe.LocalContext(), model_id=str(fp8))
    assert run.no_compensation_line == f"ompmoe: auto fits no compensation: {why}."
    assert run.compensation_granularity is None
    named = ompmoe.PruningRun(ompmoe.RunOptions(plots=False, layer_by_layer=True, compensation="linear"))
    with pytest.raises(CompensationError) as refused:
        named.start(build_skeleton(load_stock_config(fp8)), ompmoe.LocalContext(), model_id=str(fp8))
    assert str(refused.value) == f"{why}. Run without compensation." and named.collector is None

    # ompmoe prune --compensation: refused before the pass reads a layer (the skeleton says so)
    from ompmoe.cli import main

    stats = collect_stats_layerwise(fp8, BLOCKS, progress=False).save(tmp_path / "stats.safetensors")
    with pytest.raises(SystemExit):
        main(["prune", "--stats", str(stats), "--ratio", "0.5", "--model", str(fp8), "--output_dir",
              str(tmp_path / "pruned"), "--compensation", "down", "--quiet", "true"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: {why}. Run without compensation (--compensation off).")
    assert not (tmp_path / "pruned").exists()


def test_loading_partial_fp8_blocks_without_a_gpu_is_refused_where_transformers_would_read_them_wrong(tmp_path):
    """Tiny DeepSeek-V3 in 32 x 16 blocks: its 48-row weights end in a partial block, which transformers'
    dequantization (without a GPU) reads as two blocks of 24 rows. ompmoe.load_pruned (every resident front door's
    loader) refuses it by name; the layer-by-layer reading of the same files is the literal one (the test above)."""
    fp8, dequantized = _fp8_source("deepseek_v3", tmp_path)
    literal = read_tensors(dequantized)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = dict(transformers.AutoModelForCausalLM.from_pretrained(fp8).state_dict())
    name = "model.layers.0.mlp.gate_proj.weight"
    assert list(literal[name].shape)[0] == 48 and not torch.equal(theirs[name], literal[name])  # wrong, no error
    with pytest.raises(QuantizedCheckpointError) as refused:
        ompmoe.load_pruned(fp8)
    message = str(refused.value)
    assert message.startswith(f"{fp8} stores FP8 weights that are not whole 32x16 blocks (")
    assert name in message and message.endswith(
        "); without a GPU transformers dequantizes them as if they were and would load them wrong. Calibrate and "
        "prune it with layer_by_layer=True (ompmoe fit --layer_by_layer true), which reads partial blocks as "
        "DeepSeek's reference does, or load it on a GPU.")


WEIGHT = "model.layers.1.mlp.experts.0.down_proj.weight"
ROUTER = "model.layers.1.mlp.gate.weight"


def _unscaled(tensors: dict, config: dict) -> None:
    del config["quantization_config"]


def _without_a_scale(tensors: dict, config: dict) -> None:
    del tensors[WEIGHT + "_scale_inv"]


def _e5m2(tensors: dict, config: dict) -> None:
    tensors[WEIGHT] = tensors[WEIGHT].float().to(torch.float8_e5m2)


def _bf16_scales(tensors: dict, config: dict) -> None:
    tensors[WEIGHT + "_scale_inv"] = tensors[WEIGHT + "_scale_inv"].to(torch.bfloat16)


def _short_scales(tensors: dict, config: dict) -> None:
    tensors[WEIGHT + "_scale_inv"] = torch.ones(2, 5)


def _fp8_router(tensors: dict, config: dict) -> None:
    tensors[ROUTER], tensors[ROUTER + "_scale_inv"] = quantize(tensors[ROUTER], (32, 16))


def _setting(**changes):
    def change(tensors: dict, config: dict) -> None:
        config["quantization_config"].update(changes)
    return change


def _full_precision_files(tensors: dict, config: dict) -> None:
    for name in [name for name in tensors if name.endswith("_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        tensors[weight] = literal_dequantize(tensors[weight], tensors.pop(name), (32, 16)).to(torch.bfloat16)


@pytest.mark.parametrize(("change", "message"), [
    (_without_a_scale, "{fp8} stores FP8 weights ompmoe cannot scale: {w} has no {w}_scale_inv. Its files are "
                       "incomplete or in another FP8 layout."),
    (_bf16_scales, "{fp8} stores FP8 weights ompmoe cannot scale: {w}_scale_inv is BF16, not float32 multipliers "
                   "(F32). Its files are incomplete or in another FP8 layout."),
    (_short_scales, "{fp8} stores FP8 weights ompmoe cannot scale: {w}_scale_inv [2, 5] does not cover {w} {shape} "
                    "in [32, 16] blocks (expected {grid}). Its files are incomplete or in another FP8 layout."),
    (_e5m2, "{fp8} stores 1 weights in an 8-bit float other than E4M3 ({w} (F8_E5M2)); ompmoe reads block-FP8 "
            "checkpoints in E4M3 (DeepSeek-V3's format). Prune the full-precision checkpoint instead."),
    (_unscaled, "{fp8} stores {count} tensors in FP8 (model.layers.0.mlp.down_proj.weight, ...) but its config.json "
                "has no quantization_config saying how they are scaled; they would be read as wrong values. Add the "
                "quantization_config the checkpoint was released with."),
    (_full_precision_files, "{fp8}'s config.json says its weights are FP8 (quantization_config), but no tensor of its "
                            "files is FP8; remove the quantization_config from config.json if the weights are full "
                            "precision."),
    (_fp8_router, "{fp8} stores block-FP8 routers (model.layers.1.mlp.gate.weight): cutting a router to the kept "
                  "experts' rows would split its blocks. ompmoe reads block-FP8 checkpoints whose routers are full "
                  "precision, as the releases store them."),
    (_setting(quant_method="awq"), "The checkpoint is quantized (quant_method='awq'); ompmoe reads block-FP8 "
                                   "checkpoints (quant_method 'fp8' with a weight_block_size: DeepSeek-V3, Kimi K2, "
                                   "Qwen3's -FP8 releases), MXFP4 experts (quant_method 'mxfp4': gpt-oss), "
                                   "compressed-tensors ones (quant_method 'compressed-tensors': pack-quantized "
                                   "integers, FP8), row-wise FP8 (quant_method 'fbgemm_fp8': Llama 4 Maverick's -FP8 "
                                   "release) and full-precision ones. Prune the full-precision checkpoint, then "
                                   "quantize the pruned model."),
    (_setting(weight_block_size=None), "The checkpoint is quantized in FP8 without blocks (weight_block_size=None); "
                                       "ompmoe reads block-FP8 checkpoints (a weight_block_size, as DeepSeek-V3, Kimi "
                                       "K2 and Qwen3's -FP8 releases store them). Prune the full-precision "
                                       "checkpoint, then quantize the pruned model."),
    (_setting(activation_scheme="static"), "The checkpoint's FP8 activations are statically scaled "
                                           "(activation_scheme='static'): their scales were calibrated for the "
                                           "unpruned model. ompmoe reads block-FP8 checkpoints with dynamic "
                                           "activations (DeepSeek-V3's format); prune the full-precision checkpoint "
                                           "instead."),
    (_setting(expert_dtype="fp4"), "The checkpoint's experts are stored as 'fp4' (quantization_config.expert_dtype), "
                                   "not block FP8; ompmoe reads block-FP8 checkpoints whose experts are FP8 too. "
                                   "Prune the full-precision checkpoint instead."),
], ids=lambda value: getattr(value, "__name__", "")[:24] or None)
def test_what_ompmoe_cannot_read_right_is_refused_by_name_before_any_layer_runs(change, message, tmp_path):
    fp8, _ = _fp8_source("qwen3_moe", tmp_path)
    stored = read_tensors(fp8)
    count = sum(tensor.dtype == torch.float8_e4m3fn for tensor in stored.values())
    shape, grid = list(stored[WEIGHT].shape), list(stored[WEIGHT + "_scale_inv"].shape)
    assert grid != [2, 5]
    rewrite(fp8, change)
    with pytest.raises(QuantizedCheckpointError) as refused:
        collect_stats_layerwise(fp8, BLOCKS, progress=False)
    assert str(refused.value) == message.format(fp8=fp8, w=WEIGHT, count=count, shape=shape, grid=grid)


def test_held_out_perplexity_layer_by_layer_is_the_dequantized_models(tmp_path):
    """What the run prints for an FP8 checkpoint (original -> pruned) is the dequantized model's perplexity, before
    and after pruning, as the resident pass measures it."""
    from ompmoe.engine.apply.layer_by_layer import measure_layer_by_layer
    from ompmoe.engine.export.config import load_stock_config
    from ompmoe.engine.lazy_checkpoint import build_skeleton, checkpoint_dtype
    from ompmoe.engine.perplexity import perplexity

    fp8, dequantized = _fp8_source("deepseek_v3", tmp_path)
    stats = collect_stats_layerwise(fp8, BLOCKS, progress=False)
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="waterfill")
    heldout = torch.randint(3, 250, (4, 16), generator=torch.Generator().manual_seed(7))
    config = load_stock_config(fp8)
    measured = measure_layer_by_layer(fp8, build_skeleton(config, dtype=checkpoint_dtype(config)), plan,
                                      tmp_path / "scratch", heldout={"set": heldout}, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ompmoe.load_pruned(dequantized)
    before = perplexity(model, heldout)
    after = perplexity(ompmoe.prune(model, plan), heldout)
    assert measured.heldout["set"] == pytest.approx((before, after), rel=1e-6)
    assert before != after


@pytest.mark.parametrize(("layer_by_layer", "message"), [
    (True, "ExpertPruning(layer_by_layer=True): the model was built with its config's quantization_config "
           "(quant_method='fp8'); build it with ompmoe.engine.lazy_checkpoint.build_skeleton(config), which builds it "
           "to compute on the weights dequantized (block FP8, MXFP4, compressed-tensors) or refuses the format."),
    (False, "ExpertPruning: the model was loaded quantized (quant_method='fp8'); pruning computes on full-precision "
            "weights: pass layer_by_layer=True (ompmoe fit --layer_by_layer true): it reads a quantized checkpoint's "
            "weights dequantized and writes the kept ones as stored."),
])
def test_a_run_refuses_a_model_that_kept_its_quantization_config_before_calibrating(layer_by_layer, message):
    """Layer by layer: a skeleton built otherwise than build_skeleton builds it (a user's own, its config whole);
    resident: a model transformers loaded quantized (a block-FP8 checkpoint on a GPU)."""
    from ompmoe.engine.lazy_checkpoint import build_skeleton
    from ompmoe.engine.ranks import RunContext
    from ompmoe.engine.run import PruningRun, RunOptions

    model = build_skeleton(tiny_model("qwen3_moe").config) if layer_by_layer else tiny_model("qwen3_moe")
    model.config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    run = PruningRun(RunOptions(strategy=ompmoe.PruningStrategy(ratio=0.5), layer_by_layer=layer_by_layer),
                     owner="ExpertPruning")
    with pytest.raises(ompmoe.QuantizedModelError) as refused:
        run.start(model, RunContext())
    assert str(refused.value) == message


def test_ompmoe_prune_refuses_a_model_loaded_quantized_before_any_forward(tmp_path, monkeypatch):
    """``ompmoe prune --layer_by_layer false`` on a GPU loads a block-FP8 checkpoint quantized: refused once loaded,
    before its held-out perplexity or any pruning."""
    import ompmoe.lightning.models as models
    from ompmoe.cli import _load_model

    stats = ompmoe.collect_stats(tiny_model("qwen3_moe"), BLOCKS, model_id="tiny:qwen3_moe", progress=False)

    def loaded_quantized(name: str, *args, **kwargs):
        model = tiny_model("qwen3_moe")
        model.config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
        return model

    monkeypatch.setattr(models, "load_model", loaded_quantized)
    with pytest.raises(ompmoe.QuantizedModelError) as refused:
        _load_model("tiny:qwen3_moe", stats)
    assert str(refused.value) == (
        "--model tiny:qwen3_moe was loaded quantized (quant_method='fp8'); prune computes on full-precision weights: "
        "pass --layer_by_layer true, which reads a block-FP8, MXFP4 or compressed-tensors checkpoint's weights "
        "dequantized and writes the "
        "kept ones as stored.")
