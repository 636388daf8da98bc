"""Issue 36, item 4: a run reserves its output directory when it checks it, before calibrating, so a second run into
the same (new) directory refuses in one line before its own calibration instead of failing at commit; the reservation
is released on every path: the write (committed or failed), a failed run, garbage collection, process death."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import ompmoe  # noqa: E402
import ompmoe.engine.io as io  # noqa: E402
from ompmoe.engine.io import OutputInUseError, atomic_path, check_writable, reserve  # noqa: E402
from ompmoe.engine.ranks import RunContext  # noqa: E402
from ompmoe.engine.run import PruningRun  # noqa: E402
from ompmoe.engine.tiny import tiny_model  # noqa: E402

PACKAGE = str(Path(io.__file__).parents[1])

RESERVER = r"""
import sys, types
target, package = sys.argv[1], sys.argv[2]
stub = types.ModuleType("ompmoe")  # import ompmoe.engine.io alone (seconds faster than torch)
stub.__path__, stub.__version__ = [package], "test"
sys.modules["ompmoe"] = stub
import ompmoe.engine.io as io
reservation = io.reserve(target, overwrite=False, directory=True)  # what PruningRun.check_output does on rank 0
print(reservation.lock.path.name, flush=True)
sys.stdin.readline()  # "calibrating" until the test says; exits without releasing (the finalizer does)
"""

CHECKER = r"""
import sys, types
target, package = sys.argv[1], sys.argv[2]
stub = types.ModuleType("ompmoe")
stub.__path__, stub.__version__ = [package], "test"
sys.modules["ompmoe"] = stub
import ompmoe.engine.io as io
try:
    io.check_writable(target, overwrite=True, directory=True)
except io.OutputInUseError as error:
    print(error)
else:
    print("free")
"""


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def in_use(target: Path, pid: int) -> str:
    return (f"another ompmoe run (pid {pid}) is using {target} (calibrating or writing it); wait for it to finish, or "
            "choose another output path")


def reserver(target: Path) -> subprocess.Popen:
    """Another process that checked ``target`` (and so reserved it) and is calibrating until a line arrives."""
    process = subprocess.Popen([sys.executable, "-c", RESERVER, str(target), PACKAGE], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip().endswith(".lock")
    return process


def seen_from_another_process(target: Path) -> str:
    """What another run's check says about ``target``: ``free`` or its one-line refusal."""
    done = subprocess.run([sys.executable, "-c", CHECKER, str(target), PACKAGE], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def calibration_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 200, (1, 16), generator=generator) for _ in range(2)]


# ----------------------------------------------------------------------------------- the reservation itself
def test_a_checked_output_is_reserved_until_the_run_writes_it(tmp_path):
    out = tmp_path / "new" / "out"  # a new directory: nothing to see there but the reservation
    run = PruningRun(output_dir=str(out), plots=False, save_model=False)
    run.check_output(RunContext())
    assert run.reservation is not None and run.reservation.held
    assert names(out.parent) == [run.reservation.lock.path.name]
    assert seen_from_another_process(out) == in_use(out, os.getpid())
    check_writable(out, overwrite=False, directory=True)  # this process's own reservation never blocks it
    run.start(tiny_model("qwen3_moe"), RunContext())
    run.collect(calibration_batches())
    run.finish(RunContext(print=lambda line: None))
    # the write took the reservation over (its lock for the temporary) and released it after the commit
    assert not run.reservation.held
    assert names(tmp_path) == ["new"] and names(out.parent) == ["out"]
    assert names(out) == [io.MARKER, "plan.json", "stats.safetensors"]
    assert seen_from_another_process(out) == "free"


def test_the_second_of_two_runs_into_one_new_directory_refuses_before_calibrating(tmp_path):
    from reference import ForwardCounter, batches, trainer
    from torch.utils.data import DataLoader

    from ompmoe.callbacks import ExpertPruning
    from ompmoe.lightning.calibration_module import CalibrationModule
    from ompmoe.recipes.quickstart import prune_tiny_model

    out = tmp_path / "out"
    first = reserver(out)  # a fit that checked first and is calibrating: out does not exist yet
    try:
        assert not out.exists()
        counter = ForwardCounter()
        with pytest.raises(OutputInUseError) as info:
            trainer([counter, ExpertPruning(output_dir=str(out), plots=False)]).fit(
                CalibrationModule("tiny:qwen3_moe"), DataLoader(batches(2)))
        assert str(info.value) == in_use(out, first.pid) and counter.calls == 0
        with pytest.raises(OutputInUseError, match=r"^another ompmoe run \(pid \d+\) is using .*out \(calibrating"):
            prune_tiny_model(output_dir=str(out))  # ompmoe-demo
        with pytest.raises(OutputInUseError, match=r"^another ompmoe run \(pid \d+\) is using .*out \(calibrating"):
            check_writable(out, overwrite=True, directory=True)  # ompmoe prune / plot, also with --overwrite
    finally:
        first.communicate("\n", timeout=60)
    assert first.returncode == 0
    assert names(tmp_path) == []  # the first run's reservation went with it; the refused ones left nothing


def test_two_runs_checking_at_the_same_instant_do_not_both_go_on(tmp_path, monkeypatch):
    """Both checks found the directory free; each took its lock; the one that sees the other's backs off."""
    out = tmp_path / "out"
    real = io._RunLock.__init__
    other: list[subprocess.Popen] = []

    def meanwhile(self, path):  # the other run reserves between this run's check and its lock
        other.append(reserver(out))
        real(self, path)

    monkeypatch.setattr(io._RunLock, "__init__", meanwhile)
    try:
        with pytest.raises(OutputInUseError) as info:
            reserve(out, overwrite=False, directory=True)
        assert str(info.value) == in_use(out, other[0].pid)
        assert len(names(tmp_path)) == 1  # the other run's lock only: this run's was removed
    finally:
        for process in other:
            process.communicate("\n", timeout=60)
    assert names(tmp_path) == []


# ----------------------------------------------------------------------------------- released on every path
def test_a_failed_write_releases_the_reservation_and_the_directories_made_for_it(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    reservation = reserve(out, overwrite=False, directory=True)
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(out, directory=True) as tmp:
            assert tmp.name == reservation.lock.sibling(out, "tmp").name  # written under the reservation's lock
            raise RuntimeError("boom")
    assert not reservation.held and names(tmp_path) == []


def test_a_fit_that_fails_while_calibrating_releases_its_reservation(tmp_path, monkeypatch):
    from reference import batches, trainer
    from torch.utils.data import DataLoader

    from ompmoe.callbacks import ExpertPruning
    from ompmoe.lightning.calibration_module import CalibrationModule

    out = tmp_path / "out"

    def broken_step(self, inputs, batch_idx):
        assert seen_from_another_process(out) == in_use(out, os.getpid())  # reserved while calibrating
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(CalibrationModule, "training_step", broken_step)
    callback = ExpertPruning(output_dir=str(out), plots=False)
    with pytest.raises(RuntimeError, match="the forward failed"):
        trainer([callback]).fit(CalibrationModule("tiny:qwen3_moe"), DataLoader(batches(2)))
    assert not callback.pruning.reservation.held and names(tmp_path) == []  # on_exception released it
    assert seen_from_another_process(out) == "free"


def test_a_fabric_run_that_fails_releases_its_reservation(tmp_path):
    from lightning.fabric import Fabric

    from ompmoe.engine.collect.collector import CalibrationInputError

    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(tiny_model("qwen3_moe"))
    calibration = ompmoe.FabricCalibration(fabric, model, output_dir=tmp_path / "out", plots=False)
    assert calibration.pruning.reservation.held and len(names(tmp_path)) == 1
    with pytest.raises(CalibrationInputError):
        calibration.run([torch.full((1, 8), 10**6)])  # token ids beyond the vocabulary
    assert not calibration.pruning.reservation.held and names(tmp_path) == []
    # a failure in the constructor, after the check (too little text for auto's trial, ...) releases it too
    with pytest.raises(ValueError, match="needs a data module with heldout_blocks"):
        ompmoe.FabricCalibration(fabric, model, output_dir=tmp_path / "out", plots=False, evaluate_on=["x"])
    assert names(tmp_path) == []


def test_a_forgotten_reservation_is_released_when_its_run_is_collected(tmp_path):
    out = tmp_path / "out"
    run = PruningRun(output_dir=str(out), plots=False)
    run.check_output(RunContext())
    lock = run.reservation.lock.path
    # in the same process a later run is not blocked by the forgotten one
    later = PruningRun(output_dir=str(out), plots=False)
    later.check_output(RunContext())
    later.reservation.release()
    assert names(tmp_path) == [lock.name]
    del run
    gc.collect()
    assert names(tmp_path) == []
    with reserve(out, overwrite=False, directory=True) as reservation:  # or a with block
        assert reservation.held and len(names(tmp_path)) == 1
    assert not reservation.held and names(tmp_path) == []


def test_the_reservation_of_a_killed_run_does_not_block(tmp_path):
    out = tmp_path / "out"
    killed = reserver(out)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert len(names(tmp_path)) == 1  # its lock file, no longer held by anyone
    assert seen_from_another_process(out) == "free"  # the next run cleans it
    assert names(tmp_path) == []


# ----------------------------------------------------------------------------------- the run's scratch directory
SCRATCHER = RESERVER.replace(
    "print(reservation.lock.path.name, flush=True)",
    "(reservation.scratch() / 'layer-3.pt').write_bytes(b'kept inputs')\nprint(reservation.lock.path.name, "
    "flush=True)")


def test_the_scratch_directory_is_private_beside_the_output_and_goes_with_the_reservation(tmp_path):
    out = tmp_path / "out"
    reservation = reserve(out, overwrite=False, directory=True)
    scratch = reservation.scratch()
    assert scratch == reservation.scratch() == tmp_path / reservation.lock.path.name.replace(".lock", ".scratch")
    assert scratch.stat().st_mode & 0o777 == 0o700
    (scratch / "spilled").mkdir()
    (scratch / "spilled" / "layer-3.pt").write_bytes(b"kept inputs")
    reservation.release()
    assert names(tmp_path) == []


def test_the_scratch_of_a_killed_run_is_removed_by_the_next_check_and_a_live_runs_is_left_alone(tmp_path):
    out = tmp_path / "out"
    live = subprocess.Popen([sys.executable, "-c", SCRATCHER, str(out), PACKAGE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    lock = live.stdout.readline().strip()
    scratch = lock.removesuffix(".lock") + ".scratch"
    assert seen_from_another_process(out) == in_use(out, live.pid)
    assert names(tmp_path) == sorted([lock, scratch]) and names(tmp_path / scratch) == ["layer-3.pt"]
    live.send_signal(signal.SIGKILL)  # as the kernel's OOM killer ends a run: no finalizer, no clean-up
    live.wait()
    assert names(tmp_path) == sorted([lock, scratch])
    assert seen_from_another_process(out) == "free"  # the next run's check cleans what the dead one left
    assert names(tmp_path) == []


def test_a_layer_by_layer_run_keeps_its_temporary_files_in_its_scratch_directory(tmp_path, monkeypatch):
    """The spilled layer inputs and the per-layer corrections live in the run's scratch directory beside the output,
    gone once the run wrote it."""
    import ompmoe.engine.collect.layerwise as layerwise
    from ompmoe.engine.lazy_checkpoint import build_skeleton, checkpoint_config

    tiny_model("qwen3_moe").save_pretrained(tmp_path / "source")
    seen: list[tuple[str, list[str]]] = []
    collect = layerwise.collect_layerwise

    def recording(*args, scratch=None, **kwargs):
        seen.append((Path(scratch).name, names(tmp_path)))
        return collect(*args, scratch=scratch, **kwargs)

    monkeypatch.setattr(layerwise, "collect_layerwise", recording)
    out = tmp_path / "out"
    run = PruningRun(output_dir=str(out), plots=False, layer_by_layer=True)
    run.check_output(RunContext())
    run.start(build_skeleton(checkpoint_config(tmp_path / "source"), dtype=torch.float32), RunContext())
    run.collect_layer_by_layer(tmp_path / "source", calibration_batches(), show_progress=False)
    scratch = run.reservation.lock.path.name.replace(".lock", ".scratch")
    assert seen == [(scratch, sorted([run.reservation.lock.path.name, scratch, "source"]))]
    run.finish(RunContext(print=lambda line: None))
    assert names(tmp_path) == ["out", "source"]


def test_a_scratch_directory_that_cannot_be_removed_keeps_its_lock_file_so_the_next_run_removes_it(tmp_path,
                                                                                                   monkeypatch):
    out = tmp_path / "out"
    reservation = reserve(out, overwrite=False, directory=True)
    scratch = reservation.scratch()
    (scratch / "layer-3.pt").write_bytes(b"kept inputs")
    remove = io._remove
    monkeypatch.setattr(io, "_remove", lambda path: None)  # busy (EBUSY on NFS): left where it is
    reservation.release()
    monkeypatch.setattr(io, "_remove", remove)
    lock = reservation.lock.path.name
    assert names(tmp_path) == sorted([lock, scratch.name])  # the lock file stays, its flock free
    assert seen_from_another_process(out) == "free"
    assert names(tmp_path) == []
