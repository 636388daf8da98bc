"""Fine-tuning with held-out validation per domain (FinetuneDataModule + FinetuneModule)."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

import ompmoe
from ompmoe.data import corpus_token_stream, resolve_shipped
from ompmoe.lightning.finetune_data import FinetuneDataModule


def test_heldout_sets_are_the_corpus_heldout_split_in_blocks():
    from transformers import AutoTokenizer

    default = FinetuneDataModule("shipped:mix", tokenizer="shipped:tiny-moe", seq_len=64, num_blocks=2)
    assert default.val_sources == ["shipped:prose", "shipped:code"]  # validates on neither trained nor reported text
    data = FinetuneDataModule("shipped:mix", tokenizer="shipped:tiny-moe", seq_len=64, num_blocks=2, val_blocks=3,
                              val_sources=["heldout:prose", "heldout:code"])
    data.setup("fit")
    loaders = data.val_dataloader()
    assert data.val_names == ["heldout:prose", "heldout:code"] and len(loaders) == 2
    tokenizer = AutoTokenizer.from_pretrained(resolve_shipped("shipped:tiny-moe"))
    for domain, loader in zip(("prose", "code"), loaders):
        blocks = torch.cat([batch["input_ids"] for batch in loader])
        expected = corpus_token_stream(tokenizer, domain, "heldout", max_tokens=3 * 64).reshape(3, 64)
        assert torch.equal(blocks, expected)
    # Training blocks are CalibrationDataModule's.
    plain = ompmoe.CalibrationDataModule("shipped:mix", tokenizer="shipped:tiny-moe", seq_len=64, num_blocks=2)
    assert torch.equal(data.blocks, plain.blocks)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"val_sources": ["heldout:poetry"]}, "Unknown held-out set 'heldout:poetry'; use one of heldout:prose, "
                                             "heldout:code or a data source."),
        ({"val_sources": ["heldout:code", "heldout:code"]}, "val_sources names a set twice: ['heldout:code', "
                                                           "'heldout:code']."),
        ({"val_blocks": 0}, "val_blocks must be positive; got 0."),
    ],
)
def test_bad_validation_sets_are_refused_up_front(kwargs, message):
    with pytest.raises(ValueError) as error:
        FinetuneDataModule(tokenizer="bytes", **kwargs)
    assert str(error.value) == message


def test_validation_loss_and_perplexity_are_logged_per_domain():
    module = ompmoe.FinetuneModule("tiny:qwen3_moe", learning_rate=1e-3)
    data = FinetuneDataModule("shipped:mix", tokenizer="bytes", seq_len=32, num_blocks=4, batch_size=2, val_blocks=3)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, data)
    metrics = trainer.callback_metrics
    module.eval()
    for name, loader in zip(data.val_names, data.val_dataloader()):
        with torch.no_grad():  # literal: each batch's loss, weighted by its number of blocks
            losses = [(module.compute_loss(batch).lm_loss.item(), batch["input_ids"].shape[0]) for batch in loader]
        expected = sum(loss * size for loss, size in losses) / sum(size for _, size in losses)
        assert metrics[f"val_loss/{name}"].item() == pytest.approx(expected, rel=1e-5)
        assert metrics[f"val_ppl/{name}"].item() == pytest.approx(math.exp(expected), rel=1e-5)
