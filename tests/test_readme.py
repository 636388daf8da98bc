"""The README's Python example runs as written, offline, and does what its comments say."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import ompmoe

ROOT = Path(__file__).parents[1]


def python_api_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Python\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_readme_python_example_runs(tmp_path):
    code = python_api_example()
    assert "batches =" in code and "tokenizer =" in code  # everything it uses is defined in it
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    stats = ompmoe.MoEStats.load(tmp_path / "stats.safetensors")
    assert stats.num_tokens == 16 * 256
    plan = ompmoe.PruningPlan.load(tmp_path / "plan.json")
    assert plan == ompmoe.plan_pruning(stats, 0.5)
    assert done.stdout.splitlines()[-1] == ompmoe.kept_summary(plan)
    model = ompmoe.load_pruned(tmp_path / "tiny-moe-omp50")
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(model)] == [layer.num_kept for layer in plan.layers]
    assert (tmp_path / "tiny-moe-omp50" / "tokenizer.json").is_file()
