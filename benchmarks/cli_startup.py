"""How long the ``ompmoe`` command takes to answer help and argument mistakes, against ``import torch``.

    python benchmarks/cli_startup.py --repeats 7

Each command runs in a fresh process, interleaved with the reference ``python -c "import torch"``, and
the script prints wall-clock medians and their ratio to the reference (goal for ``ompmoe --help``:
under 0.3x). Commands that need no model must not import torch at all; tests/test_cli_startup.py checks
that, this script measures what it buys.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

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


def seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, capture_output=True, check=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    ompmoe = shutil.which("ompmoe") or sys.exit("the ompmoe command is not on PATH: pip install -e .")
    seconds(REFERENCE)  # warm the file cache once
    times: dict[str, list[float]] = {name: [] for name in ["import torch", *COMMANDS]}
    for _ in range(args.repeats):
        for name, argv in COMMANDS.items():
            times["import torch"].append(seconds(REFERENCE))
            times[name].append(seconds([ompmoe, *argv]))
    reference = statistics.median(times["import torch"])
    print(f"wall-clock medians of {args.repeats} interleaved runs, each in a fresh process")
    print(f"{'command':32s} {'seconds':>8s} {'/ import torch':>15s}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:32s} {median:8.3f} {median / reference:15.2f}")


if __name__ == "__main__":
    main()
