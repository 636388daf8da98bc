"""Run a calibration fit under a multi-process CPU strategy (launched as a script by the tests).

usage: python tests/distributed_fit.py OUTPUT_DIR {ddp,fsdp2} NUM_BLOCKS MODEL_TYPE [loss_aware]
"""

import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from ompmoe.lightning.calibration_module import CalibrationModule
from ompmoe.callbacks import ExpertPruning
from ompmoe.data import byte_tokens, shipped_text, token_blocks
from ompmoe import PruningStrategy


def calibration_batches(num_blocks: int, seq_len: int = 32) -> list[dict[str, torch.Tensor]]:
    blocks = token_blocks(byte_tokens(shipped_text()), seq_len, num_blocks)
    return [{"input_ids": block, "attention_mask": torch.ones_like(block)} for block in blocks]


def main(output_dir: str, mode: str, num_blocks: int, model_type: str, loss_aware: bool = False) -> None:
    if mode == "ddp":
        strategy = "ddp"
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    callback = ExpertPruning(PruningStrategy(ratio=0.5, min_kept_fraction=0.25), output_dir=output_dir, loss_aware=loss_aware)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(CalibrationModule(f"tiny:{model_type}"), DataLoader(calibration_batches(num_blocks), batch_size=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:] == ["loss_aware"])
