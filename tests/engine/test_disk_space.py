"""A run whose pruned model, or whose layer inputs kept for the loss-aware backward, cannot fit the disk they go to
is refused before calibration with one message naming the place, the sizes and the fix; the sizes checked are lower
bounds of what is written (never a wrong refusal)."""

from __future__ import annotations

import collections
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import ompmoe
from ompmoe.engine.disk_space import (NotEnoughSpaceError, free_bytes, model_bytes, pruned_bytes_lower_bound,
                                      require_free_space, stored_pruned_bytes_lower_bound)
from ompmoe.engine.export.streamed import save_pruned_from_files
from ompmoe.engine.io import readable_size
from ompmoe.engine.lazy_checkpoint import build_skeleton, checkpoint_config, checkpoint_files
from ompmoe.engine.safetensors_header import read_header
from ompmoe.engine.tiny import tiny_model

BLOCKS = [torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
Usage = collections.namedtuple("Usage", "total used free")


def tensor_bytes(directory: Path) -> int:
    """The bytes of the tensors in a checkpoint's safetensors files (headers left out)."""
    return sum(end - begin for file in checkpoint_files(directory)
               for begin, end in (entry["data_offsets"] for entry in read_header(file).values()))


def with_free_space(monkeypatch: pytest.MonkeyPatch, free: int) -> list[Path]:
    """Every file system reports ``free`` bytes free; returns the paths asked about."""
    asked: list[Path] = []

    def usage(path):
        asked.append(Path(path))
        return Usage(2**50, 0, free)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    return asked


def quietly(function, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return function(*args, **kwargs)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss", "minimax_m2"])
@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_the_sizes_checked_are_at_most_what_is_written_and_within_a_group_and_the_routers_of_it(
        model_type, ratio, tmp_path):
    """Resident (``save_pretrained`` of the pruned model) and from the files (``save_pruned_from_files``): the bound
    is at most the tensor bytes written, and short of them by no more than one router group of experts, one expert
    and the routers' removed rows (the slack the bound leaves for rounding)."""
    model = tiny_model(model_type)
    stats = ompmoe.collect_stats(model, BLOCKS, progress=False)
    plan = ompmoe.plan_pruning(stats, ratio, method="omp", allocation="waterfill", min_kept_fraction=0.25)
    quietly(model.save_pretrained, tmp_path / "source")
    quietly(ompmoe.prune(tiny_model(model_type), plan).save_pretrained, tmp_path / "resident")
    quietly(save_pruned_from_files, tmp_path / "source", plan, tmp_path / "streamed")
    layers = ompmoe.find_moe_layers(model)
    total, cut = model_bytes(model)
    assert total == tensor_bytes(tmp_path / "source")
    slack = (max(layer.num_groups for layer in layers) + 1) * max(
        cut[layer.name] / layer.num_experts for layer in layers) + sum(
        layer.router.weight.numel() * 4 for layer in layers)
    bound = pruned_bytes_lower_bound(model, 1 - ratio)
    written = tensor_bytes(tmp_path / "resident")
    assert bound <= written <= bound + slack
    skeleton = build_skeleton(checkpoint_config(tmp_path / "source"), dtype=torch.float32)
    stored = stored_pruned_bytes_lower_bound(tmp_path / "source", skeleton, 1 - ratio)
    assert stored == bound  # one dtype in the files and in the skeleton: the same bound
    kept = {name: len(experts) for name, experts in plan.kept_by_layer().items()}  # the plan's counts: the same bytes
    assert pruned_bytes_lower_bound(model, None, kept=kept) == stored_pruned_bytes_lower_bound(
        tmp_path / "source", skeleton, None, kept=kept) == written
    assert stored <= tensor_bytes(tmp_path / "streamed") == written


def test_a_skeletons_output_embeddings_tied_to_its_input_embeddings_count_once(tmp_path):
    """A weightless skeleton's embeddings are not tied yet; the files hold them once, and so does the size."""
    model = tiny_model("qwen3_moe", tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    quietly(model.save_pretrained, tmp_path / "source")
    skeleton = build_skeleton(checkpoint_config(tmp_path / "source"), dtype=torch.float32)
    assert model_bytes(skeleton) == model_bytes(model)
    assert model_bytes(skeleton)[0] == tensor_bytes(tmp_path / "source")
    stats = ompmoe.collect_stats(model, BLOCKS, progress=False)
    plan = ompmoe.plan_pruning(stats, 0.5, method="omp", allocation="waterfill", min_kept_fraction=0.25)
    quietly(save_pruned_from_files, tmp_path / "source", plan, tmp_path / "streamed")
    bound = stored_pruned_bytes_lower_bound(tmp_path / "source", skeleton, 0.5)
    assert bound == pruned_bytes_lower_bound(model, 0.5) <= tensor_bytes(tmp_path / "streamed")


def test_each_layer_rounding_its_own_share_keeps_fewer_experts_than_the_budget_and_the_bound_counts_it(tmp_path):
    """The uniform allocation rounds each layer's share: 32 layers of 8 experts at ratio 0.45 keep 4 each (4.4
    rounded), 128 in all, against a budget of 141; the bound counts 128."""
    from ompmoe.engine.disk_space import kept_experts_lower_bound

    model = tiny_model("mixtral", num_hidden_layers=32)
    layers = ompmoe.find_moe_layers(model)
    stats = ompmoe.collect_stats(model, BLOCKS[:1], progress=False)
    plan = ompmoe.plan_pruning(stats, 0.45, allocation="uniform")
    assert sum(layer.num_kept for layer in plan.layers) == kept_experts_lower_bound(layers, 0.55) == 128
    quietly(ompmoe.prune(model, plan).save_pretrained, tmp_path / "pruned")
    assert pruned_bytes_lower_bound(tiny_model("mixtral", num_hidden_layers=32), 0.55) <= tensor_bytes(
        tmp_path / "pruned")


def test_file_tensors_the_model_has_no_place_for_are_not_counted(tmp_path):
    """A multi-token-prediction layer (DeepSeek-V3's layer 61, GLM-4.5's 46) in the files is never written."""
    from safetensors.torch import load_file, save_file

    model = tiny_model("deepseek_v3")
    quietly(model.save_pretrained, tmp_path / "source")
    (file,) = checkpoint_files(tmp_path / "source")
    tensors = load_file(file)
    last = model.config.num_hidden_layers - 1
    extra = {key.replace(f"layers.{last}.", "layers.61."): value.clone() for key, value in tensors.items()
             if f"layers.{last}." in key}
    save_file({**tensors, **extra}, file, metadata={"format": "pt"})
    skeleton = build_skeleton(checkpoint_config(tmp_path / "source"), dtype=torch.float32)
    stats = ompmoe.collect_stats(model, BLOCKS, progress=False)
    plan = ompmoe.plan_pruning(stats, 0.5, min_kept_fraction=0.25)
    quietly(save_pruned_from_files, tmp_path / "source", plan, tmp_path / "streamed")
    assert stored_pruned_bytes_lower_bound(tmp_path / "source", skeleton, 0.5) == pruned_bytes_lower_bound(
        model, 0.5) <= tensor_bytes(tmp_path / "streamed")


def test_embeddings_tied_by_the_top_level_config_of_a_multimodal_model_count_once(tmp_path):
    """Gemma 4 ties its embeddings in its top-level config while its text config says not."""
    model = tiny_model("gemma4")
    assert model.config.tie_word_embeddings and not model.config.get_text_config().tie_word_embeddings
    quietly(model.save_pretrained, tmp_path / "source")
    skeleton = build_skeleton(checkpoint_config(tmp_path / "source"), dtype=torch.float32)
    assert model_bytes(skeleton)[0] == model_bytes(model)[0] == tensor_bytes(tmp_path / "source")


def test_the_dtype_written_counts_and_without_a_ratio_no_expert_does():
    model = tiny_model("qwen3_moe")
    layers = ompmoe.find_moe_layers(model)
    total, cut = model_bytes(model)
    assert model_bytes(model, torch.bfloat16) == (total // 2, {name: size // 2 for name, size in cut.items()})
    assert pruned_bytes_lower_bound(model, None) == total - sum(cut.values())
    experts = sum(layer.num_experts for layer in layers)  # all kept, but one router group for rounding
    smallest = min(cut[layer.name] / layer.num_experts for layer in layers)
    assert pruned_bytes_lower_bound(model, 1.0) == int(total - sum(cut.values()) + (experts - 1) * smallest)


def test_the_refusal_names_the_place_the_sizes_and_the_fix(tmp_path, monkeypatch):
    asked = with_free_space(monkeypatch, 3 * 2**30)
    require_free_space(tmp_path / "new" / "out", 3 * 2**30, "the pruned model needs", "free space there")  # just enough
    assert asked == [tmp_path]  # the nearest folder that exists
    with pytest.raises(NotEnoughSpaceError) as refused:
        require_free_space(tmp_path / "out", 3 * 2**30 + 1, "the pruned model needs", "free space there")
    assert str(refused.value) == (f"not enough disk space at {tmp_path / 'out'}: the pruned model needs at least "
                                  "3 GiB and its file system has 3 GiB free; free space there")
    assert refused.value.errno == 28 and isinstance(refused.value, ompmoe.OutputNotWritableError)
    assert [readable_size(n) for n in (512, 1536, 5 * 2**20, 1.5 * 2**40)] == [
        "512 bytes", "1.5 KiB", "5 MiB", "1.5 TiB"]


def test_free_space_that_cannot_be_told_refuses_nothing(tmp_path, monkeypatch):
    def fails(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(shutil, "disk_usage", fails)
    assert free_bytes(tmp_path) is None
    require_free_space(tmp_path, 2**60, "the pruned model needs", "free space there")


def resident_run(tmp_path: Path, **options) -> ompmoe.PruningRun:
    return ompmoe.PruningRun(ompmoe.RunOptions(strategy=ompmoe.PruningStrategy(ratio=0.5), plots=False,
                                               output_dir=str(tmp_path / "run"), **options))


def test_a_resident_run_is_refused_at_start_before_any_forward_and_leaves_the_output_free(tmp_path, monkeypatch):
    model = tiny_model("qwen3_moe")
    needed = pruned_bytes_lower_bound(model, 0.5)
    forwards: list[int] = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    context = ompmoe.LocalContext()
    run = resident_run(tmp_path)
    run.check_output(context)
    with_free_space(monkeypatch, needed - 1)
    with pytest.raises(NotEnoughSpaceError) as refused:
        run.start(model, context)
    assert str(refused.value) == (
        f"not enough disk space at {tmp_path / 'run'}: the pruned model needs at least {readable_size(needed)} and "
        f"its file system has {readable_size(needed - 1)} free; free space there, or choose another output_dir "
        "(save_model false writes the statistics and plan only)")
    assert forwards == [] and sorted(p.name for p in tmp_path.iterdir()) == []  # no lock left: the output is free
    monkeypatch.undo()
    with_free_space(monkeypatch, needed)  # enough: the run goes on and writes
    run = resident_run(tmp_path)
    run.check_output(context)
    run.start(model, context)
    run.collect(BLOCKS)
    quietly(run.finish, context)
    assert tensor_bytes(tmp_path / "run" / "model") >= needed
    monkeypatch.undo()
    with_free_space(monkeypatch, 0)  # nothing to write but the statistics and plan: no model to fit
    run = resident_run(tmp_path / "plans", save_model=False)
    run.check_output(context)
    run.start(model, context)


def test_a_layer_by_layer_run_is_refused_before_it_reads_a_layer(tmp_path, monkeypatch):
    from ompmoe.engine import lazy_checkpoint

    quietly(tiny_model("qwen3_moe").save_pretrained, tmp_path / "source")
    skeleton = build_skeleton(checkpoint_config(tmp_path / "source"), dtype=torch.float32)
    needed = stored_pruned_bytes_lower_bound(tmp_path / "source", skeleton, 0.5)
    run = resident_run(tmp_path, layer_by_layer=True)
    context = ompmoe.LocalContext()
    run.check_output(context)
    run.start(skeleton, context)
    filled: list[tuple[str, ...]] = []
    monkeypatch.setattr(lazy_checkpoint.LazyCheckpoint, "fill", lambda self, prefixes, *a, **k: filled.append(prefixes))
    with_free_space(monkeypatch, needed - 1)
    with pytest.raises(NotEnoughSpaceError, match=f"the pruned model needs at least {readable_size(needed)} and"):
        run.collect_layer_by_layer(tmp_path / "source", BLOCKS, show_progress=False)
    assert filled == [] and sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_kept_layer_inputs_that_cannot_fit_their_disk_are_refused_before_any_layer_runs(tmp_path, monkeypatch):
    """The loss-aware backward down the layers keeps each layer's input: past the memory it may take, on disk. At
    least the hidden states of every layer from the first MoE one up must fit there."""
    import ompmoe.engine.collect.layerwise as layerwise
    from ompmoe.engine.collect.collector import StatisticsCollector

    model = tiny_model("glm4_moe")  # a dense first layer: inputs kept from the first MoE layer's (1) up
    quietly(model.save_pretrained, tmp_path / "source")
    layer_bytes = sum(block.numel() for block in BLOCKS) * model.config.hidden_size * 4
    kept = layer_bytes * (model.config.num_hidden_layers - 1)
    monkeypatch.setattr(layerwise, "available_memory", lambda: 2 * layer_bytes)  # one layer's inputs in memory
    (tmp_path / "scratch").mkdir()
    collector = StatisticsCollector(build_skeleton(checkpoint_config(tmp_path / "source"), dtype=torch.float32),
                                    statistics=["loss_aware"])
    ran: list[int] = []
    monkeypatch.setattr(layerwise.LayerMajor, "run", lambda self, name, index, before=None: ran.append(index))
    with_free_space(monkeypatch, kept - layer_bytes - 1)
    with pytest.raises(NotEnoughSpaceError) as refused:
        layerwise.collect_layerwise(collector, tmp_path / "source", BLOCKS, scratch=tmp_path / "scratch")
    assert str(refused.value) == (
        f"not enough disk space at {tmp_path / 'scratch'}: keeping the layer inputs for the loss-aware backward (past "
        f"the {readable_size(layer_bytes)} of memory they may take) needs at least {readable_size(kept - layer_bytes)} "
        f"and its file system has {readable_size(kept - layer_bytes - 1)} free; free space there, or calibrate on "
        "fewer tokens")
    assert ran == [] and list((tmp_path / "scratch").iterdir()) == []
