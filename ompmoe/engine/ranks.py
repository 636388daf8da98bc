"""What a pruning run needs from the processes it runs in: rank 0's decisions handed to every rank, and the full
model gathered from FSDP2 shards. A loop lends its own (Lightning's Trainer, Fabric) as a :class:`RunContext`."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from torch import nn

T = TypeVar("T")


class RunContext(Protocol):
    """What a loop lends the run: its rank and its collectives (Lightning's Trainer, Fabric, or one process)."""

    is_global_zero: bool
    world_size: int

    def broadcast(self, obj: T, src: int = 0) -> T: ...

    def barrier(self, name: str) -> None: ...

    def print(self, line: str) -> None: ...

    def warn(self, message: str) -> None: ...

    def log_metrics(self, metrics: dict[str, float]) -> None: ...


class LocalContext:
    """One process, no loggers: what a Python script or the demo lends the run."""

    is_global_zero = True
    world_size = 1

    def broadcast(self, obj: T, src: int = 0) -> T:
        return obj

    def barrier(self, name: str) -> None:
        pass

    def print(self, line: str) -> None:
        print(line)

    def warn(self, message: str) -> None:
        warnings.warn(message, stacklevel=3)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        pass


def on_rank_zero(context: RunContext, function: Callable[[], T]) -> T:
    """``function()`` run on rank 0 only, its result (or its exception) given to every rank.

    Every rank raises the same error, so none is left waiting in a collective for a rank that stopped.
    """
    result: Any = None
    error: BaseException | None = None
    if context.is_global_zero:
        try:
            result = function()
        except Exception as caught:  # handed to every rank below, then raised on each
            error = caught
    if context.world_size > 1:
        result, error = context.broadcast((result, error), src=0)
    if error is not None:
        raise error
    return result


def unsharded(model: nn.Module, is_global_zero: bool) -> nn.Module | None:
    """``model`` itself, or for FSDP-sharded (DTensor) parameters a full CPU copy on rank 0 (``None`` elsewhere);
    gathering is a collective, so every rank must call this."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_global_zero:
        return None
    dtype = next(iter(state.values())).dtype
    full = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    full.load_state_dict(state)
    return full.eval()



__all__ = ["LocalContext", "RunContext", "on_rank_zero", "unsharded"]
