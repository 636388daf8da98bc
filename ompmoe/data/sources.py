"""Calibration text sources, Lightning-free: presets, hub access, local files, token packing.

As in the paper (appendix "Dataset Processing and Calibration"): raw text without a chat template, documents
joined by eos, the first ``num_blocks`` blocks of ``seq_len`` tokens kept; the domain sets shuffled with seed 42.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock  # torch imports it anyway

import torch

from ..engine.hub import hub_reachable, offline_mode
from ..engine.names import SHIPPED_TEXT_RECORD, corpus_record
from . import CORPUS_DOMAINS, byte_tokens, corpus_documents, resolve_shipped, shipped_text, token_blocks

BYTES = "bytes"
"""Tokenizer name of the tiny demo models: UTF-8 bytes as token ids, no end-of-sequence token."""

LOCAL_SUFFIXES: dict[str, str] = {
    ".txt": "text", ".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json", ".parquet": "parquet",
}
"""Extension of a local calibration file -> how it is read."""

_TOKENIZE_BATCH = 32  # documents tokenized per tokenizer call
_TEXT_CHUNK = 64 * 1024  # characters of a .txt file read (and tokenized) at a time
_TEXT_WINDOW_MAX = 16 * _TEXT_CHUNK  # a window without a cut point is cut here regardless


class HubUnavailableError(ConnectionError):
    """A hub model or data set was asked for while offline (or the hub is unreachable) and is not cached."""


def _join(parts: Iterable[str]) -> str:
    return "\n\n".join(part for part in parts if part)


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
    """``allenai/tulu-3-sft-personas-math`` row as raw text: the ``messages``' contents joined by blank
    lines (no roles, no chat template), ``prompt`` first unless it is already the first message."""
    parts = [_as_text(message) for message in row.get("messages") or []]
    prompt = _as_text(row.get("prompt"))
    if prompt and (not parts or parts[0].strip() != prompt.strip()):
        parts.insert(0, prompt)
    return _join(parts)


def evol_code_text(row: dict[str, Any]) -> str:
    """``theblackcat102/evol-codealpaca-v1`` row (``instruction``, ``output``) as raw text."""
    return _join([_as_text(row.get("instruction")), _as_text(row.get("output"))])


def wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """WikiText rows (one line each) regrouped into articles, streaming: an article starts at a
    top-level heading (`` = Title = ``), empty rows become blank lines, blank articles are dropped."""
    article: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("= ") and stripped.endswith(" =") and not stripped.startswith("= =") and article:
            if "".join(article).strip():
                yield "".join(article)
            article = []
        article.append(line if line else "\n")
    if "".join(article).strip():
        yield "".join(article)


def _cut(text: str, force: bool) -> int:
    """Where to end a piece so that tokenizing the pieces gives the whole text's tokens: before a space
    that follows a non-space (a pre-tokenizer boundary of byte-level BPE and SentencePiece).
    0: no such point (read more), unless ``force``: then the whole window."""
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
    """The text of ``reads`` in pieces of about ``_TEXT_CHUNK`` characters, cut by :func:`_cut`."""
    pending = ""
    for data in reads:
        pending += data
        if cut := _cut(pending, len(pending) >= _TEXT_WINDOW_MAX):
            yield pending[:cut]
            pending = pending[cut:]
    if pending:
        yield pending


def text_pieces(text: str) -> Iterator[str]:
    """A long document (e.g. one JSON record's text field) in the pieces a ``.txt`` file is read in."""
    return _pieces(text[start:start + _TEXT_CHUNK] for start in range(0, len(text), _TEXT_CHUNK))


class TextFile:
    """A ``.txt`` calibration file: one document, read and tokenized in pieces (never whole)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def chunks(self) -> Iterator[str]:
        try:
            with open(self.path, encoding="utf-8") as handle:  # universal newlines, like read_text
                yield from _pieces(iter(lambda: handle.read(_TEXT_CHUNK), ""))
        except UnicodeDecodeError:
            raise _utf8_error(self.path) from None


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


def corpus_sources(prefix: str, split: str, mix: bool = True) -> dict[str, tuple[tuple[str, ...], str]]:
    """``<prefix>:prose``, ``<prefix>:code`` (and ``<prefix>:mix``) -> (domains, split) of the shipped corpus."""
    names = {domain: (domain,) for domain in CORPUS_DOMAINS}
    if mix:
        names["mix"] = tuple(CORPUS_DOMAINS)
    return {f"{prefix}:{name}": (domains, split) for name, domains in names.items()}


SHIPPED_CORPUS = corpus_sources("shipped", "calibration")
"""``shipped:prose``, ``shipped:code``, ``shipped:mix``: the calibration split of the shipped two-domain corpus
(:func:`ompmoe.data.corpus_documents`); ``mix`` takes ``ceil(n / 2)`` prose and ``floor(n / 2)`` code blocks."""
HELDOUT_PREFIX = "heldout:"
HELDOUT_CORPUS = corpus_sources("heldout", "heldout", mix=False)
"""``heldout:prose`` / ``heldout:code``: the held-out split of the shipped corpus (never trained or calibrated on)."""


def local_format(path: str) -> str | None:
    """``text``, ``json`` or ``parquet`` by the file name's extension; ``None`` if unsupported."""
    matches = [suffix for suffix in LOCAL_SUFFIXES if Path(path).name.lower().endswith(suffix)]
    return LOCAL_SUFFIXES[max(matches, key=len)] if matches else None


def require_hub_model(repo_id: str) -> None:
    """Refuse, before any work, a hub model that cannot be had: not cached, and offline or the hub unreachable
    (transformers would retry for most of a minute and end in a long traceback about connections)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return
    except Exception:  # not a valid repository id: transformers says so when it loads
        return
    offline = offline_mode()
    if not offline and hub_reachable():
        return
    reason = "offline mode is on (HF_HUB_OFFLINE)" if offline else "the hub is unreachable"
    raise HubUnavailableError(
        f"cannot load model {repo_id!r} from the Hugging Face hub: {reason} and it is not in the local cache; "
        f"download it where the hub is reachable (hf download {repo_id}) and pass its local directory, "
        "or use shipped:tiny-moe"
    )


@contextmanager
def hub_offline() -> Iterator[None]:
    """Force ``datasets``/``huggingface_hub`` offline (cache only, no retries) for a call: both read
    ``HF_HUB_OFFLINE`` once, at import. The flags are restored afterwards."""
    import datasets.config
    from huggingface_hub import constants

    with (mock.patch.object(datasets.config, "HF_HUB_OFFLINE", True),
          mock.patch.object(constants, "HF_HUB_OFFLINE", True)):
        yield


def _require_datasets() -> Any:  # imported only when a hub data set or a json/parquet file is read
    try:
        import datasets
    except ImportError as error:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "Reading hub data sets and json/parquet calibration files needs the `datasets` package: "
            "pip install 'ompmoe[lightning]'. Offline alternatives: source='shipped' or a .txt file."
        ) from error
    return datasets


def _check_files(files: Sequence[str]) -> list[str]:
    paths = [str(Path(file).expanduser().resolve()) for file in files]
    kinds = set()
    for path in paths:
        kind = local_format(path)
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


def _looks_like_hub_name(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not source.startswith((".", "~"))


Encoder = tuple[Callable[[list[str]], list[list[int]]], int | None]
"""``(batch of texts -> token ids, eos id or None)``: see :func:`text_encoder`."""


class TextSource:
    """Where calibration documents come from, checked at construction (arguments as in
    :class:`ompmoe.CalibrationDataModule`; ``corpus``: source names -> (domains, split) of the shipped
    corpus accepted besides :data:`SHIPPED_CORPUS`, e.g. ``train:mix`` for fine-tuning)."""

    def __init__(self, source: str, data_files: Sequence[str] = (), text_field: str | None = None,
                 split: str = "train", seed: int | None = None,
                 corpus: Mapping[str, tuple[Sequence[str], str]] | None = None) -> None:
        self.source, self.data_files, self.text_field, self.split = source, list(data_files), text_field, split
        self.kind, self.files, self.preset = "hub", [], None
        self._hub_rows: Any = None  # the loaded hub split, kept between prefetch and reading
        corpus = {**SHIPPED_CORPUS, **(corpus or {})}
        self.domains, self.corpus_split = corpus.get(source, ((), "calibration"))
        if source == SHIPPED or source in corpus:
            if self.data_files:
                raise ValueError(f"source={source!r} takes no data_files; give the files as source instead.")
            self.kind = "corpus" if source in corpus else SHIPPED
        elif source not in PRESETS and (os.path.exists(source) or local_format(source) is not None):
            self.kind, self.files = "local", _check_files([source, *self.data_files])
        elif source in PRESETS or _looks_like_hub_name(source):
            self.preset = PRESETS.get(source)
            local = [os.path.exists(path) for path in self.data_files]
            if self.data_files and all(local):
                self.kind, self.files = "local", _check_files(self.data_files)
            elif any(local):
                raise ValueError(
                    f"data_files mixes local paths and hub file patterns: {self.data_files}. "
                    "Give either local files or patterns inside the hub repository."
                )
        else:
            raise ValueError(
                f"Unknown calibration source {source!r}. Use a preset ({', '.join([*PRESETS, SHIPPED])}), a "
                f"shipped corpus domain ({', '.join(f'heldout:{domain}' for domain in CORPUS_DOMAINS)} for held-out "
                "sets), "
                "a hub data set as 'owner/name' (e.g. 'Salesforce/wikitext'), or a local file "
                f"({', '.join(LOCAL_SUFFIXES)})."
            )
        self.seed = seed if seed is not None else (self.preset.seed if self.preset is not None else None)

    @property
    def field(self) -> str:
        return self.text_field or (self.preset.field if self.preset is not None else "text")

    def describe(self) -> str:
        """Short description of the source, for the statistics metadata."""
        suffix = f":seed{self.seed}" if self.seed is not None else ""
        if self.kind == SHIPPED:
            return SHIPPED_TEXT_RECORD
        if self.kind == "corpus":
            return corpus_record(tuple(self.domains), self.corpus_split)
        if self.kind == "local":
            prefix = f"{self.source}:" if self.preset is not None else ""
            return f"{prefix}file:{','.join(self.files)}{suffix}"
        path, kwargs = self._hub_arguments()
        files = kwargs.get("data_files")
        parts = [path, kwargs.get("name"), ",".join(files) if isinstance(files, list) else files]
        return ":".join([*filter(None, parts), self.split]) + suffix

    def _hub_arguments(self) -> tuple[str, dict[str, Any]]:
        """The hub path and the ``load_dataset`` keywords besides the split (config name, data files)."""
        preset = self.preset or Preset(self.source)
        kwargs = {"name": preset.name, "data_files": self.data_files or preset.data_files}
        return preset.path, {key: value for key, value in kwargs.items() if value}

    def prefetch(self) -> None:
        """Load a hub data set into the cache (and keep it); fail early if it cannot be had."""
        if self.kind == "hub":
            self._load_hub()

    def _load_hub(self) -> Any:
        """The hub data set's split (a ``datasets.Dataset``), from the cache when offline."""
        if self._hub_rows is not None:
            return self._hub_rows
        datasets = _require_datasets()
        path, kwargs = self._hub_arguments()
        kwargs["split"] = self.split
        offline = offline_mode()
        if offline or not hub_reachable():
            reason = "offline mode is on (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)" if offline else "the hub is unreachable"
            try:
                with hub_offline():
                    self._hub_rows = datasets.load_dataset(path, **kwargs)
            except Exception as error:
                raise HubUnavailableError(
                    f"Cannot load calibration data set {path!r} from the Hugging Face hub: {reason} and it is "
                    "not in the local datasets cache. Use local files instead: download the data where the hub "
                    f"is reachable and pass a .jsonl/.json/.parquet file (text in field {self.field!r}) or a .txt "
                    f"file as source (or as data_files with source={self.source!r} to keep its text format), or "
                    "use source='shipped' for the offline text shipped with ompmoe."
                ) from error
        else:
            self._hub_rows = datasets.load_dataset(path, **kwargs)
        return self._hub_rows

    def _local_items(self) -> Iterator[str | TextFile]:
        """``.txt`` files as :class:`TextFile` (shuffled if a seed applies), else the documents of the records."""
        builder = local_format(self.files[0])
        if builder == "text":
            texts = [TextFile(file) for file in self.files]
            if self.seed is not None:
                random.Random(self.seed).shuffle(texts)
            return iter(texts)
        datasets = _require_datasets()
        from datasets.exceptions import DatasetGenerationError
        from pyarrow import ArrowException

        try:
            rows = datasets.load_dataset(builder, data_files=self.files, split="train")
        except (DatasetGenerationError, ArrowException) as error:  # malformed file: name it, say the fix
            raise _malformed(self.files, builder, error) from error
        return self._rows_to_text(rows)

    def _rows_to_text(self, rows: Any) -> Iterator[str]:
        """Documents of a ``datasets.Dataset``: shuffled if a seed applies, then formatted."""
        if self.seed is not None:
            rows = rows.shuffle(seed=self.seed)
        preset = self.preset
        if self.text_field is None and preset is not None and preset.to_text is not None:
            yield from (preset.to_text(row) for row in rows)
            return
        columns = list(getattr(rows, "column_names", None) or [])
        if self.field not in columns:
            raise ValueError(
                f"Calibration source {self.describe()!r} has no text field {self.field!r}; its columns are "
                f"{columns}. Set text_field to one of them."
            )
        texts = (_as_text(value) for chunk in rows.select_columns([self.field]).iter(batch_size=256)
                 for value in chunk[self.field])  # read lazily, in chunks
        yield from wikitext_articles(texts) if (preset is not None and preset.articles) else texts

    def items(self, domain: str | None = None) -> Iterator[str | TextFile]:
        """The documents in reading order, lazily, ``.txt`` files left unread (:func:`token_stream`
        reads them in pieces); ``domain``: only that domain of a corpus source."""
        if self.kind == SHIPPED:
            yield shipped_text()
        elif self.kind == "corpus":
            for name in self.domains if domain is None else (domain,):
                yield from (doc["text"] for doc in corpus_documents(name, self.corpus_split))
        elif self.kind == "local":
            yield from self._local_items()
        else:
            yield from self._rows_to_text(self._load_hub())

    def documents(self) -> Iterator[str]:
        """The raw-text documents in reading order (lazily)."""
        for item in self.items():
            yield "".join(item.chunks()) if isinstance(item, TextFile) else item

    def blocks(self, encoder: Encoder, seq_len: int, num_blocks: int) -> torch.Tensor:
        """``(num_blocks, seq_len)`` token ids (too little text raises); a corpus source of several domains cuts
        each domain's share from its own stream and interleaves them, the first domain first."""
        if self.kind != "corpus" or len(self.domains) == 1:
            return token_blocks(token_stream(self.items(), encoder, seq_len * num_blocks), seq_len, num_blocks)
        parts = []
        for index, domain in enumerate(self.domains):
            count = num_blocks // len(self.domains) + (index < num_blocks % len(self.domains))
            if count:
                parts.append(token_blocks(token_stream(self.items(domain), encoder, seq_len * count), seq_len, count))
        order = sorted((j, i) for i, part in enumerate(parts) for j in range(part.shape[0]))
        return torch.stack([parts[i][j] for j, i in order])


def text_encoder(tokenizer: Any) -> Encoder:
    """The encoder (no special tokens) of a tokenizer, or of its name or path (``shipped:`` too, ``bytes``)."""
    if isinstance(tokenizer, str):
        if tokenizer == BYTES:
            return (lambda texts: [byte_tokens(text).tolist() for text in texts]), None
        from ..engine.export.config import load_tokenizer

        # reads non-uniform pruned checkpoints too
        tokenizer = load_tokenizer(resolve_shipped(tokenizer, "tokenizer path"))

    def encode(texts: list[str]) -> list[list[int]]:
        return list(tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"])

    return encode, tokenizer.eos_token_id


def token_stream(documents: Iterable[str | TextFile], encoder: Encoder, needed: int) -> torch.Tensor:
    """The first ``needed`` tokens (fewer if the text runs out) of the documents, each tokenized on its
    own, eos between them; blank documents are skipped; reading stops once ``needed`` are there.
    ``.txt`` files and long documents are tokenized in pieces (:func:`text_pieces`)."""
    encode, eos = encoder
    ids: list[int] = []
    batch: list[str] = []
    started = False  # a document was added (the next one gets an eos before it)

    def add(tokens: list[int], starts_document: bool) -> bool:
        nonlocal started
        if starts_document and started and eos is not None:
            ids.append(eos)
        started = True
        ids.extend(tokens)
        return len(ids) >= needed

    def flush() -> bool:
        done = any(add(tokens, True) for tokens in encode(batch)) if batch else False
        batch.clear()
        return done

    def in_pieces(pieces: Iterable[str]) -> bool:
        """One document given in pieces: eos before it, none between its pieces."""
        lead: str | None = ""  # leading whitespace-only pieces, kept until the document proves non-blank
        for piece in pieces:
            if lead is not None and not piece.strip():
                lead += piece
                continue
            starts_document = lead is not None
            piece, lead = (lead or "") + piece, None
            if add(encode([piece])[0], starts_document):
                return True
        return False

    for text in documents:
        if isinstance(text, TextFile) or len(text) > _TEXT_CHUNK:
            if flush() or in_pieces(text.chunks() if isinstance(text, TextFile) else text_pieces(text)):
                break
        elif text.strip():
            batch.append(text)
            if len(batch) == _TOKENIZE_BATCH and flush():
                break
    else:
        flush()
    return torch.tensor(ids[:needed], dtype=torch.long)


def _malformed(files: list[str], builder: str, error: Exception) -> ValueError:
    """A clear error for a json/parquet calibration file ``datasets`` could not read: for json, the
    first file and line that is not a JSON record (found by reading the files, on this error path only)."""
    cause = error.__cause__ or error.__context__ or error
    if builder == "json":
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
