"""Row-wise FP8 checkpoints (``quant_method`` ``fbgemm_fp8``: Llama 4 Maverick's -FP8 release, a ``llama4`` container
read as its text model): read layer by layer dequantized as the row-wise kernels multiply, pruned into their own
format (the kept experts' FP8 tensors and multipliers as stored), and refused by name where ompmoe would read them
wrong. Stock transformers loads this format only on a GPU with FBGEMM, so no fresh-process load here."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import ompmoe
from ompmoe.engine.collect.layerwise import collect_stats_layerwise
from ompmoe.engine.fbgemm_fp8 import RowwiseSlice, dequantize
from ompmoe.engine.names import shipped_model_path
from ompmoe.engine.quantized_files import QuantizedCheckpointError
from ompmoe.engine.tiny import tiny_config, tiny_model

from fbgemm_fp8_reference import dequantized_checkpoint, literal_dequantize, quantize, to_fbgemm_fp8
from quantized_checkpoints import assert_pruned_layer_by_layer_as_resident, read_tensors, rewrite

BLOCKS = [torch.randint(3, 4000, (2, 16), generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
FORMAT = "row-wise FP8 (fbgemm_fp8)"


def _source(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny ``llama4`` container checkpoint in row-wise FP8 (with the shipped model's tokenizer), and the
    full-precision checkpoint it stands for."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = dict(tiny_config("llama4").text_config.to_dict(), vocab_size=4096)  # the shipped tokenizer's ids
        tiny_model("llama4", dtype=torch.bfloat16, text_config=text).save_pretrained(tmp_path / "original")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shipped_model_path() / name, tmp_path / "original" / name)
    fp8 = to_fbgemm_fp8(tmp_path / "original", tmp_path / "fp8")
    return fp8, dequantized_checkpoint(fp8, tmp_path / "dequantized")


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.feed_forward.shared_expert.up_proj.weight", (6, 5)),
    ("model.layers.0.feed_forward.experts.gate_up_proj", (3, 5, 8)),
    ("model.layers.0.feed_forward.experts.down_proj", (3, 4, 5)),
    ("model.layers.0.feed_forward.experts.down_proj", (3, 5, 5)),  # square: the output is the last axis still
])
def test_dequantize_multiplies_each_output_channel_by_its_own_multiplier(name, shape):
    values = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    weight, scale = quantize(name, values)
    expected = literal_dequantize(name, weight, scale)
    assert torch.equal(dequantize(weight, scale), expected)
    torch.testing.assert_close(expected, values, rtol=0.07, atol=0.0)  # E4M3 keeps 3 bits of mantissa

    class Slice:
        def __init__(self, tensor):
            self.tensor = tensor

        def get_shape(self):
            return list(self.tensor.shape)

        def __getitem__(self, index):
            return self.tensor[index]

    assert torch.equal(RowwiseSlice(Slice(weight), Slice(scale))[:], expected)


def test_a_row_wise_fp8_checkpoint_prunes_layer_by_layer_into_its_own_format(tmp_path):
    fp8, dequantized = _source(tmp_path)
    stored = read_tensors(fp8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        settings = json.loads((fp8 / "config.json").read_text())["quantization_config"]
        text_names = [name.removeprefix("language_model.") for name in settings["modules_to_not_convert"]]
        plan = assert_pruned_layer_by_layer_as_resident(fp8, dequantized, BLOCKS, tmp_path, quantization_config={
            **settings, "modules_to_not_convert": text_names})  # the text model's names
    expected, written = read_tensors(tmp_path / "resident"), read_tensors(tmp_path / "streamed")
    scales = {name for name in written if name.endswith("_scale")}
    assert written.keys() - scales == expected.keys()
    assert len({len(ids) for ids in plan.kept_by_layer().values()}) == 1  # transformers reads one count only
    assert {name for name, tensor in written.items() if tensor.dtype == torch.float8_e4m3fn} == {
        name.removesuffix("_scale") for name in scales}
    kept = plan.kept_by_layer()
    for name, tensor in expected.items():  # the resident model's values, read back from the written format
        if name + "_scale" not in written:
            assert torch.equal(written[name], tensor), name
            continue
        ours = literal_dequantize(name, written[name], written[name + "_scale"]).to(tensor.dtype)
        assert torch.equal(ours, tensor), name
        source = "language_model." + name  # the container's name in the source
        if written[name].dim() == 3:  # the kept experts' rows of the source, its bytes and multipliers
            rows = torch.tensor(kept[next(layer for layer in kept if name.startswith(layer + "."))])
            assert torch.equal(written[name].view(torch.uint8), stored[source].view(torch.uint8)[rows]), name
            assert torch.equal(written[name + "_scale"], stored[source + "_scale"][rows]), name
        else:
            assert torch.equal(written[name].view(torch.uint8), stored[source].view(torch.uint8)), name
            assert torch.equal(written[name + "_scale"], stored[source + "_scale"]), name


def test_per_layer_counts_and_a_compensation_are_refused_before_any_work_and_uniform_is_written_as_stored(
        tmp_path, capsys, caplog):
    """transformers builds every layer's row-wise FP8 experts at the config's count, so a plan with per-layer counts
    would be written unloadable: refused before calibrating (fit) or writing (prune), as a compensation is; a uniform
    plan is written in the source's format, auto fitting no compensation."""
    from ompmoe.cli import main

    from test_cli import tiny_config

    fp8, _ = _source(tmp_path)
    one_count = (f"{fp8} stores row-wise FP8 (fbgemm_fp8) weights, which transformers builds at the config's expert "
                 "count in every layer (FbgemmFp8Llama4TextExperts), so a plan with per-layer counts would be written "
                 "unloadable. Plan with allocation uniform (ompmoe fit --allocation uniform, ompmoe prune "
                 "--allocation uniform).")
    (tmp_path / "auto").mkdir()
    fit = ["fit", "-c", str(tiny_config(tmp_path / "auto")), "--trainer.enable_progress_bar=false", "--layer_by_layer",
           "true", "--model.model", str(fp8)]
    for extra, refusal in (([], one_count), (["--allocation", "uniform", "--compensation", "down"], (
            f"{fp8} stores row-wise FP8 (fbgemm_fp8) weights, which ompmoe writes as stored; a compensation changes "
            "the kept experts' weights, which would have to be quantized again (ompmoe quantizes again block-FP8 "
            "weights whose scale_fmt is none, 'float' or 'ue8m0', MXFP4 and compressed-tensors integer and FP8 "
            "ones). Prune it with compensation='off' (the paper's setting), or compensate its full-precision "
            "checkpoint."))):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main([*fit, *extra])
        assert capsys.readouterr().err == f"error: {refusal}\n"  # the one line, before any work
        assert not (tmp_path / "auto" / "run").exists()
    stats = collect_stats_layerwise(fp8, BLOCKS, progress=False)
    stats.save(tmp_path / "stats.pt")
    assert len({len(ids) for ids in ompmoe.plan_pruning(stats, 0.3, allocation="waterfill", min_kept_fraction=0.125,
                                                         max_kept_fraction=1.0).kept_by_layer().values()}) > 1
    with pytest.raises(SystemExit):
        main(["prune", "--stats", str(tmp_path / "stats.pt"), "--ratio", "0.3", "--model", str(fp8), "--output_dir",
              str(tmp_path / "pruned"), "--allocation", "waterfill", "--min_kept_fraction", "0.125",
              "--max_kept_fraction", "1.0"])
    assert capsys.readouterr().err == f"error: {one_count}\n" and not (tmp_path / "pruned").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caplog.set_level("INFO")
        main([*fit, "--allocation", "uniform"])
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("ompmoe")]
    assert (f"ompmoe: the checkpoint stores {FORMAT} weights, written as stored: auto fits no compensation"
            in "\n".join(lines))
    written = read_tensors(tmp_path / "auto" / "run" / "model")
    assert any(tensor.dtype == torch.float8_e4m3fn for tensor in written.values())
    plan = ompmoe.PruningPlan.load(tmp_path / "auto" / "run" / "plan.json")
    assert plan.achieved_ratio == 0.5 and len({layer.num_kept for layer in plan.layers}) == 1


def test_loading_it_whole_without_fbgemm_on_a_gpu_is_refused_with_the_layer_by_layer_route(tmp_path):
    fp8, _ = _source(tmp_path)
    with pytest.raises(QuantizedCheckpointError) as refused:
        ompmoe.load_pruned(fp8)
    assert str(refused.value) == (
        f"{fp8} stores row-wise FP8 (fbgemm_fp8) weights, which transformers loads only on a GPU with fbgemm_gpu. "
        "ompmoe prunes such a checkpoint layer by layer (ompmoe fit --layer_by_layer true, ompmoe prune --model), "
        "which reads its weights dequantized on any machine.")


def _e5m2(tensors: dict, config: dict) -> None:
    name = next(name for name, tensor in tensors.items() if tensor.dtype == torch.float8_e4m3fn)
    tensors[name] = tensors[name].float().to(torch.float8_e5m2)


def _without_a_scale(tensors: dict, config: dict) -> None:
    del tensors[next(name for name in sorted(tensors) if name.endswith("experts.down_proj_scale"))]


def _bf16_scales(tensors: dict, config: dict) -> None:
    name = next(name for name in sorted(tensors) if name.endswith("_scale"))
    tensors[name] = tensors[name].to(torch.bfloat16)


def _per_input_scales(tensors: dict, config: dict) -> None:
    name = next(name for name in sorted(tensors) if name.endswith("experts.gate_up_proj_scale"))
    tensors[name] = tensors[name][:, :, :64].reshape(tensors[name].shape[0], 64, 1).contiguous()


def _leftover_scale(tensors: dict, config: dict) -> None:
    name = next(name for name in sorted(tensors) if name.endswith("shared_expert.up_proj.weight"))
    tensors[name] = tensors[name].float().to(torch.bfloat16)


def _full_precision_files(tensors: dict, config: dict) -> None:
    for name in [name for name, tensor in tensors.items() if tensor.dtype == torch.float8_e4m3fn]:
        tensors[name] = tensors.pop(name).float().to(torch.bfloat16)
        del tensors[name + "_scale"]


@pytest.mark.parametrize(("change", "message"), [
    (_e5m2, "stores 1 weights in an 8-bit float other than E4M3 (language_model.model.layers.0.feed_forward.experts."
            "down_proj (F8_E5M2)); FBGEMM's row-wise FP8 is E4M3."),
    (_without_a_scale, "stores FP8 weights ompmoe cannot scale: language_model.model.layers.0.feed_forward.experts."
                       "down_proj has no language_model.model.layers.0.feed_forward.experts.down_proj_scale."),
    (_bf16_scales, "stores FP8 weights ompmoe cannot scale: language_model.model.layers.0.feed_forward.experts."
                   "down_proj_scale is BF16, not float32 multipliers (F32)."),
    (_per_input_scales, "stores FP8 weights ompmoe cannot scale: language_model.model.layers.0.feed_forward.experts."
                        "gate_up_proj_scale [8, 64, 1] is not one multiplier per output channel of "
                        "language_model.model.layers.0.feed_forward.experts.gate_up_proj [8, 64, 128]."),
    (_leftover_scale, "stores FP8 weights ompmoe cannot scale: language_model.model.layers.0.feed_forward."
                      "shared_expert.up_proj.weight_scale scales language_model.model.layers.0.feed_forward."
                      "shared_expert.up_proj.weight, which is BF16, not FP8."),
    (_full_precision_files, "config.json says its weights are FP8 (quantization_config, quant_method 'fbgemm_fp8'), "
                            "but no tensor of its files is FP8"),
])
def test_what_ompmoe_cannot_read_right_is_refused_by_name_before_any_layer_runs(change, message, tmp_path):
    fp8, _ = _source(tmp_path)
    rewrite(fp8, change)
    with pytest.raises(QuantizedCheckpointError) as refused:
        collect_stats_layerwise(fp8, BLOCKS, progress=False)
    assert message in str(refused.value)
    assert str(refused.value).startswith(str(fp8))
