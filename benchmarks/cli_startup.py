"""How long the ``ompmoe`` command takes to answer help and argument mistakes, against ``import torch``.

    python benchmarks/cli_startup.py --repeats 7

Each command runs in a fresh process, interleaved with the reference ``python -c "import torch"``, and
the script prints wall-clock medians and their ratio to the reference (goal for ``ompmoe --help``:
under 0.3x). Commands that need no model must not import torch at all; tests/test_cli_startup.py checks
that, this script measures what it buys. ``prune`` and ``plot`` from saved statistics (synthetic ones, 48 layers x
128 experts, written once to a temporary folder) import torch but never torchmetrics (tests/test_layout.py);
``--work`` adds them, and the same commands with torchmetrics imported first, to say what that saves.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REFERENCE = [sys.executable, "-c", "import torch"]
COMMANDS = {
    "ompmoe --help": ["--help"],
    "ompmoe": [],
    "ompmoe fit -h": ["fit", "-h"],
    "ompmoe fit -c missing.yaml": ["fit", "-c", "missing.yaml"],
    "ompmoe prune --help": ["prune", "--help"],
    "ompmoe report --help": ["report", "--help"],
    "ompmoe validate -h": ["validate", "-h"],
    "ompmoe fitt (typo)": ["fitt"],
}


def work_commands(folder: Path) -> dict[str, list[str]]:
    """``ompmoe prune`` and ``ompmoe plot`` on synthetic statistics in ``folder``, run as the command runs them and
    with torchmetrics imported first (what every such command paid before collect/sums.py)."""
    from ompmoe.engine.collect.synthetic import synthetic_stats

    stats = str(synthetic_stats(48, 128, 8).save(folder / "stats.safetensors"))
    commands = {"prune": ["prune", "--stats", stats, "--ratio", "0.25,0.5", "--output_dir", str(folder / "plans"),
                          "--overwrite", "--quiet"],
                "plot": ["plot", "--stats", stats, "--output_dir", str(folder / "plots"), "--overwrite", "--quiet"]}
    found = {}
    for name, argv in commands.items():
        for label, first in ((f"ompmoe {name} (saved stats)", ""),
                             (f"ompmoe {name}, torchmetrics first", "import torchmetrics; ")):
            found[label] = [sys.executable, "-c", f"{first}from ompmoe.cli import main; main()", *argv]
    return found


def seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, capture_output=True, check=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--work", action="store_true", help="also prune and plot from saved statistics")
    args = parser.parse_args()
    ompmoe = shutil.which("ompmoe") or sys.exit("the ompmoe command is not on PATH: pip install -e .")
    commands = {name: [ompmoe, *argv] for name, argv in COMMANDS.items()}
    folder = tempfile.TemporaryDirectory()
    if args.work:
        commands.update(work_commands(Path(folder.name)))
    seconds(REFERENCE)  # warm the file cache once
    times: dict[str, list[float]] = {name: [] for name in ["import torch", *commands]}
    for _ in range(args.repeats):
        for name, command in commands.items():
            times["import torch"].append(seconds(REFERENCE))
            times[name].append(seconds(command))
    folder.cleanup()
    reference = statistics.median(times["import torch"])
    print(f"wall-clock medians of {args.repeats} interleaved runs, each in a fresh process")
    print(f"{'command':32s} {'seconds':>8s} {'/ import torch':>15s}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:32s} {median:8.3f} {median / reference:15.2f}")


if __name__ == "__main__":
    main()
