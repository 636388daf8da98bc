"""compressed-tensors checkpoints (Kimi K2 Thinking's INT4 experts, llm-compressor's FP8-dynamic requants) pruned
layer by layer: ompmoe's reading equals compressed-tensors' own bit for bit, the statistics are those of the
checkpoint dequantized, the written checkpoint keeps the kept experts' tensors as stored, and stock transformers
(with compressed-tensors) reads it in a fresh process as the pruned dequantized model. What ompmoe cannot read
right is refused before any work."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import ompmoe
from ompmoe.engine.collect.layerwise import collect_stats_layerwise
from ompmoe.engine.compressed_tensors_format import dequantize, unpack
from ompmoe.engine.names import shipped_model_path
from ompmoe.engine.quantized_files import QuantizedCheckpointError
from ompmoe.engine.tiny import tiny_model

from compressed_tensors_reference import (FP8_DYNAMIC, INT4_EXPERTS, LINEAR_PLUS_ATTENTION, MIXED, NVFP4_EXPERTS,
                                          decompress, dequantized_checkpoint, quantized_names, scheme_for,
                                          to_compressed)
from quantized_checkpoints import (assert_pruned_layer_by_layer_as_resident,
                                   assert_stock_transformers_reads_it_pruned, read_tensors, rewrite)

BLOCKS = [torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
SOURCES = {"int4_experts": ("deepseek_v3", INT4_EXPERTS, {"n_routed_experts": 32}),
           "fp8_dynamic": ("qwen3_moe", FP8_DYNAMIC, {}), "mixed": ("deepseek_v3", MIXED, {"n_routed_experts": 32}),
           "linear_plus_attention": ("qwen3_moe", LINEAR_PLUS_ATTENTION, {}),
           "nvfp4_experts": ("qwen3_moe", NVFP4_EXPERTS, {"num_experts": 32})}
"""Kimi K2 Thinking's format on its architecture (DeepSeek-V3's; 32 experts, so that its plan's counts differ by
layer), llm-compressor's FP8_DYNAMIC on Qwen3-MoE, two schemes in one checkpoint (INT4 experts, FP8 attention), a
recipe whose second group takes attention from the first (INT8 per channel among INT4 per group), and llm-compressor's
NVFP4A16 on the routed experts."""
SUFFIXES = {"int": ("_packed", "_scale", "_shape"), "fp4": ("_packed", "_scale", "_global_scale"),
            "fp8": ("", "_scale")}
"""The file tensors that store a weight, by its scheme (:func:`_kind`)."""


def _kind(scheme: dict) -> str:
    return "int" if scheme["type"] == "int" else "fp4" if scheme["num_bits"] == 4 else "fp8"


def _source(kind: str, tmp_path: Path) -> tuple[Path, Path]:
    """A tiny checkpoint stored as ``SOURCES[kind]`` says (the shipped tokenizer beside it), and the full-precision
    checkpoint it stands for."""
    model_type, settings, overrides = SOURCES[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_model(model_type, dtype=torch.bfloat16, hidden_size=64, moe_intermediate_size=32, intermediate_size=64,
                   num_hidden_layers=4, vocab_size=4096, **overrides).save_pretrained(tmp_path / "original")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shipped_model_path() / name, tmp_path / "original" / name)
    compressed = to_compressed(tmp_path / "original", tmp_path / kind, settings)
    return compressed, dequantized_checkpoint(compressed, tmp_path / "dequantized", tmp_path / "original")


def _int_scheme(bits: int, strategy: str, group_size: int | None = None) -> dict:
    return {"type": "int", "num_bits": bits, "strategy": strategy, "group_size": group_size, "symmetric": True}


@pytest.mark.parametrize(("bits", "strategy", "cols"), [(1, "channel", 45), (2, "channel", 70), (3, "channel", 45),
                                                       (4, "group", 96), (4, "tensor", 37), (5, "group", 64),
                                                       (6, "channel", 33), (7, "group", 64), (8, "group", 64)])
def test_unpack_and_dequantize_equal_compressed_tensors_own_reading_bit_for_bit(bits, strategy, cols):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    generator = torch.Generator().manual_seed(bits)
    integers = torch.randint(-2 ** (bits - 1), 2 ** (bits - 1), (6, cols), generator=generator, dtype=torch.int8)
    packed = pack_to_int32(integers, bits)
    assert torch.equal(unpack(packed, bits, cols), integers)
    assert torch.equal(unpack_from_int32(packed, bits, torch.Size([6, cols])), integers)  # the same reading
    groups = {"group": cols // 32, "channel": 1, "tensor": None}[strategy]
    scale = (torch.rand(6, groups, generator=generator) if groups else torch.rand(1, generator=generator))
    scale = (scale + 0.01).to(torch.bfloat16)
    scheme = _int_scheme(bits, strategy, 32 if strategy == "group" else None)
    parts = {"_packed": packed, "_scale": scale, "_shape": torch.tensor([6, cols])}
    ours = dequantize(unpack(packed, bits, cols), scale, scheme)
    theirs = decompress(parts, scheme, "pack-quantized")
    assert ours.dtype == theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs)


def test_nvfp4_weights_dequantize_as_compressed_tensors_reads_them_bit_for_bit():
    """Every code (both nibbles, both signs), FP8 group scales over a float32 global scale, as compressed-tensors'
    ``NVFP4PackedCompressor.decompress`` reads them; and a weight llm-compressor's way stores reads back close."""
    from ompmoe.engine.compressed_tensors_format import dequantize_fp4

    from compressed_tensors_reference import compress_nvfp4

    generator = torch.Generator().manual_seed(0)
    packed = (torch.arange(6 * 48) % 256).to(torch.uint8).reshape(6, 48)  # every byte; [rows, 96 values / 2]
    scale = (torch.rand(6, 6, generator=generator) * 400).to(torch.float8_e4m3fn)
    scheme = NVFP4_EXPERTS["config_groups"]["group_0"]["weights"]
    for global_scale in (torch.tensor([2688.0]), torch.tensor([37.3])):
        parts = {"_packed": packed, "_scale": scale, "_global_scale": global_scale}
        ours = dequantize_fp4(packed, scale, global_scale)
        theirs = decompress(parts, scheme, "nvfp4-pack-quantized")
        assert ours.dtype == theirs.dtype == torch.bfloat16 and torch.equal(ours, theirs)
    weight = torch.randn(6, 96, generator=generator).to(torch.bfloat16)
    stored = compress_nvfp4(weight, scheme)
    read = dequantize_fp4(stored["_packed"], stored["_scale"], stored["_global_scale"])
    assert torch.equal(read, decompress(stored, scheme, "nvfp4-pack-quantized"))
    assert (read.float() - weight.float()).abs().max() <= weight.float().abs().max() / 4


@pytest.mark.parametrize(("strategy", "dtype"), [("channel", torch.bfloat16), ("channel", torch.float32),
                                                 ("tensor", torch.float32)])
def test_fp8_weights_dequantize_as_compressed_tensors_reads_them(strategy, dtype):
    torch.manual_seed(0)
    weight = torch.randn(70, 45)
    scale = (torch.rand((70, 1) if strategy == "channel" else (1,)) + 0.01).to(dtype)
    values = (weight / 0.05).to(torch.float8_e4m3fn)
    scheme = {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True}
    ours = dequantize(values, scale, scheme)
    theirs = decompress({"": values, "_scale": scale}, scheme, "float-quantized")
    assert ours.dtype == theirs.dtype == dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize(("kind", "granularity"), [("int4_experts", "down"), ("fp8_dynamic", "linear"),
                                                   ("linear_plus_attention", "expert")])
def test_a_compensated_compressed_tensors_checkpoint_is_written_as_the_run_measured_it(kind, granularity, tmp_path):
    """The layer-by-layer pass measures the compensated down projections as they will be written (quantized again:
    INT4 per group, FP8 per channel); the writer quantizes the resident compensated rows exactly as llm-compressor
    does (compressed-tensors' own functions, its packing); read back by compressed-tensors itself, the checkpoint
    has the perplexity the run reported, and every other tensor is the source's as stored."""
    from ompmoe.engine.perplexity import perplexity

    from compressed_tensors_reference import compress_as_llm_compressor
    from quantized_checkpoints import compensated_layer_by_layer

    source, dequantized = _source(kind, tmp_path)
    plan, heldout, measured = compensated_layer_by_layer(source, BLOCKS, granularity, tmp_path)
    written, stored = read_tensors(tmp_path / "written"), read_tensors(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resident = measured.compensation.apply(ompmoe.prune(ompmoe.load_pruned(dequantized), plan))
        resident.save_pretrained(tmp_path / "resident")
        read_back = ompmoe.load_pruned(dequantized_checkpoint(tmp_path / "written", tmp_path / "read",
                                                              tmp_path / "resident"))
    assert perplexity(read_back, heldout) == pytest.approx(measured.heldout["set"][1], rel=1e-6)
    expected = read_tensors(tmp_path / "resident")
    settings = SOURCES[kind][1]
    kept = plan.kept_by_layer()
    down = [name for name in quantized_names(expected, settings) if ".experts." in name and "down_proj" in name]
    assert down
    for name, tensor in expected.items():
        scheme = scheme_for(name, tensor, settings)
        if scheme is None:
            continue
        suffixes = ("_packed", "_scale", "_shape") if scheme[0]["type"] == "int" else ("", "_scale")
        if name in down:  # the resident compensated rows, stored as llm-compressor stores them
            theirs = compress_as_llm_compressor(tensor, scheme[0])
            for suffix in suffixes:
                assert torch.equal(written[name + suffix].view(torch.uint8),
                                   theirs[suffix].view(torch.uint8)), name + suffix
            continue
        layer, _, rest = name.partition(".experts.")  # the rest as the source stores it
        number, _, projection = rest.partition(".")
        origin = f"{layer}.experts.{kept[layer][int(number)]}.{projection}" if ".experts." in name else name
        for suffix in suffixes:
            assert torch.equal(written[name + suffix].view(torch.uint8), stored[origin + suffix].view(torch.uint8))
    row = ("; the kept experts' compensated down projections quantized again where the source quantizes them, the "
           "others the source's tensors as it stores them), the rest bfloat16 |")
    assert row in (tmp_path / "written" / "README.md").read_text()


@pytest.mark.parametrize("kind", SOURCES)
def test_a_compressed_tensors_checkpoint_prunes_layer_by_layer_into_its_own_format(kind, tmp_path):
    source, dequantized = _source(kind, tmp_path)
    stored = read_tensors(source)
    plan = assert_pruned_layer_by_layer_as_resident(source, dequantized, BLOCKS, tmp_path, str(shipped_model_path()))
    assert len({len(kept) for kept in plan.kept_by_layer().values()}) > 1  # non-uniform: counts differ
    expected, written = read_tensors(tmp_path / "resident"), read_tensors(tmp_path / "streamed")
    settings = SOURCES[kind][1]
    schemes = {name: scheme_for(name, tensor, settings) for name, tensor in expected.items()}
    suffixes = {name: SUFFIXES[_kind(scheme[0])] for name, scheme in schemes.items() if scheme is not None}
    quantized = set(quantized_names(expected, settings))
    assert quantized == suffixes.keys() and any(".experts." in name for name in quantized)
    assert (kind in ("int4_experts", "nvfp4_experts")) == all(".experts." in name for name in quantized)
    assert written.keys() == (expected.keys() - quantized) | {name + suffix for name in quantized
                                                              for suffix in suffixes[name]}
    kept = plan.kept_by_layer()
    for name, tensor in expected.items():  # what the written checkpoint reads back is save_pruned's, bit for bit
        ours = written[name] if name not in quantized else decompress(
            {suffix: written[name + suffix] for suffix in suffixes[name]}, *schemes[name]).to(tensor.dtype)
        assert ours.dtype == tensor.dtype and torch.equal(ours, tensor), name
        if name in quantized:  # as the source stores it: a kept expert's tensors are its source expert's
            layer, _, rest = name.partition(".experts.")
            number, _, projection = rest.partition(".")
            origin = f"{layer}.experts.{kept[layer][int(number)]}.{projection}" if ".experts." in name else name
            for suffix in suffixes[name]:
                ours, theirs = written[name + suffix], stored[origin + suffix]
                assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), name + suffix
    described = {"int4_experts": "int4 per group of 32", "fp8_dynamic": "fp8 e4m3 per channel",
                 "mixed": "fp8 e4m3 per channel; int4 per group of 32",
                 "linear_plus_attention": "int4 per group of 32; int8 per channel",
                 "nvfp4_experts": "NVFP4 (fp4 e2m1 per group of 16, fp8 scales, a global scale)"}[kind]
    row = (f"| Weights dtype | compressed-tensors ({described}; the source's tensors as it stores them), the rest "
           "bfloat16 |")
    assert row in (tmp_path / "streamed" / "README.md").read_text()


def test_stock_transformers_reads_the_pruned_int4_checkpoint_in_a_fresh_process(tmp_path):
    """Pruned uniformly and non-uniformly: stock ``from_pretrained`` (uniform) and with the remote code
    (non-uniform), with compressed-tensors installed, in a process that never imported ompmoe, read it to the logits
    of the pruned dequantized model. (Checkpoints mixing schemes read as transformers loads them: the load_pruned
    test, which loads the stock way.)"""
    source, dequantized = _source("int4_experts", tmp_path)
    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(1))
    stats = collect_stats_layerwise(source, BLOCKS, progress=False)
    written = assert_stock_transformers_reads_it_pruned(source, dequantized, stats, ids, tmp_path)
    assert all(any(name.endswith(".weight_packed") for name in read_tensors(path)) for path in written.values())


def test_stock_transformers_runs_the_pruned_fp8_dynamic_checkpoint_as_the_source_cut_by_hand(tmp_path):
    """FP8_DYNAMIC also quantizes each linear's input to FP8 as it runs (what its format asks; ompmoe's statistics
    are the dequantized weights' on full-precision activations), so the reference here is the source as stock
    transformers runs it, each MoE block's router rows and experts cut to the kept ones by hand; the pruned
    checkpoint, read by stock transformers in a fresh process (the remote code for per-layer counts), gives its
    logits exactly."""
    import transformers
    from torch import nn

    from ompmoe.engine.export.streamed import save_pruned_from_files

    from quantized_checkpoints import logits_in_a_fresh_process

    source, _ = _source("fp8_dynamic", tmp_path)
    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(1))
    stats = collect_stats_layerwise(source, BLOCKS, progress=False)
    for allocation in ("uniform", "waterfill"):
        plan = ompmoe.plan_pruning(stats, 0.5, allocation=allocation)
        written = save_pruned_from_files(source, plan, tmp_path / allocation)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_pretrained(source)
        for name, kept in plan.kept_by_layer().items():
            block, rows = model.get_submodule(name), torch.tensor(kept)
            block.gate.weight = nn.Parameter(block.gate.weight[rows])
            block.experts.gate_up_proj = nn.Parameter(block.experts.gate_up_proj[rows])
            block.experts.down_proj = nn.Parameter(block.experts.down_proj[rows])
            block.gate.num_experts = block.experts.num_experts = len(kept)
        with torch.no_grad():
            expected = model(ids).logits
        logits = logits_in_a_fresh_process(written, ids, tmp_path, remote_code=allocation != "uniform")
        assert torch.equal(logits, expected), allocation
        assert any(tensor.dtype == torch.float8_e4m3fn for tensor in read_tensors(written).values())


def test_nvfp4_experts_which_transformers_reads_without_their_global_scale_are_not_loaded(tmp_path):
    """transformers reads NVFP4 routed experts stored per expert without their ``weight_global_scale``
    (huggingface/transformers#48371; the first assertion fails once it reads them right, and the refusal can go):
    ``ompmoe.load_pruned`` (every resident front door, ``ompmoe validate``) refuses the release and its pruned
    checkpoint by name, before any tensor is read; layer by layer prunes it (the tests above)."""
    import transformers

    from ompmoe.engine.export.streamed import save_pruned_from_files

    source, dequantized = _source("nvfp4_experts", tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(source).state_dict()
        expected = ompmoe.load_pruned(dequantized).state_dict()
    name, scale = "model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.0.down_proj.weight_global_scale"
    times = read_tensors(source)[scale].float()  # transformers' values: the right ones times the global scale
    assert torch.allclose(theirs[name][0].float(), expected[name][0].float() * times, rtol=1e-2, atol=1e-3)
    assert not torch.allclose(theirs[name][0].float(), expected[name][0].float(), rtol=0.5)
    plan = ompmoe.plan_pruning(collect_stats_layerwise(source, BLOCKS, progress=False), 0.5)
    pruned = save_pruned_from_files(source, plan, tmp_path / "pruned")
    for path in (source, pruned):
        scales = sorted(name for name in read_tensors(path)
                        if ".experts." in name and name.endswith(".weight_global_scale"))
        with pytest.raises(QuantizedCheckpointError) as refused:
            ompmoe.load_pruned(path)
        assert str(refused.value) == (
            f"{path} stores its routed experts in NVFP4 (compressed-tensors: {', '.join(scales[:5])} and "
            f"{len(scales) - 5} more), "
            f"which transformers {transformers.__version__} loads without their weight_global_scale "
            "(huggingface/transformers#48371): every expert would be read wrong, silently. ompmoe prunes such a "
            "checkpoint layer by layer (ompmoe fit --layer_by_layer true, ompmoe prune --model), which reads them as "
            "compressed-tensors does; run what it writes with an engine that reads NVFP4 (vLLM, which takes a "
            "uniform plan only: allocation uniform).")
    card = (pruned / "README.md").read_text()
    assert ("**NVFP4 experts.** transformers " + transformers.__version__ + " reads NVFP4 routed experts") in card


def test_only_nvfp4_experts_stop_a_compensation():
    """Whether a compensation is written follows the scheme transformers reads the routed experts with: NVFP4 experts
    are not quantized again, INT4 experts beside NVFP4 attention are (their down projections are INT4)."""
    from ompmoe.engine.stored_formats import format_name, requantizes

    fp4 = NVFP4_EXPERTS["config_groups"]["group_0"]
    attention = {**MIXED, "config_groups": {"attention": {**fp4, "format": "nvfp4-pack-quantized",
                                                          "targets": ["re:.*self_attn\\..*"]},
                                            "experts": MIXED["config_groups"]["experts"]}}
    assert not requantizes(NVFP4_EXPERTS) and format_name(NVFP4_EXPERTS) == "compressed-tensors NVFP4"
    assert requantizes(attention) and format_name(attention) == "compressed-tensors"
    assert requantizes(INT4_EXPERTS) and requantizes(FP8_DYNAMIC)


def test_ompmoe_fit_layer_by_layer_prunes_an_nvfp4_checkpoint_uncompensated(tmp_path, caplog, capsys):
    """NVFP4 is written as stored only: auto fits no compensation and says why; one named is refused by both commands
    before any work; the written experts are the source's NVFP4 tensors; W4A4's calibrated activation global scales
    are refused by name."""
    from quantized_checkpoints import assert_both_commands_refuse_a_named_compensation, fit_layer_by_layer

    source, _ = _source("nvfp4_experts", tmp_path)
    lines, plan = fit_layer_by_layer(source, tmp_path, caplog)
    assert ("ompmoe: the checkpoint stores compressed-tensors NVFP4 weights, written as stored: auto fits no "
            "compensation (its refit would change them)") in lines
    assert "compensation" not in plan.extra
    written, stored = read_tensors(tmp_path / "run" / "model"), read_tensors(source)
    kept = plan.kept_by_layer()
    scales = [name for name in written if ".experts." in name and name.endswith("weight_global_scale")]
    assert len(scales) == 3 * sum(len(ids) for ids in kept.values())
    for name in scales:  # each kept expert's NVFP4 tensors, its source expert's
        layer, _, rest = name.partition(".experts.")
        number, _, projection = rest.partition(".")
        origin = f"{layer}.experts.{kept[layer][int(number)]}.{projection}".removesuffix("_global_scale")
        for suffix in ("_packed", "_scale", "_global_scale"):
            part = name.removesuffix("_global_scale") + suffix
            assert torch.equal(written[part].view(torch.uint8), stored[origin + suffix].view(torch.uint8)), part
    refusal = assert_both_commands_refuse_a_named_compensation(source, tmp_path / "run" / "stats.safetensors",
                                                               tmp_path, capsys, "compressed-tensors NVFP4")
    assert refusal.startswith(f"{source} stores compressed-tensors NVFP4 weights, which ompmoe writes as stored")

    def w4a4(tensors: dict, config: dict) -> None:  # llm-compressor's NVFP4 preset: activations in FP4 too
        config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
            "dynamic": "local", "group_size": 16, "num_bits": 4, "strategy": "tensor_group", "symmetric": True,
            "type": "float"}
        for name in [name for name in tensors if name.endswith(".weight_global_scale")]:
            tensors[name.replace(".weight_global_scale", ".input_global_scale")] = torch.ones(1)

    def scalar_global_scale(tensors: dict, config: dict) -> None:  # compressed-tensors and transformers take [1]
        tensors["model.layers.1.mlp.experts.0.up_proj.weight_global_scale"] = torch.tensor(448.0)

    scalar = tmp_path / "scalar"
    shutil.copytree(source, scalar)
    rewrite(scalar, scalar_global_scale)
    with pytest.raises(QuantizedCheckpointError) as refused:
        collect_stats_layerwise(scalar, BLOCKS, progress=False)
    weight = "model.layers.1.mlp.experts.0.up_proj.weight"
    assert str(refused.value) == FILES.format(f"{weight}_global_scale is F32 [], not one float32 global "
                                              "scale").format(source=scalar)

    rewrite(source, w4a4)
    with pytest.raises(QuantizedCheckpointError) as refused:
        collect_stats_layerwise(source, BLOCKS, progress=False)
    first = min(name for name in read_tensors(source) if name.endswith(".input_global_scale"))
    assert str(refused.value) == FILES.format(f"{first} (an activation scale calibrated for the unpruned "
                                              "model)").format(source=source)


@pytest.mark.parametrize("kind", [kind for kind in SOURCES if kind != "nvfp4_experts"])
def test_load_pruned_reads_a_compressed_tensors_release_dequantized(kind, tmp_path):
    """The resident front doors load through ``ompmoe.load_pruned``: the release's packed int32 values and shapes are
    the format's, not wrong weights, and transformers (with compressed-tensors) reads every weight as
    compressed-tensors does, each with its own config group, decompressed as it loads (left compressed until its first
    forward, that forward would wrap every module's forward, ompmoe's hooks included)."""
    source, dequantized = _source(kind, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, theirs = ompmoe.load_pruned(source).state_dict(), ompmoe.load_pruned(dequantized).state_dict()
    assert theirs.keys() <= ours.keys()  # and the quantized linears' scales and shapes, which stock loading keeps
    assert all(name.endswith(("weight_scale", "weight_shape")) for name in ours.keys() - theirs.keys())
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_ompmoe_fit_layer_by_layer_prunes_a_compressed_tensors_checkpoint(tmp_path, caplog, capsys):
    from ompmoe.cli import main

    from quantized_checkpoints import fit_layer_by_layer
    from test_cli import tiny_config

    source, _ = _source("int4_experts", tmp_path)
    with pytest.raises(SystemExit):  # resident: transformers loads it quantized; refused with the fix
        main(["fit", "-c", str(tiny_config(tmp_path)), "--trainer.enable_progress_bar=false", "--model.model",
              str(source)])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: ExpertPruning: the model was loaded quantized (quant_method='compressed-tensors'); pruning computes on "
        "full-precision weights: pass layer_by_layer=True (ompmoe fit --layer_by_layer true): it reads a quantized "
        "checkpoint's weights dequantized and writes the kept ones as stored.")
    assert not (tmp_path / "run" / "model").exists()
    lines, plan = fit_layer_by_layer(source, tmp_path, caplog)
    assert not any("fits no compensation" in line for line in lines)
    record = plan.extra["compensation"]  # auto fits and checks one; its down projections are quantized again
    assert f"ompmoe: compensation ({record['granularity']}, " in "\n".join(lines)
    written, stored = read_tensors(tmp_path / "run" / "model"), read_tensors(source)
    experts = sum(layer.num_kept for layer in plan.layers)
    assert sum(name.endswith(".weight_packed") for name in written) == 3 * experts
    down = [name for name in written if ".experts." in name and name.endswith("down_proj.weight_packed")]
    kept = plan.kept_by_layer()
    changed = 0
    for name in down:
        layer, _, rest = name.partition(".experts.")
        number, _, tail = rest.partition(".")
        source_name = f"{layer}.experts.{kept[layer][int(number)]}.{tail}"
        changed += not (torch.equal(written[name], stored[source_name]) and torch.equal(
            written[name.replace("_packed", "_scale")], stored[source_name.replace("_packed", "_scale")]))
    assert down and changed == (len(down) if record["applied"] else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ompmoe.load_pruned(tmp_path / "run" / "model", trust_remote_code=True)
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(model)] == [layer.num_kept for layer in plan.layers]

    # pruned again: per-layer counts, which a skeleton cannot read, and stored quantized, which a resident run does
    # not prune; the refusal says what to do instead (both refusals used to point at each other)
    (tmp_path / "twice").mkdir()
    with pytest.raises(SystemExit):
        main(["fit", "-c", str(tiny_config(tmp_path / "twice")), "--trainer.enable_progress_bar=false",
              "--model.model", str(tmp_path / "run" / "model")])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: ExpertPruning: the model was loaded quantized (quant_method='compressed-tensors'); pruning computes on "
        "full-precision weights: it was pruned to per-layer counts, which layer by layer cannot read: plan again "
        "from the statistics it was pruned with and prune its source (ompmoe prune --stats STATS --ratio R --model "
        f"{source}).")  # the source the record names


EXPERT = "model.layers.1.mlp.experts.0.down_proj.weight"
MODULE = EXPERT.removesuffix(".weight")
GATE = "model.layers.1.mlp.experts.0.gate_proj.weight"  # [32, 64]: two groups of 32 per row
GROUP = "config_groups.group_0: "
SETTINGS = ("The checkpoint is quantized with compressed-tensors in a way ompmoe does not read: {}. ompmoe reads "
            "symmetric pack-quantized integer weights (per group, channel or tensor), float-quantized FP8 weights "
            "(per channel or tensor) and nvfp4-pack-quantized NVFP4 weights (FP4 per group of 16 with a global "
            "scale), with dynamic or no activation quantization. Prune the full-precision checkpoint, then quantize "
            "the pruned model (llm-compressor's oneshot).")
FIX = "Prune the full-precision checkpoint, then quantize the pruned model (llm-compressor's oneshot)."
FILES = ("{{source}} stores compressed-tensors weights ompmoe cannot read: {}. Prune the full-precision checkpoint, "
         "then quantize the pruned model (llm-compressor's oneshot).")


def _weights(config: dict) -> dict:
    return config["quantization_config"]["config_groups"]["group_0"]["weights"]


@pytest.mark.parametrize(("change", "message"), [
    (lambda tensors, config: _weights(config).update(symmetric=False),
     SETTINGS.format(GROUP + "asymmetric weights (zero points)")),
    (lambda tensors, config: _weights(config).update(actorder="group"),
     SETTINGS.format(GROUP + "actorder 'group' (activation-ordered groups)")),
    (lambda tensors, config: config["quantization_config"]["config_groups"]["group_0"].update(
        input_activations={"dynamic": False, "num_bits": 8, "type": "float", "strategy": "tensor"}),
     SETTINGS.format(GROUP + "static input_activations (scales calibrated for the unpruned model)")),
    (lambda tensors, config: config["quantization_config"].update(format="nvfp4-pack-quantized"),
     SETTINGS.format(GROUP + "int weights of 4 bits in format 'nvfp4-pack-quantized' (ompmoe reads int "
                     "pack-quantized, 8-bit float float-quantized, 4-bit float nvfp4-pack-quantized)")),
    (lambda tensors, config: config["quantization_config"].update(
        kv_cache_scheme={"num_bits": 8, "type": "float"}, quantization_status="frozen"),
     SETTINGS.format("quantization_status='frozen' (its files do not store the compressed weights); a "
                     "kv_cache_scheme (KV-cache scales calibrated for the unpruned model)")),
    (lambda tensors, config: config.pop("quantization_config"),
     "{source} stores 288 packed integer weights (model.layers.1.mlp.experts.0.down_proj.weight_packed, ...) but its "
     "config.json has no quantization_config with quant_method 'compressed-tensors'; they would not be read as "
     "weights. Add the quantization_config the checkpoint was released with."),
    (lambda tensors, config: tensors.pop(EXPERT + "_scale"),
     FILES.format(f"{EXPERT} has no {EXPERT}_scale")),
    (lambda tensors, config: tensors.update({EXPERT + "_zero_point": torch.zeros(64, 1, dtype=torch.int32)}),
     FILES.format(f"{EXPERT}_zero_point (asymmetric zero points)")),
    (lambda tensors, config: tensors.update({GATE + "_scale": tensors[GATE + "_scale"][:, :1].contiguous()}),
     FILES.format(f"{GATE}_scale [32, 1] does not cover {GATE}_packed [32, 8] in groups of 32 4-bit values")),
    (lambda tensors, config: tensors.update({EXPERT[:-len("weight")] + "input_scale": torch.ones(1)}),
     FILES.format(f"{EXPERT[:-len('weight')]}input_scale (an activation scale calibrated for the unpruned model)")),
    (lambda tensors, config: _weights(config).update(actorder=True),
     SETTINGS.format(GROUP + "actorder True (activation-ordered groups)")),
    (lambda tensors, config: config["quantization_config"]["config_groups"]["group_0"]["targets"].append(MODULE),
     SETTINGS.format(GROUP + f"target {MODULE!r} (ompmoe reads groups that target Linear or re: patterns)")),
    (lambda tensors, config: config["quantization_config"]["config_groups"].update(
        group_1=config["quantization_config"]["config_groups"]["group_0"]),
     SETTINGS.format("config groups group_0, group_1 all target Linear (which one stores a weight is ambiguous)")),
    (lambda tensors, config: config["quantization_config"].update(moe_sparsity_config={"method": "prune"}),
     SETTINGS.format("a moe_sparsity_config (experts already pruned by compressed-tensors)")),
    (lambda tensors, config: config["quantization_config"]["config_groups"].update(
        a={**config["quantization_config"]["config_groups"]["group_0"], "targets": ["re:.*experts.*"]},
        b={**config["quantization_config"]["config_groups"]["group_0"], "targets": ["re:.*down_proj"]}),
     f"{MODULE} is matched by the re: targets of several config groups (a, b): which scheme stores it is ambiguous "
     f"(readers differ). {FIX}"),
    (lambda tensors, config: config["quantization_config"]["config_groups"].update(
        shared={**config["quantization_config"]["config_groups"]["group_0"], "targets": ["re:.*shared_experts.*"]}),
     f"{MODULE} is stored with config group 'group_0', but transformers reads every routed expert with group "
     f"'shared' (the first whose re: targets name experts): the checkpoint does not load as it is stored. {FIX}"),
    (lambda tensors, config: tensors.update({EXPERT + "_shape": torch.tensor([64, 64])}),
     f"{EXPERT}_packed [64, 4] does not hold {EXPERT}_shape [64, 64] in 4-bit values ({EXPERT}_shape and the "
     f"scheme's num_bits disagree): its config group's scheme does not describe it. {FIX}"),
    (lambda tensors, config: tensors.update({MODULE + ".input_global_scale": torch.ones(1)}),
     FILES.format(f"{MODULE}.input_global_scale (an activation scale calibrated for the unpruned model)")),
], ids=["asymmetric", "actorder", "static_activations", "nvfp4", "frozen_kv_cache", "no_config", "no_scale",
        "zero_point", "short_scale", "input_scale", "actorder_true", "exact_name", "two_linear_groups",
        "moe_sparsity", "two_patterns", "experts_group", "shape_vs_bits", "global_scale"])
def test_what_ompmoe_cannot_read_right_is_refused_by_name_before_any_layer_runs(change, message, tmp_path):
    _assert_refused("int4_experts", change, message, tmp_path)


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
def test_a_weight_packed_before_compressed_tensors_dense_packing_is_refused_saying_so(bits, tmp_path):
    """compressed-tensors once packed 3, 5, 6 and 7 bits ``32 // bits`` to a word, none across words; current
    versions (and transformers through them) read such words densely, as other values."""
    source, _ = _source("int4_experts", tmp_path)
    per_word = 32 // bits

    def old_packing(tensors: dict, config: dict) -> None:
        _weights(config).update(num_bits=bits)
        for name in [name for name in tensors if name.endswith(".weight_packed")]:
            rows, cols = tensors[name.removesuffix("_packed") + "_shape"].tolist()
            tensors[name] = torch.zeros(rows, -(-cols // per_word), dtype=torch.int32)

    rewrite(source, old_packing)
    with pytest.raises(QuantizedCheckpointError) as refused:
        collect_stats_layerwise(source, BLOCKS, progress=False)
    message = str(refused.value)
    assert message.startswith(f"{source} stores compressed-tensors weights ompmoe cannot read: {EXPERT}_packed "
                              f"[64, {-(-32 // per_word)}] holds {per_word} {bits}-bit values per int32 word, as "
                              "compressed-tensors packed them before its dense packing; current compressed-tensors "
                              "and transformers read it as other values; ") and message.endswith(f"; .... {FIX}")


def _assert_refused(kind: str, change, message: str, tmp_path: Path) -> None:
    """``SOURCES[kind]`` changed by ``change(tensors, config)`` is refused with ``message`` (``{source}``: its path)
    when the layer-by-layer run opens it."""
    source, _ = _source(kind, tmp_path)
    rewrite(source, change)
    with pytest.raises(QuantizedCheckpointError) as refused:
        collect_stats_layerwise(source, BLOCKS, progress=False)
    assert str(refused.value) == message.format(source=source)


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize(("change", "message"), [
    (lambda tensors, config: _weights(config).update(strategy="block", block_structure=[32, 32]),
     SETTINGS.format(GROUP + "strategy 'block'")),
    (lambda tensors, config: tensors.update({Q_PROJ + "_scale": tensors[Q_PROJ + "_scale"].half()}),
     FILES.format(f"{Q_PROJ}_scale is F16 (transformers and compressed-tensors round FP8 weights with half-precision "
                  "scales differently; ompmoe reads bf16 or float32 scales)")),
], ids=["block", "f16_scale"])
def test_fp8_variants_transformers_reads_otherwise_are_refused(change, message, tmp_path):
    _assert_refused("fp8_dynamic", change, message, tmp_path)


def test_what_compressed_tensors_leaves_aside_is_read(tmp_path):
    """A dense sparsity_config (no sparsity: compressed-tensors ignores it) and GPTQ's ``actorder: weight`` (no
    g_idx stored) read as the checkpoint without them."""
    source, _ = _source("int4_experts", tmp_path)
    expected = collect_stats_layerwise(source, BLOCKS, progress=False)

    def change(tensors: dict, config: dict) -> None:
        config["quantization_config"]["sparsity_config"] = {"format": "dense", "global_sparsity": 0.0}
        _weights(config).update(actorder="weight")

    rewrite(source, change)
    stats = collect_stats_layerwise(source, BLOCKS, progress=False)
    assert all(torch.equal(ours.gram, theirs.gram) for ours, theirs in zip(stats.layers, expected.layers))


def test_experts_stored_partly_quantized_or_quantized_but_ignored_are_refused_when_opened(tmp_path):
    """An ignore list naming experts by number: experts 0 and 1's down projections kept in bf16 among INT4 ones
    (transformers does not load such a layer, and a kept expert renumbered into 0 or 1 would be read as full
    precision from its packed tensors); every expert's down projection in bf16 beside INT4 gate and up projections
    (stock from_pretrained leaves the down projections random); one layer's experts in bf16 among INT4 layers
    (stock loading fails); or a quantized expert the ignore list names."""
    source, dequantized = _source("int4_experts", tmp_path)
    plain = read_tensors(dequantized)

    def partly(tensors: dict, config: dict) -> None:
        config["quantization_config"]["ignore"].append("re:.*experts\\.(0|1)\\.down_proj$")
        for name in [name for name in tensors if re.match(r".*experts\.(0|1)\.down_proj\.weight_", name)]:
            base = name[:name.index(".weight_") + len(".weight")]
            tensors.pop(name)
            tensors[base] = plain[base]

    layers = [f"model.layers.{index}.mlp.experts" for index in (1, 2, 3)]
    rewrite(source, partly)
    with pytest.raises(QuantizedCheckpointError) as refused:
        collect_stats_layerwise(source, BLOCKS, progress=False)
    problems = "; ".join(f"{layer}.{{0, 1}}.down_proj are stored in full precision and the layer's other experts "
                         "quantized (transformers reads a layer's experts with one scheme)" for layer in layers)
    assert str(refused.value) == f"{source} stores compressed-tensors weights ompmoe cannot read: {problems}. {FIX}"

    for case, (kept_plain, problem) in enumerate((
            ("re:.*experts\\.\\d+\\.down_proj$",
             "; ".join(f"{layer}.*.down_proj are stored in full precision and the layer's other projections quantized "
                       "(transformers reads a layer's experts with one scheme: stock from_pretrained would leave "
                       "down_proj unloaded)" for layer in layers)),
            ("re:model\\.layers\\.2\\.mlp\\.experts\\..*",
             "model.layers.2.mlp.experts are stored in full precision and other layers' experts quantized "
             "(transformers' compressed-tensors loading fails on such a checkpoint)"))):
        source, _ = _source("int4_experts", tmp_path / f"case{case}")

        def in_full_precision(tensors: dict, config: dict, pattern: str = kept_plain) -> None:
            config["quantization_config"]["ignore"].append(pattern)
            for name in [name for name in tensors if re.match(pattern[3:].removesuffix("$") + r"\.weight_", name)]:
                base = name[:name.index(".weight_") + len(".weight")]
                tensors.pop(name)
                tensors[base] = plain[base]

        rewrite(source, in_full_precision)
        with pytest.raises(QuantizedCheckpointError) as refused:
            collect_stats_layerwise(source, BLOCKS, progress=False)
        assert str(refused.value) == f"{source} stores compressed-tensors weights ompmoe cannot read: {problem}. {FIX}"

    ignored = tmp_path / "ignored"
    shutil.rmtree(source)
    source, _ = _source("int4_experts", ignored)
    rewrite(source, lambda tensors, config: config["quantization_config"]["ignore"].append(
        "re:.*experts\\.0\\.down_proj$"))
    with pytest.raises(QuantizedCheckpointError) as refused:
        collect_stats_layerwise(source, BLOCKS, progress=False)
    problems = "; ".join(f"{layer}.0.down_proj.weight is stored quantized, but the quantization_config's ignore list "
                         "names it" for layer in layers)
    assert str(refused.value) == f"{source} stores compressed-tensors weights ompmoe cannot read: {problems}. {FIX}"


def _as_kimi_release(tensors: dict, config: dict) -> None:
    """config.json as Kimi K2 (Thinking) ships it: its own model_type, and its remote code for DeepSeek-V3's model."""
    config["model_type"] = "kimi_k2"
    config["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                          "AutoModel": "modeling_deepseek.DeepseekV3Model",
                          "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}


def test_kimi_k2_thinking_as_released_prunes_as_deepseek_v3(tmp_path, capfd):
    """model_type ``kimi_k2`` is not transformers' (its remote code, written for transformers 4, is not run): ompmoe
    reads it as ``deepseek_v3``, the model its ``architectures`` name, with the same statistics as that checkpoint
    labelled so, without transformers asking to run the remote code; the pruned checkpoint is a stock DeepSeek-V3
    one, read by stock transformers in a fresh process, and the release loads resident through load_pruned."""
    source, dequantized = _source("int4_experts", tmp_path)
    kimi = tmp_path / "kimi"
    shutil.copytree(source, kimi)
    rewrite(kimi, _as_kimi_release)
    stats = collect_stats_layerwise(kimi, BLOCKS, progress=False)
    expected = collect_stats_layerwise(source, BLOCKS, progress=False)
    assert stats.model_type == "deepseek_v3"
    assert all(torch.equal(ours.gram, theirs.gram) for ours, theirs in zip(stats.layers, expected.layers))
    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(1))
    written = assert_stock_transformers_reads_it_pruned(kimi, dequantized, stats, ids, tmp_path / "pruned")
    for allocation, path in written.items():
        config = json.loads((path / "config.json").read_text())
        assert config["model_type"] == "deepseek_v3", allocation
        assert "auto_map" not in config if allocation == "uniform" else "ompmoe" in config["auto_map"]["AutoConfig"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert type(ompmoe.load_pruned(kimi)).__name__ == "DeepseekV3ForCausalLM"
    captured = capfd.readouterr()
    assert "custom code" not in captured.out + captured.err

    # Kimi's tokenizer is remote code (tiktoken): refused by name with what to pass instead, never run nor asked about
    from ompmoe.engine.export.checkpoint import resolve_tokenizer

    settings = json.loads((kimi / "tokenizer_config.json").read_text())
    settings.update(tokenizer_class="TikTokenTokenizer", auto_map={"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer",
                                                                                     None]})
    (kimi / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError) as refused:
        resolve_tokenizer(str(kimi), None)
    assert ("; its tokenizer is remote code, which ompmoe does not run: pass one that loads without it (ompmoe fit "
            "--model.tokenizer, ompmoe prune --tokenizer); pass a hub id") in str(refused.value)
    captured = capfd.readouterr()
    assert "custom code" not in captured.out + captured.err


def test_a_release_loaded_resident_runs_ompmoe_hooks_and_adaptive_inference(tmp_path):
    """transformers leaves a compressed-tensors model compressed until its first forward, which then wraps every
    module's forward and failed on those ompmoe replaces; load_pruned reads it dequantized, so the resident
    statistics of the release are those of the dequantized checkpoint, and it runs OMP-MoE+."""
    source, dequantized = _source("int4_experts", tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = ompmoe.load_pruned(source)
        theirs = ompmoe.collect_stats(ompmoe.load_pruned(dequantized), BLOCKS, progress=False)
    ours = ompmoe.collect_stats(model, BLOCKS, progress=False)
    assert all(torch.equal(a.gram, b.gram) for a, b in zip(ours.layers, theirs.layers))
    ompmoe.enable_adaptive(model, ours, epsilon=0.1)
    with torch.no_grad():
        assert torch.isfinite(model(BLOCKS[0]).logits).all()
