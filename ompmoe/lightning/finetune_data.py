"""Fine-tuning data: training blocks as in calibration, plus held-out validation blocks per domain.

Fine-tuning a pruned model on a mix of domains can help one and hurt another (on the shipped
model, code improved while held-out prose perplexity rose); one validation set per domain,
logged as ``val_loss/<name>`` and ``val_ppl/<name>`` by :class:`ompmoe.FinetuneModule`, shows it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.utils.data import DataLoader

from .calibration_data import CalibrationBlocks, CalibrationDataModule
from ..data import CORPUS_DOMAINS, corpus_documents, token_blocks

HELDOUT_PREFIX = "heldout:"
"""``heldout:prose`` / ``heldout:code``: the held-out split of the shipped corpus (never trained or calibrated on)."""


class FinetuneDataModule(CalibrationDataModule):
    """:class:`ompmoe.CalibrationDataModule` for training, with one validation set per entry of ``val_sources``.

    Args:
        source: Training text (any ``CalibrationDataModule`` source; default ``shipped:mix``).
        val_sources: Validation sets, each named by its entry: ``heldout:prose`` / ``heldout:code``
            (the held-out split of the shipped corpus), or any ``CalibrationDataModule`` source
            (a preset, hub name or local file). Empty: no validation.
        val_blocks: Blocks of ``seq_len`` tokens in each validation set.
        **kwargs: The other ``CalibrationDataModule`` arguments (``tokenizer``, ``seq_len``,
            ``num_blocks``, ``batch_size``, ...).
    """

    def __init__(
        self,
        source: str = "shipped:mix",
        val_sources: Sequence[str] = ("heldout:prose", "heldout:code"),
        val_blocks: int = 8,
        **kwargs,
    ) -> None:
        super().__init__(source, **kwargs)
        if val_blocks <= 0:
            raise ValueError(f"val_blocks must be positive; got {val_blocks}.")
        self.val_sources = list(val_sources)
        for name in self.val_sources:
            domain = name.removeprefix(HELDOUT_PREFIX)
            if name.startswith(HELDOUT_PREFIX) and domain not in CORPUS_DOMAINS:
                raise ValueError(
                    f"Unknown held-out set {name!r}; use one of "
                    f"{', '.join(HELDOUT_PREFIX + d for d in CORPUS_DOMAINS)} or a data source."
                )
        if len(set(self.val_sources)) != len(self.val_sources):
            raise ValueError(f"val_sources names a set twice: {self.val_sources}.")
        self.val_blocks = val_blocks
        self._val: list[CalibrationBlocks] | None = None

    @property
    def val_names(self) -> list[str]:
        """Names the validation losses are logged under (``val_loss/<name>``), in dataloader order."""
        return list(self.val_sources)

    def _validation_set(self, name: str) -> CalibrationBlocks:
        if name.startswith(HELDOUT_PREFIX):
            texts = (doc["text"] for doc in corpus_documents(name.removeprefix(HELDOUT_PREFIX), "heldout"))
            stream = self.token_stream(self.seq_len * self.val_blocks, texts)
            return CalibrationBlocks(token_blocks(stream, self.seq_len, self.val_blocks))
        other = CalibrationDataModule(name, tokenizer=self._tokenizer_name(), seq_len=self.seq_len,
                                      num_blocks=self.val_blocks, text_field=self.text_field)
        other.prepare_data()
        return other.dataset

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if self._val is None and self.val_sources:
            self._val = [self._validation_set(name) for name in self.val_sources]

    def val_dataloader(self) -> list[DataLoader]:
        """One loader per validation set, in ``val_sources`` order."""
        if self._val is None:
            self.setup("validate")
        return [DataLoader(blocks, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
                for blocks in self._val or []]


__all__ = ["HELDOUT_PREFIX", "FinetuneDataModule"]
