"""Compensation of a block-FP8 checkpoint: does the refit survive quantizing the kept experts' down projections again?

    python benchmarks/fp8_compensation.py                  # both shipped models, 128 x 128 blocks, ratio 0.5
    python benchmarks/fp8_compensation.py --models tiny-moe --block 64

Per shipped model: its experts quantized to block FP8 (``ompmoe.engine.block_fp8.quantize``, as transformers'
``Fp8Quantize`` quantizes; routers, embeddings, norms, attention and head stay as they are), then two measurements on
the first ``--eval_blocks`` blocks of 256 tokens of each held-out split (prose, code):

1. **the product's path**: ``ompmoe fit --layer_by_layer true`` on the FP8 checkpoint with ``--compensation off`` and
   with the default (``auto``), as the run reports them (held-out perplexity of the model it writes: the compensated
   down projections quantized again);
2. **what quantizing again costs**: the same FP8 model's dequantized copy fitted resident (``ompmoe fit``, whose
   ``auto`` also tries its loss-aware plans and the down refit), pruned without and with compensation, and the
   compensated one again with its experts rounded to the FP8 grid: the last two columns differ only by that.

Prints a markdown table; writes ``--output`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUANTIZED = re.compile(r"\.experts\.")  # what the experiment quantizes: the experts, fused or per expert


def quantize_experts(model: torch.nn.Module, block: tuple[int, int], grid_only: bool) -> dict[str, torch.Tensor]:
    """Round every experts weight of ``model`` to the block-FP8 grid in place; returns ``{name: (fp8, scale_inv)}``
    pairs flattened for the files (``grid_only``: none)."""
    from ompmoe.engine.block_fp8 import quantize, round_to_grid

    stored = {}
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if QUANTIZED.search(name) and parameter.dim() >= 2:
                if not grid_only:
                    stored[name] = quantize(parameter.data, block)
                parameter.data.copy_(round_to_grid(parameter.data, block))
    return stored


def fp8_checkpoint(name: str, block: tuple[int, int], directory: Path) -> tuple[Path, Path]:
    """The shipped model ``name`` with its experts in block FP8 (``directory/fp8``, as a release stores them, per
    expert) and the same values in full precision (``directory/dequantized``)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ompmoe.engine.block_fp8 import quantize
    from ompmoe.engine.names import shipped_model_path

    source = shipped_model_path(name)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    quantize_experts(model, block, grid_only=True)
    dequantized, fp8 = directory / "dequantized", directory / "fp8"
    for target in (dequantized, fp8):
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
    tensors = load_file(str(fp8 / "model.safetensors"))
    for key in [key for key in tensors if QUANTIZED.search(key) and tensors[key].dim() == 2]:
        tensors[key], tensors[key + "_scale_inv"] = quantize(tensors[key], block)
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (fp8 / "config.json").write_text(json.dumps(config, indent=2))
    return fp8, dequantized


def fit(model: Path, output: Path, eval_blocks: int, *options: str) -> dict[str, float]:
    """``ompmoe fit`` (the shipped config, 32 calibration blocks) on ``model``; the pruned held-out perplexity per set,
    as the run prints it."""
    command = [sys.executable, "-m", "ompmoe.cli", "fit", "-c", str(ROOT / "configs" / "tiny.yaml"),
               "--model.model", str(model), "--trainer.callbacks.init_args.output_dir", str(output),
               "--trainer.enable_progress_bar", "false", "--data.num_blocks", "32",
               "--trainer.callbacks.init_args.evaluate_blocks", str(eval_blocks), *options]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=True)
    line = next(line for line in done.stderr.splitlines() if "held-out perplexity on" in line)
    return {name: float(after) for name, after in re.findall(r"heldout:(\w+) [\d.]+ -> ([\d.]+)", line)}


def perplexities(model: torch.nn.Module, tokenizer, eval_blocks: int) -> dict[str, float]:
    from ompmoe.data import corpus_token_stream, token_blocks
    from ompmoe.engine.perplexity import perplexity

    return {domain: perplexity(model, token_blocks(corpus_token_stream(tokenizer, domain, "heldout"), 256,
                                                   eval_blocks)) for domain in ("prose", "code")}


def measure(name: str, block: tuple[int, int], eval_blocks: int, directory: Path) -> dict[str, dict[str, float]]:
    import ompmoe
    from transformers import AutoTokenizer

    fp8, dequantized = fp8_checkpoint(name, block, directory)
    rows = {"layer by layer, off": fit(fp8, directory / "lbl-off", eval_blocks, "--layer_by_layer", "true",
                                       "--trainer.callbacks.init_args.compensation", "off"),
            "layer by layer, auto (quantized again)": fit(fp8, directory / "lbl-auto", eval_blocks,
                                                          "--layer_by_layer", "true")}
    fit(dequantized, directory / "resident-off", eval_blocks, "--trainer.callbacks.init_args.compensation", "off")
    fit(dequantized, directory / "resident-auto", eval_blocks)
    tokenizer = AutoTokenizer.from_pretrained(dequantized)
    off = ompmoe.load_pruned(directory / "resident-off" / "model", dtype=torch.float32)
    rows["resident, off"] = perplexities(off, tokenizer, eval_blocks)
    auto = ompmoe.load_pruned(directory / "resident-auto" / "model", dtype=torch.float32)
    rows["resident, auto (not quantized again)"] = perplexities(auto, tokenizer, eval_blocks)
    quantize_experts(auto, block, grid_only=True)
    rows["resident, auto (quantized again)"] = perplexities(auto, tokenizer, eval_blocks)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-moe", "tiny-moe-64"])
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--eval_blocks", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=Path("outputs/fp8-compensation"))
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "fp8_compensation.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {name: measure(name, (args.block, args.block), args.eval_blocks, args.workdir / name)
               for name in args.models}
    print(f"| model | run | prose | code |  ({args.block}x{args.block} blocks, ratio 0.5, "
          f"{args.eval_blocks} x 256 held-out tokens per set)")
    print("|---|---|---|---|")
    for name, rows in results.items():
        for run, values in rows.items():
            print(f"| {name} | {run} | {values['prose']:.2f} | {values['code']:.2f} |")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"block": args.block, "eval_blocks": args.eval_blocks, "results": results},
                                      indent=2) + "\n")


if __name__ == "__main__":
    main()
