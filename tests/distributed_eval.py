"""Run an lm-eval suite through LMEvalDataModule on 2 CPU processes (launched as a script by the tests).

usage: python tests/distributed_eval.py OUTPUT_JSON {ddp,fsdp2} BATCH_SIZE TASK [TASK ...]
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from ompmoe.eval import EvalModule, LMEvalDataModule

TASKS_DIR = str(Path(__file__).parent / "eval_tasks")


def main(output: str, mode: str, batch_size: int, tasks: list[str]) -> None:
    torch.set_num_threads(1)
    if mode == "ddp":
        strategy = "ddp"
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    datamodule = LMEvalDataModule(tasks=tasks, include_path=TASKS_DIR, batch_size=batch_size, bootstrap_iters=0,
                                  output_path=output, log_samples=True)
    metrics = trainer.validate(EvalModule("tiny:qwen3_moe"), datamodule=datamodule, verbose=False)
    # Every rank logs the same metrics; rank 1 checks it received rank 0's.
    assert metrics[0]["tiny_group/acc"] >= 0.0


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
