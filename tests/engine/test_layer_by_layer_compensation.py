"""Compensation, its check and held-out perplexity of a model bigger than memory, one decoder layer at a time
(``ompmoe.engine.apply.layer_by_layer``): the same correction, the same choice and the same perplexities as the
resident run's (the literal: ``fit_compensation``, ``pruned_view``, ``perplexity`` on the loaded model), and a
checkpoint written from the files with the correction folded in equal to ``save_pruned`` of the compensated model."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

import ompmoe
from ompmoe.engine.apply.compensation import CompensationError
from ompmoe.engine.apply.compensation_step import fit_compensation
from ompmoe.engine.apply.layer_by_layer import choose_plan_layer_by_layer, measure_layer_by_layer
from ompmoe.engine.apply.plan_choice import choose_plan, kept_key
from ompmoe.engine.apply.trial import pruned_view
from ompmoe.engine.export.streamed import save_pruned_from_files
from ompmoe.engine.lazy_checkpoint import build_skeleton, checkpoint_dtype
from ompmoe.engine.export.config import load_stock_config
from ompmoe.engine.perplexity import perplexity
from ompmoe.engine.names import shipped_model_path
from ompmoe.engine.tiny import tiny_model

from test_layerwise import NOT_LAYER_BY_LAYER, SUPPORTED, assert_same_checkpoint, file_tensors

TEXT = torch.randint(3, 250, (8, 16), generator=torch.Generator().manual_seed(1))
CHECK = torch.randint(3, 250, (4, 16), generator=torch.Generator().manual_seed(2))
HELDOUT = {"heldout:a": torch.randint(3, 250, (4, 16), generator=torch.Generator().manual_seed(3)),
           "heldout:b": torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(4))}


def skeleton(path):
    config = load_stock_config(path)
    return build_skeleton(config, dtype=checkpoint_dtype(config))


def saved_tiny(model_type: str, directory: Path) -> tuple[torch.nn.Module, ompmoe.MoEStats]:
    """A tiny model saved in ``directory / "source"``, and its resident statistics on :data:`TEXT`; the scratch
    directory ``directory / "scratch"`` made."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(model_type)
        model.save_pretrained(directory / "source")
    (directory / "scratch").mkdir()
    return model, ompmoe.collect_stats(model, TEXT.split(4), model_id=str(directory / "source"), progress=False)


def assert_same_record(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        if isinstance(value, float):
            assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
        elif isinstance(value, dict):
            assert ours[key].keys() == value.keys(), key
            for name, each in value.items():
                assert ours[key][name] == pytest.approx(each, rel=1e-5, abs=1e-9), (key, name)
        else:
            assert ours[key] == value, key


@pytest.mark.parametrize(("model_type", "granularity", "checked"), [
    ("qwen3_moe", "down", True), ("qwen3_moe", "down", False), ("gpt_oss", "down", True),
    ("deepseek_v3", "linear", True), ("mixtral", "expert", False), ("qwen3_moe", None, False)])
def test_the_layer_by_layer_pass_equals_the_resident_fit_check_and_perplexity(model_type, granularity, checked,
                                                                              tmp_path):
    model, stats = saved_tiny(model_type, tmp_path)
    plan = ompmoe.plan_pruning(stats, 0.5, method="reap")
    paper = ompmoe.plan_pruning(stats, 0.5)
    check = CHECK if checked else None
    measured = measure_layer_by_layer(tmp_path / "source", skeleton(tmp_path / "source"), plan, tmp_path / "scratch",
                                      granularity=granularity, text=TEXT, batch_size=4, check_blocks=check,
                                      unchecked="applied as asked", heldout=HELDOUT, paper=paper, progress=False)
    original = {name: perplexity(model, blocks, 4) for name, blocks in HELDOUT.items()}
    with pruned_view(model, paper):
        paper_ppl = {name: perplexity(model, blocks, 4) for name, blocks in HELDOUT.items()}
    compensation = None
    if granularity is not None:
        compensation, record = fit_compensation(model, plan, TEXT, 4, granularity, check, None, "applied as asked")
        assert_same_record(measured.record, record)
        assert (measured.compensation is None) == (compensation is None)
    pruned = ompmoe.prune(model, plan)
    if compensation is not None:
        compensation.apply(pruned)
    for name, blocks in HELDOUT.items():
        assert measured.heldout[name] == pytest.approx((original[name], perplexity(pruned, blocks, 4)), rel=1e-5)
        assert measured.paper[name] == pytest.approx(paper_ppl[name], rel=1e-5)
    if compensation is None:
        return
    ompmoe.save_pruned(pruned, tmp_path / "resident")
    save_pruned_from_files(tmp_path / "source", plan, tmp_path / "streamed", compensation=measured.compensation)
    ours, theirs = file_tensors(tmp_path / "streamed"), file_tensors(tmp_path / "resident")
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


TRIAL_TYPES = ["qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "mixtral", "zaya", "glm_moe_dsa", "qwen3_vl_moe",
               "llama4_text"]
"""Layouts for the trial: softmax and grouped sigmoid routers, a dense first layer, shared experts, biased and
transposed experts, a float and an integer carried state, a multimodal container, routing weights on the experts' input
(all of them ran it alike)."""


@pytest.mark.parametrize("model_type", TRIAL_TYPES)
def test_the_layer_by_layer_trial_of_plans_equals_choose_plan(model_type, tmp_path, monkeypatch):
    """``auto``'s trial one decoder layer at a time: the same losses (to float rounding) and choice as the resident
    ``choose_plan``; candidates keeping the same experts run once (one stream each)."""
    import ompmoe.engine.apply.layer_by_layer as layer_by_layer

    model, stats = saved_tiny(model_type, tmp_path)
    candidates = [ompmoe.plan_pruning(stats, 0.5, method=method, allocation=allocation)
                  for method, allocation in (("omp", "waterfill"), ("reap", "uniform"), ("omp", "waterfill"),
                                             ("frequency", "uniform"))]
    candidates[2] = dataclasses.replace(candidates[2], method="omp_normalized")  # the same experts, another name
    streams, add = [], layer_by_layer.LayerMajor.add
    monkeypatch.setattr(layer_by_layer.LayerMajor, "add",
                        lambda passes, name, batches: (streams.append(name), add(passes, name, batches))[1])
    ours = choose_plan_layer_by_layer(tmp_path / "source", skeleton(tmp_path / "source"), candidates, CHECK, 3)
    theirs = choose_plan(model, candidates, CHECK, 3)
    assert streams == [f"trial/{i}" for i in range(len({kept_key(plan) for plan in candidates}))]
    assert list(ours.losses) == list(theirs.losses) and ours.index == theirs.index and ours.plan is theirs.plan
    assert ours.losses == {name: pytest.approx(loss, rel=1e-6) for name, loss in theirs.losses.items()}


def test_the_streamed_writer_folds_a_compensation_bit_for_bit(tmp_path):
    """Given the same fitted compensation, the checkpoint written from the files is the one ``save_pruned`` writes of
    the pruned and compensated model: tensors, config (its compensation record) and files; the down projections
    differ from the uncompensated checkpoint's."""
    tokenizer = str(shipped_model_path())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
        model.save_pretrained(tmp_path / "source")
        stats = ompmoe.collect_stats(model, TEXT.split(4), model_id=str(tmp_path / "source"), progress=False)
        plan = ompmoe.plan_pruning(stats, 0.5)
        save_pruned_from_files(tmp_path / "source", plan, tmp_path / "plain", tokenizer=tokenizer)
        for granularity in ("linear", "down"):
            compensation, _ = fit_compensation(model, plan, TEXT, 4, granularity)
            pruned = ompmoe.prune(tiny_model("qwen3_moe", dtype=torch.bfloat16), plan)
            ompmoe.save_pruned(compensation.apply(pruned), tmp_path / f"resident-{granularity}", tokenizer=tokenizer)
            save_pruned_from_files(tmp_path / "source", plan, tmp_path / f"streamed-{granularity}",
                                   tokenizer=tokenizer, compensation=compensation)
            assert_same_checkpoint(tmp_path / f"resident-{granularity}", tmp_path / f"streamed-{granularity}")
            plain, ours = file_tensors(tmp_path / "plain"), file_tensors(tmp_path / f"streamed-{granularity}")
            changed = sorted(name for name in ours if not torch.equal(ours[name], plain[name]))
            assert changed and all("down_proj" in name for name in changed), changed


def test_a_layer_by_layer_run_fits_checks_measures_and_writes_what_the_resident_literal_gives(tmp_path):
    """``PruningRun(layer_by_layer=True)`` with ``auto``: its trial of auto's settings (from loss-aware statistics,
    whose backward runs down the layers) is the resident ``choose_plan``'s, its compensation
    record the literal ``fit_compensation`` (refit and map fitted, checked on the choice blocks), its held-out figures
    the literal perplexities, its written checkpoint ``save_pruned`` of the literal prune + apply; its lines say it."""
    from types import SimpleNamespace

    source = tmp_path / "source"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model("qwen3_moe")
        model.save_pretrained(source)
    data = SimpleNamespace(choice_blocks=lambda n=None: CHECK, heldout_blocks=lambda name, n: HELDOUT[name])
    auto = ompmoe.PruningStrategy(ratio=0.5, method="auto", allocation="auto", min_kept_fraction=0.25)
    run = ompmoe.PruningRun(ompmoe.RunOptions(strategy=auto, plots=False, evaluate_on=list(HELDOUT),
                                              layer_by_layer=True, output_dir=str(tmp_path / "run"),
                                              adaptive_epsilon=0.1,
                                              tokenizer=str(shipped_model_path())))
    lines: list[str] = []
    context = ompmoe.LocalContext(print=lines.append)
    run.check_output(context)
    run.start(skeleton(source), context, model_id=str(source), data=data)
    run.collect_layer_by_layer(source, TEXT.split(4), show_progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.finish(context)

    stats = ompmoe.collect_stats(model, TEXT.split(4), model_id=str(source), progress=False, loss_aware=True)
    choice = choose_plan(model, auto.candidates(stats), CHECK, 4)  # the resident trial of auto's settings
    assert run.choice.index == choice.index and list(run.choice.losses) == list(choice.losses)
    assert run.choice.losses == {name: pytest.approx(loss, rel=1e-6) for name, loss in choice.losses.items()}
    plan = choice.plan
    assert run.plan.kept_by_layer() == plan.kept_by_layer()
    compensation, record = fit_compensation(model, plan, TEXT, 4, "down", CHECK, None, "")
    ours = dict(run.plan.extra["compensation"])
    assert ours.keys() == record.keys()
    assert_same_record(ours, record)
    assert (run.compensation is None) == (compensation is None)
    original = {name: perplexity(model, blocks, 4) for name, blocks in HELDOUT.items()}
    with pruned_view(model, ompmoe.PruningStrategy(ratio=0.5, method="omp", allocation="waterfill",
                                                   min_kept_fraction=0.25).plan(stats)):
        paper = {name: perplexity(model, blocks, 4) for name, blocks in HELDOUT.items()}
    pruned = ompmoe.prune(model, plan)
    if compensation is not None:
        compensation.apply(pruned)
    for name, blocks in HELDOUT.items():
        assert run.heldout_perplexity[name] == pytest.approx((original[name], perplexity(pruned, blocks, 4)), rel=1e-5)
    measured_against_paper = compensation is not None or (plan.method, plan.allocation) != ("omp", "waterfill")
    assert run.heldout_paper == ({name: pytest.approx(value, rel=1e-5) for name, value in paper.items()}
                                 if measured_against_paper else {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ompmoe.save_pruned(pruned, tmp_path / "expected", tokenizer=str(shipped_model_path()))
    written, expected = file_tensors(tmp_path / "run" / "model"), file_tensors(tmp_path / "expected")
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(written[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    saved = ompmoe.load_pruned(tmp_path / "run" / "model").config.ompmoe
    assert (saved.get("compensation") is not None) == (compensation is not None)
    if compensation is not None:  # config.json states the held-out check the correction passed, as a resident run's
        assert saved["compensation"]["checked"] == record["checked"]
        assert saved["compensation"]["check_blocks"] == record["check_blocks"]
        assert saved["compensation"]["loss_with"] == pytest.approx(record["loss_with"], rel=1e-5)
    assert saved["plan"]["calibration_mode"] == "layer by layer"
    assert lines[2].startswith("ompmoe: auto's trial of its settings ran layer by layer in one more pass over the "
                               "layers: ")
    assert lines[3].startswith("ompmoe: compensation and its check and held-out perplexity ran layer by layer in one "
                               "more pass over the layers: ")
    assert lines[3].endswith("; the pruned perplexity is without OMP-MoE+'s per-token skipping (adaptive_epsilon "
                             "switches it on in the written model; measure that resident or with ompmoe validate)")
    assert lines[4].startswith(f"ompmoe: compensation ({record['granularity']}")
    assert lines[5].startswith("ompmoe: held-out perplexity on 32 tokens per set, original -> pruned: heldout:a ")


def test_a_run_without_compensation_or_heldout_makes_no_second_pass(tmp_path, monkeypatch):
    """Compensation off and nothing to measure: the checkpoint is read twice only (calibration, write)."""
    import ompmoe.engine.run as run_module

    source = tmp_path / "source"
    tiny_model("qwen3_moe").save_pretrained(source)
    monkeypatch.setattr(run_module, "measure_layer_by_layer", None)  # any call would fail
    run = ompmoe.PruningRun(ompmoe.RunOptions(layer_by_layer=True, compensation="off", plots=False))
    lines: list[str] = []
    context = ompmoe.LocalContext(print=lines.append)
    run.start(skeleton(source), context, model_id=str(source))
    run.collect_layer_by_layer(source, TEXT.split(4), show_progress=False)
    run.finish(context)
    assert "compensation" not in run.plan.extra and not any("one more pass" in line for line in lines)


SLOW = {"kimi_linear", "nemotron_h"}
"""Left out of the matrix for time only: their reference kernels take 10 to 30 s per fit on 2 CPU cores."""


@pytest.mark.parametrize("model_type", [t for t in SUPPORTED if t not in {*NOT_LAYER_BY_LAYER, *SLOW}])
def test_the_layer_by_layer_refit_its_check_and_perplexity_equal_the_residents_on_every_architecture(model_type,
                                                                                                     tmp_path):
    model, stats = saved_tiny(model_type, tmp_path)
    plan = ompmoe.plan_pruning(stats, 0.5)
    if getattr(ompmoe.find_moe_layers(model)[0].experts, "has_post_expert_norm", False):  # MuseSpark: no fit anywhere
        with pytest.raises(CompensationError, match="normalizes each expert's output after its down projection"):
            measure_layer_by_layer(tmp_path / "source", skeleton(tmp_path / "source"), plan, tmp_path / "scratch",
                                   granularity="down", text=TEXT, batch_size=4, progress=False)
        with pytest.raises(CompensationError, match="normalizes each expert's output after its down projection"):
            fit_compensation(model, plan, TEXT, 4, "down", CHECK)
        return
    measured = measure_layer_by_layer(tmp_path / "source", skeleton(tmp_path / "source"), plan, tmp_path / "scratch",
                                      granularity="down", text=TEXT, batch_size=4, check_blocks=CHECK,
                                      heldout=HELDOUT, paper=plan, progress=False)
    compensation, record = fit_compensation(model, plan, TEXT, 4, "down", CHECK)
    assert_same_record(measured.record, record)
    original = {name: perplexity(model, blocks, 4) for name, blocks in HELDOUT.items()}
    pruned = ompmoe.prune(model, plan)
    if compensation is not None:
        compensation.apply(pruned)
    assert measured.heldout == {name: pytest.approx((original[name], perplexity(pruned, blocks, 4)), rel=1e-5)
                                for name, blocks in HELDOUT.items()}


def test_a_granularity_named_outright_is_fitted_layer_by_layer_and_applied_as_asked(tmp_path):
    source = tmp_path / "source"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model("qwen3_moe")
        model.save_pretrained(source)
    run = ompmoe.PruningRun(ompmoe.RunOptions(layer_by_layer=True, compensation="expert", plots=False))
    context = ompmoe.LocalContext(print=lambda line: None)
    run.start(skeleton(source), context, model_id=str(source))
    run.collect_layer_by_layer(source, TEXT.split(4), show_progress=False)
    run.finish(context)
    _, record = fit_compensation(model, run.plan, TEXT, 4, "expert", None, None,
                                 "applied as asked (compensation='expert')")
    assert_same_record(run.plan.extra["compensation"], record)
    assert run.compensation is not None and list(run.compensation.scales) == [
        layer.name for layer in ompmoe.find_moe_layers(model)]


def test_the_writer_refuses_a_compensation_fitted_for_another_plan_before_writing(tmp_path):
    """Another plan keeping as many experts per layer would fold rows into the wrong experts without a word."""
    model, stats = saved_tiny("qwen3_moe", tmp_path)
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="uniform")
    other = ompmoe.plan_pruning(stats, 0.5, allocation="uniform", method="random", method_options={"seed": 5})
    assert [layer.num_kept for layer in other.layers] == [layer.num_kept for layer in plan.layers]
    assert other.kept_by_layer() != plan.kept_by_layer()
    compensation, _ = fit_compensation(model, other, TEXT, 4, "expert")
    name = next(layer.name for layer, mine in zip(other.layers, plan.layers) if sorted(layer.kept) != sorted(mine.kept))
    with pytest.raises(ompmoe.CompensationError) as error:
        save_pruned_from_files(tmp_path / "source", plan, tmp_path / "out", compensation=compensation)
    theirs = sorted(int(i) for i in dict(other.kept_by_layer())[name])
    mine = sorted(int(i) for i in dict(plan.kept_by_layer())[name])
    assert str(error.value) == (f"The correction of {name} was fitted for kept experts {theirs} but the model keeps "
                                f"{mine}; fit it with the plan the model was pruned with.")
    assert not (tmp_path / "out").exists()


def test_a_correction_read_after_its_scratch_directory_is_gone_names_the_lifetime(tmp_path):
    from ompmoe.engine.apply.layer_by_layer import LayerStore

    store = LayerStore(tmp_path / "scratch")
    (tmp_path / "scratch").mkdir()
    store.put("model.layers.0.mlp", {"scale": torch.ones(3)})
    assert torch.equal(store.get("model.layers.0.mlp")["scale"], torch.ones(3))
    (tmp_path / "scratch" / "00000.safetensors").unlink()
    (tmp_path / "scratch").rmdir()
    with pytest.raises(FileNotFoundError) as error:
        store.get("model.layers.0.mlp")
    assert str(error.value) == (
        f"The layer-by-layer correction of model.layers.0.mlp was kept in {tmp_path / 'scratch'}, which no longer "
        "exists: a run's scratch directory is removed when the run ends. Write the model within the run (output_dir), "
        "or keep the directory given to measure_layer_by_layer until save_pruned_from_files returns.")


def test_a_pass_given_the_originals_perplexity_runs_no_original_stream_and_measures_the_same(tmp_path, monkeypatch):
    """``ompmoe prune`` at several ratios measures the unpruned model once: a later plan's pass given those figures
    runs none of its streams and gives the same measures as a pass that runs them."""
    import ompmoe.engine.apply.layer_by_layer as layer_by_layer

    _, stats = saved_tiny("qwen3_moe", tmp_path)
    streams: list[str] = []
    add = layer_by_layer.LayerMajor.add

    def spy(passes, name, batches):
        streams.append(name)
        return add(passes, name, batches)

    monkeypatch.setattr(layer_by_layer.LayerMajor, "add", spy)
    plan = ompmoe.plan_pruning(stats, 0.5)
    measures = []
    for original in (None, {"heldout:a": 1.5}):
        streams.clear()
        measures.append(measure_layer_by_layer(tmp_path / "source", skeleton(tmp_path / "source"), plan,
                                               tmp_path / "scratch", granularity="linear", text=TEXT, batch_size=4,
                                               check_blocks=CHECK, heldout=HELDOUT, original=original,
                                               progress=False))
        assert [name for name in streams if name.startswith("original/")] == (
            ["original/heldout:a", "original/heldout:b"] if original is None else ["original/heldout:b"])
    first, second = measures
    assert second.heldout == {"heldout:a": (1.5, first.heldout["heldout:a"][1]), "heldout:b": first.heldout["heldout:b"]}
    assert second.record == first.record
