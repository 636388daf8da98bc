"""Every command block of docs/recipes.md runs as written (with the documented speed substitutions)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).parents[1]
RECIPES = ROOT / "docs" / "recipes.md"

# The substitutions docs/recipes.md announces, and nothing else.
FAST = [
    ("--data.num_blocks 800", "--data.num_blocks 8"),
    ("num_blocks=800", "num_blocks=8"),
]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```", re.MULTILINE | re.DOTALL)


def blocks(text: str) -> list[tuple[str, str, bool]]:
    """``(language, code, runs)`` of each fenced block; ``runs`` is False under a ``<!-- not run`` comment."""
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip().splitlines()[-1:] or [""]
        indent = len(match.group("indent"))
        code = "\n".join(line[indent:] for line in match.group("body").splitlines())
        found.append((match.group("lang"), code, not before[0].strip().startswith("<!-- not run")))
    return found


def test_block_extraction_finds_every_block_and_only_the_marked_ones_are_skipped():
    found = blocks(RECIPES.read_text())
    languages = [language for language, _, _ in found]
    assert languages.count("bash") == 3 and languages.count("python") == 5
    skipped = [code for _, code, runs in found if not runs]
    assert len(skipped) == 2 and "llmcompressor" in skipped[0] and "gptqmodel" in skipped[1]
    assert all(runs for language, _, runs in found if language == "bash")


@pytest.mark.slow  # every recipe of docs/recipes.md: about a minute on 2 CPU cores
def test_every_recipe_runs_in_order(tmp_path):
    text = RECIPES.read_text()
    for old, new in FAST:
        assert old in text, old  # the documented substitutions still apply
        text = text.replace(old, new)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    ran = 0
    for number, (language, code, runs) in enumerate(blocks(text)):
        if not runs or language not in ("bash", "python"):
            continue
        command = ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [sys.executable, "-c", code]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"block {number} ({language}) failed:\n{code}\n--- stderr ---\n{done.stderr[-4000:]}"
        ran += 1
        if "metrics.csv" in code:  # held-out validation per domain was logged
            (header,) = [line for line in done.stdout.splitlines() if line.startswith("epoch,") or ",epoch," in line]
            assert {"val_loss/shipped:prose", "val_ppl/shipped:prose", "val_loss/shipped:code",
                    "val_ppl/shipped:code", "val_loss/mean"} <= set(header.split(","))
    assert ran == 6
    import ompmoe

    uniform = ompmoe.PruningPlan.load(tmp_path / "outputs" / "tiny-uniform" / "plan-0.5.json")
    assert uniform.is_uniform and uniform.allocation == "uniform"
