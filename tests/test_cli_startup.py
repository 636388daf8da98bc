"""``ompmoe`` answers help and argument mistakes without importing torch (benchmarks/cli_startup.py times it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import sys
from ompmoe.cli import main
try:
    main({argv!r})
except SystemExit as done:
    code = done.code
else:
    code = 0
print(sorted(name for name in ("torch", "transformers", "lightning") if name in sys.modules), code)
"""


@pytest.mark.parametrize(("argv", "code"), [
    (["--help"], 0),
    ([], 0),
    (["fit", "-h"], 0),
    (["validate", "-h"], 0),
    (["test", "-h"], 0),
    (["predict", "-h"], 0),
    (["fitt"], 2),
    (["bogus", "--help"], 2),
    (["fit", "-c", "no-such-config.yaml"], 2),
    (["report", "--help"], 0),
    (["plot", "--help"], 0),
    (["prune", "--ratio", "0.5"], 2),  # --stats and --output_dir missing
    (["plot", "--stats"], 2),
])
def test_help_and_argument_errors_leave_torch_unimported(argv, code, tmp_path):
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.splitlines()[-1] == f"[] {code}", done.stderr[-2000:]


def test_import_ompmoe_loads_the_engine_only_on_first_use():
    code = "import sys, ompmoe; before = 'torch' in sys.modules; ompmoe.PruningStrategy; print(before, 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["False", "True"], done.stderr[-2000:]


def test_prune_help_is_built_from_the_registries_once_then_printed_from_the_cache_without_torch(tmp_path):
    from ompmoe.engine.planning.allocation import ALLOCATIONS
    from ompmoe.engine.methods import METHODS, option_defaults

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "COLUMNS": "200"}
    runs = [subprocess.run([sys.executable, "-c", PROBE.format(argv=["prune", "--help"])], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    first, second = (run.stdout.splitlines() for run in runs)
    assert first[-1] == "['torch'] 0", runs[0].stderr[-2000:]
    assert second[-1] == "[] 0" and first[:-1] == second[:-1], runs[1].stderr[-2000:]
    text = " ".join(runs[1].stdout.split())
    names = "auto (the setting recommended for the model's architecture), "
    assert names + ", ".join(METHODS) + " or one registered with ompmoe.register_method" in text
    assert names + ", ".join(ALLOCATIONS) in text
    for name in METHODS:
        for key, value in option_defaults(name).items():
            assert f"{key}={value!r}" in text, (name, key)


def test_full_fit_help_is_built_once_then_printed_from_the_cache_without_torch(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "COLUMNS": "100"}
    runs = [subprocess.run([sys.executable, "-c", PROBE.format(argv=["fit", "--help"])], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    first, second = (run.stdout.splitlines() for run in runs)
    assert first[-1] == "['lightning', 'torch', 'transformers'] 0", runs[0].stderr[-2000:]
    assert second[-1] == "[] 0", runs[1].stderr[-2000:]
    assert first[:-1] == second[:-1] and len(first) > 500
    assert "--trainer.callbacks" in runs[1].stdout
    assert [path.name.split("-")[0] for path in (tmp_path / "cache" / "ompmoe" / "help").iterdir()] == ["fit"]


def test_the_help_cache_is_keyed_by_command_width_and_ompmoe_source(monkeypatch, tmp_path):
    from ompmoe import help_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "100")
    fit = help_cache.cache_file(["fit", "--help"])
    assert fit.parent == tmp_path / "ompmoe" / "help"
    assert help_cache.cache_file(["validate", "--help"]) != fit
    monkeypatch.setenv("COLUMNS", "80")
    assert help_cache.cache_file(["fit", "--help"]) != fit
    assert (help_cache.is_plain_help(["fit", "--help"]), help_cache.is_plain_help(["fit", "-c", "a.yaml", "--help"]),
            help_cache.is_plain_help(["plot", "--help"])) == (True, False, False)


def test_python_dash_m_ompmoe_is_the_ompmoe_command(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ompmoe", "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("usage: ompmoe <command> [options]"), done.stderr
