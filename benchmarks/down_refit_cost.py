"""What the ``down`` compensation costs at a Qwen3-30B-A3B layer shape, against a plain forward, measured in one run.

    python benchmarks/down_refit_cost.py [--tokens 2048] [--layers 1]

A random ``qwen3_moe`` model of ``--layers`` decoder layers of Qwen3-30B-A3B's shape (hidden 2,048, 128 experts of
768, top-8, 32 query and 4 key-value heads of 128), float32 on the CPU, one thread; a plan at 0.5 (the paper's) from
one statistics pass. Times (median of ``--repeats``) a plain forward over the fitting tokens, the ``linear``
compensation over them and ``refit_down`` over them (the ``linear`` map and the refit for each ``alpha`` of
``DOWN_ALPHAS``, three sweeps; the run's ``auto`` fits exactly this; and with two ``alpha``s, 0.1 and 1), and the
process's peak anonymous memory of each.
Prints one JSON line: per token, the refit's cost in forwards; and for a run of Qwen3-30B-A3B (262,144 calibration
tokens, of which the refit fits on ``MAX_TOKENS`` = 65,536 in one batch) the cost in forwards over the calibration
text (per-token cost x 65,536 / 262,144).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch

from bigger_than_memory import AnonymousPeak

import ompmoe
from ompmoe.engine.apply.compensation import compensate
from ompmoe.engine.apply.down_refit import DOWN_ALPHAS, MAX_TOKENS, SWEEPS, refit_down

CALIBRATION_TOKENS = 64 * 4096  # the paper's Qwen3-30B-A3B calibration: 64 blocks of 4,096


def model_of_the_shape(layers: int) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=2048, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


def timed(function, repeats: int) -> tuple[float, float]:
    """Median wall seconds over ``repeats`` and the peak anonymous memory (GiB) of the first."""
    times, peak = [], 0.0
    for index in range(repeats):
        with AnonymousPeak() as memory:
            started = time.perf_counter()
            function()
            times.append(time.perf_counter() - started)
        if index == 0:
            peak = memory.peak / 2**30
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model = model_of_the_shape(args.layers)
    blocks = torch.randint(0, 2048, (args.tokens // args.seq_len, args.seq_len),
                           generator=torch.Generator().manual_seed(1))
    plan = ompmoe.plan_pruning(ompmoe.collect_stats(model, blocks.split(1), progress=False), 0.5)

    @torch.no_grad()
    def forward() -> None:
        for batch in blocks.split(1):
            model(input_ids=batch, use_cache=False)

    forward_s, forward_peak = timed(forward, args.repeats)
    linear_s, linear_peak = timed(lambda: compensate(model, plan, blocks, 1, max_tokens=None), 1)
    refit_s, refit_peak = timed(lambda: refit_down(model, plan, blocks, alphas=DOWN_ALPHAS), 1)
    wider_s, wider_peak = timed(lambda: refit_down(model, plan, blocks, alphas=(0.1, 1.0)), 1)
    per_token = refit_s / forward_s
    share = min(MAX_TOKENS, CALIBRATION_TOKENS) / CALIBRATION_TOKENS
    print(json.dumps({
        "layers": args.layers, "tokens": int(blocks.numel()), "threads": 1, "alphas": list(DOWN_ALPHAS),
        "sweeps": SWEEPS, "forward_s": round(forward_s, 2), "linear_s": round(linear_s, 2),
        "refit_s": round(refit_s, 2), "refit_two_alphas_s": round(wider_s, 2),
        "linear_over_forward": round(linear_s / forward_s, 2), "refit_over_forward": round(per_token, 2),
        "refit_two_alphas_over_forward": round(wider_s / forward_s, 2),
        "qwen3_30b_run_refit_over_calibration_forward": round(per_token * share, 2),
        "peak_anon_gib": {"forward": round(forward_peak, 2), "linear": round(linear_peak, 2),
                          "refit": round(refit_peak, 2), "refit_two_alphas": round(wider_peak, 2)},
        "torch": torch.__version__, "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
