"""Calibration data as a Lightning DataModule over :mod:`ompmoe.data.sources` (imported lazily by ``ompmoe``)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from ..data.sources import HELDOUT_CORPUS, Encoder, TextSource, text_encoder
from ..engine.apply.plan_choice import default_choice_blocks

__all__ = ["CalibrationBlocks", "CalibrationDataModule"]


class CalibrationBlocks(Dataset):
    """Map-style dataset of calibration blocks: item ``i`` is block ``i`` with an all-ones mask."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return int(self.blocks.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class ResumableDataLoader(DataLoader):
    """A DataLoader whose position Lightning saves in checkpoints, so a resumed calibration fit
    continues after the last batch it saw instead of replaying the first ones."""

    _batches_yielded = 0
    _resume_from = 0

    def __iter__(self) -> Iterator[Any]:
        start, self._resume_from = self._resume_from, 0
        self._batches_yielded = start
        for index, batch in itertools.islice(enumerate(super().__iter__()), start, None):
            self._batches_yielded = index + 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_yielded": self._batches_yielded}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._resume_from = int(state_dict["batches_yielded"])


class CalibrationDataModule(pl.LightningDataModule):
    """Calibration blocks for OMP-MoE statistics, built as in the paper (:mod:`ompmoe.data.sources`).

    Documents are read in order (shuffled first for the domain presets), each tokenized on its own
    with ``add_special_tokens=False`` and no chat template, and concatenated into one token stream
    with the tokenizer's eos token between documents (none for ``bytes``); blank documents are
    skipped and reading stops once ``seq_len * num_blocks`` tokens are there. The first
    ``num_blocks`` blocks of ``seq_len`` tokens are kept; too little text raises in ``setup``, before
    any model work. Batches are ``{"input_ids": LongTensor(batch, seq_len), "attention_mask": ones}``
    in block order. Offline (``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``) or with the hub unreachable,
    a hub data set missing from the local cache raises :class:`HubUnavailableError` at once.

    Args:
        source: What to calibrate on. A preset: ``wikitext2`` (``wikitext``, ``wikitext-2-raw-v1``),
            ``c4`` (``allenai/c4``, file ``en/c4-train.00000-of-01024.json.gz``), ``tulu-math``
            (``allenai/tulu-3-sft-personas-math``, shuffled with seed 42; messages' contents as raw
            text), ``evol-code`` (``theblackcat102/evol-codealpaca-v1``, shuffled with seed 42;
            instruction + output) or ``shipped`` (Python docs text shipped with ompmoe, offline).
            Or the calibration split of the shipped two-domain corpus (offline; the text the shipped
            ``shipped:tiny-moe`` model was *not* trained on): ``shipped:prose`` (Python/IDLE
            documentation), ``shipped:code`` (standard-library source) or ``shipped:mix`` (the first
            ``ceil(num_blocks / 2)`` prose blocks and ``floor(num_blocks / 2)`` code blocks,
            interleaved prose, code, prose, ...).
            Or any hub data set as ``owner/name`` (field ``text_field``). Or a local file: ``.txt``
            (the whole file is one document), ``.jsonl``/``.json``/``.json.gz``/``.jsonl.gz``
            (one document per record, field ``text_field``) or ``.parquet`` (same).
        tokenizer: Hugging Face tokenizer name or local path (``AutoTokenizer.from_pretrained``), or ``bytes`` (UTF-8
            bytes, vocabulary 256) for the tiny demo models. If unset, the ``tokenizer_name`` or else
            ``model_name_or_path`` attribute of the trainer's LightningModule is used.
        seq_len: Tokens per calibration block (the paper: 4096).
        num_blocks: Number of blocks kept (the paper: 64); seq_len * num_blocks tokens in all.
        batch_size: Blocks per batch.
        data_files: Extra local files read after ``source`` when it is a file. With a preset or hub name: local files
            (read instead of the hub, keeping the preset's text format and shuffle, e.g. a downloaded copy of the
            preset's data) or, if they are not local paths, file patterns inside the hub repository.
        text_field: Column holding the text, for hub names and json/parquet files (default
            ``text``); with a preset it replaces the preset's own text format.
        split: Data set split to read.
        seed: Shuffle the documents with this seed before reading (``datasets.Dataset.shuffle``).
            Default: the preset's (42 for ``tulu-math`` and ``evol-code``), else no shuffle.
        num_workers: DataLoader worker processes.
    """

    corpus: dict[str, tuple[tuple[str, ...], str]] = {}
    """Source names of shipped-corpus splits accepted besides ``shipped:*`` (-> domains, split)."""

    def __init__(
        self,
        source: str = "wikitext2",
        tokenizer: str | None = None,
        seq_len: int = 4096,
        num_blocks: int = 64,
        batch_size: int = 1,
        data_files: str | list[str] | None = None,
        text_field: str | None = None,
        split: str = "train",
        seed: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if seq_len <= 0 or num_blocks <= 0 or batch_size <= 0:
            raise ValueError(
                f"seq_len, num_blocks and batch_size must be positive; got seq_len={seq_len}, "
                f"num_blocks={num_blocks}, batch_size={batch_size}."
            )
        self.save_hyperparameters()
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.num_blocks = num_blocks
        self.batch_size = batch_size
        self.data_files = [data_files] if isinstance(data_files, str) else list(data_files or [])
        self.text_field = text_field
        self.split = split
        self.seed = seed
        self.num_workers = num_workers
        self._blocks: torch.Tensor | None = None
        self._text = self._text_source()  # validates the source before anything is read

    def _text_source(self) -> TextSource | None:
        return None if self.source is None else TextSource(self.source, self.data_files, self.text_field, self.split,
                                                           self.seed, corpus=self.corpus)

    def describe(self) -> str:
        return self._text.describe()

    def documents(self) -> Iterator[str]:
        return self._text.documents()

    def _encoder(self) -> Encoder:
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        name = (self.tokenizer or getattr(module, "tokenizer_name", None)
                or getattr(module, "model_name_or_path", None))
        if name:
            return text_encoder(str(name))
        raise ValueError(
            "CalibrationDataModule needs a tokenizer: pass tokenizer=<hub name or local path> "
            "(or 'bytes' for the tiny demo models), or attach it to a Trainer whose LightningModule "
            "has a tokenizer_name or model_name_or_path attribute."
        )

    def heldout_blocks(self, name: str, num_blocks: int) -> torch.Tensor:
        """``num_blocks`` blocks of another text, cut like the calibration blocks: ``heldout:prose`` /
        ``heldout:code`` (the shipped corpus' held-out split) or any source this module accepts."""
        other = TextSource(name, text_field=self.text_field, corpus=HELDOUT_CORPUS)
        return other.blocks(self._encoder(), self.seq_len, num_blocks)

    def choice_blocks(self, num_blocks: int | None = None) -> torch.Tensor:
        """``num_blocks`` blocks of the calibration text right after the calibration blocks, which the statistics
        never see: where ``method="auto"`` tries its candidate plans (:func:`ompmoe.choose_plan`). Default: enough
        blocks for 2,048 tokens (:func:`~ompmoe.engine.apply.plan_choice.default_choice_blocks`)."""
        num_blocks = default_choice_blocks(self.seq_len) if num_blocks is None else num_blocks
        try:
            return self._text.blocks(self._encoder(), self.seq_len, self.num_blocks + num_blocks)[self.num_blocks:]
        except ValueError as error:  # "Calibration text has N tokens but ..." -> this run's need and fixes
            raise ValueError(
                f"{str(error).split(' but ')[0]}: too few for the {self.num_blocks} calibration blocks and the "
                f"{num_blocks} more that method 'auto' tries its candidate plans on ({self.num_blocks + num_blocks} "
                f"blocks of {self.seq_len}). Add text, lower num_blocks, or set choice_blocks=0 (auto then takes the "
                "setting recommended for the architecture)."
            ) from None

    def prepare_data(self) -> None:
        """Fetch a hub data set into the cache once (rank 0); fail early if it cannot be had."""
        if self._text is not None:
            self._text.prefetch()

    def setup(self, stage: str | None = None) -> None:
        """Tokenize and cut the blocks (once); raises if the text is too short."""
        if self._blocks is None:
            self._blocks = self._text.blocks(self._encoder(), self.seq_len, self.num_blocks)

    @property
    def blocks(self) -> torch.Tensor:
        """``(num_blocks, seq_len)`` LongTensor of calibration token ids (built on first use)."""
        if self._blocks is None:
            self.setup()
        return self._blocks

    @property
    def num_tokens(self) -> int:
        return int(self.blocks.numel())

    @property
    def dataset(self) -> CalibrationBlocks:
        return CalibrationBlocks(self.blocks)

    def train_dataloader(self) -> DataLoader:
        """Batches of ``batch_size`` blocks in block order (no shuffle), resumable mid-epoch."""
        return ResumableDataLoader(self.dataset, batch_size=self.batch_size, num_workers=self.num_workers)

    def predict_dataloader(self) -> DataLoader:
        return self.train_dataloader()  # the same batches, for Trainer.predict
