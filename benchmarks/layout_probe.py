"""What differs between the shipped layouts, measured: shared-expert share, correction bias, and routing loss.

    python benchmarks/layout_probe.py --blocks 8      # both shipped models, held-out blocks of each domain

Per MoE layer, on held-out tokens of the shipped corpus (prose and code, ``--blocks`` x 256 each):

- ``shared_share``: ``sum ||S||^2 / sum ||S + R||^2``, the shared expert's share of the block output's energy
  (``S`` shared output, ``R`` routed output), and ``cos_shared_routed``, the mean cosine between them;
- ``bias_changed``: the fraction of top-k slots whose expert changes when the router's correction bias is
  zeroed (the bias selects experts but does not weight them);
- ``kept_slots``: after pruning half the experts with a setting, the fraction of each token's original top-k
  experts that survive (the rest of its weight goes to experts the pursuit's atoms never saw it use),
  for ``omp_normalized`` + ``loss`` and ``reap`` + ``waterfill`` plans made on the shipped mix calibration;
- ``predicted_err`` / ``actual_err``: for the paper's ``omp`` + ``waterfill`` plan at 0.5, the relative error
  of the routed output ``||Y' - Y||^2 / ||Y||^2`` that the pursuit's atom model predicts (``sum`` of the Gram
  over the removed experts: their slots simply vanish), against the pruned block's real error on the same
  inputs (the router re-picks its top-k among the kept experts and renormalizes their weights);
- ``group_cost`` (group-limited routers): how much larger the pursuit's residual is with the same number of
  experts kept in every group than without that constraint, at the plan's count (Gram of the probe tokens).
"""

from __future__ import annotations

import argparse
import copy

import torch

import ompmoe
from ompmoe.data import CORPUS_DOMAINS, corpus_token_stream, shipped_model_path, token_blocks
from ompmoe.engine.adapters import find_moe_layers
from ompmoe.engine.planning.selection import greedy_pursuit
from ompmoe.engine.planning.strategy import PruningStrategy

PAPER = "omp/waterfill"
SETTINGS = {PAPER: ("omp", "waterfill"), "omp_normalized/loss": ("omp_normalized", "loss"), "reap/waterfill": ("reap", "waterfill")}


def remember_block(record: dict[str, list], inputs: tuple, output: object) -> None:
    """Keep a sparse block's input and output (a forward hook that must return ``None``)."""
    record["input"].append(inputs[0].detach())
    record["output"].append((output[0] if isinstance(output, tuple) else output).detach())


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
    record: dict[str, dict[str, list]] = {layer.name: {"shared": [], "routed": [], "topk": [], "nobias": [],
                                                       "input": [], "output": []} for layer in layers}
    hooks = []
    for layer in layers:
        block, rec = layer.block, record[layer.name]
        hooks.append(block.register_forward_hook(lambda m, i, o, rec=rec: remember_block(rec, i, o)))
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
    probe_stats = {layer.name: layer for layer in ompmoe.collect_stats(model, data.split(8)).layers}
    paper_kept = plans[PAPER].kept_by_layer()
    pruned = {layer.name: layer.block for layer in find_moe_layers(ompmoe.prune(copy.deepcopy(model), plans[PAPER]))}
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
        gram = probe_stats[layer.name].gram
        removed = torch.ones(layer.num_experts, dtype=torch.bool)
        removed[paper_kept[layer.name]] = False
        row["predicted_err"] = float(gram[removed][:, removed].sum() / gram.sum())
        shared = getattr(layer.block, "shared_experts", None) or getattr(layer.block, "shared_expert", None)
        error = energy = 0.0
        with torch.no_grad():
            for x, y in zip(rec["input"], rec["output"]):
                out = pruned[layer.name](x)
                out = out[0] if isinstance(out, tuple) else out
                routed = y - shared(x) if shared is not None else y  # the pursuit's signal Y
                error += float((out - y).double().square().sum())
                energy += float(routed.double().square().sum())
        row["actual_err"] = error / energy
        if layer.num_groups > 1:
            k = len(paper_kept[layer.name])
            balanced = greedy_pursuit(gram, num_groups=layer.num_groups, with_gains=False).residual[k]
            free = greedy_pursuit(gram, with_gains=False).residual[k]
            row["group_cost"] = float(balanced / free - 1)
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
