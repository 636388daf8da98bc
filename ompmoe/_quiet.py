"""Keep third-party messages a user of ompmoe cannot act on off their terminal.

:func:`quiet_third_party` is for the command-line entry points only (library callers own their logging); warnings and
ompmoe's own ``ompmoe: ...`` lines always stay. The library API wraps its own calls into transformers in
:func:`quiet_calls`, which changes nothing outside them (docs/usage.md, "Messages in Python").
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator

# torchao's ``Failed to load ..._C_*.so`` (kernels built for other Python or CUDA versions) and torch's
# "register_constant() on Enum subclasses is deprecated" for torchao's enums, whenever transformers imports torchao.
_DROPPED = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("%s is an Enum subclass",),
}
# Lightning's informational lines (accelerator summary, seed, "fit stopped") and tips.
LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                     "lightning.fabric.utilities.seed", "lightning.pytorch.utilities.seed")


_OWN_SOURCES = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), folder) + os.sep
                     for folder in ("ompmoe", "callbacks", "eval"))
"""Where ompmoe's own code lies (``callbacks/`` and ``eval/`` sit beside ``ompmoe/`` in an editable install)."""
_stock_format = warnings.formatwarning


def _format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    line: str | None = None) -> str:
    """ompmoe's own warnings as one ``warning:`` line: what to do is in the message, not in a source line."""
    if os.path.abspath(filename).startswith(_OWN_SOURCES):
        return f"warning: {message}\n"
    return _stock_format(message, category, filename, lineno, line)


def _keep(record: logging.LogRecord) -> bool:
    """Logging filter: drop ``_DROPPED``'s messages and, on Lightning's loggers, info lines not ompmoe's own."""
    message = str(record.msg)
    if message.startswith(_DROPPED.get(record.name, ())):
        return False
    return record.name not in LIGHTNING_LOGGERS or record.levelno >= logging.WARNING or message.startswith("ompmoe")


def quiet_third_party() -> None:
    """Install the filters above, best before torch, transformers or Lightning are imported."""
    for name in (*_DROPPED, *LIGHTNING_LOGGERS):  # addFilter skips a filter the logger has already
        logging.getLogger(name).addFilter(_keep)
    if not sys.stderr.isatty():  # a log file or CI would get one line per progress-bar update
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is imported
        os.environ.setdefault("TQDM_DISABLE", "1")  # lm-eval's request-building bars (explicit disable=False wins)
        if "transformers" in sys.modules:  # already imported: switch its bars off directly
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
    warnings.formatwarning = _format_warning
    # Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecates, on every fit; only a Lightning
    # release can act on it.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # peft (LoRA fine-tuning) reads a property transformers 5 deprecates; only a peft release can act on it.
    warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING, category=FutureWarning)


def passive_omp_threads(command: bool) -> None:
    """In a command, before torch loads OpenMP: its threads then sleep, not spin, while they wait (on 2 shared cores
    the README's fit took 38 s instead of 112 s, the demo 20 s instead of 49 s, and spinning threads made each step of
    the fine-tuning recipe 15 times slower; docs/performance.md). An ``OMP_WAIT_POLICY`` set already wins."""
    if command and "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


GRADIENT_CHECKPOINTING = "`is_gradient_checkpointing` is deprecated"
"""transformers 5's FutureWarning when peft's ``get_peft_model`` reads the property (``PeftModel.__init__``)."""


@contextlib.contextmanager
def quiet_calls() -> Iterator[None]:
    """Around ompmoe's own calls into transformers (``from_pretrained``, ``save_pretrained``, building a tiny model):
    no ``Loading weights`` / ``Writing model shards`` bars, and the lines the first import of transformers' modeling
    code prints through torchao (``Failed to load ..._C_*.so``, torch's ``register_constant() on Enum subclasses``)
    dropped. Everything is put back on exit, so the caller's own calls keep their bars and logging; the hub's download
    bars are left alone. Nests; not meant for calls made from several threads at once."""
    from transformers.utils import logging as hf_logging

    added = [logger for logger in map(logging.getLogger, _DROPPED) if _keep not in logger.filters]
    for logger in added:  # those lacking it: quiet_third_party() may have installed it for good
        logger.addFilter(_keep)
    hook = getattr(hf_logging, "set_tqdm_hook", None)
    previous = getattr(hf_logging, "_tqdm_hook", None)
    switch = hook is None and hf_logging.is_progress_bar_enabled()  # a transformers release without the hook
    if hook is not None:  # transformers' own bars only (weights, shards), not the hub's downloads
        hook(lambda factory, args, kwargs: hf_logging.EmptyTqdm(*args, **kwargs))
    elif switch:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hook is not None:
            hook(previous)
        elif switch:
            hf_logging.enable_progress_bar()
        for logger in added:
            logger.removeFilter(_keep)
