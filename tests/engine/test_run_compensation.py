"""Compensation as a step of the run: fitted once in ``PruningRun.finish`` for every front door, checked against the
literal calls it stands for (``compensate`` before ``prune``, ``apply`` after), recorded in the plan and the card."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import ompmoe
from ompmoe.engine.collect.collector import StatisticsCollector
from ompmoe.engine.apply.compensation import CompensationError, compensate, compensated_view, fitting_tokens
from ompmoe.engine.perplexity import perplexity
from ompmoe.engine.apply.compensation_step import compensation_line, fit_compensation, fitting_text
from ompmoe.engine.apply.down_refit import DOWN_ALPHAS, compensate_down, down_fitting_tokens, refit_down
from ompmoe.engine.tiny import tiny_model
from ompmoe.engine.apply.trial import pruned_view

MODEL_TYPE = "qwen3_moe"


def token_blocks(count: int, seq_len: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 200, (count, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def blocks() -> torch.Tensor:
    return token_blocks(16)


@pytest.fixture(scope="module")
def choice() -> torch.Tensor:
    return token_blocks(4, seed=1)


def run_once(blocks: torch.Tensor, choice: torch.Tensor | None, **options):
    """A whole ``PruningRun`` on a tiny model, as the demo's loop drives it; returns (run, pruned model, original)."""
    model = tiny_model(MODEL_TYPE)
    original = copy.deepcopy(model)
    data = SimpleNamespace(choice_blocks=lambda n=None: choice) if choice is not None else None
    options.setdefault("strategy", ompmoe.PruningStrategy(ratio=0.5, min_kept_fraction=0.25))
    run = ompmoe.PruningRun(ompmoe.RunOptions(plots=False, **options))
    context = ompmoe.LocalContext(print=lambda line: None)
    run.start(model, context, model_id=f"tiny:{MODEL_TYPE}", data=data)
    run.collect(blocks.split(4))
    run.finish(context)
    return run, model, original


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def literal(original: torch.nn.Module, plan, blocks: torch.Tensor, granularity: str = "linear") -> torch.nn.Module:
    """What the run stands for: compensate on the unpruned model (a quarter of the calibration tokens at most),
    prune, apply."""
    model = copy.deepcopy(original)
    if granularity == "down":
        compensation = compensate_down(model, plan, blocks)
    else:
        compensation = compensate(model, plan, blocks, 4, granularity=granularity,
                                  max_tokens=fitting_tokens(model, blocks.numel()))
    ompmoe.prune(model, plan)
    return compensation.apply(model)


def test_auto_fits_the_down_refit_and_the_pruned_model_is_the_literal_refit_prune_apply(blocks, choice):
    auto = ompmoe.PruningStrategy(ratio=0.5, method="auto", allocation="auto", min_kept_fraction=0.25)
    run, model, original = run_once(blocks, choice, strategy=auto)
    record = run.plan.extra["compensation"]
    # the trial's loss of the chosen plan is reused; each candidate's loss is the literal view's
    assert record["loss_without"] == run.choice.losses[f"{run.plan.method} + {run.plan.allocation}"]
    linear, refits = refit_down(copy.deepcopy(original), run.plan, blocks,
                                max_tokens=down_fitting_tokens(original, blocks.numel()), alphas=DOWN_ALPHAS)
    candidates = {"linear": linear, **{f"down, alpha {alpha:g}": refit for alpha, refit in refits.items()}}
    assert list(record["tried"]) == list(candidates)
    for name, candidate in candidates.items():
        with compensated_view(original, run.plan, candidate):
            assert record["tried"][name] == pytest.approx(math.log(perplexity(original, choice, 4)), abs=1e-6)
    best = min(record["tried"], key=record["tried"].__getitem__)
    assert record["loss_with"] == pytest.approx(record["tried"][best], abs=1e-6)
    assert record["granularity"] == ("linear" if best == "linear" else "down")
    assert record["applied"] == (record["loss_with"] < record["loss_without"] + 0.02) and record["tolerance"] == 0.02
    assert record["num_tokens"] == blocks.numel()  # every calibration token
    expected = ompmoe.prune(copy.deepcopy(original), run.plan)
    if record["applied"]:
        candidates[best].apply(expected)
    torch.testing.assert_close(logits(model, blocks[:2]), logits(expected, blocks[:2]), rtol=0, atol=0)
    assert (model.config.ompmoe.get("compensation") is not None) == record["applied"]


def test_a_method_named_outright_is_left_as_the_paper_prunes_it(blocks, choice):
    run, model, original = run_once(blocks, choice)  # method omp, compensation auto
    assert "compensation" not in run.plan.extra and run.compensation is None
    expected = ompmoe.prune(copy.deepcopy(original), run.plan)
    torch.testing.assert_close(logits(model, blocks[:2]), logits(expected, blocks[:2]), rtol=0, atol=0)
    assert "compensation" not in model.config.ompmoe


@pytest.mark.parametrize("granularity", ["layer", "linear", "down"])
def test_a_named_granularity_is_fitted_for_any_method_and_always_applied(blocks, granularity):
    run, model, original = run_once(blocks, None, compensation=granularity)
    record = run.plan.extra["compensation"]
    assert record["applied"] and record["checked"] == f"applied as asked (compensation={granularity!r})"
    assert "loss_with" not in record
    expected = literal(original, run.plan, blocks, granularity)
    torch.testing.assert_close(logits(model, blocks[:2]), logits(expected, blocks[:2]), rtol=0, atol=0)


def test_off_leaves_the_kept_experts_unchanged_for_auto_too(blocks, choice):
    auto = ompmoe.PruningStrategy(ratio=0.5, method="auto", allocation="auto", min_kept_fraction=0.25)
    run, model, original = run_once(blocks, choice, strategy=auto, compensation="off")
    assert "compensation" not in run.plan.extra
    expected = ompmoe.prune(copy.deepcopy(original), run.plan)
    torch.testing.assert_close(logits(model, blocks[:2]), logits(expected, blocks[:2]), rtol=0, atol=0)


def test_a_calibration_fed_inputs_embeds_is_pruned_without_compensation_and_the_plan_says_why(blocks):
    model = tiny_model(MODEL_TYPE)
    original = copy.deepcopy(model)
    run = ompmoe.PruningRun(ompmoe.RunOptions(plots=False, compensation="linear",
                                              strategy=ompmoe.PruningStrategy(ratio=0.5, min_kept_fraction=0.25)))
    context = ompmoe.LocalContext(print=lambda line: None)
    run.start(model, context, model_id=f"tiny:{MODEL_TYPE}")
    with torch.no_grad():
        run.collect([{"inputs_embeds": model.get_input_embeddings()(batch)} for batch in blocks.split(4)])
    run.finish(context)
    assert run.plan.extra["compensation"] == {"granularity": "linear", "applied": False,
                                              "checked": "the calibration fed inputs_embeds, no token ids to fit on"}
    expected = ompmoe.prune(copy.deepcopy(original), run.plan)
    torch.testing.assert_close(logits(model, blocks[:2]), logits(expected, blocks[:2]), rtol=0, atol=0)


POST_NORM = ("model.language_model.layers.0.mlp.experts normalizes each expert's output after its down projection, "
             "so a correction there does not reach the output")
LOOP = ("Inkling2LoopForCausalLM runs decoder layers 1 to 2 2 times per forward (loop_num_passes): compensation fits "
        "each layer's one call")
LOOPED = dict(n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2)


@pytest.mark.parametrize(("model_type", "overrides", "why"), [("muse_spark", {}, POST_NORM),
                                                                ("inkling2_loop_text", LOOPED, LOOP)])
def test_a_model_compensation_cannot_fit_gets_none_from_auto_and_a_named_one_is_refused(blocks, choice, model_type,
                                                                                       overrides, why):
    """MuseSpark normalizes each expert's output after the down projection every correction folds into; Inkling2-Loop
    runs layers 6 to 18 three times (here layer 1 twice). ``auto`` failed after calibrating (the fit refused at the
    end); it now fits none and says why, and a granularity asked for is refused before the collector exists."""
    model = tiny_model(model_type, **overrides)
    original = copy.deepcopy(model)
    lines: list[str] = []
    auto = ompmoe.PruningStrategy(ratio=0.5, method="auto", allocation="auto")
    run = ompmoe.PruningRun(ompmoe.RunOptions(plots=False, strategy=auto))
    context = ompmoe.LocalContext(print=lines.append)
    run.start(model, context, model_id=f"tiny:{model_type}", data=SimpleNamespace(choice_blocks=lambda n=None: choice))
    run.collect(blocks.split(4))
    run.finish(context)
    assert f"ompmoe: auto fits no compensation: {why}" in lines and "compensation" not in run.plan.extra
    expected = ompmoe.prune(copy.deepcopy(original), run.plan)
    torch.testing.assert_close(logits(model, blocks[:2]), logits(expected, blocks[:2]), rtol=0, atol=0)
    for granularity in ("linear", "down", "expert"):
        named = ompmoe.PruningRun(ompmoe.RunOptions(plots=False, compensation=granularity))
        with pytest.raises(CompensationError) as refused:
            named.start(copy.deepcopy(original), context, model_id=f"tiny:{model_type}")
        assert str(refused.value) == f"{why}; run without compensation." and named.collector is None


def test_an_unknown_mode_is_refused_at_construction_naming_the_modes():
    with pytest.raises(ValueError) as caught:
        ompmoe.RunOptions(compensation="linaer")
    assert str(caught.value) == ("compensation must be one of auto, off, layer, expert, linear, down ('auto': for "
                                 "method 'auto', the down refit or the linear map, whichever has the lower held-out "
                                 "loss, kept unless it raises that loss; 'off': none); got 'linaer'.")


def test_the_check_keeps_compensation_only_when_the_held_out_loss_falls(blocks, choice):
    model = tiny_model(MODEL_TYPE)
    stats = ompmoe.collect_stats(model, blocks.split(4))
    plan = ompmoe.plan_pruning(stats, 0.5, min_kept_fraction=0.25)
    with pruned_view(model, plan):
        without = math.log(perplexity(model, choice, 4))
    compensation, record = fit_compensation(model, plan, blocks, 4, "linear", choice)
    assert record["loss_without"] == pytest.approx(without, rel=1e-12)
    assert (compensation is not None) == record["applied"] == (record["loss_with"] < without + 0.02)
    # raising the loss by less than the tolerance (noise on so few tokens) keeps it; by more drops it
    kept, record = fit_compensation(model, plan, blocks, 4, "linear", choice, loss_without=record["loss_with"] - 0.015)
    assert kept is not None and record["applied"] is True
    # a loss to beat that is lower than any compensation reaches: measured, recorded, not applied
    kept, record = fit_compensation(model, plan, blocks, 4, "linear", choice, loss_without=-1.0)
    assert kept is None and record["applied"] is False and record["loss_without"] == -1.0
    assert compensation_line(record) == (f"ompmoe: compensation (linear, {record['num_tokens']} tokens): held-out "
                                         f"calibration loss -1.0000 -> {record['loss_with']:.4f}, not applied (it "
                                         "raised the loss by more than 0.02)")


def test_fitting_text_prefers_the_data_modules_blocks_then_what_this_process_calibrated_on(blocks):
    assert fitting_text(SimpleNamespace(blocks=blocks), [{"input_ids": blocks[:2]}]) is blocks
    batches = [{"input_ids": blocks[:4]}, {"input_ids": blocks[4:6]}]
    torch.testing.assert_close(fitting_text(None, batches), blocks[:6], rtol=0, atol=0)
    padded = [{"input_ids": blocks[:2], "attention_mask": torch.ones(2, 32, dtype=torch.long)}]
    assert fitting_text(None, padded) == padded
    assert fitting_text(None, []) is None


def test_the_collector_keeps_the_real_samples_token_ids_on_the_cpu(blocks):
    model = tiny_model(MODEL_TYPE)
    collector = StatisticsCollector(model)
    collector.calibrate({"input_ids": blocks[:4]}, first_sample=0, real_samples=6)
    collector.calibrate({"input_ids": blocks[4:8]}, first_sample=4, real_samples=6)  # two repeats past sample 6
    collector.calibrate({"inputs_embeds": torch.zeros(1, 32, model.config.hidden_size)})
    kept = [batch["input_ids"] for batch in collector.token_batches]
    assert [tuple(ids.shape) for ids in kept] == [(4, 32), (2, 32)]
    torch.testing.assert_close(torch.cat(kept), blocks[:6], rtol=0, atol=0)


@pytest.mark.parametrize("granularity", ["linear", "down"])
def test_the_saved_model_carries_the_compensation_in_its_card_and_loads_equal_in_stock_transformers(
        blocks, tmp_path, granularity):
    run, model, _ = run_once(blocks, None, compensation=granularity, output_dir=str(tmp_path / "run"))
    saved = tmp_path / "run" / "model"
    record = json.loads((saved / "config.json").read_text())["ompmoe"]["compensation"]
    assert record["granularity"] == granularity
    assert record["num_tokens"] == run.plan.extra["compensation"]["num_tokens"]
    card = (saved / "README.md").read_text()
    what = ("linear least-squares correction of the kept experts' output" if granularity == "linear" else
            "down projections of the kept experts refit by least squares to the original's routed output (ridge "
            "alpha 0.1 toward the linear map's)")
    assert (f"| Compensation | {what}, fitted on {record['num_tokens']} calibration tokens (relative routed-output "
            f"error {record['routed_error_before']:.3f} -> {record['routed_error_after']:.3f}) |") in card
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["extra"]["compensation"]["applied"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    torch.testing.assert_close(logits(reloaded, blocks[:2]), logits(model, blocks[:2]), rtol=1e-5, atol=1e-5)


def test_linear_sums_over_the_budget_make_auto_fit_per_expert_and_a_linear_asked_for_refuse_before_calibrating(
        blocks, monkeypatch):
    import ompmoe.engine.apply.compensation_step as step

    monkeypatch.setattr(step, "MAX_SUM_BYTES", 1000)
    auto = ompmoe.PruningStrategy(ratio=0.5, method="auto", allocation="auto", min_kept_fraction=0.25)
    assert step.run_granularity("auto", auto, tiny_model(MODEL_TYPE)) == "expert"
    assert step.run_granularity("layer", auto, tiny_model(MODEL_TYPE)) == "layer"
    run = ompmoe.PruningRun(ompmoe.RunOptions(strategy=auto, compensation="linear", plots=False))
    model = tiny_model(MODEL_TYPE)
    d = model.config.hidden_size
    layers = len(ompmoe.find_moe_layers(model))
    with pytest.raises(ompmoe.CompensationError) as caught:
        run.start(model, ompmoe.LocalContext())
    assert str(caught.value) == (
        f"granularity='linear' needs {2 * d * d * 8 * layers / 1024:.3g} KiB of float64 sums on cpu (two {d} x {d} per "
        "MoE layer), over max_sum_bytes=1000 (1000 bytes); pass compensation='expert' (or 'off').")
    assert run.collector is None  # refused before the model was instrumented
    run, model, original = run_once(blocks, token_blocks(4, seed=1), strategy=auto)
    assert run.plan.extra["compensation"]["granularity"] == "expert"


def test_the_heldout_line_gives_the_paper_setting_and_the_share_of_its_increase_recovered(blocks, choice):
    from ompmoe.engine.run import paper_part, paper_plan

    assert paper_part(40.0, 45.0, 50.0) == " (paper's setting 50.00: 50% of its increase recovered)"
    assert paper_part(40.0, 52.0, 50.0) == " (paper's setting 50.00: this one's increase is 120% of it)"
    assert paper_part(40.0, 41.0, 39.5) == " (paper's setting 39.50)"  # the paper lost nothing: no share
    assert paper_part(40.0, 41.0, None) == ""
    auto = ompmoe.PruningStrategy(ratio=0.5, method="auto", allocation="auto", min_kept_fraction=0.25)
    run, model, original = run_once(blocks, choice, strategy=auto)
    paper = paper_plan(run.strategy_used, run.stats, run.plan, run.compensation)
    expected = ompmoe.PruningStrategy(ratio=0.5, min_kept_fraction=0.25).plan(run.stats)
    assert paper is not None and paper.kept_by_layer() == expected.kept_by_layer()
    assert (paper.method, paper.allocation) == ("omp", "waterfill")
    # the paper's own setting uncompensated is its own baseline: nothing to compare
    plain, _, _ = run_once(blocks, None)
    assert paper_plan(plain.strategy_used, plain.stats, plain.plan, plain.compensation) is None


def test_a_run_measures_the_paper_setting_on_its_heldout_blocks(blocks, choice):
    from ompmoe.engine.run import paper_part, paper_plan

    heldout = token_blocks(3, seed=5)
    model = tiny_model(MODEL_TYPE)
    original = copy.deepcopy(model)
    data = SimpleNamespace(choice_blocks=lambda n=None: choice, heldout_blocks=lambda name, n: heldout)
    auto = ompmoe.PruningStrategy(ratio=0.5, method="auto", allocation="auto", min_kept_fraction=0.25)
    run = ompmoe.PruningRun(ompmoe.RunOptions(strategy=auto, plots=False, evaluate_on=["held"]))
    lines: list[str] = []
    context = ompmoe.LocalContext(print=lines.append)
    run.start(model, context, model_id=f"tiny:{MODEL_TYPE}", data=data)
    run.collect(blocks.split(4))
    run.finish(context)
    with pruned_view(original, paper_plan(run.strategy_used, run.stats, run.plan, run.compensation)):
        paper = perplexity(original, heldout, 4)
    assert run.heldout_paper == {"held": pytest.approx(paper, rel=1e-9)}
    before, after = run.heldout_perplexity["held"]
    assert lines[-1] == (f"ompmoe: held-out perplexity on {heldout.numel():,} tokens per set, original -> pruned: "
                         f"held {before:.2f} -> {after:.2f}{paper_part(before, after, paper)}")  # tested above


def test_under_several_ranks_the_compensation_fits_on_every_ranks_calibration_text():
    """With a plain DataLoader the text to fit on is the batches each rank calibrated on: under DDP rank 0 fitted on
    its own share (288 of 544 tokens, another correction than one process's). Every rank's batches are gathered first:
    the run's correction is the literal fit on all of them. (A two-rank context stands in for the other rank.)"""
    blocks = token_blocks(8, seed=7)
    mine, theirs = blocks[:4], blocks[4:]
    model = tiny_model(MODEL_TYPE)
    original = copy.deepcopy(model)
    other = [{"input_ids": block} for block in theirs.split(2)]

    def broadcast(obj, src=0):  # rank 0 here; rank 1's calibration batches when it sends them
        return other if src == 1 and isinstance(obj, list) else None if src == 1 else obj

    context = ompmoe.LocalContext(world_size=2, broadcast=broadcast, print=lambda line: None)
    run = ompmoe.PruningRun(ompmoe.RunOptions(strategy=ompmoe.PruningStrategy(ratio=0.5), compensation="linear",
                                              plots=False))
    run.start(model, context, model_id=f"tiny:{MODEL_TYPE}")
    run.collect(mine.split(2))
    run.finish(context)
    record = run.plan.extra["compensation"]
    _, literal = fit_compensation(original, run.plan, blocks, 4, "linear", None, None,
                                  "applied as asked (compensation='linear')")
    assert record.keys() == literal.keys() and record["num_tokens"] == literal["num_tokens"] == blocks.numel() // 4
    for key, value in literal.items():
        assert record[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key


def test_a_run_without_its_model_says_it_wrote_none(tmp_path):
    """``save_model=False`` printed "wrote statistics, plan and pruned model" and wrote no model."""
    lines: list[str] = []
    context = ompmoe.LocalContext(print=lines.append)
    for save_model, said in ((False, "statistics, plan (save_model off)"), (True, "statistics, plan and pruned model")):
        out = tmp_path / str(save_model)
        run = ompmoe.PruningRun(ompmoe.RunOptions(strategy=ompmoe.PruningStrategy(ratio=0.5), output_dir=str(out),
                                                  plots=False, save_model=save_model))
        run.start(tiny_model(MODEL_TYPE), context, model_id=f"tiny:{MODEL_TYPE}")
        run.collect(token_blocks(4, seed=3).split(2))
        run.finish(context)
        assert lines[-1] == f"ompmoe: wrote {said} to {out}"
        assert (out / "model").is_dir() == save_model
