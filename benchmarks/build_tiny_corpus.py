"""Build the two-domain corpus shipped in ``ompmoe/data/corpus/`` (run once; the output is committed).

    python benchmarks/build_tiny_corpus.py            # rewrites ompmoe/data/corpus/*.jsonl.gz

Domains (all text is part of CPython 3.11 and distributed under the PSF License Agreement, see
``ompmoe/data/corpus/LICENSE-PSF.txt``; nobody in this project wrote any of it):

- ``prose``: English documentation. The reference topics of ``pydoc_data.topics`` (the text
  ``help("if")`` shows; one document per topic) and IDLE's documentation files
  (the body of ``idlelib/help.html`` converted to plain text, ``README.txt``, ``NEWS.txt``, ``NEWS2x.txt``,
  ``HISTORY.txt``, ``TODO.txt``, ``extend.txt``, ``CREDITS.txt``; one document each), and the
  docstrings (``ast.get_docstring`` of the module, classes and functions, 80 characters or more,
  in source order; one document per module) of the standard-library modules that are *not* in
  the ``code`` domain, so that no text is in both domains. The topics
  repeat each other (``compound`` contains the text of ``if``, ``while``, ...), so paragraphs of
  64 characters or more are de-duplicated across the whole domain: documents are visited longest
  first and a paragraph seen before is dropped. Documents are then cut at paragraph boundaries
  into passages of at most ``PROSE_PASSAGE_CHARS`` characters (ids ``<document>#<n>``), the
  units of the split, so that no single long file (``NEWS.txt``) becomes a whole split.
- ``code``: Python source of the standard library (``Lib/**/*.py`` of this interpreter, one
  document per file, verbatim), leaving out tests (``test``, ``tests``, ``idle_test``),
  ``site-packages``, ``encodings`` (generated codec tables), ``pydoc_data`` (that is the prose)
  and ``_sysconfigdata*``. Files are taken in the order of ``sha256("code:" + path)`` until
  ``CODE_CHARS`` characters are collected.

Split (fixed, per domain, by whole documents so that no document is in two splits): documents
are ordered by ``sha256(domain + ":" + id)``; the first ones go to ``heldout`` until it holds at
least ``HELDOUT_FRACTION`` of the domain's characters, the next ones to ``calibration`` until it
holds ``CALIBRATION_FRACTION``, the rest to ``train``; then held-out and calibration units whose
text equals a train unit (or a held-out one) are dropped. Each split is written as
``<domain>-<split>.jsonl.gz`` (one ``{"id", "text"}`` record per document, in split order, gzip
with a zero timestamp so rebuilding gives identical bytes on the same interpreter).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import html.parser
import io
import json
import re
import sys
import sysconfig
from pathlib import Path

CODE_CHARS = 3_000_000
HELDOUT_FRACTION = 0.10
CALIBRATION_FRACTION = 0.10
DEDUP_MIN_CHARS = 64
DOCSTRING_MIN_CHARS = 80
PROSE_PASSAGE_CHARS = 6_000
SPLITS = ("train", "calibration", "heldout")
IDLE_TEXT_FILES = ("README.txt", "NEWS.txt", "NEWS2x.txt", "HISTORY.txt", "TODO.txt", "extend.txt", "CREDITS.txt")
CODE_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data", "__pycache__"}
OUT = Path(__file__).resolve().parents[1] / "ompmoe" / "data" / "corpus"


class _HTMLText(html.parser.HTMLParser):
    """Visible text of Sphinx HTML: block elements become paragraph breaks; scripts and nav dropped."""

    BLOCKS = {"p", "div", "section", "h1", "h2", "h3", "h4", "li", "dt", "dd", "pre", "table", "tr", "br"}
    SKIP = {"script", "style", "head", "nav"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0
        self.pre = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in self.SKIP:
            self.skipping += 1
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self.skipping = max(0, self.skipping - 1)
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        joined = "".join(self.parts).replace("\u00b6", "")
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", joined)]
        return "\n\n".join(p for p in paragraphs if p)


def _key(domain: str, doc_id: str) -> str:
    return hashlib.sha256(f"{domain}:{doc_id}".encode()).hexdigest()


def _code_candidates(lib: Path) -> list[str]:
    """Standard-library source files eligible for the code domain, as posix paths relative to ``lib``."""
    candidates = []
    for path in lib.rglob("*.py"):
        rel = path.relative_to(lib)
        if CODE_EXCLUDED_DIRS & set(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata") or rel.parts[0].startswith("config-"):
            continue
        candidates.append(rel.as_posix())
    return sorted(candidates)


def docstring_documents(lib: Path, code_ids: set[str]) -> list[tuple[str, str]]:
    docs = []
    for rel in _code_candidates(lib):
        if rel in code_ids:
            continue
        try:
            tree = ast.parse((lib / rel).read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):  # lib2to3 test data and the like
            continue
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        nodes.sort(key=lambda n: getattr(n, "lineno", 0))
        texts = [doc for doc in (ast.get_docstring(n) for n in nodes) if doc and len(doc) >= DOCSTRING_MIN_CHARS]
        if texts:
            docs.append((f"docstrings:{rel}", "\n\n".join(texts)))
    return docs


def prose_documents(lib: Path, code_ids: set[str]) -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    docs = [(f"pydoc_data.topics:{name}", text) for name, text in topics.items()]
    parser = _HTMLText()
    page = (lib / "idlelib" / "help.html").read_text(encoding="utf-8")
    start, end = page.index('<section id="idle">'), page.rindex("</section>")  # the page body, no navigation
    parser.feed(page[start:end])
    docs.append(("idlelib/help.html", parser.text()))
    docs += [(f"idlelib/{name}", (lib / "idlelib" / name).read_text(encoding="utf-8")) for name in IDLE_TEXT_FILES]
    docs += docstring_documents(lib, code_ids)
    # De-duplicate long paragraphs across the domain, longest documents first.
    seen: set[str] = set()
    out = []
    for doc_id, text in sorted(docs, key=lambda d: (-len(d[1]), d[0])):
        kept = []
        for paragraph in re.split(r"\n\s*\n", text):
            key = paragraph.strip()
            if not key:
                continue
            if len(key) >= DEDUP_MIN_CHARS:
                if key in seen:
                    continue
                seen.add(key)
            kept.append(paragraph.strip("\n"))
        passages: list[list[str]] = [[]]
        for paragraph in kept:
            if passages[-1] and sum(len(p) + 2 for p in passages[-1]) + len(paragraph) > PROSE_PASSAGE_CHARS:
                passages.append([])
            passages[-1].append(paragraph)
        for index, passage in enumerate(p for p in passages if p):
            out.append((f"{doc_id}#{index}", "\n\n".join(passage) + "\n"))
    return out


def code_documents(lib: Path) -> list[tuple[str, str]]:
    candidates = sorted(_code_candidates(lib), key=lambda rel: _key("code", rel))
    docs, total = [], 0
    for rel in candidates:
        if total >= CODE_CHARS:
            break
        text = (lib / rel).read_text(encoding="utf-8")
        if not text.strip():
            continue
        docs.append((rel, text))
        total += len(text)
    return docs


def split_documents(domain: str, docs: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    ordered = sorted(docs, key=lambda d: _key(domain, d[0]))
    total = sum(len(text) for _, text in ordered)
    splits: dict[str, list[tuple[str, str]]] = {name: [] for name in SPLITS}
    targets = [("heldout", HELDOUT_FRACTION * total), ("calibration", CALIBRATION_FRACTION * total)]
    filled = 0
    for doc in ordered:
        while targets and filled >= targets[0][1]:
            targets.pop(0)
            filled = 0
        name = targets[0][0] if targets else "train"
        splits[name].append(doc)
        filled += len(doc[1])
    # Decontaminate: a held-out or calibration unit whose text is also a train unit (or, for
    # calibration, a held-out unit) is dropped; "if" and "else" reduce to the same short topic.
    seen = {text for _, text in splits["train"]}
    for name in ("heldout", "calibration"):
        splits[name] = [doc for doc in splits[name] if doc[1] not in seen]
        seen |= {text for _, text in splits[name]}
    return splits


def write_jsonl_gz(path: Path, docs: list[tuple[str, str]]) -> None:
    raw = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
        for doc_id, text in docs:
            gz.write((json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n").encode("utf-8"))
    path.write_bytes(raw.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output_dir", default=str(OUT))
    args = parser.parse_args(argv)
    lib = Path(sysconfig.get_paths()["stdlib"])
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, dict[str, dict[str, int]]] = {}
    code = code_documents(lib)
    prose = prose_documents(lib, {doc_id for doc_id, _ in code})
    for domain, docs in (("prose", prose), ("code", code)):
        manifest[domain] = {}
        for split, items in split_documents(domain, docs).items():
            write_jsonl_gz(out / f"{domain}-{split}.jsonl.gz", items)
            manifest[domain][split] = {"documents": len(items), "characters": sum(len(t) for _, t in items)}
    (out / "LICENSE-PSF.txt").write_text((lib / "LICENSE.txt").read_text(encoding="utf-8"), encoding="utf-8")
    manifest_info = {"python": sys.version.split()[0], "splits": manifest}
    (out / "manifest.json").write_text(json.dumps(manifest_info, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(manifest_info, indent=2))


if __name__ == "__main__":
    main()
