"""How much of the pruning loss fine-tuning recovers, on both shipped models (docs/quality/finetune.md).

    python benchmarks/finetune_recovery.py                      # both models, the documented recipe
    python benchmarks/finetune_recovery.py --models shipped:tiny-moe --distill_weight 0 --learning_rate 1e-4

For each model (float32): held-out perplexity per domain of the unpruned model, of the model pruned
as the default job does (``configs/tiny.yaml``: ratio 0.5, ``omp_normalized``, ``loss`` allocation,
loss-aware statistics on 16 x 256 tokens of ``shipped:mix``), and after fine-tuning it with
:class:`ompmoe.FinetuneModule` in full and with LoRA, distilled from the unpruned model (``--distill_weight``): one epoch over ``--num_blocks`` blocks of
``--seq_len`` tokens of the default training text (``FinetuneDataModule(source=None)``: the shipped
corpus's *train* split, half prose, half code), validation (for the best-state restore) on
``--val_blocks`` blocks per domain of the *calibration* split, ``--val_checks`` times per epoch.

Held-out: the first ``--eval_blocks`` non-overlapping blocks of each domain's held-out split, the
split neither training, calibration nor validation reads (``ompmoe/data/corpus/README.md``).
Recovered = ``(pruned - fine-tuned) / (pruned - unpruned)`` of the perplexity. CPU time is this
process's user + system time (``time.process_time``; threads add up), since the machine is shared.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import ompmoe  # noqa: E402
from ompmoe.data import CORPUS_DOMAINS, corpus_token_stream, shipped_model_path, token_blocks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """Token perplexity of ``blocks`` (every token after the first of a block predicted)."""
    model.eval()
    total, count = 0.0, 0
    for batch in blocks.split(batch_size):
        logits = model(input_ids=batch, use_cache=False).logits.float()
        total += float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(),
                                                         reduction="sum"))
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def prune_like_default_job(model: torch.nn.Module, name: str, tokenizer: str, seq_len: int) -> torch.nn.Module:
    """``configs/tiny.yaml``'s pruning: ratio 0.5, omp_normalized, loss allocation, 16 blocks of shipped:mix."""
    blocks = ompmoe.CalibrationDataModule("shipped:mix", tokenizer=tokenizer, seq_len=seq_len, num_blocks=16).blocks
    stats = ompmoe.collect_stats(model.eval(), blocks.split(4), model_id=name, source="shipped:mix", loss_aware=True)
    plan = ompmoe.plan_pruning(stats, 0.5, method="omp_normalized", allocation="loss", risk_weight=3.0,
                               min_kept_fraction=0.375, max_kept_fraction=0.875)
    return ompmoe.prune(model, plan)


def finetune(pruned: torch.nn.Module, teacher: torch.nn.Module, tokenizer: str, lora_rank: int,
             args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    """The documented recipe on a copy of ``pruned``; returns the model and the module (validation history)."""
    import lightning.pytorch as pl

    module = ompmoe.FinetuneModule(copy.deepcopy(pruned), learning_rate=args.lora_learning_rate if lora_rank else
                                   args.learning_rate, lora_rank=lora_rank, warmup_steps=args.warmup_steps,
                                   teacher=teacher if args.distill_weight else None,
                                   distill_weight=args.distill_weight)
    data = ompmoe.FinetuneDataModule(tokenizer=tokenizer, seq_len=args.seq_len, num_blocks=args.num_blocks,
                                     batch_size=args.batch_size, val_sources=["shipped:prose", "shipped:code"],
                                     val_blocks=args.val_blocks)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         val_check_interval=1.0 / args.val_checks)
    trainer.fit(module, data)
    return module.merged_model(), module


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.process_time()
    path = shipped_model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
    tokenizer = AutoTokenizer.from_pretrained(path)
    heldout = {d: token_blocks(corpus_token_stream(tokenizer, d, "heldout", max_tokens=args.eval_blocks * args.seq_len),
                               args.seq_len, args.eval_blocks) for d in CORPUS_DOMAINS}
    rows: dict[str, dict[str, float]] = {"unpruned": {d: perplexity(model, b) for d, b in heldout.items()}}
    pruned = prune_like_default_job(copy.deepcopy(model), name, str(path), args.seq_len)
    rows["pruned 0.5"] = {d: perplexity(pruned, b) for d, b in heldout.items()}
    cpu = {"setup + prune": time.process_time() - start}
    history = {}
    variants = [("full", 0), (f"LoRA r{args.lora_rank}", args.lora_rank)]
    for label, rank in [v for v in variants if v[0] in args.variants or v[0].split()[0] in args.variants]:
        began = time.process_time()
        tuned, module = finetune(pruned, model, str(path), rank, args)
        rows[f"fine-tuned {label}"] = {d: perplexity(tuned, b) for d, b in heldout.items()}
        cpu[label] = time.process_time() - began
        history[label] = module.validation_history
        print(f"{name} {label}: {rows[f'fine-tuned {label}']} cpu {cpu[label]:.0f}s, validation {history[label]}",
              flush=True)
    return {"name": name, "rows": rows, "cpu": cpu, "cpu_total": time.process_time() - start, "history": history}


def recovered(rows: dict[str, dict[str, float]], label: str, domain: str) -> float:
    gap = rows["pruned 0.5"][domain] - rows["unpruned"][domain]
    return 100.0 * (rows["pruned 0.5"][domain] - rows[label][domain]) / gap


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Settings: one epoch over {args.num_blocks} x {args.seq_len} tokens of `train:mix` "
        f"({args.num_blocks * args.seq_len:,} tokens), batch {args.batch_size}, AdamW lr {args.learning_rate:g} (full) / "
        f"{args.lora_learning_rate:g} (LoRA rank {args.lora_rank}, attention + experts), warm-up {args.warmup_steps} steps, "
        f"distillation from the unpruned model with weight {args.distill_weight:g}, "
        f"validation {args.val_checks}x per epoch on {args.val_blocks} x {args.seq_len} tokens per domain of the "
        f"calibration split, best state kept; held-out: {args.eval_blocks} x {args.seq_len} tokens per domain; "
        f"torch {torch.__version__}, {args.threads} threads.",
        "",
    ]
    for result in results:
        rows = result["rows"]
        lines += [f"**{result['name']}**: {result['cpu_total'] / 60:.1f} CPU minutes in all "
                  f"({', '.join(f'{k} {v / 60:.1f}' for k, v in result['cpu'].items())})", "",
                  "| model | " + " | ".join(f"{d} ppl | {d} recovered" for d in CORPUS_DOMAINS) + " |",
                  "|---|" + "---:|---:|" * len(CORPUS_DOMAINS)]
        for label, ppl in rows.items():
            cells = []
            for d in CORPUS_DOMAINS:
                share = f"{recovered(rows, label, d):.0f} %" if label.startswith("fine-tuned") else ""
                cells += [f"{ppl[d]:.2f}", share]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["shipped:tiny-moe", "shipped:tiny-moe-64"])
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--num_blocks", type=int, default=800)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--lora_learning_rate", type=float, default=1e-3)
    parser.add_argument("--lora_rank", type=int, default=8)
    parser.add_argument("--distill_weight", type=float, default=1.0,
                        help="weight of KL(unpruned || fine-tuned) in the loss (0: plain causal-LM loss)")
    parser.add_argument("--warmup_steps", type=int, default=5)
    parser.add_argument("--val_blocks", type=int, default=4)
    parser.add_argument("--val_checks", type=int, default=4)
    parser.add_argument("--variants", nargs="*", default=["full", "LoRA"], help="fine-tunes to run: full, LoRA")
    parser.add_argument("--eval_blocks", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None, help="also write the report (markdown) here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = [run_model(name, args) for name in args.models]
    text = report(results, args)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
