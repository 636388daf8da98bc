"""Forward time of a non-uniform checkpoint's remote code against ``ompmoe.load_pruned``.

Run ``python benchmarks/remote_code.py`` (about five minutes on one CPU thread; bfloat16 matmuls
are slow on CPUs). It prunes the trained ``shipped:tiny-moe`` (Qwen3-MoE, 6 layers x 16 experts)
at ratio 0.5 with the default non-uniform allocation (calibration: 8 x 256 tokens of the shipped
corpus per domain), saves it with ``save_pruned`` (bf16 weights, as the source) and loads it twice:
with stock transformers' ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` and
with ``ompmoe.load_pruned(dir)``. For float32 and bfloat16 it reports both models' experts
implementation, whether their logits are bit-identical, and the median forward time of 4 x 256
held-out tokens, one thread, the two models interleaved (order reversed every other round) so
background load hits both alike; the ratio remote / load_pruned is the number to watch (goal:
<= 1.03). That the remote code picks the same implementation in a process that never imported
ompmoe nor built a stock model is checked by ``tests/engine/test_export.py``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ompmoe
from ompmoe.data import corpus_token_stream, shipped_model_path, token_blocks

SEQ_LEN = 256


def pruned_checkpoint(directory: str) -> torch.Tensor:
    """Save the shipped model pruned at 0.5 non-uniformly into ``directory``; return 4 held-out blocks."""
    path = shipped_model_path("tiny-moe")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    calibration = [token_blocks(corpus_token_stream(tokenizer, domain, "calibration", SEQ_LEN * 8), SEQ_LEN, 8)
                   for domain in ("prose", "code")]
    held_out = [token_blocks(corpus_token_stream(tokenizer, domain, "heldout", SEQ_LEN * 2), SEQ_LEN, 2)
                for domain in ("prose", "code")]
    plan = ompmoe.plan_pruning(ompmoe.collect_stats(model, list(torch.cat(calibration).split(4))), 0.5)
    assert not plan.is_uniform, "the benchmark needs a non-uniform plan (remote code)"
    ompmoe.prune(model, plan)
    ompmoe.save_pruned(model, directory)
    return torch.cat(held_out)


def median_forward_seconds(
    models: dict[str, torch.nn.Module], input_ids: torch.Tensor, repeats: int
) -> dict[str, float]:
    """Median wall seconds of one forward pass per model, interleaved, the order reversed every other round."""
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for model in models.values():  # warm-up
            model(input_ids)
        for round_ in range(repeats):
            for name, model in list(models.items())[:: 1 if round_ % 2 == 0 else -1]:
                start = time.perf_counter()
                model(input_ids)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        directory = f"{tmp}/pruned"
        input_ids = pruned_checkpoint(directory)
        print(f"shipped:tiny-moe pruned at 0.5 non-uniformly; forward of {tuple(input_ids.shape)} tokens, "
              f"1 thread, median of {args.repeats} interleaved repeats")
        print("| dtype | experts implementation (remote / load_pruned) | logits bit-identical | remote code (s) "
              "| load_pruned (s) | remote / load_pruned |")
        print("|---|---|---|---|---|---|")
        for dtype in (torch.float32, torch.bfloat16):
            remote = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=dtype).eval()
            loaded = ompmoe.load_pruned(directory, dtype=dtype).eval()
            with torch.no_grad():
                identical = torch.equal(remote(input_ids).logits, loaded(input_ids).logits)
            seconds = median_forward_seconds({"remote": remote, "load_pruned": loaded}, input_ids, args.repeats)
            implementations = f"{remote.config._experts_implementation} / {loaded.config._experts_implementation}"
            print(f"| {str(dtype).removeprefix('torch.')} | {implementations} | {'yes' if identical else 'NO'} "
                  f"| {seconds['remote']:.3f} | {seconds['load_pruned']:.3f} "
                  f"| {seconds['remote'] / seconds['load_pruned']:.3f} |")


if __name__ == "__main__":
    main()
