"""Compensation of a quantized checkpoint: does the refit survive quantizing the kept experts' down projections again?

    python benchmarks/quantized_compensation.py                    # block FP8, 128 x 128 blocks, both shipped models
    python benchmarks/quantized_compensation.py --format int4      # compressed-tensors INT4 per group of 32
    python benchmarks/quantized_compensation.py --format mxfp4     # MXFP4 (gpt-oss's format), resident only
    python benchmarks/quantized_compensation.py --models tiny-moe --block 64

Per shipped model: its experts quantized (``--format block-fp8``: ``ompmoe.engine.block_fp8.quantize``, as
transformers' ``Fp8Quantize`` quantizes; ``int4``: compressed-tensors ``pack-quantized`` INT4 per group of 32, Kimi K2
Thinking's scheme, as llm-compressor's round to nearest quantizes; ``mxfp4``: ``ompmoe.engine.mxfp4.round_to_grid``,
as transformers' ``quantize_to_mxfp4`` quantizes, measured resident only since ompmoe reads MXFP4 files in gpt-oss's
layout and the shipped models are not gpt-oss; routers, embeddings, norms, attention and head stay as they are), then
two measurements on the first ``--eval_blocks`` blocks of 256 tokens of each held-out split:

1. **the product's path**: ``ompmoe fit --layer_by_layer true`` on the quantized checkpoint with ``--compensation off`` and
   with the default (``auto``), as the run reports them (held-out perplexity of the model it writes: the compensated
   down projections quantized again);
2. **what quantizing again costs**: the same model's dequantized copy fitted resident (``ompmoe fit``, whose
   ``auto`` also tries its loss-aware plans and the down refit), pruned without and with compensation, and the
   compensated one again with its down projections put back on the format's grid: the last two rows differ only by
   that.

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
QUANTIZED = re.compile(r"\.experts\.")  # what the experiment quantizes: the routed experts


INT4_SCHEME = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True,
               "dynamic": False, "actorder": None}
INT4_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
               "config_groups": {"group_0": {"targets": ["re:.*mlp\\.experts\\..*"], "weights": INT4_SCHEME,
                                             "input_activations": None, "output_activations": None}},
               "ignore": ["lm_head"], "kv_cache_scheme": None}
"""Kimi K2 Thinking's scheme: the routed experts in INT4, one bf16 multiplier per group of 32 inputs."""


def on_grid(values: torch.Tensor, form: str, block: tuple[int, int]) -> torch.Tensor:
    """``values`` (``[..., rows, cols]``) as the format stores and reads them back."""
    from ompmoe.engine import compressed_tensors_format as ct
    from ompmoe.engine import mxfp4
    from ompmoe.engine.block_fp8 import round_to_grid

    if form == "block-fp8":
        return round_to_grid(values, block)
    if form == "mxfp4":
        return mxfp4.round_to_grid(values)
    matrices = [ct.dequantize(*ct.quantize(matrix, INT4_SCHEME, values.dtype), INT4_SCHEME).to(values.dtype)
                for matrix in values.reshape(-1, *values.shape[-2:])]
    return torch.stack(matrices).reshape(values.shape)


def stored(name: str, weight: torch.Tensor, form: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The files' tensors of one expert weight in the format."""
    from ompmoe.engine import compressed_tensors_format as ct
    from ompmoe.engine.block_fp8 import quantize

    if form == "block-fp8":
        values, scale_inv = quantize(weight, block)
        return {name: values, name + "_scale_inv": scale_inv}
    integers, scale = ct.quantize(weight, INT4_SCHEME, weight.dtype)
    return {name + "_packed": ct.pack(integers, 4), name + "_scale": scale,
            name + "_shape": torch.tensor(list(weight.shape))}


def put_on_grid(model: torch.nn.Module, form: str, block: tuple[int, int], only: str = "") -> None:
    """Every experts weight of ``model`` whose name holds ``only``, on the format's grid, in place."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if QUANTIZED.search(name) and parameter.dim() >= 2 and only in name:
                parameter.data.copy_(on_grid(parameter.data, form, block))


def quantized_checkpoint(name: str, form: str, block: tuple[int, int], directory: Path) -> tuple[Path, Path]:
    """The shipped model ``name`` with its experts in the format (``directory/quantized``, per expert, as a release
    stores them) and the same values in full precision (``directory/dequantized``)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ompmoe.engine.names import shipped_model_path

    source = shipped_model_path(name)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    put_on_grid(model, form, block)
    dequantized, quantized = directory / "dequantized", directory / "quantized"
    for target in (dequantized, quantized):
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
    if form == "mxfp4":  # resident only: ompmoe reads MXFP4 files in gpt-oss's layout
        return quantized, dequantized
    tensors = load_file(str(quantized / "model.safetensors"))
    for key in [key for key in tensors if QUANTIZED.search(key) and tensors[key].dim() == 2]:
        tensors.update(stored(key, tensors.pop(key), form, block))
    save_file(tensors, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = (INT4_CONFIG if form == "int4" else
                                     {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)})
    (quantized / "config.json").write_text(json.dumps(config, indent=2))
    return quantized, dequantized


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


def measure(name: str, form: str, block: tuple[int, int], eval_blocks: int, directory: Path
            ) -> dict[str, dict[str, float]]:
    import ompmoe
    from transformers import AutoTokenizer

    quantized, dequantized = quantized_checkpoint(name, form, block, directory)
    rows = {} if form == "mxfp4" else {  # MXFP4 files are gpt-oss's: measured resident only
        "layer by layer, off": fit(quantized, directory / "lbl-off", eval_blocks, "--layer_by_layer", "true",
                                   "--trainer.callbacks.init_args.compensation", "off"),
        "layer by layer, auto (quantized again)": fit(quantized, directory / "lbl-auto", eval_blocks,
                                                      "--layer_by_layer", "true")}
    fit(dequantized, directory / "resident-off", eval_blocks, "--trainer.callbacks.init_args.compensation", "off")
    fit(dequantized, directory / "resident-auto", eval_blocks)
    tokenizer = AutoTokenizer.from_pretrained(dequantized)
    off = ompmoe.load_pruned(directory / "resident-off" / "model", dtype=torch.float32)
    rows["resident, off"] = perplexities(off, tokenizer, eval_blocks)
    auto = ompmoe.load_pruned(directory / "resident-auto" / "model", dtype=torch.bfloat16)
    rows["resident, auto (not quantized again)"] = perplexities(auto.float(), tokenizer, eval_blocks)
    put_on_grid(auto, form, block, only="down_proj")
    rows["resident, auto (quantized again)"] = perplexities(auto.float(), tokenizer, eval_blocks)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", choices=["block-fp8", "int4", "mxfp4"], default="block-fp8")
    parser.add_argument("--models", nargs="+", default=["tiny-moe", "tiny-moe-64"])
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--eval_blocks", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=Path("outputs/quantized-compensation"))
    parser.add_argument("--output", type=Path, help="default: benchmarks/results/quantized_compensation_<format>.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    output = args.output or ROOT / "benchmarks" / "results" / f"quantized_compensation_{args.format}.json"
    results = {name: measure(name, args.format, (args.block, args.block), args.eval_blocks,
                             args.workdir / args.format / name) for name in args.models}
    grid = {"block-fp8": f"{args.block}x{args.block} blocks", "int4": "INT4 per group of 32",
            "mxfp4": "MXFP4, resident only"}[args.format]
    print(f"| model | run | prose | code |  ({args.format}, {grid}, ratio 0.5, {args.eval_blocks} x 256 held-out "
          "tokens per set)")
    print("|---|---|---|---|")
    for name, rows in results.items():
        for run, values in rows.items():
            print(f"| {name} | {run} | {values['prose']:.2f} | {values['code']:.2f} |")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"format": args.format, "block": args.block, "eval_blocks": args.eval_blocks,
                                  "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
