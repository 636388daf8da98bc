"""Files that would load silently wrong or crash confusingly get one error naming the file, the tensors and the fix."""

from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import ompmoe
from ompmoe.engine.export.weights import CheckpointWeightsError
from ompmoe.engine.planning.plan import PlanMismatchError, PruningPlan
from ompmoe.engine.collect.statistics import MoEStats, StatsFileError
from ompmoe.engine.collect.synthetic import synthetic_stats
from ompmoe.engine.tiny import tiny_model

FIX = "Re-save the model (ompmoe.save_pruned) or copy the checkpoint again."


@pytest.fixture
def saved(tmp_path):
    model = tiny_model("qwen3_moe")
    directory = tmp_path / "model"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ompmoe.save_pruned(model, directory)
    weights = directory / "model.safetensors"
    return directory, weights, load_file(str(weights))


def rewrite(weights, tensors):
    save_file(tensors, str(weights), metadata={"format": "pt"})


def test_a_missing_router_is_an_error_not_a_random_router(saved):
    directory, weights, tensors = saved
    del tensors["model.layers.1.mlp.gate.weight"]
    rewrite(weights, tensors)
    with pytest.raises(CheckpointWeightsError) as error:
        ompmoe.load_pruned(directory)
    assert str(error.value) == (f"{weights} does not match the model: tensors missing (would be random): "
                                f"model.layers.1.mlp.gate.weight. {FIX}")


def test_an_unexpected_tensor_is_an_error(saved):
    directory, weights, tensors = saved
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    rewrite(weights, tensors)
    with pytest.raises(CheckpointWeightsError, match=r"tensors not in the model: model\.layers\.0\.extra\.weight\. "):
        ompmoe.load_pruned(directory)


def test_a_transposed_tensor_names_both_shapes(saved):
    directory, weights, tensors = saved
    name = "model.layers.1.mlp.gate.weight"  # the router: (experts, hidden)
    shape = list(tensors[name].shape)
    assert shape[0] != shape[1]
    tensors[name] = tensors[name].t().contiguous()
    rewrite(weights, tensors)
    with pytest.raises(CheckpointWeightsError) as error:
        ompmoe.load_pruned(directory)
    assert str(error.value) == (f"{weights} does not match the model: tensors of the wrong shape: {name} "
                                f"{shape[::-1]} (model: {shape}). {FIX}")


def transpose_in_header(weights, name) -> tuple[list[int], list[int]]:
    """Rewrite ``name``'s shape in the safetensors JSON header to its transpose (same bytes, data untouched); returns
    the shapes (before, after)."""
    data = weights.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    before = header[name]["shape"]
    header[name]["shape"] = before[::-1]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])
    return before, before[::-1]


def test_an_expert_tensor_transposed_in_the_header_is_named_before_transformers_converts_it(saved, tmp_path):
    """transformers stacks the per-expert tensors into one (its conversion); a transposed one crashed inside its
    loading report ("stack expects each tensor to be equal size") without naming the file."""
    from ompmoe.cli import main

    directory, weights, _ = saved
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # (hidden, intermediate): not square
    expected, found = transpose_in_header(weights, name)
    assert expected != found
    message = (f"{weights} does not match the model: tensors of the wrong shape: {name} {found} (model: {expected}). "
               f"{FIX}")
    with pytest.raises(CheckpointWeightsError) as error:
        ompmoe.load_pruned(directory)
    assert str(error.value) == message
    # ompmoe prune --model: the same line, exit status 2, nothing written
    stats = ompmoe.collect_stats(tiny_model("qwen3_moe"), [torch.randint(3, 200, (1, 16))])
    stats_file = stats.save(tmp_path / "stats.safetensors")
    with pytest.raises(SystemExit) as exit_info:
        main(["prune", "--stats", str(stats_file), "--model", str(directory), "--ratio", "0.5",
              "--output_dir", str(tmp_path / "out"), "--quiet"])
    assert exit_info.value.code == 2 and str(exit_info.value) == f"error: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "stats.safetensors"]


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_the_shape_check_passes_every_saved_layout(tmp_path, model_type):
    """The shapes expected are those save_pretrained writes (per-expert or fused tensors, shared experts, biases)."""
    stats = ompmoe.collect_stats(tiny_model(model_type), [torch.randint(3, 200, (1, 16))])
    model = ompmoe.prune(tiny_model(model_type), ompmoe.plan_pruning(stats, 0.25))  # per-layer counts may differ
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ompmoe.save_pruned(model, tmp_path / "model")
    loaded = ompmoe.load_pruned(tmp_path / "model")
    for (name, tensor), (_, original) in zip(loaded.state_dict().items(), model.state_dict().items()):
        assert torch.equal(tensor, original), name


def test_integer_weights_are_refused_before_loading(saved):
    directory, weights, tensors = saved
    name = "model.embed_tokens.weight"
    tensors[name] = (tensors[name] * 100).to(torch.int32)
    rewrite(weights, tensors)
    with pytest.raises(CheckpointWeightsError) as error:
        ompmoe.load_pruned(directory)
    assert str(error.value) == (f"{weights} stores 1 tensors in a non-floating dtype (I32): {name}; the model's "
                                f"weights are floating point and would load as wrong values. {FIX}")


def test_a_truncated_weights_file_is_named(saved):
    directory, weights, _ = saved
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointWeightsError, match=rf"^{re.escape(str(weights))}: tensor '.*' ends at byte \d+ of the "
                                                     r"data, but the file holds \d+ \(truncated\?\)\. Re-save"):
        ompmoe.load_pruned(directory)


def test_hostile_statistics_headers_are_stats_file_errors(tmp_path):
    path = tmp_path / "stats.safetensors"
    path.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    with pytest.raises(StatsFileError) as error:
        MoEStats.load(path)
    assert str(error.value) == (f"{path} is truncated or not a safetensors file: its header claims {2**62} bytes "
                                "but the file has 10. Re-collect it: ompmoe.collect_stats(model, batches).save(path).")
    huge = json.dumps({"layers.0.gram": {"dtype": "F64", "shape": [10**6, 10**6], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(len(huge).to_bytes(8, "little") + huge + bytes(8))
    with pytest.raises(StatsFileError, match=r"tensor 'layers\.0\.gram' of shape \[1000000, 1000000\] and dtype F64 "
                                             r"needs 8000000000000 bytes but its offsets span 8\. Re-collect"):
        MoEStats.load(path)


def test_a_plan_with_short_curves_is_refused_on_load(tmp_path):
    plan = ompmoe.plan_pruning(synthetic_stats(3, 16, 4), 0.5)
    data = plan.to_dict()
    data["layers"][1]["residual"] = data["layers"][1]["residual"][:5]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanMismatchError) as error:
        PruningPlan.load(path)
    name = data["layers"][1]["name"]
    assert str(error.value) == (f"{path}: layer {name!r} has 5 residual values; it needs 17 (k = 0..16). "
                                "Re-create it with ompmoe.plan_pruning(stats, ratio).save(path).")


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_directory_or_fifo_as_calibration_file_says_what_it_is(kind, tmp_path):
    from ompmoe.lightning.calibration_data import CalibrationDataModule

    path = tmp_path / "calib.txt"
    if kind == "directory":
        path.mkdir()
        what = "a directory"
    else:
        os.mkfifo(path)
        what = "not a regular file (a FIFO, socket or device)"
    with pytest.raises(ValueError) as error:
        CalibrationDataModule(str(path), tokenizer="bytes", seq_len=8, num_blocks=1)
    assert str(error.value).startswith(f"Calibration file {path} is {what}; give the path of a regular ")


def test_a_long_json_record_is_tokenized_in_pieces_and_only_as_far_as_needed(tmp_path):
    from ompmoe.data import sources
    from ompmoe.data.sources import text_pieces
    from ompmoe.lightning.calibration_data import CalibrationDataModule

    text = " ".join(f"word{i}" for i in range(400_000))  # ~3.7 MB in one record
    assert "".join(text_pieces(text)) == text
    file = tmp_path / "one.jsonl"
    file.write_text(json.dumps({"text": text}) + "\n")
    dm = CalibrationDataModule(str(file), tokenizer="bytes", seq_len=64, num_blocks=4)
    lengths = []
    encode = dm._encoder

    def recording_encoder():
        inner, eos = encode()

        def counted(texts):
            lengths.extend(len(t) for t in texts)
            return inner(texts)

        return counted, eos

    dm._encoder = recording_encoder
    assert bytes(dm.blocks.reshape(-1).tolist()).decode() == text[:256]
    assert max(lengths) <= sources._TEXT_WINDOW_MAX and sum(lengths) < len(text) // 10


def test_blocks_longer_than_the_models_positions_warn_once():
    from ompmoe.lightning.calibration_module import CalibrationModule

    module = CalibrationModule(tiny_model("qwen3_moe", max_position_embeddings=16))
    batch = {"input_ids": torch.randint(3, 200, (1, 32))}
    with pytest.warns(UserWarning, match=r"Calibration blocks of 32 tokens exceed the model's max_position_embeddings "
                                         r"\(16\).*Set the data module's seq_len to 16 or less\.") as caught:
        module.training_step(batch, 0)
        module.training_step(batch, 1)
    assert sum("max_position_embeddings" in str(w.message) for w in caught) == 1
