"""Calibration data as a Lightning DataModule: raw text -> one token stream -> fixed-length blocks.

The paper's protocol (appendix "Dataset Processing and Calibration"): raw text is tokenized
directly, *without* a chat template, the token sequences are concatenated into one stream, the
stream is cut into non-overlapping blocks of ``seq_len`` tokens (4096), the first ``num_blocks``
(64) complete blocks are kept and the incomplete remainder is dropped. The domain sets
(``allenai/tulu-3-sft-personas-math``, ``theblackcat102/evol-codealpaca-v1``) are shuffled with
seed 42 first.

This module imports :mod:`lightning`; the core package does not (``ompmoe.CalibrationDataModule``
is resolved lazily). :mod:`datasets` is only imported when a hub data set or a json/parquet file is
read (``pip install 'ompmoe[lightning]'``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from ..data import CORPUS_DOMAINS, byte_tokens, corpus_documents, resolve_shipped, shipped_text, token_blocks

__all__ = ["PRESETS", "CalibrationBlocks", "CalibrationDataModule", "HubUnavailableError"]

BYTES = "bytes"
"""``tokenizer`` value for the tiny demo models: UTF-8 bytes as token ids, no end-of-sequence token."""

LOCAL_SUFFIXES: dict[str, str] = {
    ".txt": "text",
    ".jsonl": "json",
    ".json": "json",
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".parquet": "parquet",
}
"""Extension of a local calibration file -> how it is read (see :class:`CalibrationDataModule`)."""

_TOKENIZE_BATCH = 32  # documents tokenized per tokenizer call while streaming
HELDOUT_PREFIX = "heldout:"
"""``heldout:prose`` / ``heldout:code``: the held-out split of the shipped corpus (never trained or calibrated on)."""
_TEXT_CHUNK = 64 * 1024  # characters of a .txt file read (and tokenized) at a time
_TEXT_WINDOW_MAX = 16 * _TEXT_CHUNK  # a window without a cut point is cut here regardless
_PROBE_TIMEOUT_S = 5.0  # one HEAD request to the hub before any download, no retries
_TRUE = {"1", "ON", "YES", "TRUE"}


class HubUnavailableError(ConnectionError):
    """A hub data set was asked for while offline (or the hub is unreachable) and is not cached."""


def _join(parts: Iterable[Any], sep: str = "\n\n") -> str:
    return sep.join(str(part) for part in parts if part is not None and str(part) != "")


def _as_text(value: Any) -> str:
    """A field's value as raw text: strings as is, chat lists as their contents (no template)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return _as_text(value.get("content", value.get("text", "")))
    if isinstance(value, (list, tuple)):
        return _join(_as_text(item) for item in value)
    return str(value)


def tulu_text(row: dict[str, Any]) -> str:
    """``allenai/tulu-3-sft-personas-math`` row (``id``, ``prompt``, ``messages``) as raw text.

    The contents of ``messages`` (user prompt, then assistant answer) joined by blank lines, with no
    role markers or chat template; ``prompt`` is prepended only where it is not already the first
    message.
    """
    parts = [_as_text(message) for message in row.get("messages") or []]
    prompt = _as_text(row.get("prompt"))
    if prompt and (not parts or parts[0].strip() != prompt.strip()):
        parts.insert(0, prompt)
    return _join(parts)


def evol_code_text(row: dict[str, Any]) -> str:
    """``theblackcat102/evol-codealpaca-v1`` row (``instruction``, ``output``) as raw text."""
    return _join([_as_text(row.get("instruction")), _as_text(row.get("output"))])


def wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """Regroup WikiText rows (one line each) into articles, streaming.

    An article starts at a top-level heading row (`` = Title = ``); its rows are concatenated as in
    the raw file, empty rows becoming blank lines. Blank-only articles are dropped.
    """
    article: list[str] = []
    for line in lines:
        stripped = line.strip()
        is_title = stripped.startswith("= ") and stripped.endswith(" =") and not stripped.startswith("= =")
        if is_title and article:
            text = "".join(article)
            if text.strip():
                yield text
            article = []
        article.append(line if line else "\n")
    text = "".join(article)
    if text.strip():
        yield text


def _cut(text: str, force: bool) -> int:
    """Where to end a piece of text so tokenizing the pieces gives the whole text's tokens: before a
    space that follows a non-space (a pre-tokenizer boundary of byte-level BPE and SentencePiece
    tokenizers). 0: no such point (read more), unless ``force``: then the whole window."""
    end = len(text)
    while True:
        at = text.rfind(" ", 1, end)
        if at == -1:
            return len(text) if force else 0
        if not text[at - 1].isspace():
            return at
        end = at


def _utf8_error(path: str) -> ValueError:
    """Where the first invalid UTF-8 sequence of ``path`` is (byte offset and line), and the fix."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = newlines = 0
    detail = "invalid UTF-8"
    with open(path, "rb") as handle:
        while chunk := handle.read(_TEXT_CHUNK):
            buffered = len(decoder.getstate()[0])  # bytes of a split sequence, already counted
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as error:
                offset += error.start - buffered
                newlines += chunk[: max(error.start - buffered, 0)].count(b"\n")
                detail = f"{error.reason} (byte {error.object[error.start:error.end]!r})"
                break
            offset += len(chunk)
            newlines += chunk.count(b"\n")
    return ValueError(
        f"Calibration file {path} is not UTF-8 text: {detail} at byte offset {offset} (line {newlines + 1}). "
        "Give a UTF-8 .txt file (e.g. convert it with `iconv -f <encoding> -t UTF-8`), or a "
        ".jsonl/.parquet file for other data."
    )


def _pieces(reads: Iterable[str]) -> Iterator[str]:
    """Text arriving in ``reads`` as pieces of about ``_TEXT_CHUNK`` characters cut before spaces, so that
    tokenizing the pieces one by one gives the tokens of the whole text."""
    pending = ""
    for data in reads:
        pending += data
        cut = _cut(pending, len(pending) >= _TEXT_WINDOW_MAX)
        if cut:
            yield pending[:cut]
            pending = pending[cut:]
    if pending:
        yield pending


def text_pieces(text: str) -> Iterator[str]:
    """A long document (e.g. one JSON record's text field) in the pieces a ``.txt`` file is read in."""
    return _pieces(text[start:start + _TEXT_CHUNK] for start in range(0, len(text), _TEXT_CHUNK))


class TextFile:
    """A ``.txt`` calibration file: one document, read and tokenized in pieces of about
    ``_TEXT_CHUNK`` characters cut at spaces, so a large file is never read or tokenized whole."""

    def __init__(self, path: str) -> None:
        self.path = path

    def chunks(self) -> Iterator[str]:
        """The file's text in order, as pieces whose tokens concatenate to the whole text's."""
        try:
            with open(self.path, encoding="utf-8") as handle:  # universal newlines, like read_text
                yield from _pieces(iter(lambda: handle.read(_TEXT_CHUNK), ""))
        except UnicodeDecodeError:
            raise _utf8_error(self.path) from None

    def read(self) -> str:
        """The whole text (for :meth:`CalibrationDataModule.documents`)."""
        return "".join(self.chunks())


@dataclass(frozen=True)
class Preset:
    """A named calibration source on the Hugging Face hub."""

    path: str
    name: str | None = None
    data_files: str | None = None
    field: str = "text"
    seed: int | None = None
    to_text: Callable[[dict[str, Any]], str] | None = None  # row -> raw text; None: the ``field``
    articles: bool = False  # rows are WikiText lines, regrouped by :func:`wikitext_articles`


PRESETS: dict[str, Preset] = {
    "wikitext2": Preset("wikitext", name="wikitext-2-raw-v1", articles=True),
    "c4": Preset("allenai/c4", data_files="en/c4-train.00000-of-01024.json.gz"),
    "tulu-math": Preset("allenai/tulu-3-sft-personas-math", seed=42, to_text=tulu_text),
    "evol-code": Preset("theblackcat102/evol-codealpaca-v1", seed=42, to_text=evol_code_text),
}
"""Hub presets of ``source``; ``shipped`` (offline, :func:`ompmoe.data.shipped_text`) is the other."""

SHIPPED = "shipped"
SHIPPED_CORPUS = {f"shipped:{name}": name for name in (*CORPUS_DOMAINS, "mix")}
"""``shipped:prose``, ``shipped:code``, ``shipped:mix``: the calibration split of the shipped two-domain
corpus (:func:`ompmoe.data.corpus_documents`); ``mix`` takes half of the blocks from each domain."""


def _local_format(path: str) -> str | None:
    name = Path(path).name.lower()
    for suffix, kind in sorted(LOCAL_SUFFIXES.items(), key=lambda item: -len(item[0])):
        if name.endswith(suffix):
            return kind
    return None


def offline_mode() -> bool:
    """Offline mode as the environment says *now* (or as the hub libraries read it at import)."""
    if any(os.environ.get(var, "").upper() in _TRUE for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover - datasets depends on huggingface_hub
        return False


def hub_reachable() -> bool:
    """One HEAD request to the hub endpoint (proxies honoured), no retries."""
    try:
        from huggingface_hub import constants, get_session

        get_session().head(constants.ENDPOINT, timeout=_PROBE_TIMEOUT_S)
        return True
    except Exception:  # any transport failure: DNS, refused, timeout, proxy
        return False


@contextmanager
def hub_offline() -> Iterator[None]:
    """Force ``datasets``/``huggingface_hub`` offline (cache only, no network, no retries) for a call.

    Both libraries read ``HF_HUB_OFFLINE`` once, at import; this makes an offline environment set
    later (or an unreachable hub) take effect, and restores the flags afterwards.
    """
    import datasets.config
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _require_datasets() -> Any:
    try:
        import datasets
    except ImportError as error:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "Reading hub data sets and json/parquet calibration files needs the `datasets` package: "
            "pip install 'ompmoe[lightning]'. Offline alternatives: source='shipped' or a .txt file."
        ) from error
    return datasets


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches_yielded = 0
        self._resume_from = 0

    def __iter__(self) -> Iterator[Any]:
        start, self._resume_from = self._resume_from, 0
        self._batches_yielded = start
        for index, batch in enumerate(super().__iter__()):
            if index < start:
                continue
            self._batches_yielded = index + 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_yielded": self._batches_yielded}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._resume_from = int(state_dict["batches_yielded"])


class CalibrationDataModule(pl.LightningDataModule):
    """Calibration blocks for OMP-MoE statistics, built as in the paper.

    Documents are read in order (shuffled first for the domain presets), each tokenized on its own
    with ``add_special_tokens=False`` and no chat template, and concatenated into one token stream
    with the tokenizer's end-of-sequence token between consecutive documents (nothing between them
    when the tokenizer has no eos token, e.g. ``bytes``). Documents that are empty or whitespace-only
    are skipped. Reading stops as soon as ``seq_len * num_blocks`` tokens are collected, so a large
    corpus is never tokenized whole. The stream is cut into the first ``num_blocks`` non-overlapping
    blocks of ``seq_len`` tokens and the remainder is dropped; too little text raises in ``setup``
    (before any model work), saying how many tokens were found and needed.

    Batches from :meth:`train_dataloader` (and :meth:`predict_dataloader`) are dicts
    ``{"input_ids": LongTensor(batch, seq_len), "attention_mask": ones}`` in block order.

    Hub data sets are read with ``datasets.load_dataset`` (the ``data`` extra). In offline mode
    (``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``), or when the hub cannot be reached, only the local
    ``datasets`` cache is consulted and a missing data set raises :class:`HubUnavailableError`
    at once, naming it and the local-file alternative; no download is retried.

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
        tokenizer: Hugging Face tokenizer name or local path (``AutoTokenizer.from_pretrained``), or
            ``bytes`` (UTF-8 bytes, vocabulary 256) for the tiny demo models. If unset, the
            ``tokenizer_name`` or else ``model_name_or_path`` attribute of the trainer's
            LightningModule is used.
        seq_len: Tokens per calibration block (the paper: 4096).
        num_blocks: Number of blocks kept (the paper: 64); seq_len * num_blocks tokens in all.
        batch_size: Blocks per batch.
        data_files: Extra local files read after ``source`` when it is a file. With a preset or hub
            name: local files (read instead of the hub, keeping the preset's text format and
            shuffle, e.g. a downloaded copy of the preset's data) or, if they are not local paths,
            file patterns inside the hub repository.
        text_field: Column holding the text, for hub names and json/parquet files (default
            ``text``); with a preset it replaces the preset's own text format.
        split: Data set split to read.
        seed: Shuffle the documents with this seed before reading (``datasets.Dataset.shuffle``).
            Default: the preset's (42 for ``tulu-math`` and ``evol-code``), else no shuffle.
        num_workers: DataLoader worker processes.
    """

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
        self._hub_rows: Any = None  # the loaded hub split, kept between prepare_data and setup
        self._plan = self._resolve_source()  # validates the source before anything is read

    # ----------------------------------------------------------------------------------- source
    def _resolve_source(self) -> dict[str, Any]:
        """Decide where the documents come from; raise on unknown presets and bad files."""
        source = self.source
        if source == SHIPPED:
            if self.data_files:
                raise ValueError("source='shipped' takes no data_files; give the files as source instead.")
            return {"kind": SHIPPED}
        if source in SHIPPED_CORPUS:
            if self.data_files:
                raise ValueError(f"source={source!r} takes no data_files; give the files as source instead.")
            name = SHIPPED_CORPUS[source]
            return {"kind": "corpus", "domains": list(CORPUS_DOMAINS) if name == "mix" else [name]}
        if source in PRESETS or self._looks_like_hub_name(source):
            preset = PRESETS.get(source)
            local = [os.path.exists(path) for path in self.data_files]
            if self.data_files and all(local):
                return {"kind": "local", "files": self._check_files(self.data_files), "preset": preset}
            if any(local):
                raise ValueError(
                    f"data_files mixes local paths and hub file patterns: {self.data_files}. "
                    "Give either local files or patterns inside the hub repository."
                )
            return {"kind": "hub", "preset": preset}
        if os.path.exists(source) or _local_format(source) is not None:
            return {"kind": "local", "files": self._check_files([source, *self.data_files]), "preset": None}
        raise ValueError(
            f"Unknown calibration source {source!r}. Use a preset ({', '.join([*PRESETS, SHIPPED])}), "
            "a hub data set as 'owner/name' (e.g. 'Salesforce/wikitext'), or a local file "
            f"({', '.join(LOCAL_SUFFIXES)})."
        )

    @staticmethod
    def _looks_like_hub_name(source: str) -> bool:
        if os.path.exists(source) or _local_format(source) is not None:
            return False
        parts = source.split("/")
        return len(parts) == 2 and all(parts) and not source.startswith((".", "~"))

    @staticmethod
    def _check_files(files: Sequence[str]) -> list[str]:
        paths = [str(Path(file).expanduser().resolve()) for file in files]
        kinds = set()
        for path in paths:
            kind = _local_format(path)
            if kind is None:
                raise ValueError(
                    f"Unsupported calibration file {path!r}: use one of {', '.join(LOCAL_SUFFIXES)} "
                    "(.txt: the whole file is one document; json/parquet: one document per record)."
                )
            if not os.path.exists(path):
                raise FileNotFoundError(f"Calibration file not found: {path}")
            if not os.path.isfile(path):  # a directory, FIFO, socket or device: "not found" would be false
                what = "a directory" if os.path.isdir(path) else "not a regular file (a FIFO, socket or device)"
                raise ValueError(f"Calibration file {path} is {what}; give the path of a regular "
                                 f"{', '.join(LOCAL_SUFFIXES)} file (a directory: list its files in data_files).")
            kinds.add(kind)
        if len(kinds) > 1:
            raise ValueError(f"Calibration files must share one format (.txt, json or parquet); got {paths}.")
        return paths

    def _effective_seed(self) -> int | None:
        preset = self._plan.get("preset")
        if self.seed is not None:
            return self.seed
        return preset.seed if preset is not None else None

    def describe(self) -> str:
        """Short description of the calibration source, for the statistics metadata."""
        plan, seed = self._plan, self._effective_seed()
        suffix = f":seed{seed}" if seed is not None else ""
        if plan["kind"] == SHIPPED:
            return "shipped:ompmoe/data/calibration.txt"
        if plan["kind"] == "corpus":
            split = plan.get("split", "calibration")
            return ",".join(f"shipped:ompmoe/data/corpus/{domain}-{split}" for domain in plan["domains"])
        if plan["kind"] == "local":
            prefix = f"{self.source}:" if plan["preset"] is not None else ""
            return f"{prefix}file:{','.join(plan['files'])}{suffix}"
        preset = plan["preset"]
        path = preset.path if preset is not None else self.source
        parts = [path]
        if preset is not None and preset.name:
            parts.append(preset.name)
        files = self.data_files or ([preset.data_files] if preset is not None and preset.data_files else [])
        if files:
            parts.append(",".join(files))
        parts.append(self.split)
        return ":".join(parts) + suffix

    # ------------------------------------------------------------------------------- documents
    def _load_hub(self) -> Any:
        """The hub data set's split (a ``datasets.Dataset``), from the cache when offline."""
        datasets = _require_datasets()
        preset = self._plan["preset"]
        path = preset.path if preset is not None else self.source
        name = preset.name if preset is not None else None
        files: Any = self.data_files or (preset.data_files if preset is not None else None)
        kwargs: dict[str, Any] = {"split": self.split}
        if name:
            kwargs["name"] = name
        if files:
            kwargs["data_files"] = files
        if self._hub_rows is not None:
            return self._hub_rows
        offline = offline_mode()
        if offline or not hub_reachable():
            reason = "offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)" if offline else "the hub is unreachable"
            try:
                with hub_offline():
                    self._hub_rows = datasets.load_dataset(path, **kwargs)
            except Exception as error:
                raise self._unavailable(path, reason) from error
        else:
            self._hub_rows = datasets.load_dataset(path, **kwargs)
        return self._hub_rows

    def _unavailable(self, path: str, reason: str) -> HubUnavailableError:
        field = self.text_field or (self._plan["preset"].field if self._plan["preset"] else "text")
        return HubUnavailableError(
            f"Cannot load calibration data set {path!r} from the Hugging Face hub: {reason} and it is "
            "not in the local datasets cache. Use local files instead: download the data where the hub "
            f"is reachable and pass a .jsonl/.json/.parquet file (text in field {field!r}) or a .txt file "
            f"as source (or as data_files with source={self.source!r} to keep its text format), or use "
            "source='shipped' for the offline text shipped with ompmoe."
        )

    def _load_local(self, files: list[str]) -> Any:
        if _local_format(files[0]) == "text":
            texts = [TextFile(file) for file in files]
            seed = self._effective_seed()
            if seed is not None:
                random.Random(seed).shuffle(texts)
            return texts
        datasets = _require_datasets()
        builder = _local_format(files[0])
        from datasets.exceptions import DatasetGenerationError
        from pyarrow import ArrowException

        try:
            return datasets.load_dataset(builder, data_files=files, split="train")
        except (DatasetGenerationError, ArrowException) as error:  # malformed file: name it, say the fix
            raise _malformed(files, builder, error) from error

    def _rows_to_text(self, rows: Any) -> Iterator[str]:
        """Documents of a ``datasets.Dataset``: shuffled if a seed applies, then formatted."""
        seed = self._effective_seed()
        if seed is not None:
            rows = rows.shuffle(seed=seed)
        preset = self._plan.get("preset")
        if self.text_field is None and preset is not None and preset.to_text is not None:
            yield from (preset.to_text(row) for row in rows)
            return
        field = self.text_field or (preset.field if preset is not None else "text")
        columns = list(getattr(rows, "column_names", None) or [])
        if field not in columns:
            raise ValueError(
                f"Calibration source {self.describe()!r} has no text field {field!r}; its columns are "
                f"{columns}. Set text_field to one of them."
            )
        texts = (_as_text(value) for value in _iter_column(rows, field))
        yield from wikitext_articles(texts) if (preset is not None and preset.articles) else texts

    def documents(self) -> Iterator[str]:
        """The raw-text documents in reading order (lazily, as the stream consumes them)."""
        for item in self._read_documents():
            yield item.read() if isinstance(item, TextFile) else item

    def _items(self) -> Iterator[str | TextFile]:
        """:meth:`documents`, with ``.txt`` files left unread (:meth:`token_stream` reads them in pieces)."""
        if self._plan["kind"] == "local" and _local_format(self._plan["files"][0]) == "text":
            yield from self._read_documents()
        else:
            yield from self.documents()

    def _read_documents(self) -> Iterator[str | TextFile]:
        kind = self._plan["kind"]
        if kind == SHIPPED:
            yield shipped_text()
            return
        if kind == "corpus":
            for domain in self._plan["domains"]:
                yield from (doc["text"] for doc in corpus_documents(domain, self._plan.get("split", "calibration")))
            return
        if kind == "local":
            loaded = self._load_local(self._plan["files"])
            if isinstance(loaded, list):
                yield from loaded
                return
            yield from self._rows_to_text(loaded)
            return
        yield from self._rows_to_text(self._load_hub())

    # ------------------------------------------------------------------------------- tokenizer
    def _tokenizer_name(self) -> str:
        if self.tokenizer:
            return self.tokenizer
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        for attribute in ("tokenizer_name", "model_name_or_path"):
            value = getattr(module, attribute, None) if module is not None else None
            if value:
                return str(value)
        raise ValueError(
            "CalibrationDataModule needs a tokenizer: pass tokenizer=<hub name or local path> "
            "(or 'bytes' for the tiny demo models), or attach it to a Trainer whose LightningModule "
            "has a tokenizer_name or model_name_or_path attribute."
        )

    def _encoder(self) -> tuple[Callable[[list[str]], list[list[int]]], int | None, str]:
        """``(batch of texts -> token ids, eos id or None, tokenizer name)``."""
        name = self._tokenizer_name()
        if name == BYTES:
            return (lambda texts: [byte_tokens(text).tolist() for text in texts]), None, name
        from ..engine.export.config import load_tokenizer

        tokenizer = load_tokenizer(resolve_shipped(name))  # AutoTokenizer; reads non-uniform pruned checkpoints too

        def encode(texts: list[str]) -> list[list[int]]:
            return list(tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"])

        return encode, tokenizer.eos_token_id, name

    def token_stream(self, needed: int, documents: Iterable[str] | None = None) -> torch.Tensor:
        """The first ``needed`` tokens of the stream (fewer if the text runs out), as a 1-D LongTensor.

        ``documents`` replaces :meth:`documents` as the text read (``shipped:mix`` reads each domain).
        """
        encode, eos, _ = self._encoder()
        ids: list[int] = []
        first = True
        batch: list[str] = []

        def consume_file(chunks: Iterable[str]) -> bool:
            """One document given in pieces: eos before it, none between its pieces."""
            nonlocal first
            lead = ""  # leading whitespace-only pieces, kept until the document proves non-blank
            for chunk in chunks:
                if lead is not None:
                    if not chunk.strip():
                        lead += chunk
                        continue
                    chunk, lead = lead + chunk, None
                    if not first and eos is not None:
                        ids.append(eos)
                    first = False
                ids.extend(encode([chunk])[0])
                if len(ids) >= needed:
                    return True
            return False

        def consume(texts: list[str]) -> bool:
            nonlocal first
            for tokens in encode(texts):
                if not first and eos is not None:
                    ids.append(eos)
                ids.extend(tokens)
                first = False
                if len(ids) >= needed:
                    return True
            return False

        done = False
        for text in self._items() if documents is None else documents:
            if isinstance(text, TextFile):
                done = bool(batch) and consume(batch)
                batch = []
                if done or consume_file(text.chunks()):
                    done = True
                    break
                continue
            if not text or not text.strip():
                continue
            if len(text) > _TEXT_CHUNK:  # one long record: tokenized in pieces, and only as far as needed
                done = bool(batch) and consume(batch)
                batch = []
                if done or consume_file(text_pieces(text)):
                    done = True
                    break
                continue
            batch.append(text)
            if len(batch) == _TOKENIZE_BATCH:
                if consume(batch):
                    done = True
                    break
                batch = []
        if not done and batch:
            consume(batch)
        return torch.tensor(ids[:needed], dtype=torch.long)

    def heldout_blocks(self, name: str, num_blocks: int) -> torch.Tensor:
        """``num_blocks`` blocks of another text, cut like the calibration blocks: ``heldout:prose`` /
        ``heldout:code`` (the shipped corpus' held-out split) or any source this module accepts."""
        if name.startswith(HELDOUT_PREFIX):
            texts = (doc["text"] for doc in corpus_documents(name.removeprefix(HELDOUT_PREFIX), "heldout"))
            return token_blocks(self.token_stream(self.seq_len * num_blocks, texts), self.seq_len, num_blocks)
        other = CalibrationDataModule(name, tokenizer=self._tokenizer_name(), seq_len=self.seq_len,
                                      num_blocks=num_blocks, text_field=self.text_field)
        other.prepare_data()
        return other.blocks

    # ------------------------------------------------------------------------------- lightning
    def prepare_data(self) -> None:
        """Fetch a hub data set into the cache once (rank 0); fail early if it cannot be had."""
        if self._plan["kind"] == "hub":
            self._load_hub()

    def setup(self, stage: str | None = None) -> None:
        """Tokenize and cut the blocks (once); raises if the text is too short."""
        if self._blocks is None and self._plan["kind"] == "corpus" and len(self._plan["domains"]) > 1:
            self._blocks = self._mixed_blocks()
        if self._blocks is None:
            needed = self.seq_len * self.num_blocks
            self._blocks = token_blocks(self.token_stream(needed), self.seq_len, self.num_blocks)

    def _mixed_blocks(self) -> torch.Tensor:
        """``shipped:mix``: blocks cut from each domain's own stream, interleaved (prose first)."""
        domains = self._plan["domains"]
        counts = [self.num_blocks // len(domains) + (i < self.num_blocks % len(domains)) for i in range(len(domains))]
        parts = []
        for domain, count in zip(domains, counts):
            if count:
                texts = (doc["text"] for doc in corpus_documents(domain, self._plan.get("split", "calibration")))
                parts.append(token_blocks(self.token_stream(self.seq_len * count, texts), self.seq_len, count))
        order = sorted(((j, i) for i, part in enumerate(parts) for j in range(part.shape[0])))
        return torch.stack([parts[i][j] for j, i in order])

    @property
    def blocks(self) -> torch.Tensor:
        """``(num_blocks, seq_len)`` LongTensor of calibration token ids (built on first use)."""
        if self._blocks is None:
            self.setup()
        assert self._blocks is not None
        return self._blocks

    @property
    def num_tokens(self) -> int:
        """Calibration tokens in all: ``num_blocks * seq_len``."""
        return int(self.blocks.numel())

    @property
    def dataset(self) -> CalibrationBlocks:
        """The blocks as a map-style dataset (one block per item)."""
        return CalibrationBlocks(self.blocks)

    def train_dataloader(self) -> DataLoader:
        """Batches of ``batch_size`` blocks in block order (no shuffle), resumable mid-epoch."""
        return ResumableDataLoader(
            self.dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers, drop_last=False
        )

    def predict_dataloader(self) -> DataLoader:
        """The same batches as :meth:`train_dataloader`, for ``Trainer.predict``."""
        return self.train_dataloader()


def _malformed(files: list[str], builder: str, error: Exception) -> ValueError:
    """A clear error for a json/parquet calibration file ``datasets`` could not read: for json, the
    first file and line that is not a JSON record (found by reading the files, on this error path only)."""
    cause = error.__cause__ or error.__context__ or error
    if builder == "json":
        import gzip
        import json

        for file in files:
            opener = gzip.open if file.endswith(".gz") else open
            with opener(file, "rb") as handle:
                for number, raw in enumerate(handle, 1):
                    try:
                        line = raw.decode("utf-8")
                        if line.strip():
                            json.loads(line.rstrip("\r\n"))
                    except UnicodeDecodeError as bad:
                        return ValueError(
                            f"Calibration file {file} line {number} is not UTF-8: {bad.reason} at byte "
                            f"{bad.start} of the line. Save the file as UTF-8 (one JSON record per line)."
                        )
                    except json.JSONDecodeError as bad:
                        if file.endswith((".json", ".json.gz")) and number == 1:
                            break  # maybe one JSON document over many lines: report datasets' reason
                        return ValueError(
                            f"Calibration file {file} line {number} is not a JSON record: {bad.msg} "
                            f"(column {bad.pos + 1}). Fix or remove that line: each line must be one JSON "
                            'object with the text in a field, e.g. {"text": "..."}.'
                        )
    return ValueError(
        f"Cannot read calibration file(s) {', '.join(files)} as {builder}: {type(cause).__name__}: {cause}. "
        f"Check that each is a valid {builder} file (json: one object per line with a text field; "
        "parquet: a table with a text column), or give the text as a UTF-8 .txt file."
    )


def _iter_column(rows: Any, field: str) -> Iterator[Any]:
    """Values of one column, read lazily in chunks (a ``datasets.Dataset`` or a list of dicts)."""
    if hasattr(rows, "select_columns") and hasattr(rows, "iter"):
        for chunk in rows.select_columns([field]).iter(batch_size=256):
            yield from chunk[field]
        return
    for row in rows:
        yield row[field]
