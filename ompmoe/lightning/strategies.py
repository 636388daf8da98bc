"""The Trainer strategies :class:`~ompmoe.callbacks.ExpertPruning` cannot run under, refused in its ``setup`` (before
the model is built or any batch runs) with the strategy that works instead."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher


def check_trainer_strategy(strategy: Any) -> None:
    """Refuse FSDP1 (its flat parameters cannot be sliced per expert) and strategies that spawn or fork their
    processes (Lightning loads the spawned rank 0's pruned weights back into the main process's unpruned model)."""
    if isinstance(strategy, FSDPStrategy):
        raise ValueError("ExpertPruning shards with FSDP2: use ModelParallelStrategy(data_parallel_size=N, "
                         "tensor_parallel_size=1) (as configs/qwen3-30b-a3b.yaml does) instead of FSDPStrategy, "
                         "whose flattened FSDP1 parameters cannot be gathered and sliced per expert.")
    launcher = getattr(strategy, "launcher", None)
    if isinstance(launcher, _MultiProcessingLauncher):
        raise ValueError(f"ExpertPruning cannot run under strategy={type(strategy).__name__} started by "
                         f"{launcher._start_method!r} (ddp_spawn, ddp_fork, ddp_notebook): Lightning copies the "
                         "spawned rank 0's weights back into the unpruned model of the main process, which no longer "
                         "fit. Use strategy='ddp' (ompmoe fit, a script run by Lightning, fabric run or torchrun "
                         "start one process per device).")


def epochs_warning(trainer: Any) -> str | None:
    """What a fit of more than one epoch does to the statistics (each batch counted once per epoch: the time of as many
    passes for nothing new; Lightning's own default, without max_epochs or max_steps, is 1000 epochs), else ``None``."""
    epochs = trainer.max_epochs
    if epochs is None or epochs <= 1 or trainer.max_steps != -1:  # one epoch, or bounded otherwise (max_steps)
        return None
    return (f"ExpertPruning counts every batch of every epoch: max_epochs={epochs} runs the calibration data "
            f"{epochs} times, counting each batch again each time (no new information, that many times the time). "
            "Set Trainer(max_epochs=1), as configs/*.yaml do.")


__all__ = ["check_trainer_strategy", "epochs_warning"]
