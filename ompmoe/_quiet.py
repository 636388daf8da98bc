"""Keep third-party messages a user of an ``ompmoe`` command cannot act on off their terminal.

Called first thing by the command-line entry points, never by the library API, whose callers own their logging.
Warnings and ompmoe's own ``ompmoe: ...`` lines always stay; ompmoe's warnings print as one ``warning:`` line.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

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
    for name in (*_DROPPED, *LIGHTNING_LOGGERS):
        logger = logging.getLogger(name)
        if _keep not in logger.filters:
            logger.addFilter(_keep)
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
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
