"""README.md and docs/ say what is true: every path they name exists, and every code block runs in a test.

A fenced block of ``bash`` or ``python`` is run here, page by page in order in one scratch directory (with
``configs/`` linked in), unless the line before it says where it runs instead (``<!-- runs in: FILE, ... -->``,
each file naming the page) or why it cannot run here (``<!-- not run: ... -->``, needing a GPU, the hub or a
benchmark's minutes). Other blocks must say what they are (``text``, ``yaml``, ``json``) so no command hides in
an unlabelled one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = {"bash", "python"}
DESCRIPTIVE = {"text", "yaml", "json", "csv", "markdown"}
REASONS = ("GPU", "hub", "benchmark")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
CODE_SPAN = re.compile(r"`(?P<path>(?:ompmoe|callbacks|eval|tests|benchmarks|docs|configs)/[\w./*-]*)`")


class Block(NamedTuple):
    page: Path
    line: int
    language: str
    code: str
    marker: str  # the "not run" / "runs in" comment right before the block, or ""


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip().splitlines()[-1:] or [""]
        marker = before[0].strip() if before[0].strip().startswith(("<!-- not run:", "<!-- runs in:")) else ""
        indent = len(match.group("indent"))
        code = "\n".join(line[indent:] for line in match.group("body").splitlines())
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(page, line, match.group("lang"), code, marker))
    return found


def name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def runs_here(block: Block) -> bool:
    return block.language in RUNNABLE and not block.marker


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_named_path_exists(page):
    text = page.read_text(encoding="utf-8")
    missing = []
    for match in LINK.finditer(text):
        target = match.group("target").split("#")[0]
        if target and not re.match(r"^[a-z]+:", target) and not (page.parent / target).exists():
            missing.append(target)
    for match in CODE_SPAN.finditer(text):
        path = match.group("path").rstrip(".")
        if not list(ROOT.glob(path)) and not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"{name(page)} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_code_block_runs_somewhere_or_says_why_not(page):
    problems = []
    for block in blocks(page):
        where = f"{name(page)}:{block.line}"
        if block.language not in RUNNABLE | DESCRIPTIVE:
            problems.append(f"{where}: label the block (```bash/```python run; ```text for output)")
        elif block.marker.startswith("<!-- not run:"):
            if not any(reason in block.marker for reason in REASONS):
                problems.append(f"{where}: a block may skip only for a GPU, the hub or a benchmark: {block.marker}")
        elif block.marker.startswith("<!-- runs in:"):
            for file in block.marker.removeprefix("<!-- runs in:").removesuffix("-->").split(","):
                runner = ROOT / file.strip()
                if not runner.is_file() or name(page) not in runner.read_text(encoding="utf-8"):
                    problems.append(f"{where}: {file.strip()} does not exist or does not name {name(page)}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("page", [page for page in PAGES if any(map(runs_here, blocks(page)))], ids=name)
def test_code_blocks_run_verbatim(page, tmp_path):
    for shared in ("configs", "tests"):  # configs/eval/*.yaml name tests/eval_tasks, as from the repository root
        (tmp_path / shared).symlink_to(ROOT / shared)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for block in filter(runs_here, blocks(page)):
        command = ["bash", "-euo", "pipefail", "-c", block.code] if block.language == "bash" else [sys.executable, "-c", block.code]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{name(page)}:{block.line} failed:\n{block.code}\n--- stderr ---\n{done.stderr[-4000:]}"


def test_the_development_page_names_every_module():
    """docs/development.md's layout stays a map of the whole source: every module is named there."""
    page = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    modules = [path for folder in ("ompmoe", "callbacks", "eval") for path in sorted((ROOT / folder).rglob("*.py"))
               if path.name != "__init__.py"]
    missing = [path.relative_to(ROOT).as_posix() for path in modules if f"`{path.name}`" not in page]
    assert len(modules) > 70 and missing == []
