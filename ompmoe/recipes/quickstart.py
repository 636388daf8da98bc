"""The offline main job: calibrate, plan, prune, save and reload a small MoE on shipped text.

``ompmoe-demo`` (writing ``outputs/demo``) runs everything a real job runs on the trained
``shipped:tiny-moe`` model (calibrated on the shipped corpus' calibration split, perplexity on its
held-out split before and after pruning), in seconds and without a network;
``--model tiny --model_type gpt_oss`` does the same on a tiny random model of any supported
architecture (byte tokens of the shipped text; its perplexity means nothing).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch

from .. import collect_stats, find_moe_layers, load_pruned, plan_pruning, prune, save_pruned
from ..engine.plan import validate_budget
from ..data import byte_tokens, corpus_token_stream, resolve_shipped, shipped_text, token_blocks
from ..engine.export.checkpoint import MissingTokenizerWarning
from ..engine.io import OutputNotWritableError, atomic_path, check_writable
from ..engine.summary import settings_summary
from ..engine.tiny import tiny_model


SHIPPED_MODEL = "shipped:tiny-moe"
DATA_DIR = Path(__file__).parents[1] / "data"
"""Everything the demo reads: the shipped models and text."""
RANDOM_MODEL = "tiny"


def demo_model_and_data(model: str, model_type: str, seq_len: int, num_blocks: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, str, str]:
    """``(model, calibration blocks, held-out blocks, model id, source)`` of the demo.

    The shipped model gets half its blocks from each domain's calibration split and is scored on
    the held-out splits; the random tiny model gets byte blocks of the shipped text.
    """
    if model == RANDOM_MODEL:
        blocks = token_blocks(byte_tokens(shipped_text()), seq_len, num_blocks + 2)
        return tiny_model(model_type), blocks[:num_blocks], blocks[num_blocks:], f"ompmoe.engine.tiny:{model_type}", "shipped:python-docs"
    if model != SHIPPED_MODEL:
        raise ValueError(f"model must be {SHIPPED_MODEL!r} (the trained shipped model) or {RANDOM_MODEL!r} (a random tiny "
                         f"model of model_type); got {model!r}. For other checkpoints use `ompmoe fit`.")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_shipped(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    network = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # stored in bf16 for size
    per_domain = [(num_blocks + 1) // 2, num_blocks // 2]
    calibration = torch.cat([
        token_blocks(corpus_token_stream(tokenizer, domain, "calibration", seq_len * count), seq_len, count)
        for domain, count in zip(("prose", "code"), per_domain) if count
    ])
    held_out = torch.cat([token_blocks(corpus_token_stream(tokenizer, domain, "heldout", seq_len), seq_len, 1)
                          for domain in ("prose", "code")])
    return network, calibration, held_out, model, "shipped:prose,code calibration splits"


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor) -> float:
    return float(model(blocks, labels=blocks).loss.exp())


def prune_tiny_model(
    output_dir: str = "outputs/demo",
    model: str = SHIPPED_MODEL,
    model_type: str = "qwen3_moe",
    ratio: float = 0.5,
    allocation: str = "waterfill",
    risk_weight: float = 3.0,
    min_kept_fraction: float = 0.375,
    max_kept_fraction: float = 0.875,
    seq_len: int = 256,
    num_blocks: int = 16,
    batch_size: int = 4,
    overwrite: bool = False,
) -> dict[str, float]:
    """Prune a tiny ``model_type`` MoE calibrated on the shipped text; write stats, plan and model.

    Args:
        output_dir: Directory for ``stats.safetensors``, ``plan.json`` and ``model/``.
        model: ``shipped:tiny-moe`` (the trained shipped Qwen3-MoE) or ``tiny`` (a random tiny model of ``model_type``).
        model_type: Architecture of the random tiny model (see ``ompmoe.supported_model_types()``); only with ``model=tiny``.
        ratio: Fraction of routed experts removed over all MoE layers (0.5 removes half).
        allocation: ``uniform``, ``waterfill`` or ``optimal``.
        risk_weight: Lambda of the routing-risk term of the allocation cost.
        min_kept_fraction: Fewest experts a layer may keep, as a fraction of its experts.
        max_kept_fraction: Most experts a layer may keep, as a fraction of its experts.
        seq_len: Tokens per calibration block.
        num_blocks: Number of calibration blocks.
        batch_size: Blocks per forward pass.
        overwrite: Replace an existing ``output_dir``.
    """
    inputs = [str(DATA_DIR)]  # the shipped model and text: an output holding them is never replaced
    out = check_writable(output_dir, overwrite, directory=True, inputs=inputs)
    model_name = model
    model, blocks, held_out, model_id, source = demo_model_and_data(model_name, model_type, seq_len, num_blocks)
    validate_budget([(layer.name, layer.routing) for layer in find_moe_layers(model)], ratio, allocation, min_kept_fraction, max_kept_fraction)

    start = time.perf_counter()
    stats = collect_stats(model, blocks.split(batch_size), model_id=model_id, source=source)
    plan = plan_pruning(
        stats, ratio, allocation=allocation, risk_weight=risk_weight, min_kept_fraction=min_kept_fraction,
        max_kept_fraction=max_kept_fraction
    )
    probe = blocks[:2, :64]
    with torch.no_grad():
        original_logits = model(probe).logits
    original_ppl = perplexity(model, held_out)
    prune(model, plan)
    with torch.no_grad():
        pruned_logits = model(probe).logits
    pruned_ppl = perplexity(model, held_out)

    with atomic_path(out, overwrite=overwrite, directory=True, inputs=inputs) as tmp:
        stats.save(tmp / "stats.safetensors")
        plan.save(tmp / "plan.json")
        with warnings.catch_warnings():
            if model_name == RANDOM_MODEL:  # byte tokens: there is no tokenizer to save, and no flag could add one
                warnings.simplefilter("ignore", MissingTokenizerWarning)
            save_pruned(model, tmp / "model", calibration="shipped:python-docs")
        with torch.no_grad():
            # Saved in the source checkpoint's dtype (bf16 for the shipped model, lossless: its weights are bf16
            # values); reload in the dtype the in-memory model computed in to compare logits exactly.
            dtype = next(model.parameters()).dtype
            reloaded_logits = load_pruned(tmp / "model", dtype=dtype)(probe).logits
        if not torch.equal(reloaded_logits, pruned_logits):
            raise RuntimeError("The reloaded pruned model does not reproduce the in-memory logits.")
    elapsed = time.perf_counter() - start
    print(f"ompmoe: {model_id}, {stats.num_tokens} calibration tokens, ratio {ratio}; {settings_summary(plan)}")
    print(f"{'layer':<22}{'kept':>8}{'r(k)':>10}{'C(k)':>10}")
    for layer in plan.layers:
        k = layer.num_kept
        print(f"{layer.name:<22}{k:>4}/{layer.num_experts:<3}{layer.residual[k]:>10.4f}{layer.coverage[k]:>10.4f}")
    drift = float((pruned_logits - original_logits).abs().max())
    meaning = "" if model_name == SHIPPED_MODEL else " (random model: meaningless)"
    if model_name == RANDOM_MODEL:
        print("ompmoe-demo: the random tiny model reads UTF-8 bytes as tokens, so model/ has no tokenizer files")
    print(f"held-out perplexity ({held_out.numel()} tokens){meaning}: {original_ppl:.2f} before, {pruned_ppl:.2f} after pruning")
    print(f"removed {plan.achieved_ratio:.3f} of routed experts; max logit change {drift:.4f}; "
          f"reload identical; {elapsed:.1f}s; wrote {Path(out).resolve()}")
    return {"achieved_ratio": plan.achieved_ratio, "seconds": elapsed, "perplexity_before": original_ppl,
            "perplexity_after": pruned_ppl}


def main() -> None:
    from jsonargparse import auto_cli

    from .._quiet import quiet_third_party

    quiet_third_party()
    try:
        auto_cli(prune_tiny_model, description=__doc__)
    except (ValueError, FileExistsError, FileNotFoundError, OutputNotWritableError) as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
