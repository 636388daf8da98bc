"""The offline main job: calibrate, plan, prune, save and reload a tiny MoE on shipped text.

``ompmoe-demo --output_dir outputs/tiny`` runs everything a real job runs, on a tiny
random model of any supported architecture, in seconds and without a network.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .. import collect_stats, find_moe_layers, load_pruned, plan_pruning, prune, save_pruned
from ..engine.plan import validate_budget
from ..data import byte_tokens, shipped_text, token_blocks
from ..engine.io import OutputNotWritableError, atomic_path, check_writable
from ..engine.tiny import tiny_model


def prune_tiny_model(
    output_dir: str = "outputs/tiny",
    model_type: str = "qwen3_moe",
    ratio: float = 0.5,
    allocation: str = "waterfill",
    risk_weight: float = 3.0,
    min_ratio: float = 0.375,
    max_ratio: float = 0.875,
    seq_len: int = 256,
    num_blocks: int = 16,
    batch_size: int = 4,
    overwrite: bool = False,
) -> dict[str, float]:
    """Prune a tiny ``model_type`` MoE calibrated on the shipped text; write stats, plan and model.

    Args:
        output_dir: Directory for ``stats.safetensors``, ``plan.json`` and ``model/``.
        model_type: Architecture of the tiny random model (see ``ompmoe.supported_model_types()``).
        ratio: Fraction of routed experts removed over all MoE layers (0.5 removes half).
        allocation: ``uniform``, ``waterfill`` or ``optimal``.
        risk_weight: Lambda of the routing-risk term of the allocation cost.
        min_ratio: Fewest experts a layer may keep, as a fraction of its experts.
        max_ratio: Most experts a layer may keep, as a fraction of its experts.
        seq_len: Tokens per calibration block.
        num_blocks: Number of calibration blocks.
        batch_size: Blocks per forward pass.
        overwrite: Replace an existing ``output_dir``.
    """
    out = check_writable(output_dir, overwrite, directory=True)
    blocks = token_blocks(byte_tokens(shipped_text()), seq_len, num_blocks)
    model = tiny_model(model_type)
    validate_budget([(layer.name, layer.routing) for layer in find_moe_layers(model)], ratio, allocation, min_ratio, max_ratio)

    start = time.perf_counter()
    stats = collect_stats(model, blocks.split(batch_size), model_id=f"ompmoe.engine.tiny:{model_type}", source="shipped:python-docs")
    plan = plan_pruning(
        stats, ratio, allocation=allocation, risk_weight=risk_weight, min_ratio=min_ratio, max_ratio=max_ratio
    )
    probe = blocks[:2, :64]
    with torch.no_grad():
        original_logits = model(probe).logits
    prune(model, plan)
    with torch.no_grad():
        pruned_logits = model(probe).logits

    with atomic_path(out, overwrite=overwrite, directory=True) as tmp:
        stats.save(tmp / "stats.safetensors")
        plan.save(tmp / "plan.json")
        save_pruned(model, tmp / "model")
        with torch.no_grad():
            reloaded_logits = load_pruned(tmp / "model")(probe).logits
        if not torch.equal(reloaded_logits, pruned_logits):
            raise RuntimeError("The reloaded pruned model does not reproduce the in-memory logits.")
    elapsed = time.perf_counter() - start
    print(f"ompmoe: {model_type}, {stats.num_tokens} calibration tokens, ratio {ratio} ({allocation})")
    print(f"{'layer':<22}{'kept':>8}{'r(k)':>10}{'C(k)':>10}")
    for layer in plan.layers:
        k = layer.num_kept
        print(f"{layer.name:<22}{k:>4}/{layer.num_experts:<3}{layer.residual[k]:>10.4f}{layer.coverage[k]:>10.4f}")
    drift = float((pruned_logits - original_logits).abs().max())
    print(f"removed {plan.achieved_ratio:.3f} of routed experts; max logit change {drift:.4f}; "
          f"reload identical; {elapsed:.1f}s; wrote {Path(out).resolve()}")
    return {"achieved_ratio": plan.achieved_ratio, "seconds": elapsed}


def main() -> None:
    from jsonargparse import auto_cli

    try:
        auto_cli(prune_tiny_model, description=__doc__)
    except (ValueError, FileExistsError, FileNotFoundError, OutputNotWritableError) as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
