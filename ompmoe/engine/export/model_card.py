"""The ``README.md`` model card of a pruned checkpoint, in the Hugging Face convention.

The front matter lets the hub link the checkpoint to its base model; the body says what was pruned and how to load it.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml


def _is_hub_id(name: str | None) -> bool:
    return bool(name) and not os.path.exists(str(name)) and re.fullmatch(r"[\w.-]+/[\w.-]+", str(name)) is not None


def front_matter(model_id: str | None, model_type: str | None, uniform: bool) -> dict[str, Any]:
    """The card's metadata; ``base_model`` only for a hub id (the hub rejects local paths)."""
    tags = ["ompmoe", "moe", "expert-pruning", "uniform-experts" if uniform else "non-uniform-experts"]
    if model_type:
        tags.append(model_type)
    if not uniform:
        tags.append("custom_code")
    base: dict[str, Any] = {"base_model": model_id} if _is_hub_id(model_id) else {}
    return {**base, "library_name": "transformers", "pipeline_tag": "text-generation", "tags": tags}


def _compensation(record: dict[str, Any] | None) -> str:
    """The card's compensation cell: what was fitted into the kept experts, on how much text, and what it did."""
    if not record:
        return "none (the kept experts are the original's)"
    text = f"{record.get('granularity', '?')} least-squares correction of the kept experts' output"
    if record.get("num_tokens"):
        text += f", fitted on {record['num_tokens']} calibration tokens"
    if "routed_error_before" in record:
        text += (f" (relative routed-output error {record['routed_error_before']:.3f} -> "
                 f"{record['routed_error_after']:.3f})")
    return text


def model_card(
    config: dict[str, Any], model_id: str | None, calibration: str | None, info: dict[str, Any]
) -> str:
    """Markdown card for a saved checkpoint whose ``config.json`` is ``config``."""
    record = config.get("ompmoe") or {}
    plan = record.get("plan") or {}
    kept = record.get("kept_experts") or {}
    original = record.get("original_num_experts") or {}
    uniform = bool(record.get("uniform", True))
    total_kept = sum(len(ids) for ids in kept.values())
    total = sum(original.values())
    ratio = "not recorded" if plan.get("ratio") is None else format(plan["ratio"], "g")
    meta = yaml.safe_dump(front_matter(model_id, config.get("model_type"), uniform), sort_keys=False).rstrip()
    title = f"# {os.path.basename(str(model_id)) if model_id else 'MoE model'}, experts pruned with ompmoe"
    lines = ["---", meta, "---", "", title, ""]
    if model_id and not _is_hub_id(model_id):
        lines += [f"Base model: `{model_id}` (not a Hugging Face Hub id, so no `base_model` above).", ""]
    if plan.get("statistics_model_id"):
        lines += [f"Statistics collected as `{plan['statistics_model_id']}`.", ""]
    lines += [
        "| | |",
        "|---|---|",
        f"| Method | {plan.get('method', 'not recorded')} |",
        f"| Requested ratio (experts removed) | {ratio} |",
        f"| Achieved ratio | {f'{1 - total_kept / total:.4f}' if total else 'not recorded'} "
        f"({total_kept} of {total} routed experts kept) |",
        f"| Allocation | {plan.get('allocation', 'not recorded')} |",
        f"| Compensation | {_compensation(record.get('compensation'))} |",
        f"| Calibration data | {calibration or plan.get('calibration') or 'not recorded'} |",
        f"| Calibration tokens | {format(plan['num_tokens'], 'd') if plan.get('num_tokens') else 'not recorded'} |",
        f"| Weights dtype | {info.get('dtype') or 'not recorded'} |",
        f"| Tokenizer included | {'yes' if info.get('tokenizer') else 'no'} |",
        "",
        "Per-layer rounding keeps `round((1 - ratio) * N)` experts of `N` for a uniform plan "
        "(REAP and llm-compressor keep `N - int(ratio * N)`).",
        "",
        "## Experts kept per layer",
        "",
        "| MoE layer | kept | of | kept ids (original numbering) |",
        "|---|---|---|---|",
    ]
    for name, ids in kept.items():
        lines.append(f"| `{name}` | {len(ids)} | {original.get(name, '?')} | {', '.join(map(str, ids))} |")
    lines += ["", "## How to load", ""]
    if uniform:
        lines += [
            "Every MoE layer keeps the same number of experts, so this is a standard checkpoint of the original "
            "architecture: any tool that loads the base model loads it (transformers, lm-eval, vLLM, ...).",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            'model = AutoModelForCausalLM.from_pretrained("path/to/this/directory")',
            'tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")',
            "```",
            "",
            "```bash",
            "lm_eval --model hf --model_args pretrained=path/to/this/directory --tasks ...",
            "```",
        ]
    else:
        lines += [
            "MoE layers keep different numbers of experts, which the stock config cannot describe. The directory "
            "carries its own modeling code (`configuration_ompmoe_pruned.py`, `modeling_ompmoe_pruned.py`, named in "
            "`auto_map`; they need only torch and transformers), so load it with remote code, or with ompmoe:",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            'model = AutoModelForCausalLM.from_pretrained("path/to/this/directory", trust_remote_code=True)',
            'tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")  # needs no remote code',
            "# or, with ompmoe installed (no remote code):",
            "import ompmoe",
            'model = ompmoe.load_pruned("path/to/this/directory")',
            "```",
            "",
            "```bash",
            "lm_eval --model hf --model_args pretrained=path/to/this/directory,trust_remote_code=True --tasks ...",
            "```",
            "",
            "Without `trust_remote_code=True`, transformers refuses to build the model (also with "
            "`ignore_mismatched_sizes=True`) instead of loading wrongly sized experts. Serving stacks that only "
            "take the original architecture (e.g. vLLM) need a uniform plan: prune again with "
            "`allocation: uniform`.",
        ]
    lines.append("")
    return "\n".join(lines)
