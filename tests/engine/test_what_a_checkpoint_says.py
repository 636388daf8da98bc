"""What a pruned checkpoint says about itself (issue 44, item 6): the card names its calibration data as a user names
it, states the tolerance of a kept compensation map that raised the loss (as the run's printed line does), and the
plots show the criterion the plan's allocation used, with the plan's method in their titles."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import warnings

import numpy as np
import pytest
import torch

import ompmoe
from ompmoe.engine.export.checkpoint import MissingTokenizerWarning
from ompmoe.engine.export.plots import allocation_figure, overview_figure, write_plots
from ompmoe.engine.apply.compensation_step import CHECK_TOLERANCE, compensation_line, fit_compensation
from ompmoe.engine.tiny import tiny_model
from ompmoe.lightning.calibration_data import CalibrationDataModule

MODEL_TYPE = "qwen3_moe"


def token_blocks(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 200, (count, 32), generator=torch.Generator().manual_seed(seed))


def card_row(directory, name: str) -> str:
    """The card's table row ``| name | ... |``, whole."""
    (row,) = [line for line in (directory / "README.md").read_text().splitlines() if line.startswith(f"| {name} |")]
    return row


def save(model: torch.nn.Module, path, **kwargs) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MissingTokenizerWarning)  # byte-level tiny model: no tokenizer files
        ompmoe.save_pruned(model, path, **kwargs)


def test_the_card_names_shipped_calibration_data_as_a_user_names_it_and_the_statistics_keep_the_record(tmp_path):
    mix = CalibrationDataModule("shipped:mix", tokenizer="bytes", seq_len=16, num_blocks=2)
    text = CalibrationDataModule("shipped", tokenizer="bytes", seq_len=16, num_blocks=2)
    model = tiny_model(MODEL_TYPE)
    stats = ompmoe.collect_stats(model, [token_blocks(2)], source=mix.describe())
    assert stats.sources == [mix.describe()]  # the exact record: files inside the package
    assert mix.describe().startswith("shipped:ompmoe/data/corpus/")
    ompmoe.prune(model, ompmoe.plan_pruning(stats, 0.5, allocation="uniform"))
    # As PruningRun.save_model passes the statistics' sources (one run may read several).
    save(model, tmp_path / "m", calibration="; ".join([*stats.sources, text.describe(), "wikitext:wikitext-2-raw-v1"]))
    assert card_row(tmp_path / "m", "Calibration data") == (
        "| Calibration data | shipped:mix (the shipped corpus's calibration split: prose + code); shipped (the "
        "calibration text shipped with ompmoe: Python reference documentation); wikitext:wikitext-2-raw-v1 |")


@pytest.fixture(scope="module")
def raised_within_tolerance() -> tuple[torch.nn.Module, ompmoe.PruningPlan, object, dict]:
    """A linear map whose held-out check measured a loss 0.01 nats above the pruned model's: ``auto`` keeps it."""
    model = tiny_model(MODEL_TYPE)
    blocks, choice = token_blocks(16), token_blocks(4, seed=1)
    plan = ompmoe.plan_pruning(ompmoe.collect_stats(model, blocks.split(4)), 0.5, allocation="uniform")
    _, measured = fit_compensation(model, plan, blocks, 4, "linear", choice)
    compensation, record = fit_compensation(model, plan, blocks, 4, "linear", choice,
                                            loss_without=measured["loss_with"] - 0.01)
    assert compensation is not None and record["applied"] and record["loss_with"] > record["loss_without"]
    return model, plan, compensation, record


def test_the_printed_line_of_a_kept_map_that_raised_the_loss_states_the_tolerance(raised_within_tolerance):
    record = raised_within_tolerance[3]
    raised = record["loss_with"] - record["loss_without"]
    assert compensation_line(record) == (
        f"ompmoe: compensation (linear, {record['num_tokens']} tokens): held-out calibration loss "
        f"{record['loss_without']:.4f} -> {record['loss_with']:.4f}, applied (it raised the loss by {raised:.4f} "
        f"nats, within the {CHECK_TOLERANCE:g}-nat tolerance)")
    lowered = {**record, "loss_without": record["loss_with"] + 0.01}  # a map that lowered the loss: no note
    assert compensation_line(lowered).endswith(f"{lowered['loss_with']:.4f}, applied")


def test_the_card_of_a_kept_map_that_raised_the_loss_states_the_check_and_its_tolerance(raised_within_tolerance,
                                                                                         tmp_path):
    model, plan, compensation, record = raised_within_tolerance
    pruned = ompmoe.prune(tiny_model(MODEL_TYPE), plan)
    # The run's record of the check goes with the map it keeps (the card reads the model's config only).
    compensation.record.update({key: record[key] for key in ("checked", "check_blocks", "loss_without", "loss_with",
                                                             "tolerance", "applied")})
    compensation.apply(pruned)
    save(pruned, tmp_path / "m")
    fitted = compensation.record
    raised = record["loss_with"] - record["loss_without"]
    assert card_row(tmp_path / "m", "Compensation") == (
        f"| Compensation | linear least-squares correction of the kept experts' output, fitted on "
        f"{fitted['num_tokens']} calibration tokens (relative routed-output error {fitted['routed_error_before']:.3f} "
        f"-> {fitted['routed_error_after']:.3f}); held-out calibration loss {record['loss_without']:.4f} -> "
        f"{record['loss_with']:.4f} on {record['check_blocks']} blocks: kept, it raised the loss by {raised:.4f} "
        f"nats, within the {CHECK_TOLERANCE:g}-nat tolerance |")



def test_a_model_pruned_again_keeps_what_each_earlier_pruning_did_in_its_record_and_card(raised_within_tolerance,
                                                                                       tmp_path):
    """Re-pruning replaced the record's plan and dropped the earlier compensation: the card of a model whose kept
    experts carry a correction said "none (the kept experts are the original's)". Each pruning now stays listed."""
    _, plan, compensation, _ = raised_within_tolerance
    model = compensation.apply(ompmoe.prune(tiny_model(MODEL_TYPE), plan))  # 16 of 32 kept, corrected
    second = ompmoe.plan_pruning(ompmoe.collect_stats(model, token_blocks(4, seed=3).split(2)), 0.25,
                                 allocation="uniform")
    ompmoe.prune(model, second)  # 12 of 32, no correction of its own
    save(model, tmp_path / "twice")
    first_step = {"plan": {"allocation": "uniform", "method": "omp", "model_id": None, "num_tokens": 16 * 32,
                           "ratio": 0.5}, "compensation": compensation.record, "kept": 16, "of": 32,
                  "kept_experts": {layer.name: sorted(int(i) for i in layer.kept) for layer in plan.layers}}
    record = json.loads((tmp_path / "twice" / "config.json").read_text())["ompmoe"]
    assert record["earlier"] == [json.loads(json.dumps(first_step))]
    assert record["plan"]["num_tokens"] == 4 * 32 and "compensation" not in record
    assert card_row(tmp_path / "twice", "Compensation") == (
        "| Compensation | none in the last pruning; the kept experts carry an earlier pruning's (see Pruned before) |")
    said = "omp, ratio 0.5, uniform allocation, 512 calibration tokens, linear compensation: kept 16 of 32 routed experts"
    assert card_row(tmp_path / "twice", "Pruned before").startswith(f"| Pruned before | {said} (the method, ")
    third = ompmoe.plan_pruning(ompmoe.collect_stats(model, token_blocks(2, seed=4).split(2)), 0.25,
                                allocation="uniform")
    ompmoe.prune(model, third)  # 8 of 32: both earlier prunings listed, oldest first
    save(model, tmp_path / "thrice")
    assert card_row(tmp_path / "thrice", "Pruned before").startswith(
        f"| Pruned before | {said}; then omp, ratio 0.25, uniform allocation, 128 calibration tokens: kept 12 of 32 "
        "routed experts (the method, ")
    assert card_row(tmp_path / "thrice", "Achieved ratio") == "| Achieved ratio | 0.7500 (8 of 32 routed experts kept) |"
    assert card_row(tmp_path / "thrice", "Requested ratio (experts removed)").endswith("| 0.25 |")


def test_a_model_pruned_again_is_compensated_and_made_adaptive_with_the_statistics_of_the_model_it_pruned():
    """Re-pruning with a correction failed after all the work: the fit's kept experts (numbered as the pruned model
    numbers its experts, as its statistics and plan do) were checked against the record's ids of the original. The
    corrected re-pruned model computes what the compensated view of the model it pruned computes, and its alphas are
    those statistics' for its experts (or the original's statistics', by the original's ids)."""
    from ompmoe.engine.apply.adaptive import resolve_alphas
    from ompmoe.engine.apply.compensation import compensated_view

    original = tiny_model(MODEL_TYPE)
    first_stats = ompmoe.collect_stats(original, token_blocks(4, seed=5).split(2))
    first = ompmoe.plan_pruning(first_stats, 0.5, allocation="uniform")
    model = ompmoe.prune(original, first)  # 16 of 32, numbered 0..15 in the model
    stats = ompmoe.collect_stats(model, token_blocks(8, seed=6).split(4))
    second = ompmoe.plan_pruning(stats, 0.5, allocation="uniform")  # 8 of the 16, by their positions
    kept_first = {layer.name: sorted(int(i) for i in layer.kept) for layer in first.layers}
    kept_second = {layer.name: sorted(int(i) for i in layer.kept) for layer in second.layers}
    assert any(kept_second[name] != [kept_first[name][i] for i in ids] for name, ids in kept_second.items())
    compensation, record = fit_compensation(model, second, token_blocks(8, seed=7), 4, "linear")
    assert compensation is not None and record["applied"]
    probe = token_blocks(2, seed=8)
    with torch.no_grad(), compensated_view(model, second, compensation):
        expected = model(input_ids=probe).logits
    compensation.apply(ompmoe.prune(model, second))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=probe).logits, expected, rtol=1e-5, atol=1e-5)
    saved = ompmoe.pruning_info(model)
    assert saved["compensation"]["granularity"] == "linear"
    assert saved["kept_experts"] == {name: [kept_first[name][i] for i in ids] for name, ids in kept_second.items()}
    assert saved["earlier"][0]["kept_experts"] == kept_first
    for alphas, expected_alphas in (
            (resolve_alphas(model, stats), {layer.name: layer.alpha[kept_second[layer.name]] for layer in stats.layers}),
            (resolve_alphas(model, first_stats),
             {layer.name: layer.alpha[saved["kept_experts"][layer.name]] for layer in first_stats.layers})):
        assert alphas.keys() == expected_alphas.keys()
        for name, value in expected_alphas.items():
            assert torch.equal(alphas[name], value.to(torch.float64))


@pytest.fixture(scope="module")
def loss_aware() -> ompmoe.MoEStats:
    model = tiny_model(MODEL_TYPE)
    return ompmoe.collect_stats(model, [token_blocks(4, seed=2)], loss_aware=True)


def literal_loss_estimate(layer, kept: list[int], num_tokens: int) -> float:
    """``(-s^T u + u^T H u / 2) / tokens`` with ``u`` the experts the plan removes (docs/methods.md)."""
    u = torch.ones(layer.num_experts, dtype=torch.float64)
    u[kept] = 0.0
    s, h = layer.loss_first_order.to(torch.float64), layer.gram_loss.to(torch.float64)
    return float((-(s @ u) + 0.5 * (u @ h @ u)) / num_tokens)


def test_an_allocation_by_loss_plots_its_loss_estimates_and_the_titles_name_the_plan(loss_aware, tmp_path):
    plan = ompmoe.plan_pruning(loss_aware, 0.5, method="omp_normalized", allocation="loss", min_kept_fraction=0.25)
    write_plots(loss_aware, tmp_path, plan=plan, progress=False)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "allocation.csv").read_text())))
    expected = [literal_loss_estimate(layer, planned.kept, loss_aware.num_tokens)
                for layer, planned in zip(loss_aware.layers, plan.layers)]
    np.testing.assert_allclose([float(row["loss_estimate"]) for row in rows], expected, rtol=1e-9, atol=1e-15)

    figure = allocation_figure(loss_aware, plan)
    assert figure.get_suptitle() == "plan: omp_normalized/loss, ratio 0.5"
    counts, losses = figure.axes[:2]
    assert [patch.get_height() for patch in counts.containers[1]] == [layer.num_kept for layer in plan.layers]
    assert losses.get_title() == ("Estimated loss increase $\\Delta L_l(k)$ per layer:\nthe criterion allocation loss "
                                  "minimized")
    assert losses.get_ylabel() == "nats per token"
    np.testing.assert_allclose([patch.get_height() for patch in losses.containers[0]], expected, rtol=1e-9,
                               atol=1e-15)
    assert overview_figure(loss_aware, plan).axes[0].get_title().endswith("\nplan: omp_normalized/loss, ratio 0.5")


def test_a_waterfill_plan_keeps_its_residual_criterion_and_names_its_method(loss_aware, tmp_path):
    plan = ompmoe.plan_pruning(loss_aware, 0.5, method="omp", allocation="waterfill", min_kept_fraction=0.25)
    write_plots(loss_aware, tmp_path, plan=plan, progress=False)
    header = (tmp_path / "allocation.csv").read_text().splitlines()[0]
    assert header == "layer,layer_index,num_experts,kept,uniform_kept,residual,coverage"  # no loss estimates
    figure = allocation_figure(loss_aware, plan)
    assert figure.get_suptitle() == "plan: omp/waterfill, ratio 0.5" and len(figure.axes) == 1


def test_a_model_saved_with_omp_moe_plus_says_a_plain_load_runs_without_it(tmp_path):
    """The fit's held-out figure and ``load_pruned`` skip experts per token; a plain ``from_pretrained`` (lm-eval's
    ``hf`` model) runs every top-k expert, a different model (85.04 against the 88.82 printed), and nothing said so.
    The card and the held-out line say it now."""
    from ompmoe.engine.apply.adaptive import enable_adaptive

    model = tiny_model(MODEL_TYPE)
    stats = ompmoe.collect_stats(model, token_blocks(4).split(2))
    pruned = enable_adaptive(ompmoe.prune(model, ompmoe.plan_pruning(stats, 0.5, allocation="uniform")), stats, 0.1)
    save(pruned, tmp_path / "adaptive")
    assert card_row(tmp_path / "adaptive", "OMP-MoE+ (adaptive inference)") == (
        "| OMP-MoE+ (adaptive inference) | epsilon 0.1: each token skips the low-energy tail of its top-k experts when "
        "loaded with `ompmoe.load_pruned`; a plain `from_pretrained` (lm-eval's `hf` model, serving engines) runs "
        "every top-k expert: the static pruned model, whose quality and speed differ "
        "(`ompmoe.engine.apply.adaptive.restore_adaptive(model)` switches it on after such a load) |")
    save(ompmoe.prune(tiny_model(MODEL_TYPE), ompmoe.plan_pruning(stats, 0.5, allocation="uniform")),
         tmp_path / "static")
    assert "OMP-MoE+" not in (tmp_path / "static" / "README.md").read_text()
    for epsilon, layer_by_layer, said in ((0.1, False, " (with OMP-MoE+ at epsilon 0.1, as ompmoe.load_pruned runs "
                                                        "it; a plain from_pretrained runs without)"),
                                          (None, False, ""), (0.1, True, "")):  # layer by layer: measured_line
        run = ompmoe.PruningRun(ompmoe.RunOptions(adaptive_epsilon=epsilon, layer_by_layer=layer_by_layer,
                                                  compensation="off" if layer_by_layer else "auto",
                                                  strategy=ompmoe.PruningStrategy(ratio=0.5)))
        run.heldout_perplexity, run.heldout_tokens = {"heldout:prose": (30.1, 33.5)}, 8192
        assert run.heldout_line() == (f"ompmoe: held-out perplexity on 8,192 tokens per set, original -> pruned"
                                      f"{said}: heldout:prose 30.10 -> 33.50")


def test_a_model_pruned_again_is_titled_by_the_model_its_first_pruning_started_from(tmp_path):
    """Re-pruning a pruned output titled the card by the folder it loaded ("# model, experts pruned with ompmoe")."""
    model = tiny_model(MODEL_TYPE)
    model.config._name_or_path = "org/base-moe"
    stats = ompmoe.collect_stats(model, token_blocks(4).split(2))
    save(ompmoe.prune(model, ompmoe.plan_pruning(stats, 0.5, allocation="uniform")), tmp_path / "first" / "model")
    again = ompmoe.load_pruned(tmp_path / "first" / "model")
    stats = ompmoe.collect_stats(again, token_blocks(4, seed=1).split(2))
    save(ompmoe.prune(again, ompmoe.plan_pruning(stats, 0.25, allocation="uniform")), tmp_path / "second")
    titles = [line for line in (tmp_path / "second" / "README.md").read_text().splitlines() if line.startswith("# ")]
    assert titles == ["# base-moe, experts pruned with ompmoe"]


def test_the_residual_figures_title_fits_its_figure(loss_aware):
    """The plan's line of the title ran past both edges of a three-panel-wide figure ("lan: ... allocation.pn")."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from ompmoe.engine.export.plots import residual_figure

    stats = dataclasses.replace(loss_aware, layers=[*loss_aware.layers] * 3)  # 6 layers: 3 x 2 panels, as tiny-moe
    stats.layers = [dataclasses.replace(layer, name=f"model.layers.{index}.mlp")
                    for index, layer in enumerate(stats.layers)]
    plan = ompmoe.plan_pruning(stats, 0.5, method="omp_normalized", allocation="loss", min_kept_fraction=0.25)
    figure = residual_figure(stats, plan)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    title = figure._suptitle.get_window_extent(canvas.get_renderer())
    assert 0 <= title.x0 and title.x1 <= figure.bbox.width
    assert figure._suptitle.get_text().count("\n") == 2


def test_a_model_re_pruned_by_an_older_ompmoe_says_why_a_correction_cannot_be_matched():
    """Its earlier pruning did not record the experts it kept: the correction's ids cannot be mapped, and the error
    says so instead of listing two numberings as a mismatch."""
    from ompmoe.engine.apply.compensation import CompensationError

    model = tiny_model(MODEL_TYPE)
    first = ompmoe.plan_pruning(ompmoe.collect_stats(model, token_blocks(4).split(2)), 0.5, allocation="uniform")
    ompmoe.prune(model, first)
    second = ompmoe.plan_pruning(ompmoe.collect_stats(model, token_blocks(4, seed=1).split(2)), 0.5,
                                 allocation="uniform")
    compensation, _ = fit_compensation(model, second, token_blocks(8, seed=2), 4, "linear")
    ompmoe.prune(model, second)
    del ompmoe.pruning_info(model)["earlier"][0]["kept_experts"]  # as an earlier ompmoe wrote the record
    with pytest.raises(CompensationError) as refused:
        compensation.apply(model)
    assert str(refused.value) == (
        "This model was pruned again by an ompmoe that did not record which experts its earlier pruning kept, so a "
        "correction cannot be matched to its experts; prune the original model (or that earlier output) again with "
        "this ompmoe, then compensate.")
