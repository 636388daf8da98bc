"""A model bigger than memory: statistics collected one decoder layer at a time equal the resident pass's (the same
plan), and a checkpoint written from its source files tensor by tensor equals ``save_pruned``'s, on every
architecture the matrix supports and on the shipped models."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ompmoe
from ompmoe.engine.collect.layerwise import LayerwiseUnsupportedError, collect_stats_layerwise
from ompmoe.engine.export.streamed import save_pruned_from_files
from ompmoe.engine.lazy_checkpoint import checkpoint_files
from ompmoe.engine.names import SHIPPED_MODELS, shipped_model_path
from ompmoe.engine.tiny import tiny_model

from test_every_moe import MULTIMODAL, MULTIMODAL_REFUSED, REFUSED, TYPES

BLOCKS = [torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
SUPPORTED = [t for t in TYPES + MULTIMODAL if t not in {*REFUSED, *MULTIMODAL_REFUSED}]
_BLOCK_STATES = "'s forward computes decoder layer 2's block_states from the outputs of the layers before it; "
_LOOP = ("'s forward calls decoder layer 1 after layer 1 (it runs layers again, in a loop, or out of order); "
         "layer-by-layer calibration runs each layer once, in order. Calibrate it resident instead.")
NOT_LAYER_BY_LAYER = {
    "inkling2": "Inkling2ForConditionalGeneration" + _BLOCK_STATES,
    "inkling2_text": "Inkling2ForCausalLM" + _BLOCK_STATES,
    "inkling2_loop": "Inkling2LoopForConditionalGeneration" + _BLOCK_STATES,
    "inkling2_loop_text": "Inkling2LoopForCausalLM" + _BLOCK_STATES,
}
"""Types layer by layer refuses, with the start of the reason: replaying each layer from recorded inputs would not be
the model's forward (it ran, silently wrong, before the recording was checked twice)."""


def file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in checkpoint_files(directory):
        with safe_open(str(file), "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def assert_same_statistics(resident: ompmoe.MoEStats, layered: ompmoe.MoEStats) -> None:
    assert [layer.name for layer in layered.layers] == [layer.name for layer in resident.layers]
    assert layered.num_tokens == resident.num_tokens and layered.fingerprint == resident.fingerprint
    for ours, theirs in zip(layered.layers, resident.layers):
        for key, value in theirs.tensors().items():
            torch.testing.assert_close(ours.tensors()[key], value, rtol=1e-6, atol=0)


def assert_same_checkpoint(expected: Path, actual: Path) -> None:
    """Bit-identical tensors (names, dtypes, values), the same files and the same config.json."""
    def names(directory: Path) -> list[str]:  # an output's own marker aside (a model inside an output has none)
        return sorted(path.name for path in directory.iterdir() if path.name != ".ompmoe-output")

    assert names(actual) == names(expected)
    ours, theirs = file_tensors(actual), file_tensors(expected)
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    assert json.loads((actual / "config.json").read_text()) == json.loads((expected / "config.json").read_text())


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_layer_by_layer_statistics_and_the_streamed_checkpoint_equal_the_resident_ones(model_type, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(model_type, dtype=torch.bfloat16)
        model.save_pretrained(tmp_path / "source")
        resident = ompmoe.collect_stats(model, BLOCKS, model_id=str(tmp_path / "source"), progress=False,
                                        loss_aware=True)
        plan = ompmoe.plan_pruning(resident, 0.5, allocation="waterfill")
        tokenizer = str(shipped_model_path())  # the same tokenizer files in both
        ompmoe.save_pruned(ompmoe.prune(model, plan), tmp_path / "resident", tokenizer=tokenizer)
        save_pruned_from_files(tmp_path / "source", plan, tmp_path / "streamed", tokenizer=tokenizer)
    assert_same_checkpoint(tmp_path / "resident", tmp_path / "streamed")
    if model_type in NOT_LAYER_BY_LAYER:
        with pytest.raises(LayerwiseUnsupportedError) as refused:
            collect_stats_layerwise(tmp_path / "source", BLOCKS, progress=False)
        assert str(refused.value).startswith(NOT_LAYER_BY_LAYER[model_type])
        return
    layered = collect_stats_layerwise(tmp_path / "source", BLOCKS, progress=False, statistics=["loss_aware"])
    assert "gram_loss" in resident.layers[0].tensors()  # the loss-aware sums, from a backward down the layers
    assert_same_statistics(resident, layered)
    assert ompmoe.plan_pruning(layered, 0.5, allocation="waterfill").kept_by_layer() == plan.kept_by_layer()
    loss_plan = ompmoe.plan_pruning(resident, 0.5, method="omp_normalized", allocation="loss")
    assert ompmoe.plan_pruning(layered, 0.5, method="omp_normalized", allocation="loss").kept_by_layer() == (
        loss_plan.kept_by_layer())


def test_a_model_that_runs_a_layer_again_is_refused_layer_by_layer(tmp_path):
    """Inkling2-Loop runs layers 6 to 18 three times (here layer 1 twice): replay runs each layer once."""
    model = tiny_model("inkling2_loop_text", dtype=torch.bfloat16, n_layers_per_attn_res_block=1,
                       loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2)
    model.save_pretrained(tmp_path / "source")
    with pytest.raises(LayerwiseUnsupportedError) as refused:
        collect_stats_layerwise(tmp_path / "source", BLOCKS, progress=False)
    assert str(refused.value) == "Inkling2LoopForCausalLM" + _LOOP


@pytest.mark.parametrize("batch", [2, 3])
def test_layers_that_pass_on_state_ompmoe_does_not_carry_are_refused_whatever_the_batch(batch, tmp_path, monkeypatch):
    """GLM-5's layers return (hidden states, the indexer's top-k) and the next one takes the top-k; with that state
    not carried, the model's forward unpacks the recorder's bare hidden states. Three blocks a batch fail to unpack;
    two unpacked into two tensors and ran on, which replaying would have fed wrong inputs: both are refused."""
    import ompmoe.engine.collect.layerwise as layerwise

    model = tiny_model("glm_moe_dsa", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "source")
    monkeypatch.setattr(layerwise, "CARRIED_STATE", ("prev_router_hidden_states",))
    blocks = [torch.randint(3, 250, (batch, 16), generator=torch.Generator().manual_seed(0))]
    with pytest.raises(LayerwiseUnsupportedError) as refused:
        collect_stats_layerwise(tmp_path / "source", blocks, progress=False)
    said = {2: "GlmMoeDsaForCausalLM's forward does not hand decoder layer 0's hidden states to layer 1 as they are (it "
               "changes them between layers, or its layers pass on more than ompmoe carries: "
               "prev_router_hidden_states); ",
            3: "GlmMoeDsaForCausalLM's decoder layers pass more than the hidden states on to the next layer (its "
               "forward failed after 1 of 3 layers: ValueError: too many values to unpack (expected 2)); "}[batch]
    assert str(refused.value) == said + ("layer-by-layer calibration cannot run them one at a time. Calibrate it "
                                         "resident instead.")


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_the_shipped_models_calibrate_layer_by_layer_to_the_same_plan(name, tmp_path):
    import ompmoe.data
    from ompmoe.data import token_blocks

    source = shipped_model_path(name)
    model = ompmoe.load_pruned(source, dtype="auto")
    blocks = token_blocks(ompmoe.data.byte_tokens(ompmoe.data.shipped_text()), seq_len=64, num_blocks=4)
    resident = ompmoe.collect_stats(model, blocks, model_id=str(source), progress=False)
    layered = collect_stats_layerwise(source, blocks, progress=False)
    assert_same_statistics(resident, layered)
    plan = ompmoe.plan_pruning(layered, 0.5)
    assert plan.kept_by_layer() == ompmoe.plan_pruning(resident, 0.5).kept_by_layer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ompmoe.save_pruned(ompmoe.prune(model, plan), tmp_path / "resident")
    save_pruned_from_files(source, plan, tmp_path / "streamed")
    assert_same_checkpoint(tmp_path / "resident", tmp_path / "streamed")


class RecordingSlices(dict):
    """The checkpoint's lazy tensors, recording which were read."""

    def __init__(self, slices: dict) -> None:
        super().__init__(slices)
        self.read: set[str] = set()

    def __getitem__(self, key: str):
        self.read.add(key)
        return super().__getitem__(key)


def test_the_streamed_writer_reads_only_the_kept_experts(tmp_path):
    """A removed expert is never read from the source (half the bytes of a pruned MoE at 0.5), and the kept ones
    fill rows equal to the whole layer's kept rows."""
    from ompmoe.engine.lazy_checkpoint import LazyCheckpoint, build_skeleton

    from ompmoe.engine.export.config import load_stock_config

    tiny_model("qwen3_moe", dtype=torch.bfloat16).save_pretrained(tmp_path)
    config = load_stock_config(tmp_path)
    layer = ompmoe.find_moe_layers(build_skeleton(config))[0].name  # model.layers.N.mlp
    part_prefix, kept = (layer.rpartition(".")[0] + ".",), [0, 2, 3]
    with LazyCheckpoint(tmp_path, build_skeleton(config)) as whole:
        whole.fill(part_prefix)
        experts = whole.model.get_submodule(f"{layer}.experts")
        expected = {name: tensor[kept].clone() for name, tensor in experts.named_parameters()}
    with LazyCheckpoint(tmp_path, build_skeleton(config)) as part:
        part.slices = RecordingSlices(part.slices)
        part.fill(part_prefix, only_experts={f"{layer}.experts": kept})
        experts = part.model.get_submodule(f"{layer}.experts")
        assert expected and dict(experts.named_parameters()).keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(dict(experts.named_parameters())[name], tensor), name
    read_experts = {int(key.split(".experts.")[1].split(".")[0]) for key in part.slices.read if ".experts." in key}
    assert read_experts == set(kept)


def test_the_fill_asks_the_kernel_for_exactly_the_bytes_it_will_read(tmp_path, monkeypatch):
    """The read-ahead hints name each tensor of the part the fill reads (only the kept experts' of a tensor stored per
    expert), by its byte range in its file; the rows then read with preadv equal the memory map's."""
    import os

    from ompmoe.engine.export.config import load_stock_config
    from ompmoe.engine.lazy_checkpoint import LazyCheckpoint, build_skeleton

    tiny_model("qwen3_moe", dtype=torch.bfloat16).save_pretrained(tmp_path)
    config = load_stock_config(tmp_path)
    layer = ompmoe.find_moe_layers(build_skeleton(config))[0].name
    prefix, kept = layer.rpartition(".")[0] + ".", [1, 3]
    hinted: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: hinted.append((offset, length)))
    reads: list[int] = []
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: reads.append(offset) or preadv(fd, buffers, offset))
    with LazyCheckpoint(tmp_path, build_skeleton(config, dtype=torch.bfloat16)) as part:
        part.fill((prefix,), only_experts={f"{layer}.experts": kept})
        expected = {key for key in part.keys_under((prefix,))
                    if ".experts." not in key or int(key.split(".experts.")[1].split(".")[0]) in kept}
        assert sorted(hinted) == sorted(part._ranges[key][1:] for key in expected)
        per_expert = [key for key in expected if ".experts." in key]
        assert sorted(reads) == sorted(part._ranges[key][1] for key in per_expert)  # each read once, with preadv
        experts = part.model.get_submodule(f"{layer}.experts")
        for name, tensor in experts.named_parameters():
            for row, expert in enumerate(kept):
                stored = part.slices[f"{layer}.experts.{expert}.down_proj.weight"][:] if name == "down_proj" else None
                if stored is not None:
                    assert torch.equal(tensor[row], stored), (name, expert)


def test_a_fill_in_another_dtype_than_the_files_converts_as_from_pretrained(tmp_path):
    from ompmoe.engine.export.config import load_stock_config
    from ompmoe.engine.lazy_checkpoint import LazyCheckpoint, build_skeleton

    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    config = load_stock_config(tmp_path)
    with LazyCheckpoint(tmp_path, build_skeleton(config, dtype=torch.float32)) as checkpoint:
        checkpoint.fill(("model.layers.0.",), dtype=torch.float32)
        for name, tensor in checkpoint.model.model.layers[0].named_parameters():
            reference = model.model.layers[0].get_parameter(name)
            assert tensor.dtype == torch.float32 and torch.equal(tensor, reference.float()), name


def test_token_ids_past_the_vocabulary_are_refused_layer_by_layer_as_resident(tmp_path):
    """Text tokenized with another tokenizer than the model's: named, as the resident pass names it (it was reported
    as decoder layers that pass more than their hidden states: the embedding lookup failed while recording)."""
    from ompmoe.engine.collect.collector import CalibrationInputError

    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    vocab = tiny_model("qwen3_moe").config.vocab_size
    with pytest.raises(CalibrationInputError) as refused:
        collect_stats_layerwise(tmp_path, [torch.full((1, 8), vocab)], progress=False)
    assert str(refused.value) == (f"input_ids hold token id {vocab} (min {vocab}, max {vocab}) but the model's "
                                  f"vocabulary has {vocab} tokens (valid ids 0..{vocab - 1}); tokenize with this "
                                  "model's tokenizer.")


def test_statistics_whose_backward_cannot_run_layer_by_layer_are_refused_before_any_work(tmp_path, monkeypatch):
    """An extension that runs a backward and has no layer-by-layer pass of its own (the base class's) is refused
    before the checkpoint is opened."""
    from ompmoe.engine.collect import extensions
    from ompmoe.engine.methods.loss.statistics import LossAwareStatistics

    class WholeModelOnly(LossAwareStatistics):
        name = "whole_model_only"
        collect_layer_by_layer = extensions.StatisticsExtension.collect_layer_by_layer

    from ompmoe.engine.collect.collector import StatisticsCollector
    from ompmoe.engine.collect.layerwise import collect_layerwise

    monkeypatch.setitem(extensions.STATISTICS, WholeModelOnly.name, WholeModelOnly)
    collector = StatisticsCollector(tiny_model("qwen3_moe"), statistics=["whole_model_only"])
    with pytest.raises(ValueError) as refused:  # refused before it looks for the files
        collect_layerwise(collector, tmp_path / "no checkpoint here", BLOCKS, progress=False)
    assert str(refused.value) == (
        "layer-by-layer calibration cannot collect 'whole_model_only' statistics: loss-aware statistics need a "
        "backward through the whole model; collect them resident.")


def test_each_layer_hands_its_freed_memory_back_once_emptied(tmp_path, monkeypatch):
    """After each layer of a pass (forward, then the loss-aware backward from the top down to the first MoE layer),
    once its weights are emptied, the C allocator's free pages go back to the system (glibc's malloc_trim); without
    it resident memory crept up with depth (docs/performance.md)."""
    import ompmoe.engine.collect.layerwise as layerwise

    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    events: list[tuple] = []
    empty = layerwise.LazyCheckpoint.empty

    def emptied(checkpoint, module):
        layers = list(checkpoint.model.model.layers)
        events.append(("emptied", layers.index(module) if module in layers else type(module).__name__))
        return empty(checkpoint, module)

    monkeypatch.setattr(layerwise.LazyCheckpoint, "empty", emptied)
    monkeypatch.setattr(layerwise, "_malloc_trim", lambda: lambda pad: events.append(("trimmed", pad)) or 1)
    collect_stats_layerwise(tmp_path, BLOCKS, progress=False, statistics=["loss_aware"])
    first = min(layerwise.moe_blocks_by_layer("model.layers.", ompmoe.find_moe_layers(model)))
    layers = [*range(model.config.num_hidden_layers), *reversed(range(first, model.config.num_hidden_layers))]
    head = [("emptied", "Linear")]  # the output head, once the loss's gradient at the top is taken
    forward = [event for index in layers[:model.config.num_hidden_layers] for event in (("emptied", index),
                                                                                          ("trimmed", 0))]
    backward = [event for index in layers[model.config.num_hidden_layers:] for event in (("emptied", index),
                                                                                          ("trimmed", 0))]
    assert events == forward + head + backward


def test_the_memory_available_is_the_systems_within_the_cgroups_limit(tmp_path, monkeypatch):
    """What the kept inputs' budget is half of: Linux's MemAvailable, no more than what is left of a cgroup v2 limit
    (a container, a Slurm job); without /proc/meminfo the free pages, else psutil's figure, else 0 (all to disk)."""
    import sys

    import ompmoe.engine.collect.layerwise as layerwise

    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    cgroup.mkdir()
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:    8388608 kB\n")
    monkeypatch.setattr(layerwise, "MEMINFO", meminfo)
    monkeypatch.setattr(layerwise, "CGROUP", cgroup)
    assert layerwise.available_memory() == 8 * 2**30  # no cgroup files: the system's
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(f"{2**30}\n")
    assert layerwise.available_memory() == 8 * 2**30  # no limit
    (cgroup / "memory.max").write_text(f"{6 * 2**30}\n")
    assert layerwise.available_memory() == 5 * 2**30  # 6 GiB allowed, 1 GiB used
    meminfo.unlink()
    monkeypatch.setattr(layerwise.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 1024, "SC_PAGE_SIZE": 4096}[name])
    (cgroup / "memory.max").unlink()
    assert layerwise.available_memory() == 4 * 2**20

    def no_such_setting(name):
        raise ValueError("unrecognized configuration name")  # macOS

    monkeypatch.setattr(layerwise.os, "sysconf", no_such_setting)
    monkeypatch.setitem(sys.modules, "psutil", None)  # not installed
    assert layerwise.available_memory() == 0


def test_layer_by_layer_runs_one_backward_down_the_layers(tmp_path, monkeypatch):
    """Two extensions that each need a backward are refused before any work: the backward consumes the kept inputs."""
    from ompmoe.engine.collect import extensions
    from ompmoe.engine.collect.collector import StatisticsCollector
    from ompmoe.engine.collect.layerwise import collect_layerwise
    from ompmoe.engine.methods.loss.statistics import LossAwareStatistics

    class AnotherBackward(LossAwareStatistics):
        name = "another_backward"

    monkeypatch.setitem(extensions.STATISTICS, AnotherBackward.name, AnotherBackward)
    collector = StatisticsCollector(tiny_model("qwen3_moe"), statistics=["loss_aware", "another_backward"])
    with pytest.raises(ValueError) as refused:
        collect_layerwise(collector, tmp_path / "no checkpoint here", BLOCKS, progress=False)
    assert str(refused.value) == ("layer-by-layer calibration runs one backward down the layers; 'loss_aware', "
                                  "'another_backward' each need one. Collect them resident, or one of them at a time.")


def test_a_failed_backward_leaves_no_weights_and_no_files(tmp_path, monkeypatch):
    """An error in the middle of the backward down the layers: every weight of the skeleton is back on the meta
    device (the layer computing, the one read ahead, the embeddings) and the kept inputs' files are gone."""
    from ompmoe.engine.collect.collector import StatisticsCollector
    from ompmoe.engine.collect.layerwise import collect_layerwise
    from ompmoe.engine.lazy_checkpoint import build_skeleton, checkpoint_config
    from ompmoe.engine.methods.loss.metric import LossStatsMetric

    tiny_model("qwen3_moe").save_pretrained(tmp_path / "source")
    updates, update = [], LossStatsMetric.update

    def failing(metric, *args, **kwargs):
        updates.append(1)
        if len(updates) > 2:
            raise RuntimeError("out of memory")
        return update(metric, *args, **kwargs)

    monkeypatch.setattr(LossStatsMetric, "update", failing)  # before the metric (torchmetrics wraps it then)
    skeleton = build_skeleton(checkpoint_config(tmp_path / "source"), dtype=torch.float32)
    collector = StatisticsCollector(skeleton, statistics=["loss_aware"])
    (tmp_path / "scratch").mkdir()
    with pytest.raises(RuntimeError, match="out of memory"):
        collect_layerwise(collector, tmp_path / "source", BLOCKS, scratch=tmp_path / "scratch", inputs_on_disk=True)
    assert [name for name, p in skeleton.named_parameters() if p.device.type != "meta"] == []
    assert list((tmp_path / "scratch").iterdir()) == []


@pytest.mark.parametrize("in_memory", [2, 1, 0])
def test_layer_inputs_for_the_loss_aware_backward_go_to_disk_past_half_the_memory(in_memory, tmp_path, monkeypatch):
    """The backward down the layers recomputes each from its input, kept from the forward sweep: in host memory up to
    half the memory available, the layers past it one file each in a temporary directory of ``scratch``, each read
    once and removed. All give the resident sums bit for bit."""
    import ompmoe.engine.collect.layerwise as layerwise
    from ompmoe.engine.collect.collector import StatisticsCollector
    from ompmoe.engine.lazy_checkpoint import build_skeleton, checkpoint_config

    model = tiny_model("glm4_moe")  # a dense first layer: inputs kept from the first MoE layer's (1) up
    model.save_pretrained(tmp_path / "source")
    resident = ompmoe.collect_stats(model, BLOCKS, progress=False, loss_aware=True)
    layer_bytes = sum(block.numel() for block in BLOCKS) * model.config.hidden_size * 4
    monkeypatch.setattr(layerwise, "available_memory", lambda: 2 * layer_bytes * in_memory)
    taken, take = [], layerwise.LayerMajor.take_kept

    def take_kept(passes, name, index):
        kept = passes.kept[name][index]
        taken.append((index, kept if isinstance(kept, Path) else type(kept).__name__,
                      sorted(path.name for path in (tmp_path / "scratch").rglob("*.pt"))))
        return take(passes, name, index)

    monkeypatch.setattr(layerwise.LayerMajor, "take_kept", take_kept)
    (tmp_path / "scratch").mkdir()
    collector = StatisticsCollector(build_skeleton(checkpoint_config(tmp_path / "source"), dtype=torch.float32),
                                    statistics=["loss_aware"])
    timings: dict[str, float] = {}
    layerwise.collect_layerwise(collector, tmp_path / "source", BLOCKS, scratch=tmp_path / "scratch",
                                timings=timings)
    layered = collector.result()
    for ours, theirs in zip(layered.layers, resident.layers):
        assert all(torch.equal(ours.tensors()[key], value) for key, value in theirs.tensors().items())
    assert timings["kept_inputs_bytes"] == 2 * layer_bytes
    assert timings["kept_inputs_layers_on_disk"] == 2 - in_memory
    directory = next((kept.parent for _, kept, _ in taken if isinstance(kept, Path)), None)
    assert directory is None or (directory.parent == tmp_path / "scratch"
                                 and directory.name.startswith(".ompmoe-layer-inputs-"))
    if in_memory == 2:
        assert taken == [(2, "list", []), (1, "list", [])]
    elif in_memory == 1:  # the first kept layer's inputs fit in memory, the second's go to disk
        assert taken == [(2, directory / "calibration-2.pt", ["calibration-2.pt"]), (1, "list", [])]
    else:
        assert taken == [(2, directory / "calibration-2.pt", ["calibration-1.pt", "calibration-2.pt"]),
                         (1, directory / "calibration-1.pt", ["calibration-1.pt"])]
    assert list((tmp_path / "scratch").iterdir()) == []  # the temporary directory is gone


def test_loss_aware_statistics_refuse_batches_without_token_ids_before_any_layer_runs(tmp_path, monkeypatch):
    """The loss needs token ids: a batch of ``inputs_embeds`` is refused as the resident pass refuses it, before the
    forward sweep (not after every layer of a model bigger than memory ran)."""
    import ompmoe.engine.collect.layerwise as layerwise
    from ompmoe.engine.methods.loss.statistics import LossAwareError

    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    embeds = [{"inputs_embeds": model.get_input_embeddings()(block).detach()} for block in BLOCKS]
    with pytest.raises(LossAwareError) as resident:
        ompmoe.collect_stats(model, embeds, loss_aware=True, progress=False)
    filled, fill = [], layerwise.LazyCheckpoint.fill
    monkeypatch.setattr(layerwise.LazyCheckpoint, "fill",
                        lambda checkpoint, prefixes, *a, **k: (filled.extend(prefixes), fill(checkpoint, prefixes,
                                                                                              *a, **k))[1])
    with pytest.raises(LossAwareError) as refused:
        collect_stats_layerwise(tmp_path, embeds, statistics=["loss_aware"], progress=False)
    assert str(refused.value) == str(resident.value) == (
        "Loss-aware statistics need input_ids (the next-token loss is computed on them); this batch passes only "
        "inputs_embeds. Pass token ids, or collect without loss_aware.")
    assert not [prefix for prefix in filled if re.fullmatch(r"model\.layers\.\d+\.", prefix)]


def test_ompmoe_fit_layer_by_layer_equals_the_resident_fit_and_says_how_it_ran(tmp_path, caplog, capsys):
    """``ompmoe fit --layer_by_layer true`` on the default config: the statistics (loss-aware ones too, from a
    backward down the layers), auto's trial of its settings (one more pass, its time in a line: the same losses and
    choice) and the plan of the resident fit, compensation and held-out perplexity measured in one more pass (its
    time in a line); with ``--compensation off`` the lines of the resident fit and its written tensors; ``ompmoe prune
    --model`` on those statistics writes from the files too, the same tensors as loading."""
    from ompmoe.cli import main

    from test_cli import tiny_config

    for name in "abc":
        (tmp_path / name).mkdir()
    caplog.set_level("INFO")
    main(["fit", "-c", str(tiny_config(tmp_path / "a")), "--trainer.enable_progress_bar=false",
          "--layer_by_layer", "true"])
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("ompmoe")]
    layered = tmp_path / "a" / "run"
    layered_plan = ompmoe.PruningPlan.load(layered / "plan.json")
    record = layered_plan.extra["compensation"]
    assert record["fitted"] == "down" and record["checked"] == "held-out calibration loss"
    assert lines[0].startswith(f"ompmoe: method {layered_plan.method}, allocation {layered_plan.allocation}, "
                               f"compensation {record['granularity']}, risk_weight 3, min_kept_fraction 0.375, "
                               "max_kept_fraction 0.875, zeta 1e-06 (method and allocation 'auto': chose ")
    assert lines[1] == f"ompmoe: {ompmoe.kept_summary(layered_plan)}"  # the whole of what the run says
    assert re.fullmatch(r"ompmoe: auto's trial of its settings ran layer by layer in one more pass over the layers: "
                        r"\d+\.\d s", lines[2])
    assert lines[3].startswith("ompmoe: compensation and its check and held-out perplexity ran layer by layer in "
                               "one more pass over the layers: ") and lines[3].endswith(" s)")
    assert lines[4].startswith(f"ompmoe: compensation ({record['granularity']}")
    assert lines[5].startswith("ompmoe: held-out perplexity on 512 tokens per set, original -> pruned: heldout:prose ")
    assert "(paper's setting " in lines[5] if record["applied"] else "(paper's setting" not in lines[5]
    assert lines[6:] == [f"ompmoe: wrote statistics, plan and pruned model to {layered}"]
    assert layered_plan.extra["calibration"] == {"mode": "layer by layer"}
    saved = ompmoe.load_pruned(layered / "model").config.ompmoe
    assert saved["plan"]["calibration_mode"] == "layer by layer"
    assert (saved.get("compensation") is not None) == record["applied"]
    assert "| Calibration mode | layer by layer " in (layered / "model" / "README.md").read_text()

    # ompmoe prune on its statistics refits and measures layer by layer too, as the fit did (the model is never
    # loaded): the plans, the lines and the checkpoints of the resident prune (--layer_by_layer false); the original's
    # perplexity is measured in the first ratio's pass only (it does not depend on the plan)
    from unittest import mock

    from ompmoe.engine.run import PruningRun

    capsys.readouterr()
    prune = ["prune", "--stats", str(layered / "stats.safetensors"), "--model", "shipped:tiny-moe", "--ratio",
             "0.25,0.5"]
    measure, known, scratches = PruningRun.measure_from_files, [], []

    def measure_from_files(run, *args, original=None, **kwargs):
        known.append(dict(original or {}))
        scratches.append(args[6].parent.name)  # where the ratio's per-layer corrections are kept
        return measure(run, *args, original=original, **kwargs)

    with mock.patch("ompmoe.lightning.models.load_model", side_effect=AssertionError("the model was loaded")), \
            mock.patch.object(PruningRun, "measure_from_files", measure_from_files):
        main([*prune, "--output_dir", str(tmp_path / "files")])
    from_files = capsys.readouterr().out.splitlines()
    # the corrections' scratch is inside the output's temporary (a killed run's goes with it), and gone
    assert len(scratches) == 2 and all(re.fullmatch(r"\.files\.[A-Za-z0-9-]+-\d+\.[a-f0-9]+\.tmp", name)
                                       for name in scratches), scratches
    assert not list(tmp_path.rglob(".ompmoe-compensation-*"))
    main([*prune, "--output_dir", str(tmp_path / "loaded"), "--layer_by_layer", "false"])
    loaded = capsys.readouterr().out.splitlines()
    passes = [line for line in from_files if " ran layer by layer " in line]
    assert [line.split(": ")[0] for line in passes] == ["ratio 0.25", "ratio 0.5"]
    assert all(line.split(": ", 1)[1].startswith("compensation and its check and held-out perplexity ran layer by "
                                                 "layer in one pass over the layers: ") for line in passes)
    heldout = [line for line in loaded if line.startswith("ratio 0.25: held-out perplexity")][0]
    original = dict(re.findall(r"(heldout:\w+) ([\d.]+) -> ", heldout))  # the resident prune's
    assert known[0] == {} and known[1].keys() == original.keys() == {"heldout:prose", "heldout:code"}
    assert all(f"{value:.2f}" == original[name] for name, value in known[1].items())
    from_files = [line for line in from_files if line not in passes]
    assert len(from_files) == len(loaded) == 7  # settings; per ratio: compensation, held-out, written
    assert from_files[:-4] + from_files[-3:-1] == loaded[:-4] + loaded[-3:-1]
    for ratio, ours, theirs in (("0.25", from_files[-4], loaded[-4]), ("0.5", from_files[-1], loaded[-1])):
        assert ours.removesuffix(f"{tmp_path / 'files' / f'model-{ratio}'}") == theirs.removesuffix(
            f"{tmp_path / 'loaded' / f'model-{ratio}'}")
        assert ompmoe.PruningPlan.load(tmp_path / "files" / f"plan-{ratio}.json") == ompmoe.PruningPlan.load(
            tmp_path / "loaded" / f"plan-{ratio}.json")  # its compensation record (fit, check), held-out record
        assert_same_checkpoint(tmp_path / "loaded" / f"model-{ratio}", tmp_path / "files" / f"model-{ratio}")

    caplog.clear()
    config = tiny_config(tmp_path / "b")  # --compensation: the short option for the callback's compensation
    main(["fit", "-c", str(config), "--trainer.enable_progress_bar=false", "--layer_by_layer", "true",
          "--compensation", "off"])
    layered_lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("ompmoe")]
    caplog.clear()
    main(["fit", "-c", str(tiny_config(tmp_path / "c")), "--trainer.enable_progress_bar=false", "--compensation",
          "off"])
    resident_lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("ompmoe")]
    layered, resident = tmp_path / "b" / "run", tmp_path / "c" / "run"
    assert [line for line in layered_lines if " layer by layer " not in line] == [
        line.replace(str(resident), str(layered)) for line in resident_lines]  # the trial's losses, to 4 decimals
    assert lines[0] == resident_lines[0].replace("compensation off", f"compensation {record['granularity']}")
    assert_same_statistics(ompmoe.MoEStats.load(resident / "stats.safetensors"),
                           ompmoe.MoEStats.load(layered / "stats.safetensors"))
    plan = ompmoe.PruningPlan.load(layered / "plan.json")
    assert plan.kept_by_layer() == ompmoe.PruningPlan.load(resident / "plan.json").kept_by_layer()
    assert plan.kept_by_layer() == layered_plan.kept_by_layer() and "compensation" not in plan.extra
    model = ompmoe.load_pruned(shipped_model_path(), dtype="auto")
    ompmoe.save_pruned(ompmoe.prune(model, plan), tmp_path / "expected", tokenizer=str(shipped_model_path()))
    assert file_tensors(layered / "model").keys() == file_tensors(tmp_path / "expected").keys()
    assert all(torch.equal(tensor, file_tensors(tmp_path / "expected")[name])
               for name, tensor in file_tensors(layered / "model").items())
    main(["prune", "--stats", str(layered / "stats.safetensors"), "--model", "shipped:tiny-moe", "--ratio", "0.25",
          "--output_dir", str(tmp_path / "pruned"), "--quiet"])
    plan = ompmoe.PruningPlan.load(tmp_path / "pruned" / "plan-0.25.json")
    ompmoe.save_pruned(ompmoe.prune(ompmoe.load_pruned(shipped_model_path(), dtype="auto"), plan),
                       tmp_path / "expected-0.25", tokenizer=str(shipped_model_path()))
    assert_same_checkpoint(tmp_path / "expected-0.25", tmp_path / "pruned" / "model-0.25")


@pytest.mark.parametrize(("options", "message"), [
    (dict(dtype="float32"), "layer_by_layer writes the checkpoint's tensors as its files store them; got "
                            "dtype='float32'. Remove dtype (save_dtype), or calibrate resident."),
])
def test_run_options_refuse_what_needs_the_whole_model_before_any_work(options, message):
    with pytest.raises(ValueError) as refused:
        ompmoe.RunOptions(layer_by_layer=True, **options)
    assert str(refused.value) == message


@pytest.mark.parametrize(("options", "message"), [
    (["--layer_by_layer", "true"], "--layer_by_layer reads the model's files: give --model (plans alone hold no "
                                   "weights)"),
    (["--layer_by_layer", "true", "--model", "tiny:qwen3_moe"],
     "--layer_by_layer reads the model's safetensors files, and tiny:qwen3_moe has none (it is built in memory); "
     "pass --layer_by_layer false."),
    (["--layer_by_layer", "true", "--model", "shipped:tiny-moe", "--dtype", "float32"],
     "--layer_by_layer writes the checkpoint's tensors as its files store them; got --dtype float32. Remove --dtype, "
     "or pass --layer_by_layer false to load the model."),
])
def test_prune_refuses_layer_by_layer_where_there_are_no_files_to_read_before_any_work(options, message, tmp_path,
                                                                                         capsys):
    from ompmoe.cli import main

    stats = ompmoe.collect_stats(tiny_model("qwen3_moe"), BLOCKS, progress=False).save(tmp_path / "stats.safetensors")
    with pytest.raises(SystemExit) as exit_info:
        main(["prune", "--stats", str(stats), "--ratio", "0.5", "--output_dir", str(tmp_path / "out"), *options])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    assert not (tmp_path / "out").exists()


def test_a_tiny_model_has_no_files_to_read_layer_by_layer():
    from ompmoe.lightning.layer_by_layer import local_checkpoint

    with pytest.raises(ValueError) as refused:
        local_checkpoint("tiny:qwen3_moe")
    assert str(refused.value) == (
        "layer_by_layer reads the model's safetensors files, and tiny:qwen3_moe has none (it is built in memory); "
        "save it with save_pretrained and pass that directory, or calibrate resident.")


def test_a_loop_that_holds_the_model_is_refused_layer_by_layer():
    """Fabric, a script or the callback on a user's own module hold a loaded model: layer_by_layer is refused at the
    run's start, before any batch, in the run itself (one place for every front door)."""
    run = ompmoe.PruningRun(owner="FabricCalibration", layer_by_layer=True)
    with pytest.raises(ValueError) as refused:
        run.start(tiny_model("qwen3_moe"), ompmoe.LocalContext())
    assert str(refused.value) == (
        "FabricCalibration(layer_by_layer=True) calibrates a model built without weights, one layer read from its "
        "files at a time (ompmoe fit --layer_by_layer true, or PruningRun.collect_layer_by_layer on "
        "ompmoe.engine.lazy_checkpoint.build_skeleton); this model holds its weights: calibrate it resident "
        "(layer_by_layer=False).")


def test_a_non_uniform_pruned_checkpoint_is_refused_layer_by_layer_by_every_front_door(tmp_path, capsys):
    """A skeleton cannot read a checkpoint whose layers keep different expert counts: the fit said only that a file
    "holds 6 tensors ... which has 9 experts"; the fit and ompmoe prune now say why and what to do, before any work."""
    from ompmoe.cli import main
    from ompmoe.engine.export.config import non_uniform_config
    from ompmoe.lightning.layer_by_layer import layer_by_layer_checkpoint

    model = tiny_model("qwen3_moe")
    stats = ompmoe.collect_stats(model, BLOCKS, progress=False)
    plan = ompmoe.plan_pruning(stats, 0.5)
    assert len({layer.num_kept for layer in plan.layers}) > 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ompmoe.save_pruned(ompmoe.prune(model, plan), tmp_path / "pruned")
    assert non_uniform_config(tmp_path / "pruned") is not None
    with pytest.raises(ValueError) as refused:
        layer_by_layer_checkpoint(str(tmp_path / "pruned"))
    assert str(refused.value) == (
        f"layer_by_layer reads {tmp_path / 'pruned'} one decoder layer at a time, but its MoE layers keep different "
        "numbers of experts (a non-uniform pruned checkpoint); calibrate it resident (layer_by_layer false).")
    saved = stats.save(tmp_path / "stats.safetensors")
    with pytest.raises(SystemExit):
        main(["prune", "--stats", str(saved), "--ratio", "0.25", "--output_dir", str(tmp_path / "out"), "--model",
              str(tmp_path / "pruned"), "--layer_by_layer", "true"])
    assert capsys.readouterr().err == (
        f"error: --layer_by_layer reads {tmp_path / 'pruned'} one decoder layer at a time, but its MoE layers keep "
        "different numbers of experts (a non-uniform pruned checkpoint); pass --layer_by_layer false to load it.\n")
    import lightning.pytorch as pl

    from ompmoe.callbacks import ExpertPruning

    with pytest.raises(ValueError, match="non-uniform pruned checkpoint"):
        run_fit = ExpertPruning(layer_by_layer=True, output_dir=str(tmp_path / "run"))
        pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, callbacks=[run_fit]).fit(
            ompmoe.CalibrationModule(str(tmp_path / "pruned")), [BLOCKS[0]])
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


def test_a_layer_that_changes_its_input_in_place_is_refused_before_the_backward(tmp_path, monkeypatch):
    """On the CPU the input kept for the backward down the layers is the very tensor the layer takes: a layer that
    wrote to it would be recomputed from what it wrote. Its version counter tells, and the run stops there."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from ompmoe.engine.collect.collector import StatisticsCollector
    from ompmoe.engine.collect.layerwise import collect_layerwise
    from ompmoe.engine.lazy_checkpoint import build_skeleton, checkpoint_config

    tiny_model("qwen3_moe").save_pretrained(tmp_path / "source")
    forward = modeling_qwen3_moe.Qwen3MoeDecoderLayer.forward

    def in_place(self, hidden_states, *args, **kwargs):
        hidden_states.mul_(1.0)  # the same values: only the version counter shows it
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeDecoderLayer, "forward", in_place)
    for statistics, refused in ((["loss_aware"], True), ([], False)):  # nothing kept, nothing to refuse
        collector = StatisticsCollector(build_skeleton(checkpoint_config(tmp_path / "source"), dtype=torch.float32),
                                        statistics=statistics)
        if not refused:
            collect_layerwise(collector, tmp_path / "source", BLOCKS, progress=False)
            continue
        with pytest.raises(LayerwiseUnsupportedError) as error:
            collect_layerwise(collector, tmp_path / "source", BLOCKS, progress=False)
        assert str(error.value) == (  # the first layer whose input is kept: the first with a MoE block (0 is dense)
            "Qwen3MoeDecoderLayer (decoder layer 1) changes its input in place, and the backward down the layers "
            "recomputes each layer from its input as the forward sweep kept it. Calibrate it resident instead.")
