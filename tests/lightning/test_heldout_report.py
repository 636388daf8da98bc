"""A calibration fit says what pruning cost: held-out perplexity of the original and the pruned model per set."""

from __future__ import annotations

import copy
import logging

import lightning.pytorch as pl
import pytest
import torch

import ompmoe
from ompmoe.callbacks import ExpertPruning
from ompmoe.engine.perplexity import perplexity
from ompmoe.engine.tiny import tiny_model


def test_perplexity_is_the_models_own_mean_token_loss():
    model = tiny_model("qwen3_moe")
    blocks = torch.randint(3, 250, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = float(model(blocks, labels=blocks).loss.exp())  # one batch: HF's mean over every predicted token
    assert abs(perplexity(model, blocks, batch_size=3) - expected) < 1e-4 * expected
    assert abs(perplexity(model, blocks, batch_size=1) - expected) < 1e-4 * expected


def test_perplexity_runs_in_eval_mode_and_leaves_the_models_own_mode():
    model = tiny_model("qwen3_moe", attention_dropout=0.5).train()  # dropout would change every train-mode loss
    blocks = torch.randint(3, 250, (3, 24), generator=torch.Generator().manual_seed(0))
    measured = perplexity(model, blocks)
    assert model.training
    assert measured == perplexity(model.eval(), blocks)


def test_fit_reports_heldout_perplexity_before_and_after_pruning(tmp_path, caplog):
    module = ompmoe.CalibrationModule("tiny:qwen3_moe")
    data = ompmoe.CalibrationDataModule("shipped", tokenizer="bytes", seq_len=32, num_blocks=4, batch_size=2)
    callback = ExpertPruning(ompmoe.PruningStrategy(ratio=0.5), save_model=False, plots=False,
                             evaluate_on=["heldout:prose", "heldout:code"], evaluate_blocks=2)
    module.configure_model()
    original = copy.deepcopy(module.model)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    # Lightning's rank-zero logger reaches the root (and so caplog) only in some import orders: capture it at the
    # logger itself and stop it propagating meanwhile, so that every record is counted once
    lightning_log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    propagate, lightning_log.propagate = lightning_log.propagate, False
    lightning_log.addHandler(caplog.handler)
    try:
        with caplog.at_level("INFO", logger=lightning_log.name):
            trainer.fit(module, data)
    finally:
        lightning_log.removeHandler(caplog.handler)
        lightning_log.propagate = propagate
    for name in ("heldout:prose", "heldout:code"):
        blocks = data.heldout_blocks(name, 2)
        assert blocks.shape == (2, 32)
        assert callback.heldout_perplexity[name] == (perplexity(original, blocks, 2),
                                                     perplexity(callback.pruned_model, blocks, 2))
    (line,) = [r.getMessage() for r in caplog.records if "held-out perplexity" in r.getMessage()]
    (prose, code) = (callback.heldout_perplexity[n] for n in ("heldout:prose", "heldout:code"))
    assert line == (f"ompmoe: held-out perplexity on 64 tokens per set, original -> pruned: heldout:prose "
                    f"{prose[0]:.2f} -> {prose[1]:.2f}, heldout:code {code[0]:.2f} -> {code[1]:.2f}")


def test_heldout_sets_hold_8192_tokens_by_default_and_the_plan_records_them():
    from ompmoe.engine.perplexity import HELDOUT_TOKENS

    data = ompmoe.CalibrationDataModule("shipped", tokenizer="bytes", seq_len=3000, num_blocks=1)
    run = ompmoe.PruningRun(evaluate_on=["heldout:code"], plots=False)
    run.data, run.calibration_data = data, {"seq_len": 3000}
    assert HELDOUT_TOKENS == 8192 and run.heldout_record() == {"sets": ["heldout:code"], "blocks": 3,
                                                                "calibration_data": {"seq_len": 3000}}
    assert ompmoe.PruningRun(evaluate_on=["heldout:code"], evaluate_blocks=5, plots=False).heldout_record()["blocks"] == 5
    with pytest.raises(ValueError) as error:
        ompmoe.RunOptions(evaluate_blocks=0)
    assert str(error.value) == "evaluate_blocks must be positive (default: 8,192 tokens' worth); got 0."
