"""Keep third-party messages a user of an ``ompmoe`` command cannot act on off their terminal.

Called first thing by the command-line entry points (never by the library API, whose callers own
their logging). What is dropped, and why nobody can act on it:

* torchao's ``Failed to load ..._C_*.so`` for kernels built for other Python or CUDA versions, and
  torch's "register_constant() on Enum subclasses is deprecated" for torchao's enums, printed
  whenever transformers imports an installed torchao;
* Hugging Face's "Loading weights" / "Writing model shards" bars and lm-eval's bars when stderr is
  not a terminal (a log file or CI gets one line per update);
* Lightning's informational lines (accelerator summary, seed, "fit stopped") and tips; warnings
  and ompmoe's own ``ompmoe: ...`` lines stay;
* Lightning 2.6's use of a torch pytree API that torch 2.13 deprecates, and peft's of a transformers
  property that transformers 5 deprecates.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

_DROPPED = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("%s is an Enum subclass",),
}
LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                     "lightning.fabric.utilities.seed", "lightning.pytorch.utilities.seed")


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


class _OnlyOwnInfo(logging.Filter):
    """Warnings and errors pass; of the info lines only ompmoe's own (``ompmoe: ...``) do."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or str(record.msg).startswith("ompmoe")


def _add_once(logger: logging.Logger, kind: type, *args) -> None:
    if not any(type(existing) is kind for existing in logger.filters):
        logger.addFilter(kind(*args))


def quiet_third_party() -> None:
    """Install the filters above, best before torch, transformers or Lightning are imported."""
    for name, prefixes in _DROPPED.items():
        _add_once(logging.getLogger(name), _DropMessages, prefixes)
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when huggingface_hub is imported
        os.environ.setdefault("TQDM_DISABLE", "1")  # lm-eval's request-building bars (explicit disable=False wins)
        if "transformers" in sys.modules:  # already imported: switch its bars off directly
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
    for name in LIGHTNING_LOGGERS:
        _add_once(logging.getLogger(name), _OnlyOwnInfo)
    # Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecates, on every fit; only a Lightning
    # release can act on it.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # peft (LoRA fine-tuning) reads a property transformers 5 deprecates; only a peft release can act on it.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
