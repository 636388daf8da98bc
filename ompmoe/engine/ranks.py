"""What a pruning run needs from the processes it runs in: rank 0's decisions handed to every rank, and the full
model gathered from FSDP2 shards. A loop lends its own (Lightning's Trainer, Fabric) as a :class:`RunContext`."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from torch import nn

T = TypeVar("T")


@dataclass
class RunContext:
    """What a loop lends the run: its rank, its collectives, where lines, warnings and metrics go. The defaults are
    one process without loggers (a Python script, the demo); Lightning's Trainer and Fabric lend their own."""

    is_global_zero: bool = True
    world_size: int = 1
    broadcast: Callable[..., Any] = lambda obj, src=0: obj
    barrier: Callable[[str], None] = lambda name: None
    print: Callable[[str], None] = print
    warn: Callable[[str], None] = partial(warnings.warn, stacklevel=2)  # names the caller of what warns
    log_metrics: Callable[[dict[str, float]], None] = lambda metrics: None


LocalContext = RunContext
"""One process, no loggers: ``ompmoe.LocalContext()`` is what a script lends :class:`ompmoe.PruningRun`."""


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

    from .model_classes import default_model_class

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_global_zero:
        return None
    dtype = next(iter(state.values())).dtype
    full = default_model_class(model.config)._from_config(model.config, dtype=dtype)
    full.load_state_dict(state)
    return full.eval()


__all__ = ["LocalContext", "RunContext", "on_rank_zero", "unsharded"]
