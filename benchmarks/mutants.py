"""Does the test suite still bite? Plant each known mutant in a copy of the repository and run the tests that
should catch it: a mutant the tests pass is a hole in the suite.

    python benchmarks/mutants.py                 # every mutant
    python benchmarks/mutants.py --only swapped_nibbles

Each mutant is one textual edit of one source file (the edit must apply exactly once). The copy holds the working
tree's tracked and untracked files, so uncommitted tests count; it is imported first through ``PYTHONPATH`` (checked
per run). Prints one line per mutant: caught (with the first failing test) or MISSED, and exits 1 if any was missed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    """Test files (or ids) that should catch it; the whole suite holds them."""


PER_TOKEN = "        per_token = (target.exp() * (target - torch.log_softmax(logits.float(), dim=-1))).sum(-1)\n"
MUTANTS = (
    Mutant("distillation_zeroed", "ompmoe/lightning/finetune_module.py", PER_TOKEN,
           PER_TOKEN + "        per_token = per_token * 0\n", ("tests/lightning/test_finetune_recipe.py",)),
    Mutant("distillation_reversed", "ompmoe/lightning/finetune_module.py", PER_TOKEN,
           PER_TOKEN + "        per_token = -per_token\n", ("tests/lightning/test_finetune_recipe.py",)),
    Mutant("swapped_nibbles", "ompmoe/recipes/quantization.py", "torch.stack((qdata & 0x0F, qdata >> 4), dim=-1)",
           "torch.stack((qdata >> 4, qdata & 0x0F), dim=-1)", ("tests/recipes/test_quantization_reference.py",)),
    Mutant("dequantized_zeroed", "ompmoe/recipes/quantization.py",
           "    return (groups * scale.unsqueeze(-1)).reshape(qdata.shape)",
           "    return (groups * scale.unsqueeze(-1) * 0).reshape(qdata.shape)",
           ("tests/recipes/test_quantization_reference.py",)),
    Mutant("compensation_identity", "ompmoe/engine/apply/compensation.py",
           "        return _solve(sums.output_gram + lam * eye, (sums.output_cross + lam * base * eye).T).T.contiguous()",
           "        return eye.clone()", ("tests/engine/test_compensation.py",)),
    Mutant("auto_choice_inverted", "ompmoe/engine/apply/plan_choice.py",
           "    best = min(range(len(candidates)), key=lambda i: losses[setting_name(candidates[i])])",
           "    best = max(range(len(candidates)), key=lambda i: losses[setting_name(candidates[i])])",
           ("tests/engine/test_plan_choice.py",)),
    Mutant("saved_kept_ids_shifted", "ompmoe/engine/planning/plan.py",
           "            tmp.write_text(json.dumps(self.to_dict(), indent=1))",
           "            data = self.to_dict()\n"
           "            layer = data['layers'][0]\n"
           "            layer['kept'] = sorted((k + 1) % layer['num_experts'] for k in layer['kept'])\n"
           "            tmp.write_text(json.dumps(data, indent=1))",
           ("tests/engine/test_plan.py",)),
)


def _copy(destination: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def _plant(copy: Path, mutant: Mutant) -> None:
    path = copy / mutant.path
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise SystemExit(f"{mutant.name}: the edit does not apply exactly once to {mutant.path} "
                         f"({text.count(mutant.old)} matches); update benchmarks/mutants.py")
    path.write_text(text.replace(mutant.old, mutant.new))


def _env(copy: Path) -> dict[str, str]:
    # The copy's ompmoe/, callbacks/ and eval/ first (the editable install maps ompmoe.callbacks and ompmoe.eval).
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(copy), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def run(mutant: Mutant, copy: Path) -> tuple[bool, str, float]:
    """Whether the tests caught ``mutant`` (its first failing test) and the seconds they took."""
    module = mutant.path.removesuffix(".py").replace("/", ".")
    probe = subprocess.run([sys.executable, "-c", f"import {module} as m; print(m.__file__)"], cwd=copy,
                           env=_env(copy), capture_output=True, text=True)
    if not probe.stdout.strip().startswith(str(copy)):
        raise SystemExit(f"{mutant.name}: {module} is not imported from the copy ({probe.stdout or probe.stderr})")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests],
                          cwd=copy, env=_env(copy), capture_output=True, text=True)
    seconds = time.perf_counter() - start
    failed = next((line.split(" ", 1)[1].split(" - ")[0] for line in done.stdout.splitlines()
                   if line.startswith("FAILED ")), "")
    return done.returncode != 0, failed or done.stdout.strip().splitlines()[-1], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=[m.name for m in MUTANTS], help="mutants to plant (default: all)")
    args = parser.parse_args()
    missed = []
    for mutant in MUTANTS:
        if args.only and mutant.name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as directory:
            copy = Path(directory)
            _copy(copy)
            _plant(copy, mutant)
            caught, detail, seconds = run(mutant, copy)
        print(f"{mutant.name:<24} {'caught' if caught else 'MISSED'} in {seconds:5.1f} s: {detail}", flush=True)
        if not caught:
            missed.append(mutant.name)
    if missed:
        raise SystemExit(f"missed: {', '.join(missed)}")


if __name__ == "__main__":
    main()
