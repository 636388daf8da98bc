"""``ompmoe`` answers help and argument mistakes without importing torch (benchmarks/cli_startup.py times it)."""

from __future__ import annotations

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
    (["fit", "-c", "no-such-config.yaml"], 2),
    (["report", "--help"], 0),
])
def test_help_and_argument_errors_leave_torch_unimported(argv, code, tmp_path):
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.splitlines()[-1] == f"[] {code}", done.stderr[-2000:]


def test_import_ompmoe_loads_the_engine_only_on_first_use():
    code = "import sys, ompmoe; before = 'torch' in sys.modules; ompmoe.PruningStrategy; print(before, 'torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["False", "True"], done.stderr[-2000:]
