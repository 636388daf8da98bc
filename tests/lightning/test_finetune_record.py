"""A fine-tuned checkpoint says how it was fine-tuned: method, loss, steps, data and the recovery the fit measured, in
``config.json`` (``ompmoe.finetune``) and in its model card (issue 44, item 6)."""

from __future__ import annotations

import copy
import json
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import ompmoe
from ompmoe.engine.export.checkpoint import MissingTokenizerWarning
from ompmoe.engine.export.config import add_finetune_record, finetune_records
from ompmoe.engine.tiny import tiny_model
from ompmoe.lightning.finetune_data import FinetuneDataModule
from ompmoe.lightning.finetune_module import attention_linear_names, expert_parameter_names

TEACHER = "tiny:qwen3_moe"


def literal_set_losses(model: torch.nn.Module, data: FinetuneDataModule) -> list[float]:
    """Each validation set's mean next-token cross-entropy (its blocks are equally long and unpadded)."""
    losses = []
    with torch.no_grad():
        for loader in data.val_dataloader():
            ids = torch.cat([batch["input_ids"] for batch in loader])
            logits = model.eval()(input_ids=ids).logits
            losses.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item())
    return losses


def card_rows(directory) -> list[str]:
    return (directory / "README.md").read_text().splitlines()


def test_a_fine_tuned_checkpoint_records_method_steps_data_and_recovery_in_config_json_and_its_card(tmp_path):
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe")
    stats = ompmoe.collect_stats(model, [torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(0))])
    ompmoe.prune(model, ompmoe.plan_pruning(stats, 0.5, allocation="uniform"))
    pruned = copy.deepcopy(model)
    # The validation sets are the first blocks of the training text, so two steps lower their loss.
    data = FinetuneDataModule("shipped:mix", tokenizer="bytes", seq_len=32, num_blocks=4, batch_size=2, val_blocks=2)
    data.setup("fit")
    before = literal_set_losses(pruned, data)
    module = ompmoe.FinetuneModule(model, teacher=TEACHER, distill_weight=0.5, lora_rank=2, learning_rate=1e-2,
                                   warmup_steps=1, save_dir=str(tmp_path / "ft"))
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MissingTokenizerWarning)  # byte-level tiny model: no tokenizer files
        trainer.fit(module, data)

    saved = ompmoe.load_pruned(tmp_path / "ft")
    after = literal_set_losses(saved, data)
    (record,) = json.loads((tmp_path / "ft" / "config.json").read_text())["ompmoe"]["finetune"]
    assert record == module.finetune_record and ompmoe.pruning_info(saved)["finetune"] == [record]
    assert ompmoe.pruning_info(saved)["kept_experts"] == ompmoe.pruning_info(pruned)["kept_experts"]
    validation = record.pop("validation")
    modules, experts = attention_linear_names(pruned), expert_parameter_names(pruned)
    assert record == {
        "method": "lora",
        "lora": {"rank": 2, "alpha": 4.0, "dropout": 0.0, "modules": modules, "expert_parameters": experts},
        "teacher": TEACHER, "distill_weight": 0.5, "aux_loss_coef": 0.0,
        "optimizer": {"name": "AdamW", "learning_rate": 1e-2, "weight_decay": 0.0, "warmup_steps": 1},
        "steps": 2, "tokens": 2 * 2 * 32,  # steps x blocks per batch x tokens per block
        "data": {"source": "shipped:mix", "data_files": [], "seq_len": 32, "num_blocks": 4, "batch_size": 2},
    }
    assert validation.pop("loss_before") == pytest.approx(before, rel=1e-5)
    assert validation.pop("loss_after") == pytest.approx(after, rel=1e-5)
    assert sum(after) < sum(before)
    assert validation == {"sets": ["shipped:prose", "shipped:code"], "perplexity": True, "before_step": 0,
                          "kept_step": 2, "final_step": 2, "final_mean": pytest.approx(sum(after) / 2, rel=1e-5)}

    recorded = module.finetune_record["validation"]
    rows = card_rows(tmp_path / "ft")
    assert "| Fine-tuned | LoRA, 2 steps after pruning (see below) |" in rows
    start = rows.index("## Fine-tuning after pruning")
    b, a = recorded["loss_before"], recorded["loss_after"]
    assert rows[start:start + 15] == [
        "## Fine-tuning after pruning", "", "| | |", "|---|---|",
        f"| Method | LoRA rank 2 (alpha 4) on {', '.join(modules + experts)}, merged into the weights; routers, "
        "norms, embeddings and the LM head frozen |",
        f"| Loss | 0.5 x causal-LM cross-entropy + 0.5 x per-token KL(teacher, model), distilled from {TEACHER} |",
        "| Optimizer | AdamW, learning rate 0.01, weight decay 0, linear warm-up over 1 step |",
        "| Steps | 2 optimizer steps on 128 tokens |",
        "| Data | shipped:mix (the shipped corpus's calibration split: prose + code), 4 blocks of 32 tokens, batch 2 |",
        f"| Validation loss, mean of 2 sets | {sum(b) / 2:.4f} -> {sum(a) / 2:.4f} |",
        f"| Validation loss, shipped:prose (the shipped corpus's calibration split: prose) | {b[0]:.4f} -> "
        f"{a[0]:.4f} (perplexity {math.exp(b[0]):.2f} -> {math.exp(a[0]):.2f}) |",
        f"| Validation loss, shipped:code (the shipped corpus's calibration split: code) | {b[1]:.4f} -> "
        f"{a[1]:.4f} (perplexity {math.exp(b[1]):.2f} -> {math.exp(a[1]):.2f}) |",
        "| Weights saved | the final state (step 2) |",
        "",
        "## Experts kept per layer",
    ]


def test_a_fine_tune_of_a_never_pruned_model_is_recorded_beside_the_pruning_record_and_kept_by_a_later_prune(
        tmp_path):
    model = tiny_model("qwen3_moe")
    record = {"method": "full", "steps": 3, "tokens": 96, "data": None,
              "validation": {"not_measured": "keep_best=False validates no starting model to compare with"}}
    add_finetune_record(model.config, record)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MissingTokenizerWarning)
        ompmoe.save_pruned(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert "ompmoe" not in config and finetune_records(config) == [("", record)]  # no pruning record to mislead
    loaded = ompmoe.load_pruned(tmp_path / "m")
    assert ompmoe.pruning_info(loaded) is None
    rows = card_rows(tmp_path / "m")
    assert "| Fine-tuned | full, 3 steps (see below) |" in rows and "## Fine-tuning" in rows
    assert "| Method | full: every parameter trained |" in rows
    assert "| Data | the user's own data loaders (not described) |" in rows
    assert "| Validation | not measured: keep_best=False validates no starting model to compare with |" in rows

    # Pruned afterwards (e.g. calibrated again on the fine-tuned model): the card says the fine-tune came first.
    stats = ompmoe.collect_stats(loaded, [torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(0))])
    ompmoe.prune(loaded, ompmoe.plan_pruning(stats, 0.5, allocation="uniform"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MissingTokenizerWarning)
        ompmoe.save_pruned(loaded, tmp_path / "pruned")
    assert finetune_records(json.loads((tmp_path / "pruned" / "config.json").read_text())) == [
        ("before pruning", record)]
    rows = card_rows(tmp_path / "pruned")
    assert "| Fine-tuned | full, 3 steps before pruning (see below) |" in rows and "## Fine-tuning before pruning" in rows


def test_a_fine_tune_after_pruning_is_kept_as_before_pruning_when_the_model_is_pruned_again(tmp_path):
    model = tiny_model("qwen3_moe")
    calibration = [torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(0))]
    before, after = {"method": "lora", "steps": 2, "tokens": 64, "data": None}, {
        "method": "full", "steps": 3, "tokens": 96, "data": None}
    add_finetune_record(model.config, before)  # fine-tuned, then pruned
    ompmoe.prune(model, ompmoe.plan_pruning(ompmoe.collect_stats(model, calibration), 0.25, allocation="uniform"))
    add_finetune_record(model.config, after)  # fine-tuned again, then pruned again
    assert finetune_records(model.config.to_dict()) == [("before pruning", before), ("after pruning", after)]
    ompmoe.prune(model, ompmoe.plan_pruning(ompmoe.collect_stats(model, calibration), 0.25, allocation="uniform"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MissingTokenizerWarning)
        ompmoe.save_pruned(model, tmp_path / "twice")
    config = json.loads((tmp_path / "twice" / "config.json").read_text())
    assert finetune_records(config) == [("before pruning", before), ("before pruning", after)]
    assert "finetune" not in config["ompmoe"]
    assert "| Fine-tuned | LoRA, 2 steps before pruning; full, 3 steps before pruning (see below) |" in card_rows(
        tmp_path / "twice")
