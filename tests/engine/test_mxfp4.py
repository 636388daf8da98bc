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
from ompmoe.engine.collect.layerwise import collect_stats_layerwise
from ompmoe.engine.export.streamed import save_pruned_from_files
from ompmoe.engine.mxfp4 import dequantize
from ompmoe.engine.names import shipped_model_path
from ompmoe.engine.quantized_files import QuantizedCheckpointError
from ompmoe.engine.tiny import tiny_model

from mxfp4_reference import dequantized_checkpoint, literal_dequantize, quantize, to_mxfp4
from quantized_checkpoints import (assert_pruned_layer_by_layer_as_resident,
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


def _hard_rows() -> torch.Tensor:
    """Rows ``[6, 96]`` (3 groups each) that reach every rounding case: values of many sizes, every midpoint between
    two magnitudes (a tie), groups whose largest over 6 is a power of two or just above one, a group of zeros and one
    of negative zeros, bfloat16 subnormals, and values no bfloat16 holds (rounded to one first)."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 96, generator=generator) * torch.logspace(-3, 3, 18).repeat_interleave(32).reshape(6, 96)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    rows[0, :32] = torch.cat([midpoints, -midpoints, midpoints, -midpoints]) * 2.0 ** -3  # multiplier 2 ** -3
    rows[0, 32:64] = torch.cat([midpoints * 2, -midpoints, midpoints, midpoints * 0.5]) * 2.0 ** 5  # 2 ** 6
    rows[0, 64:96] = rows[0, :32] * 1.01  # largest over 6 just above a power of two: the next one
    rows[1, :32], rows[1, 32:64] = 0.0, -0.0
    rows[2, :32] = torch.linspace(-1, 1, 32) * 2.0 ** -131  # subnormal in bfloat16: largest over 6 too
    rows[3, :32] = torch.randn(32, generator=generator) * (1 + 2.0 ** -20)  # rounded to bfloat16 first
    return rows


def test_quantize_is_transformers_quantizer_value_by_value_and_reads_back_as_its_grid():
    """:func:`quantize` writes what transformers' ``quantize_to_mxfp4`` (triton_kernels' ``downcast_to_mxfp_torch``,
    which needs the ``kernels`` hub here) writes, checked against a literal value-by-value reading of that rule;
    :func:`round_to_grid` is what those bytes read back as; a release's own values quantize back to themselves."""
    from ompmoe.engine.mxfp4 import quantize as ours
    from ompmoe.engine.mxfp4 import round_to_grid

    from mxfp4_reference import literal_requantize

    rows = _hard_rows()
    blocks, scales = ours(rows)
    codes, exponents = literal_requantize(rows)
    assert blocks.shape == (6, 3, 16) and blocks.dtype == scales.dtype == torch.uint8
    assert torch.equal(scales, exponents)
    assert torch.equal(blocks.reshape(6, 48), codes[:, 0::2] | (codes[:, 1::2] << 4))  # the lower nibble first
    assert torch.equal(blocks[1].reshape(-1)[:16], torch.zeros(16, dtype=torch.uint8))  # zeros: code 0 ...
    assert torch.equal(blocks[1].reshape(-1)[16:32], torch.full((16,), 0x88, dtype=torch.uint8))  # ... -0: code 8
    read_back = literal_dequantize(blocks[None], scales[None])[0].t()  # [rows, in]
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(round_to_grid(rows.to(dtype)), read_back.to(dtype))
    assert (read_back - rows).abs().max() <= rows.abs().max() / 4
    stacked = rows.reshape(2, 3, 96)  # any leading dimensions
    assert all(torch.equal(a, b.reshape(a.shape)) for a, b in zip(ours(stacked), (blocks, scales)))

    released = torch.randint(0, 256, (2, 8, 3, 16), dtype=torch.uint8)  # a release's codes, realistic exponents
    released_scales = torch.randint(100, 150, (2, 8, 3), dtype=torch.uint8)
    values = dequantize(released, released_scales).transpose(1, 2)  # [experts, out, in]
    assert torch.equal(round_to_grid(values), values)
    assert torch.equal(dequantize(*ours(values)).view(torch.int16), values.transpose(1, 2).view(torch.int16))

    with pytest.raises(QuantizedCheckpointError, match=r"^MXFP4 groups 32 values along a row; these rows hold 40, "):
        ours(torch.ones(2, 40))
    with pytest.raises(QuantizedCheckpointError, match=r"^MXFP4 stores finite values only; "):
        ours(torch.full((1, 32), float("inf")))


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


@pytest.mark.parametrize("granularity", ["linear", "down", "expert"])
def test_a_compensated_mxfp4_checkpoint_is_written_as_the_run_measured_it(granularity, tmp_path):
    """The layer-by-layer pass fits the compensation and measures the pruned model with its corrected down projections
    as they will be written (quantized again from gpt-oss's transposed experts); the streamed writer quantizes the
    same values as transformers' ``quantize_to_mxfp4`` does: the written checkpoint, read back literally, has the
    perplexity the run reported, its compensated down projections are the resident compensated model's quantized,
    and every other tensor is the source's as stored, or ``save_pruned``'s (the biases: full precision)."""
    from ompmoe.engine.mxfp4 import quantize as ours
    from ompmoe.engine.perplexity import perplexity

    from quantized_checkpoints import compensated_layer_by_layer

    mxfp4, dequantized = _mxfp4_source(tmp_path)
    plan, heldout, measured = compensated_layer_by_layer(mxfp4, BLOCKS, granularity, tmp_path)
    written, stored = read_tensors(tmp_path / "written"), read_tensors(mxfp4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        read_back = ompmoe.load_pruned(dequantized_checkpoint(tmp_path / "written", tmp_path / "read"))
        resident = measured.compensation.apply(ompmoe.prune(ompmoe.load_pruned(dequantized), plan))
        resident.save_pretrained(tmp_path / "resident")
    assert perplexity(read_back, heldout) == pytest.approx(measured.heldout["set"][1], rel=1e-6)
    expected, changed = read_tensors(tmp_path / "resident"), 0
    for name, tensor in expected.items():
        layer = name.split(".mlp.")[0] + ".mlp"
        if name.endswith("experts.down_proj"):  # the resident compensated rows, quantized as transformers does
            blocks, scales = ours(tensor.transpose(1, 2))
            kept = torch.tensor(plan.kept_by_layer()[layer])
            assert torch.equal(written[name + "_blocks"], blocks) and torch.equal(written[name + "_scales"], scales)
            changed += not torch.equal(written[name + "_blocks"], stored[name + "_blocks"][kept])
        elif name.endswith("experts.gate_up_proj"):  # the source's, as stored
            kept = torch.tensor(plan.kept_by_layer()[layer])
            for suffix in ("_blocks", "_scales"):
                assert torch.equal(written[name + suffix], stored[name + suffix][kept]), name + suffix
        else:
            assert torch.equal(written[name], tensor), name
    assert len(written) == len(expected) + 2 * len(plan.layers)
    # the refit moved the written codes (an expert's scale within a few per cent of 1 can leave them as stored)
    assert changed == len(plan.layers) if granularity != "expert" else changed > 0
    if granularity == "linear":  # stock transformers (its remote code: per-layer counts) reads what was measured
        from quantized_checkpoints import logits_in_a_fresh_process

        ids = torch.randint(3, 4000, (2, 24), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected_logits = read_back(ids).logits
        logits = logits_in_a_fresh_process(tmp_path / "written", ids, tmp_path, remote_code=True)
        assert torch.equal(logits, expected_logits)


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


def test_ompmoe_fit_layer_by_layer_prunes_and_compensates_an_mxfp4_checkpoint(tmp_path, caplog):
    from ompmoe.cli import main

    from quantized_checkpoints import fit_layer_by_layer

    mxfp4, _ = _mxfp4_source(tmp_path)
    lines, plan = fit_layer_by_layer(mxfp4, tmp_path, caplog)
    assert lines[0].startswith(  # auto fits its compensation: the down projections it changes are quantized again
        f"ompmoe: method {plan.method}, allocation {plan.allocation}, compensation ")
    assert lines[2].startswith("ompmoe: auto's trial of its settings ran layer by layer in one more pass over the "
                               "layers: ")
    assert lines[3].startswith("ompmoe: compensation and its check and held-out perplexity ran layer by layer in ")
    assert lines[4].startswith("ompmoe: compensation (")
    assert lines[6:] == [f"ompmoe: wrote statistics, plan and pruned model to {tmp_path / 'run'}"]
    record = plan.extra["compensation"]
    written, stored = read_tensors(tmp_path / "run" / "model"), read_tensors(mxfp4)
    assert sum(name.endswith("_blocks") for name in written) == 2 * len(plan.layers)
    down = [name for name in written if name.endswith("down_proj_blocks")]
    changed = sum(not torch.equal(written[name], stored[name][torch.tensor(plan.kept_by_layer()[name.split(
        ".mlp.")[0] + ".mlp"])]) for name in down)
    assert (changed > 0) == record["applied"]
    card = (tmp_path / "run" / "model" / "README.md").read_text()
    row = ("| Weights dtype | MXFP4 experts (e2m1, one power-of-two scale per 32 values; the kept experts' compensated "
           "down projections quantized again where the source quantizes them, the others the source's tensors as it "
           "stores them), the rest bfloat16 |")
    assert (row in card) == record["applied"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ompmoe.load_pruned(tmp_path / "run" / "model", trust_remote_code=True)
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(model)] == [layer.num_kept for layer in plan.layers]

    # ompmoe prune re-plans its statistics from the same files, MXFP4 in and out, refit by name
    main(["prune", "--stats", str(tmp_path / "run" / "stats.safetensors"), "--ratio", "0.25", "--model", str(mxfp4),
          "--output_dir", str(tmp_path / "pruned"), "--quiet", "true", "--compensation", "linear"])
    written = read_tensors(tmp_path / "pruned" / "model-0.25")
    replanned = ompmoe.PruningPlan.load(tmp_path / "pruned" / "plan-0.25.json")
    assert replanned.extra["compensation"]["granularity"] == "linear"
    kept = replanned.kept_by_layer()
    changed = sum(not torch.equal(written[name], stored[name][torch.tensor(kept[name.split(".mlp.")[0] + ".mlp"])])
                  for name in written if name.endswith("down_proj_blocks"))
    assert changed == (len(kept) if replanned.extra["compensation"]["applied"] else 0)


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
