"""benchmarks/quality_intervals.py: pooled perplexities and bootstrap intervals against literal computations."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import quality_intervals  # noqa: E402


def random_cell(pairs=3, draws=2, blocks=(5, 4), seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {domain: torch.rand(pairs, draws, count, generator=generator, dtype=torch.float64) * 50 + 100
            for domain, count in zip(("prose", "code"), blocks)}


def test_weighted_geometric_perplexity_equals_pooling_the_resampled_blocks_by_hand():
    nll, tokens = random_cell(), 7
    draws_taken, blocks_taken = [1, 1], {"prose": [0, 0, 3, 4, 2], "code": [3, 1, 1, 0]}
    draw_weights = quality_intervals._counts(torch.tensor([draws_taken]), 2)
    block_weights = {d: quality_intervals._counts(torch.tensor([taken]), nll[d].shape[2]) for d, taken in blocks_taken.items()}
    got = quality_intervals.geometric_ppl(nll, tokens, draw_weights, block_weights)[0]
    for pair in range(3):
        logs = []
        for domain, taken in blocks_taken.items():
            values = [float(nll[domain][pair, d, k]) for d in draws_taken for k in taken]
            logs.append(sum(values) / (len(values) * tokens))
        assert float(got[pair]) == pytest.approx(math.exp(sum(logs) / 2), rel=1e-12)


def test_a_pair_worse_by_a_constant_per_token_has_that_gap_in_every_resample():
    nll = random_cell(pairs=1)
    delta = 0.01  # nats per token
    nll = {d: torch.cat([v, v + delta * 7]) for d, v in nll.items()}
    cell = quality_intervals.intervals(nll, 7, resamples=300, paper=0)
    expected = math.exp(delta) - 1
    for key in ("gap_paper", "gap_paper_low", "gap_paper_high"):
        assert float(cell[key][1]) == pytest.approx(expected, rel=1e-9)
    assert float(cell["gap_best_low"][1]) > 0  # significantly worse than the best
    assert float(cell["ppl_low"][0]) <= float(cell["ppl"][0]) <= float(cell["ppl_high"][0])


def test_a_pair_that_differs_only_by_noise_is_not_significantly_worse():
    nll = random_cell(pairs=1, blocks=(40, 40))
    generator = torch.Generator().manual_seed(5)
    noisy = {d: torch.cat([v, v + torch.randn(v.shape, generator=generator, dtype=torch.float64) * 7]) for d, v in nll.items()}
    cell = quality_intervals.intervals(noisy, 7, resamples=500)
    assert float(cell["gap_best_low"].max()) <= 0 <= float(cell["gap_best_high"].min())


def test_calibration_draws_are_disjoint_and_mix_takes_half_of_each_domain():
    from transformers import AutoTokenizer

    from ompmoe.data import shipped_model_path

    tokenizer = AutoTokenizer.from_pretrained(shipped_model_path("shipped:tiny-moe"))
    draws, selection = quality_intervals.calibration_draws(tokenizer, seq_len=64, blocks=4, draws=3, select_blocks=2)
    for name in ("prose", "code"):
        rows = {tuple(row.tolist()) for draw in draws[name] for row in draw}
        assert len(rows) == 12
        # select's held-out blocks: the next blocks of the same split, in no draw
        assert torch.equal(selection[name], quality_intervals.token_blocks(
            quality_intervals.corpus_token_stream(tokenizer, name, "calibration"), 64, 14)[12:])
        assert not rows & {tuple(row.tolist()) for row in selection[name]}
    assert torch.equal(draws["mix"][2][:2], draws["prose"][2][:2]) and torch.equal(draws["mix"][2][2:], draws["code"][2][:2])
    assert torch.equal(selection["mix"], torch.stack([selection["prose"][0], selection["code"][0]]))


def test_gap_to_the_better_baseline_is_the_gap_to_the_lower_of_the_two_in_every_resample():
    nll = random_cell(pairs=1)
    # pair 0: the paper; pair 1: 0.02 nats/token below it (REAP); pair 2: 0.005 below the paper
    nll = {d: torch.cat([v, v - 0.02 * 7, v - 0.005 * 7]) for d, v in nll.items()}
    cell = quality_intervals.intervals(nll, 7, resamples=200, paper=0, baselines=(0, 1))
    for key in ("gap_baseline", "gap_baseline_low", "gap_baseline_high"):
        assert float(cell[key][0]) == pytest.approx(math.exp(0.02) - 1, rel=1e-9)
        assert float(cell[key][1]) == pytest.approx(0.0, abs=1e-12)
        assert float(cell[key][2]) == pytest.approx(math.exp(0.015) - 1, rel=1e-9)
    assert "gap_baseline" not in quality_intervals.intervals(nll, 7, resamples=10)


def test_per_draw_perplexity_is_each_draws_geometric_mean_over_domains():
    nll, tokens = random_cell(pairs=2, draws=3), 7
    got = quality_intervals.per_draw_ppl(nll, tokens)
    assert got.shape == (3, 2)
    for draw in range(3):
        for pair in range(2):
            logs = [float(nll[d][pair, draw].sum()) / (nll[d].shape[2] * tokens) for d in nll]
            assert float(got[draw, pair]) == pytest.approx(math.exp(sum(logs) / 2), rel=1e-12)


def test_right_choice_is_the_lowest_candidate_and_counts_ties():
    values = {"a": 10.0, "b": 9.0, "c": 9.0, "d": 1.0}
    assert quality_intervals.right_choice(values, "b", ["a", "b", "c"])
    assert quality_intervals.right_choice(values, "c", ["a", "b", "c"])  # the same plan twice: both right
    assert not quality_intervals.right_choice(values, "a", ["a", "b", "c"])  # "d" is no candidate


def test_wilson_interval_against_the_textbook_values():
    # 8 of 10: p = 0.8, z = 1.96 -> (0.490, 0.943) (Wilson 1927; e.g. Newcombe 1998, table I)
    low, high = quality_intervals.wilson_interval(8, 10)
    z = 1.959964
    center = (0.8 + z * z / 20) / (1 + z * z / 10)
    half = z * math.sqrt(0.8 * 0.2 / 10 + z * z / 400) / (1 + z * z / 10)
    assert (low, high) == pytest.approx((center - half, center + half), rel=1e-12)
    assert (round(low, 3), round(high, 3)) == (0.490, 0.943)
    assert quality_intervals.wilson_interval(0, 5)[0] == 0.0 and quality_intervals.wilson_interval(5, 5)[1] == 1.0
    assert all(math.isnan(x) for x in quality_intervals.wilson_interval(0, 0))


def test_variants_add_a_compensated_twin_per_pair_and_the_three_selects():
    pairs = ["omp/waterfill", "reap/waterfill"]
    assert quality_intervals.variant_names(pairs, compensate=False, select=False) == pairs
    assert quality_intervals.variant_names(pairs, compensate=False, select=True) == [*pairs, "select"]
    assert quality_intervals.variant_names(pairs, compensate=True, select=True) == [
        *pairs, "omp/waterfill+c", "reap/waterfill+c", "select", "select+c", "select_after+c"]


def test_select_auto_takes_the_settings_auto_tries_on_the_layout():
    assert quality_intervals.select_candidates(["auto"], "qwen3_moe") == ["omp_normalized/loss", "omp/waterfill"]
    assert quality_intervals.select_candidates(["auto"], "glm4_moe") == ["reap/waterfill"]
    assert quality_intervals.select_candidates(["omp/loss"], "glm4_moe") == ["omp/loss"]


def test_summary_counts_trial_accuracy_and_the_compensation_check():
    def row(pair, calibration, gap):
        return {"model": "m", "calibration": calibration, "ratio": 0.5, "pair": pair, "gap_paper": gap,
                "gap_baseline": gap - 0.01, "not_worse": True}

    rows = [row("select+c", "prose", -0.04), row("select+c", "code", 0.01), row("select+c", "mix", -0.03)]
    trials = [{"model": "m", "variant": "select+c", "right": right, "compensation_kept": kept,
               "compensation_helps": helps}
              for right, kept, helps in [(True, True, True), (False, True, False), (True, False, False),
                                         (True, True, True)]]
    (s,) = quality_intervals.summary(rows, trials)
    assert s["mean_gap_paper"] == pytest.approx(-0.02) and s["mean_gap_baseline"] == pytest.approx(-0.03)
    assert (s["worst_set"], s["worst_set_gap_paper"]) == ("code", 0.01)
    assert (s["right"], s["trials"]) == (3, 4)
    assert (s["right_low"], s["right_high"]) == quality_intervals.wilson_interval(3, 4)
    assert (s["compensation_kept"], s["compensation_check_right"], s["compensation_checks"]) == (3, 3, 4)
