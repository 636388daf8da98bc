"""Fine-tuning data: training blocks as in calibration, plus one validation set per domain.

Fine-tuning on a mix of domains can help one and hurt another: :class:`ompmoe.FinetuneModule` logs
``val_loss/<name>`` and ``val_ppl/<name>`` per set to show it (docs/recipes.md, "Fine-tuning after pruning").
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from ..data.sources import HELDOUT_CORPUS, HELDOUT_PREFIX, corpus_sources
from .calibration_data import CalibrationBlocks, CalibrationDataModule

TRAIN_CORPUS = corpus_sources("train", "train")
"""``train:prose``, ``train:code``, ``train:mix``: the train split of the shipped corpus (what the shipped
models were trained on; disjoint from the calibration and held-out splits), ``mix`` half from each domain."""

SHIPPED_DEFAULT_SOURCE = "train:mix"
"""Training text when a shipped model (or a model pruned from one) is fine-tuned and no ``source`` is given."""


def shipped_origin(model: Any) -> str | None:
    """``shipped:<name>`` when ``model`` (a name, a path saved by :func:`ompmoe.save_pruned` or an instance) is a
    shipped model or was pruned from one (its record names the model its statistics came from), else ``None``."""
    if isinstance(model, str) and model.startswith("shipped:"):
        return model
    if isinstance(model, (str, os.PathLike)):
        config = Path(model, "config.json")
        record = json.loads(config.read_text(encoding="utf-8")).get("ompmoe") if config.is_file() else None
    else:
        record = getattr(getattr(model, "config", None), "ompmoe", None)
    origin = ((record or {}).get("plan") or {}).get("model_id")
    return origin if isinstance(origin, str) and origin.startswith("shipped:") else None


def default_source(model: Any) -> str:
    """The training text of a fine-tune without ``source``: ``train:mix`` for shipped models; others must name one."""
    if shipped_origin(model) is not None:
        return SHIPPED_DEFAULT_SOURCE
    raise ValueError(
        f"FinetuneDataModule has no default training text for {model!r} (only shipped models have one: "
        f"{SHIPPED_DEFAULT_SOURCE}). Pass source=<local file, hub data set or preset>, text disjoint from "
        "the data you evaluate on."
    )


class FinetuneDataModule(CalibrationDataModule):
    """:class:`ompmoe.CalibrationDataModule` for training, with one validation set per entry of ``val_sources``.

    Args:
        source: Training text: any ``CalibrationDataModule`` source, or ``train:prose`` / ``train:code`` /
            ``train:mix`` (the shipped corpus's train split). ``None`` (default): :func:`default_source` of
            the attached module's model, i.e. ``train:mix`` for a shipped model or one pruned from it.
        val_sources: Validation sets, each named by its entry: any ``CalibrationDataModule`` source, or
            ``heldout:prose`` / ``heldout:code`` (the shipped corpus's held-out split); empty: no validation.
            The default, the corpus's calibration split, is neither trained on nor reported on (``heldout:*``),
            so the best state it picks does not flatter the reported numbers.
        val_blocks: Blocks of ``seq_len`` tokens in each validation set.
        **kwargs: The other ``CalibrationDataModule`` arguments (``tokenizer``, ``seq_len``,
            ``num_blocks``, ``batch_size``, ...).
    """

    corpus = TRAIN_CORPUS  # besides shipped:*; source=None: decided in setup, from the attached module's model

    def __init__(self, source: str | None = None, val_sources: Sequence[str] = ("shipped:prose", "shipped:code"),
                 val_blocks: int = 8, **kwargs) -> None:
        super().__init__(source, **kwargs)
        if val_blocks <= 0:
            raise ValueError(f"val_blocks must be positive; got {val_blocks}.")
        self.val_sources = list(val_sources)
        for name in self.val_sources:
            if name.startswith(HELDOUT_PREFIX) and name not in HELDOUT_CORPUS:
                raise ValueError(f"Unknown held-out set {name!r}; use one of {', '.join(HELDOUT_CORPUS)} or a data "
                                 "source.")
        if len(set(self.val_sources)) != len(self.val_sources):
            raise ValueError(f"val_sources names a set twice: {self.val_sources}.")
        self.val_blocks = val_blocks
        self._val: list[CalibrationBlocks] | None = None

    def resolve_default_source(self) -> str:
        """Set ``source`` from the attached module's model when it was left ``None``; return it."""
        if self.source is None:
            module = getattr(getattr(self, "trainer", None), "lightning_module", None)
            if module is None:
                raise ValueError("FinetuneDataModule(source=None) takes its training text from the model: attach it "
                                 "to a Trainer with a FinetuneModule, or pass source=.")
            model = getattr(module, "model", None)
            self.source = default_source(model if model is not None else getattr(module, "model_name_or_path", None))
            self._text = self._text_source()
        return self.source

    @property
    def val_names(self) -> list[str]:
        """Names the validation losses are logged under (``val_loss/<name>``), in dataloader order."""
        return list(self.val_sources)

    def setup(self, stage: str | None = None) -> None:
        if stage != "validate":  # validation alone needs no training blocks
            self.resolve_default_source()
            super().setup(stage)
        if self._val is None and self.val_sources:
            self._val = [CalibrationBlocks(self.heldout_blocks(name, self.val_blocks)) for name in self.val_sources]

    def val_dataloader(self) -> list[DataLoader]:
        """One loader per validation set, in ``val_sources`` order."""
        if self._val is None:
            self.setup("validate")
        return [DataLoader(blocks, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
                for blocks in self._val or []]


__all__ = ["HELDOUT_PREFIX", "SHIPPED_DEFAULT_SOURCE", "TRAIN_CORPUS", "FinetuneDataModule", "default_source",
           "shipped_origin"]
