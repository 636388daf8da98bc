"""Pruning composed with fine-tuning and weight-only quantization: held-out perplexity and size.

Run ``python benchmarks/quantize.py`` (about a minute on one CPU thread). Steps, on the shipped
text (Python docs, UTF-8 bytes as tokens; the last 10% is held out for perplexity and never seen
by training or calibration):

1. the tiny Qwen3-MoE (``ompmoe.engine.tiny``) is first trained for ``--train_steps`` steps on the
   training text, since perplexities of random weights mean nothing (``--train_steps 0`` shows
   the random model; ``--model PATH`` starts from a saved checkpoint instead);
2. OMP-MoE statistics on calibration blocks, plan at ``--ratio`` (waterfill), prune;
3. a short full fine-tune of the pruned model (``--finetune_steps``) with the per-layer
   load-balancing loss of ``ompmoe.recipes.finetune``; the dense model gets the same extra steps as a
   control row, since a short pre-training leaves both still improving;
4. torchao ``quantize_(model, Int8WeightOnlyConfig())`` (``nn.Linear`` only), then
   ``ompmoe.quantize_experts`` (fused routed-expert weights, int8 or int4).

Sizes are the bytes of all parameters and buffers, quantized tensors at their real size
(codes + scales). The tiny model has a 256-token vocabulary, so embeddings and LM head are a
larger share of it than in a real model.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch

import ompmoe
from ompmoe.data import byte_tokens, shipped_text, token_blocks
from ompmoe.recipes.finetune import causal_lm_loss
from ompmoe.recipes.quantization import quantization_summary
from ompmoe.engine.tiny import tiny_model


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """exp of the mean next-token negative log-likelihood over all predicted tokens of ``blocks``."""
    model.eval()
    total, count = 0.0, 0
    for batch in blocks.split(batch_size):
        logits = model(batch, use_cache=False, output_router_logits=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        total += float(nll)
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def train(model: torch.nn.Module, blocks: torch.Tensor, steps: int, lr: float, batch_size: int, seed: int) -> None:
    """Plain AdamW loop over random training blocks (causal-LM + per-layer aux loss)."""
    if steps <= 0:
        return
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        batch = blocks[torch.randint(len(blocks), (batch_size,), generator=generator)]
        loss = causal_lm_loss(model, {"input_ids": batch}, aux_coef=0.01).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:qwen3_moe", help="tiny:<model_type> or a checkpoint path (load_pruned)")
    parser.add_argument("--train_steps", type=int, default=300, help="pre-training steps of a tiny model")
    parser.add_argument("--finetune_steps", type=int, default=60, help="fine-tuning steps after pruning")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--calibration_blocks", type=int, default=32)
    parser.add_argument("--eval_blocks", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    tokens = byte_tokens(shipped_text())
    split = int(tokens.numel() * 0.9)
    train_tokens, held_out = tokens[:split], tokens[split:]
    train_blocks = token_blocks(train_tokens, args.seq_len, train_tokens.numel() // args.seq_len)
    eval_blocks = token_blocks(held_out, args.seq_len, min(args.eval_blocks, held_out.numel() // args.seq_len))
    calibration = train_blocks[: args.calibration_blocks]

    if args.model.startswith("tiny:"):
        model = tiny_model(args.model.removeprefix("tiny:"), seed=args.seed)
        train(model, train_blocks, args.train_steps, 3e-3, args.batch_size, args.seed)
        trained = f"{args.train_steps} training steps" if args.train_steps else "random weights: perplexity meaningless"
    else:
        model = ompmoe.load_pruned(args.model, dtype=torch.float32)
        trained = args.model
    model.eval()

    rows: list[tuple[str, str, torch.nn.Module]] = []

    def kept(m: torch.nn.Module) -> str:
        info = ompmoe.pruning_info(m)
        layers = [len(v) for v in info["kept_experts"].values()] if info else [layer.num_experts for layer in ompmoe.find_moe_layers(m)]
        return "/".join(str(n) for n in layers)

    rows.append(("dense", kept(model), copy.deepcopy(model)))
    if args.finetune_steps:  # control: the same extra training without pruning
        control = copy.deepcopy(model)
        train(control, train_blocks, args.finetune_steps, 1e-3, args.batch_size, args.seed + 1)
        rows.append((f"dense + {args.finetune_steps} steps (control)", kept(control), control))
    stats = ompmoe.collect_stats(model, calibration.split(args.batch_size))
    plan = ompmoe.plan_pruning(stats, args.ratio)
    pruned = ompmoe.prune(model, plan)
    rows.append((f"pruned {args.ratio:g} (OMP, waterfill)", kept(pruned), copy.deepcopy(pruned)))
    if args.finetune_steps:
        train(pruned, train_blocks, args.finetune_steps, 1e-3, args.batch_size, args.seed + 1)
        rows.append((f"+ fine-tuned {args.finetune_steps} steps", kept(pruned), copy.deepcopy(pruned)))

    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    base = copy.deepcopy(pruned)
    quantize_(base, Int8WeightOnlyConfig(set_inductor_config=False))
    rows.append(("+ torchao int8 nn.Linear", kept(pruned), base))
    for bits in (8, 4):
        quantized = copy.deepcopy(base)
        ompmoe.quantize_experts(quantized, bits=bits)
        rows.append((f"+ ompmoe int{bits} experts", kept(pruned), quantized))

    dense_size = quantization_summary(rows[0][2]).size_bytes
    print(f"ompmoe recipes benchmark: {args.model} ({trained}), held-out {eval_blocks.numel():,} tokens "
          f"(last 10% of the shipped text), torch {torch.__version__}, 1 thread")
    header = f"{'model':<34}{'experts/layer':>14}{'nn.Linear q':>13}{'expert W q':>12}{'bytes':>11}{'vs dense':>10}{'ppl':>9}"
    print(header)
    print("-" * len(header))
    for label, counts, m in rows:
        summary = quantization_summary(m)
        ppl = perplexity(m, eval_blocks)
        print(f"{label:<34}{counts:>14}{summary.linear_quantized:>6}/{summary.linear:<6}"
              f"{summary.expert_weights_quantized:>6}/{summary.expert_weights:<5}{summary.size_bytes:>11,}"
              f"{summary.size_bytes / dense_size:>10.3f}{ppl:>9.3f}")
    last = quantization_summary(rows[-1][2])
    print(f"not quantized: routers {last.routers - last.routers_quantized}/{last.routers}, embeddings "
          f"(nn.Embedding), norms, GPT-OSS expert biases; generation check: "
          f"{rows[-1][2].generate(eval_blocks[:1, :16], max_new_tokens=8, do_sample=False).shape[1] - 16} new tokens")
    print(f"done in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
