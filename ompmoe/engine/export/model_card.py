"""The ``README.md`` model card of a pruned checkpoint, in the Hugging Face convention.

The front matter lets the hub link the checkpoint to its base model; the body says what was pruned and how to load it.
"""

from __future__ import annotations

import math
import os
from functools import cache
from typing import Any

import transformers
import yaml

from ..hub import is_hub_id
from ..compressed_tensors_format import describe, experts_fp4
from ..model_classes import auto_class_of
from ..names import CORPUS_DOMAINS, SHIPPED_TEXT_RECORD, corpus_record
from ..record import ADAPTIVE_KEY, EARLIER_KEY, within_tolerance
from .config import finetune_records


def _is_hub_id(name: str | None) -> bool:
    """A hub repository id with its owner (``org/name``): what the hub takes as ``base_model``."""
    return bool(name) and "/" in str(name) and is_hub_id(str(name))


def front_matter(model_id: str | None, model_type: str | None, uniform: bool) -> dict[str, Any]:
    """The card's metadata; ``base_model`` only for a hub id (the hub rejects local paths)."""
    tags = ["ompmoe", "moe", "expert-pruning", "uniform-experts" if uniform else "non-uniform-experts"]
    if model_type:
        tags.append(model_type)
    if not uniform:
        tags.append("custom_code")
    base: dict[str, Any] = {"base_model": model_id} if _is_hub_id(model_id) else {}
    return {**base, "library_name": "transformers", "pipeline_tag": "text-generation", "tags": tags}


CORPUS_PREFIXES = {"shipped": "calibration", "train": "train", "heldout": "heldout"}
"""Prefix of the shipped corpus's source names (``shipped:mix``, ``train:prose``, ``heldout:code``) -> its split."""


@cache
def _source_names() -> dict[str, str]:
    """A shipped source as recorded (:meth:`~ompmoe.data.sources.TextSource.describe`, files inside the package) or
    as passed (``train:mix``) -> the name a user passes, explained."""
    names = {SHIPPED_TEXT_RECORD: "shipped (the calibration text shipped with ompmoe: Python reference documentation)"}
    parts = {**{domain: (domain,) for domain in CORPUS_DOMAINS}, "mix": CORPUS_DOMAINS}
    for prefix, split in CORPUS_PREFIXES.items():
        for part, domains in parts.items():
            name = f"{prefix}:{part}"
            explained = (f"{name} (the shipped corpus's {'held-out' if split == 'heldout' else split} split: "
                         f"{' + '.join(domains)})")
            names[name] = names[corpus_record(domains, split)] = explained
    return names


def readable_source(recorded: str) -> str:
    """``recorded`` (sources as the statistics record them, several joined by ``; ``) with each shipped one named as
    a user names it, and what it is: ``shipped:mix (the shipped corpus's calibration split: prose + code)`` for
    ``shipped:ompmoe/data/corpus/prose-calibration,shipped:ompmoe/data/corpus/code-calibration``. The statistics file
    keeps the exact record; the card is read by people. Other sources stay as recorded."""
    names = _source_names()
    return "; ".join(names.get(part, part) for part in recorded.split("; "))


def _compensation(record: dict[str, Any] | None, earlier: list[dict[str, Any]] = ()) -> str:
    """The card's compensation cell: what was fitted into the kept experts, on how much text, and what it did; with
    none fitted by the last pruning, whether an ``earlier`` one's is in the weights."""
    if not record:
        if any(_applied(step.get("compensation")) for step in earlier):
            return "none in the last pruning; the kept experts carry an earlier pruning's (see Pruned before)"
        return "none (the kept experts are the original's)"
    if record.get("granularity") == "down":
        text = (f"down projections of the kept experts refit by least squares to the original's routed output "
                f"(ridge alpha {record.get('ridge_alpha', '?')} toward the linear map's)")
    else:
        text = f"{record.get('granularity', '?')} least-squares correction of the kept experts' output"
    if record.get("num_tokens"):
        text += f", fitted on {record['num_tokens']} calibration tokens"
    if "routed_error_before" in record:
        text += (f" (relative routed-output error {record['routed_error_before']:.3f} -> "
                 f"{record['routed_error_after']:.3f})")
    if "loss_with" in record:
        text += "; " + compensation_check(record)
    return text


def _applied(compensation: dict[str, Any] | None) -> bool:
    """A compensation record whose correction is in the weights (``auto`` records one it tried and did not keep)."""
    return bool(compensation) and compensation.get("applied", True)


def earlier_summary(step: dict[str, Any]) -> str:
    """One earlier pruning of a re-pruned model (:func:`~ompmoe.engine.record.earlier_pruning`): ``omp, ratio 0.5,
    uniform allocation, 64 calibration tokens, linear compensation: kept 16 of 32 routed experts``."""
    plan = step.get("plan") or {}
    parts = [str(plan.get("method", "method not recorded")),
             f"ratio {plan['ratio']:g}" if plan.get("ratio") is not None else "ratio not recorded",
             f"{plan.get('allocation', 'not recorded')} allocation",
             f"{plan['num_tokens']} calibration tokens" if plan.get("num_tokens") else "calibration tokens not recorded"]
    if _applied(step.get("compensation")):
        parts.append(f"{step['compensation'].get('granularity', '?')} compensation")
    return f"{', '.join(parts)}: kept {step.get('kept', '?')} of {step.get('of', '?')} routed experts"


def compensation_check(record: dict[str, Any]) -> str:
    """The held-out check that kept the map: ``held-out calibration loss 3.9510 -> 3.9610 on 8 blocks: kept, it
    raised the loss by 0.0100 nats, within the 0.02-nat tolerance``, so a rise is never read as a mistake."""
    blocks = f" on {record['check_blocks']} blocks" if record.get("check_blocks") else ""
    verdict = "kept" if record.get("applied", True) else "not kept"
    note = within_tolerance(record)
    return (f"held-out calibration loss {record['loss_without']:.4f} -> {record['loss_with']:.4f}{blocks}: {verdict}"
            f"{f', {note}' if note else ''}")


def _finetune_summary(stage: str, record: dict[str, Any]) -> str:
    """``LoRA, 200 steps after pruning``: the fine-tune in the card's main table."""
    return f"{'LoRA' if record.get('method') == 'lora' else 'full'}, {record.get('steps', '?')} steps {stage}".rstrip()


def _finetune_method(record: dict[str, Any]) -> str:
    lora = record.get("lora")
    if record.get("method") != "lora" or not isinstance(lora, dict):
        return "full: every parameter trained"
    adapted = ", ".join([*lora.get("modules", []), *lora.get("expert_parameters", [])]) or "not recorded"
    return (f"LoRA rank {lora.get('rank')} (alpha {lora.get('alpha'):g}) on {adapted}, merged into the weights; "
            "routers, norms, embeddings and the LM head frozen")


def _finetune_loss(record: dict[str, Any]) -> str:
    text = "causal-LM cross-entropy"
    if record.get("teacher") is not None:
        weight = record.get("distill_weight", 0.0)
        text = (f"{1 - weight:g} x causal-LM cross-entropy + {weight:g} x per-token KL(teacher, model), distilled "
                f"from {record['teacher']}")
    if record.get("aux_loss_coef"):
        text += f" + {record['aux_loss_coef']:g} x per-layer load-balancing loss"
    return text


def _finetune_data(record: dict[str, Any]) -> str:
    data = record.get("data")
    if not isinstance(data, dict) or not data.get("source"):
        return "the user's own data loaders (not described)"
    shape = (f", {data['num_blocks']} blocks of {data['seq_len']} tokens, batch {data['batch_size']}"
             if data.get("num_blocks") else "")
    return f"{readable_source(str(data['source']))}{shape}"


def _validation_rows(validation: Any) -> list[str]:
    """The recovery the fine-tune measured: each validation set's loss (and perplexity) before -> after, their mean,
    and which state was saved."""
    if not isinstance(validation, dict) or "loss_before" not in validation:
        reason = validation.get("not_measured") if isinstance(validation, dict) else None
        return [f"| Validation | not measured: {reason or 'not recorded'} |"]
    before, after = validation["loss_before"], validation["loss_after"]
    rows = [f"| Validation loss, mean of {len(before)} set{'s' * (len(before) != 1)} | "
            f"{sum(before) / len(before):.4f} -> {sum(after) / len(after):.4f} |"]
    for index, name in enumerate(validation.get("sets", [])):
        ppl = (f" (perplexity {math.exp(before[index]):.2f} -> {math.exp(after[index]):.2f})"
               if validation.get("perplexity") else "")
        rows.append(f"| Validation loss, {readable_source(str(name))} | {before[index]:.4f} -> {after[index]:.4f}"
                    f"{ppl} |")
    start, kept, final = validation.get("before_step", 0), validation.get("kept_step"), validation.get("final_step")
    if kept == final:
        saved = f"the final state (step {final})"
    else:
        which = "the starting model" if kept == start else "the best validation state"
        saved = (f"{which} (step {kept}), restored: the final state (step {final}) had a higher mean validation "
                 f"loss, {validation.get('final_mean', float('nan')):.4f}")
    return [*rows, f"| Weights saved | {saved} |"]


def finetune_section(records: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The card's "Fine-tuning after pruning" section(s) (:func:`~.config.finetune_records`): how the saved weights
    were trained (method, loss, steps, data) and the recovery measured, so a reader can judge (and redo) the
    numbers."""
    lines: list[str] = []
    for number, (stage, record) in enumerate(records, 1):
        heading = f"## Fine-tuning {stage}".rstrip() + (f" ({number} of {len(records)})" if len(records) > 1 else "")
        optimizer = record.get("optimizer") or {}
        lines += [
            heading, "", "| | |", "|---|---|",
            f"| Method | {_finetune_method(record)} |",
            f"| Loss | {_finetune_loss(record)} |",
            f"| Optimizer | {optimizer.get('name', 'AdamW')}, learning rate {optimizer.get('learning_rate', 0):g}, "
            f"weight decay {optimizer.get('weight_decay', 0):g}, linear warm-up over "
            f"{optimizer.get('warmup_steps', 0)} step{'s' * (optimizer.get('warmup_steps') != 1)} |",
            f"| Steps | {record.get('steps', '?')} optimizer steps on {record.get('tokens', '?')} tokens |",
            f"| Data | {_finetune_data(record)} |",
            *_validation_rows(record.get("validation")),
            "",
        ]
    return lines


def _module_order(name: str) -> list[tuple[int, int | str]]:
    """``model.layers.2.mlp`` before ``model.layers.10.mlp``: config.json stores the record with sorted keys."""
    return [(0, int(part)) if part.isdigit() else (1, part) for part in name.split(".")]


def weights_dtype(config: dict[str, Any], dtype: str | None) -> str:
    """The card's weights row: the dtype, or a quantized checkpoint's format (its tensors as the source stores them)."""
    quantization = config.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    compensated = _applied((config.get("ompmoe") or {}).get("compensation"))
    stored = ("the kept experts' compensated down projections quantized again where the source quantizes them, the "
              "others the source's tensors as it stores them" if compensated else
              "the source's tensors as it stores them")
    if method == "fp8":
        rows, cols = quantization.get("weight_block_size") or ("?", "?")
        return f"FP8 (e4m3, one scale per {rows}x{cols} block; {stored}), the rest {dtype or 'not recorded'}"
    if method == "mxfp4":
        return f"MXFP4 experts (e2m1, one power-of-two scale per 32 values; {stored}), the rest {dtype or 'not recorded'}"
    if method == "compressed-tensors":
        return f"compressed-tensors ({describe(quantization)}; {stored}), the rest {dtype or 'not recorded'}"
    return dtype or "not recorded"


def _text_model_of(model_id: str) -> bool:
    """Whether ``model_id`` (its config from local files or the cache, nothing downloaded) is a checkpoint ompmoe
    reads as its text model; ``False`` where its config cannot be read."""
    from .config import read_as_text_model

    try:
        return read_as_text_model(model_id, local_files_only=True) is not None
    except Exception:  # noqa: BLE001 - a name whose config is not here: nothing to say
        return False


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
    finetunes = finetune_records(config)
    earlier = record.get(EARLIER_KEY) or []
    meta = yaml.safe_dump(front_matter(model_id, config.get("model_type"), uniform), sort_keys=False).rstrip()
    # a model pruned again names the model its first pruning started from (the one it loaded is a pruned output)
    named = next((step["plan"].get("model_id") for step in earlier[:1] if step.get("plan", {}).get("model_id")),
                 model_id)
    title = f"# {os.path.basename(str(named).rstrip('/')) if named else 'MoE model'}, experts pruned with ompmoe"
    lines = ["---", meta, "---", "", title, ""]
    if model_id and not _is_hub_id(model_id):
        lines += [f"Base model: `{model_id}` (not a Hugging Face Hub id, so no `base_model` above).", ""]
    if model_id and _text_model_of(model_id):
        lines += [f"This is the text model of `{model_id}`, whose multimodal class cannot run in transformers "
                  f"{transformers.__version__}: ompmoe read and pruned its text model, and the vision tower is not in "
                  "this checkpoint.", ""]
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
        f"| Compensation | {_compensation(record.get('compensation'), earlier)} |",
        *([f"| OMP-MoE+ (adaptive inference) | epsilon {adaptive['epsilon']:g}: each token skips the low-energy tail "
           "of its top-k experts when loaded with `ompmoe.load_pruned`; a plain `from_pretrained` (lm-eval's "
           f"`{'hf' if auto_class_of(config) == 'AutoModelForCausalLM' else 'hf-multimodal'}` model, serving "
           "engines) runs every top-k expert: the static pruned model, whose quality and speed differ "
           "(`ompmoe.engine.apply.adaptive.restore_adaptive(model)` switches it on after such a load) |"]
          if isinstance(adaptive := config.get(ADAPTIVE_KEY), dict) else []),
        *([f"| Pruned before | {'; then '.join(earlier_summary(step) for step in earlier)} (the method, "
           "requested ratio, allocation and compensation above are the last pruning's, of the model the earlier "
           "left; the achieved ratio, kept ids and counts are against the original) |"] if earlier else []),
        f"| Calibration data | {readable_source(calibration or plan.get('calibration') or 'not recorded')} |",
        f"| Calibration tokens | {format(plan['num_tokens'], 'd') if plan.get('num_tokens') else 'not recorded'} |",
        *([f"| Calibration mode | {plan['calibration_mode']} (one decoder layer in memory at a time; the same "
           "statistics as resident) |"] if plan.get("calibration_mode") else []),
        f"| Weights dtype | {weights_dtype(config, info.get('dtype'))} |",
        f"| Tokenizer included | {'yes' if info.get('tokenizer') else 'no'} |",
        *([f"| Fine-tuned | {'; '.join(_finetune_summary(*finetune) for finetune in finetunes)} (see below) |"]
          if finetunes else []),
        "",
        "Per-layer rounding keeps `round((1 - ratio) * N)` experts of `N` for a uniform plan "
        "(REAP and llm-compressor keep `N - int(ratio * N)`).",
        "",
        *finetune_section(finetunes),
        "## Experts kept per layer",
        "",
        "| MoE layer | kept | of | kept ids (original numbering) |",
        "|---|---|---|---|",
    ]
    for name, ids in sorted(kept.items(), key=lambda item: _module_order(item[0])):
        lines.append(f"| `{name}` | {len(ids)} | {original.get(name, '?')} | {', '.join(map(str, ids))} |")
    lines += ["", "## How to load", ""]
    auto_class = auto_class_of(config)
    # lm-eval's `hf` loads causal LMs; its `hf-multimodal` the image-text-to-text classes (generation tasks).
    lm_eval_model = "hf" if auto_class == "AutoModelForCausalLM" else "hf-multimodal"
    if uniform:
        lines += [
            "Every MoE layer keeps the same number of experts, so this is a standard checkpoint of the original "
            "architecture: any tool that loads the base model loads it (transformers, lm-eval, vLLM, ...).",
            "",
            "```python",
            f"from transformers import {auto_class}, AutoTokenizer",
            f'model = {auto_class}.from_pretrained("path/to/this/directory")',
            'tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")',
            "```",
            "",
            "```bash",
            f"lm_eval --model {lm_eval_model} --model_args pretrained=path/to/this/directory --tasks ...",
            "```",
        ]
    else:
        lines += [
            "MoE layers keep different numbers of experts, which the stock config cannot describe. The directory "
            "carries its own modeling code (`configuration_ompmoe_pruned.py`, `modeling_ompmoe_pruned.py`, named in "
            "`auto_map`; they need only torch and transformers), so load it with remote code, or with ompmoe:",
            "",
            "```python",
            f"from transformers import {auto_class}, AutoTokenizer",
            f'model = {auto_class}.from_pretrained("path/to/this/directory", trust_remote_code=True)',
            'tokenizer = AutoTokenizer.from_pretrained("path/to/this/directory")  # needs no remote code',
            "# or, with ompmoe installed (no remote code):",
            "import ompmoe",
            'model = ompmoe.load_pruned("path/to/this/directory")',
            "```",
            "",
            "```bash",
            f"lm_eval --model {lm_eval_model} --model_args pretrained=path/to/this/directory,trust_remote_code=True "
            "--tasks ...",
            "```",
            "",
            "Without `trust_remote_code=True`, transformers refuses to build the model (also with "
            "`ignore_mismatched_sizes=True`) instead of loading wrongly sized experts. Serving stacks that only "
            "take the original architecture (e.g. vLLM) need a uniform plan: prune again with "
            "`allocation: uniform`.",
        ]
    quantization = config.get("quantization_config")
    if isinstance(quantization, dict) and quantization.get("quant_method") == "compressed-tensors" and experts_fp4(
            quantization):
        lines += [
            "",
            f"**NVFP4 experts.** transformers {transformers.__version__} reads NVFP4 routed experts stored per expert "
            "without their `weight_global_scale` (huggingface/transformers#48371): loaded with transformers or "
            "lm-eval's `hf` model, every expert is off by that constant, silently, and `ompmoe.load_pruned` refuses "
            "this checkpoint. Run it with an engine that reads NVFP4 (vLLM), which takes equal expert counts in every "
            "layer only (`allocation: uniform`).",
        ]
    lines.append("")
    return "\n".join(lines)
