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
