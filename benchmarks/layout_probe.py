"""What differs between the shipped layouts, measured: shared-expert share, correction bias, and routing loss.

    python benchmarks/layout_probe.py --blocks 8      # both shipped models, held-out blocks of each domain

Per MoE layer, on held-out tokens of the shipped corpus (prose and code, ``--blocks`` x 256 each):

- ``shared_share``: ``sum ||S||^2 / sum ||S + R||^2``, the shared expert's share of the block output's energy
  (``S`` shared output, ``R`` routed output), and ``cos_shared_routed``, the mean cosine between them;
- ``bias_changed``: the fraction of top-k slots whose expert changes when the router's correction bias is
  zeroed (the bias selects experts but does not weight them);
- ``kept_slots``: after pruning half the experts with a setting, the fraction of each token's original top-k
  experts that survive (the rest of its weight goes to experts the pursuit's atoms never saw it use),
  for ``omp_normalized`` + ``loss`` and ``reap`` + ``waterfill`` plans made on the shipped mix calibration.
"""

from __future__ import annotations

import argparse

import torch

import ompmoe
from ompmoe.data import CORPUS_DOMAINS, corpus_token_stream, shipped_model_path, token_blocks
from ompmoe.engine.adapters import find_moe_layers
from ompmoe.engine.strategy import PruningStrategy

SETTINGS = {"omp_normalized/loss": ("omp_normalized", "loss"), "reap/waterfill": ("reap", "waterfill")}


def probe(name: str, blocks: int) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = shipped_model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = torch.cat([token_blocks(corpus_token_stream(tokenizer, d, "heldout"), 256, blocks) for d in CORPUS_DOMAINS])
    calibration = ompmoe.CalibrationDataModule("shipped:mix", tokenizer=str(path), seq_len=256, num_blocks=16).blocks
    stats = ompmoe.collect_stats(model, calibration.split(8), loss_aware=True)
    plans = {label: PruningStrategy(ratio=0.5, method=m, allocation=a).plan(stats) for label, (m, a) in SETTINGS.items()}
    layers = find_moe_layers(model)
    record: dict[str, dict[str, list]] = {layer.name: {"shared": [], "routed": [], "topk": [], "nobias": []} for layer in layers}
    hooks = []
    for layer in layers:
        block, rec = layer.block, record[layer.name]
        shared = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
        if shared is not None:
            hooks.append(shared.register_forward_hook(lambda m, i, o, rec=rec: rec["shared"].append(o.detach())))
            hooks.append(block.register_forward_hook(lambda m, i, o, rec=rec: rec["routed"].append(
                (o[0] if isinstance(o, tuple) else o).detach() - rec["shared"][-1])))
        router = layer.router

        def on_router(module, inputs, output, rec=rec):
            rec["topk"].append(output[2].detach())
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                saved = bias.detach().clone()
                bias.data.zero_()
                rec["nobias"].append(module.forward(*inputs)[2].detach())  # .forward: no hooks, no recursion
                bias.data.copy_(saved)
        hooks.append(router.register_forward_hook(on_router))
    with torch.no_grad():
        for batch in data.split(8):
            model(input_ids=batch, use_cache=False)
    for hook in hooks:
        hook.remove()
    rows = []
    for layer in layers:
        rec = record[layer.name]
        row = {"model": name, "layer": layer.name}
        if rec["shared"]:
            shared = torch.cat([s.flatten(0, -2) for s in rec["shared"]]).double()
            routed = torch.cat([r.flatten(0, -2) for r in rec["routed"]]).double()
            row["shared_share"] = float(shared.square().sum() / (shared + routed).square().sum())
            row["cos_shared_routed"] = float(torch.nn.functional.cosine_similarity(shared, routed, dim=-1).mean())
        topk = torch.cat(rec["topk"])
        if rec["nobias"]:
            nobias = torch.cat(rec["nobias"])
            same = (topk.unsqueeze(-1) == nobias.unsqueeze(-2)).any(-1)
            row["bias_changed"] = float(1 - same.double().mean())
        for label, plan in plans.items():
            kept = torch.zeros(layer.num_experts, dtype=torch.bool)
            kept[plan.kept_by_layer()[layer.name]] = True
            row[f"kept_slots {label}"] = float(kept[topk].double().mean())
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", default=["shipped:tiny-moe", "shipped:tiny-moe-64"])
    parser.add_argument("--blocks", type=int, default=8, help="held-out blocks of 256 tokens per domain")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.model:
        rows = probe(name, args.blocks)
        keys = [key for key in rows[0] if key not in ("model", "layer")]
        print(f"\n{name}\n| layer | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
        for row in rows:
            print(f"| {row['layer']} | " + " | ".join(f"{row.get(k, float('nan')):.3f}" for k in keys) + " |")
        print("| mean | " + " | ".join(f"{sum(r.get(k, 0) for r in rows) / len(rows):.3f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
