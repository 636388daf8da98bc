"""Atomic writes: whole or nothing, no accidental overwrite, ordinary permissions."""

import os

import pytest

from ompmoe.engine.io import OutputExistsError, atomic_path


def test_atomic_file_and_directory_get_umask_permissions(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    (tmp_path / "plain_dir").mkdir()
    with atomic_path(tmp_path / "file.txt") as tmp:
        tmp.write_text("x")
    with atomic_path(tmp_path / "dir", directory=True) as tmp:
        (tmp / "inner").write_text("x")
    assert os.stat(tmp_path / "file.txt").st_mode == os.stat(plain).st_mode
    assert os.stat(tmp_path / "dir").st_mode == os.stat(tmp_path / "plain_dir").st_mode


def test_failure_leaves_nothing_and_existing_output_is_kept(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(tmp_path / "out", directory=True) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "keep.txt").write_text("old")
    with pytest.raises(OutputExistsError, match=r"keep.txt already exists; pass --overwrite \(overwrite=True in Python\)"):
        with atomic_path(tmp_path / "keep.txt"):
            pass
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "keep.txt", overwrite=True) as tmp:
            tmp.write_text("new")
            raise RuntimeError("fail")
    assert (tmp_path / "keep.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


# ---------------------------------------------------------------- issue 15: never lose a user's files
import errno
import json
import signal
import stat
import subprocess
import sys
from pathlib import Path

import torch

import ompmoe
import ompmoe.engine.io as io
from ompmoe import collect_stats
from ompmoe.cli import main
from ompmoe.engine.io import MARKER, OutputNotReplaceableError, OutputNotWritableError, check_writable, clean_leftovers
from ompmoe.engine.tiny import tiny_model


def write_stats(path: Path) -> Path:
    stats = collect_stats(tiny_model("qwen3_moe"), [torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(0))])
    return stats.save(path)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_prune_into_the_working_directory_is_refused_and_deletes_nothing(tmp_path, monkeypatch):
    stats = write_stats(tmp_path / "stats.safetensors")
    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=r"^error: \. is \(or contains\) the current working directory .*ompmoe will not"):
        main(["prune", "--stats", "stats.safetensors", "--ratio", "[0.5]", "--output_dir", ".", "--overwrite", "true"])
    assert names(tmp_path) == ["notes.txt", "stats.safetensors"]
    assert ompmoe.MoEStats.load(stats).num_tokens == 16
    # The directory holding the input (not the cwd) is refused too, and so is any directory that is not ours.
    monkeypatch.chdir(tmp_path.parent)
    with pytest.raises(SystemExit, match=r"contains the input .*stats.safetensors; replacing it would delete the input"):
        main(["prune", "--stats", str(stats), "--ratio", "[0.5]", "--output_dir", str(tmp_path), "--overwrite", "true"])
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "a.txt").write_text("a")
    with pytest.raises(SystemExit, match=r"theirs is not an ompmoe output \(no \.ompmoe-output marker\) and holds other"):
        main(["prune", "--stats", str(stats), "--ratio", "[0.5]", "--output_dir", str(tmp_path / "theirs"),
              "--overwrite", "true"])
    assert names(tmp_path) == ["notes.txt", "stats.safetensors", "theirs"]
    assert names(tmp_path / "theirs") == ["a.txt"]


def test_save_pruned_refuses_a_foreign_directory_and_replaces_its_own(tmp_path, monkeypatch):
    model = tiny_model("qwen3_moe")
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    with pytest.raises(OutputNotReplaceableError, match="out is not an ompmoe output"):
        ompmoe.save_pruned(model, target, overwrite=True)
    assert names(target) == ["keep.txt"] and names(tmp_path) == ["out"]
    monkeypatch.chdir(target)
    with pytest.raises(OutputNotReplaceableError, match="current working directory"):
        check_writable(".", overwrite=True, directory=True)
    # Our own output (marker) and an empty directory are replaced.
    ompmoe.save_pruned(model, tmp_path / "mine")
    assert json.loads((tmp_path / "mine" / MARKER).read_text()) == {"tool": "ompmoe", "version": ompmoe.__version__}
    ompmoe.save_pruned(model, tmp_path / "mine", overwrite=True)
    (tmp_path / "empty").mkdir()
    ompmoe.save_pruned(model, tmp_path / "empty", overwrite=True)
    assert (tmp_path / "empty" / "config.json").is_file()
    assert names(tmp_path) == ["empty", "mine", "out"]


def test_callback_refuses_a_foreign_directory_before_calibration(tmp_path):
    from reference import ForwardCounter, batches, trainer
    from torch.utils.data import DataLoader

    from ompmoe.lightning.calibration_module import CalibrationModule
    from ompmoe.callbacks import ExpertPruning

    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "corpus.txt").write_text("precious")
    counter = ForwardCounter()
    with pytest.raises(OutputNotReplaceableError, match=r"data is not an ompmoe output .*Choose a new output directory"):
        trainer([counter, ExpertPruning(output_dir=str(foreign), overwrite=True)]).fit(
            CalibrationModule("tiny:qwen3_moe"), DataLoader(batches(2))
        )
    assert counter.calls == 0 and names(foreign) == ["corpus.txt"]


def test_single_file_output_replaces_only_a_regular_file(tmp_path):
    (tmp_path / "plan.json").mkdir()
    with pytest.raises(OutputNotReplaceableError, match=r"plan.json is a directory, not a file"):
        with atomic_path(tmp_path / "plan.json", overwrite=True) as tmp:
            tmp.write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "plan.json")
    with pytest.raises(OutputNotReplaceableError, match=r"link.json is not a regular file"):
        check_writable(tmp_path / "link.json", overwrite=True)
    assert names(tmp_path) == ["link.json", "plan.json"]


def test_output_that_appears_while_running_is_kept(tmp_path, monkeypatch):
    stats = write_stats(tmp_path / "stats.safetensors")
    out = tmp_path / "out"

    def other_job_commits(name):  # a second job finishes into the same output_dir first
        if name == "written" and not out.exists():
            out.mkdir()
            (out / MARKER).write_text("{}")
            (out / "plan-0.25.json").write_text("other job")

    monkeypatch.setattr(io, "_step", other_job_commits)
    with pytest.raises(SystemExit, match=r"error: .*out already exists; pass --overwrite \(overwrite=True in Python\).*"
                                         r"appeared while this run was writing; it was kept"):
        main(["prune", "--stats", str(stats), "--ratio", "[0.5]", "--output_dir", str(out)])
    assert names(out) == [MARKER, "plan-0.25.json"] and (out / "plan-0.25.json").read_text() == "other job"
    assert names(tmp_path) == ["out", "stats.safetensors"]
    # Same for a single file.
    monkeypatch.setattr(io, "_step", lambda name: (tmp_path / "f.txt").write_text("other"))
    with pytest.raises(io.OutputExistsError, match="appeared while"):
        with atomic_path(tmp_path / "f.txt") as tmp:
            tmp.write_text("mine")
    assert (tmp_path / "f.txt").read_text() == "other"
    assert names(tmp_path) == ["f.txt", "out", "stats.safetensors"]


def test_read_only_file_system_is_reported_before_any_work(tmp_path, monkeypatch):
    real_open = os.open

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(OutputNotWritableError, match=r"cannot write .*out: Read-only file system .*choose another output_dir") as info:
        check_writable(tmp_path / "deep" / "out", overwrite=False)
    assert info.value.errno == errno.EROFS and isinstance(info.value, OSError)
    loads = []
    monkeypatch.setattr(ompmoe.MoEStats, "load", lambda *a: loads.append(a))
    for command in (["prune", "--stats", "s", "--ratio", "[0.5]"], ["plot", "--stats", "s"]):
        with pytest.raises(SystemExit, match=r"^error: \[Errno 30\] cannot write .*Read-only file system"):
            main([*command, "--output_dir", str(tmp_path / "out")])
    assert loads == [] and names(tmp_path) == []
    from ompmoe.recipes.quickstart import prune_tiny_model

    from ompmoe.recipes.quickstart import main as demo_main

    with pytest.raises(OutputNotWritableError, match="Read-only file system"):
        prune_tiny_model(output_dir=str(tmp_path / "demo"))
    monkeypatch.setattr(sys, "argv", ["ompmoe-demo", "--output_dir", str(tmp_path / "demo")])
    with pytest.raises(SystemExit, match=r"^error: \[Errno 30\] cannot write .*demo: Read-only file system") as info:
        demo_main()
    assert info.value.code == 2  # bad input, as every command
    assert names(tmp_path) == []


WRITER = r"""
import json, os, sys, types
target, package, pid = sys.argv[1], sys.argv[2], sys.argv[3]
stub = types.ModuleType("ompmoe")  # import ompmoe.engine.io alone (seconds faster than torch)
stub.__path__, stub.__version__ = [package], "test"
sys.modules["ompmoe"] = stub
import ompmoe.engine.io as io
if pid:  # seen from this test, a process in another PID namespace: its pid names no process here
    io._owner = lambda: f"{io._host()}-{pid}"
    identity = getattr(io, "_identity", dict)
    io._identity = lambda: {**identity(), "pid": pid, "pid_namespace": "other"}
with io.atomic_path(target, directory=True) as tmp:
    (tmp / "part").write_text("half")
    print(tmp.name, flush=True)
    sys.stdin.readline()  # the test cleans leftovers here, mid-write
    (tmp / "part").write_text("whole")
"""


def writer(target: Path, pid: str = "") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(Path(io.__file__).parents[1]), pid],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_a_live_run_in_another_pid_namespace_keeps_its_temporary(tmp_path):
    """Issue 26.3: a pid that does not exist here is no proof of death; the run's flock is."""
    pid = dead_pid()
    live = writer(tmp_path / "out", str(pid))
    tmp_name = live.stdout.readline().strip()
    assert tmp_name.startswith(f".out.{io._host()}-{pid}.") and tmp_name.endswith(".tmp")
    assert clean_leftovers(tmp_path / "out") == []
    # What the next run does first: it refuses (issue 36), and deletes nothing of the live run.
    with pytest.raises(io.OutputInUseError) as info:
        check_writable(tmp_path / "out", overwrite=False, directory=True)
    assert str(info.value) == (f"another ompmoe run (pid {pid}, in another container or PID namespace) is using "
                               f"{tmp_path / 'out'} (calibrating or writing it); wait for it to finish, or choose "
                               "another output path")
    assert (tmp_path / tmp_name / "part").read_text() == "half"
    live.communicate("\n")
    assert live.returncode == 0
    assert names(tmp_path) == ["out"] and (tmp_path / "out" / "part").read_text() == "whole"


def test_leftovers_of_dead_runs_are_cleaned_and_unknown_ones_kept(tmp_path, monkeypatch):
    killed = writer(tmp_path / "out")
    tmp_name = killed.stdout.readline().strip()
    killed.kill()
    killed.wait()
    assert len(names(tmp_path)) == 2  # the temporary and its lock file
    assert clean_leftovers(tmp_path / "out") == [tmp_path / tmp_name]
    assert names(tmp_path) == []
    # Without a lock file (not ours to judge), or a lock file of another output, nothing is touched.
    unknown = tmp_path / f".out.{io._host()}-{dead_pid()}.0badc0de.tmp"
    unknown.mkdir()
    unrelated = tmp_path / f".outer.{io._host()}-{dead_pid()}.0badc0de.lock"
    unrelated.write_text("{}")
    assert clean_leftovers(tmp_path / "out") == []
    assert names(tmp_path) == sorted([unknown.name, unrelated.name])


@pytest.mark.parametrize("changed, cleaned", [({}, True), ({"pid_namespace": "4026532999"}, False),
                                              ({"boot_id": "another-boot"}, False), ({"host": "otherhost"}, False),
                                              ({"pid": str(os.getpid())}, False)])
def test_without_flock_the_lock_files_identity_decides(tmp_path, monkeypatch, changed, cleaned):
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(io.fcntl, "flock", no_flock)
    pid = dead_pid()
    stem = tmp_path / f".out.{io._host()}-{pid}.0123abcd"
    Path(f"{stem}.tmp").mkdir()
    Path(f"{stem}.lock").write_text(json.dumps({**io._identity(), "pid": str(pid), **changed}))
    assert clean_leftovers(tmp_path / "out") == ([Path(f"{stem}.tmp")] if cleaned else [])
    assert len(names(tmp_path)) == (0 if cleaned else 2)


KILLER = r"""
import os, shutil, signal, sys, types
target, point, exchange, package = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
stub = types.ModuleType("ompmoe")  # import ompmoe.engine.io alone (seconds faster than torch)
stub.__path__, stub.__version__ = [package], "test"
sys.modules["ompmoe"] = stub
import ompmoe.engine.io as io
if not exchange:
    real = io._renameat2
    io._renameat2 = lambda s, t, f: False if f == io._RENAME_EXCHANGE else real(s, t, f)
def step(name):
    if name == point:
        os.kill(os.getpid(), signal.SIGKILL)
io._step = step
if point == "deleting":
    def half_then_die(path, ignore_errors=False):
        for i, entry in enumerate(sorted(os.listdir(path))):
            if i == 1000:
                os.kill(os.getpid(), signal.SIGKILL)
            os.unlink(os.path.join(path, entry))
    io.shutil.rmtree = half_then_die
with io.atomic_path(target, overwrite=True, directory=True) as tmp:
    (tmp / "new.txt").write_text("new")
"""


@pytest.mark.parametrize(
    "point, exchange, after_kill",
    [
        ("written", True, "old"),
        ("exchanged", True, "new"),
        ("deleting", True, "new"),
        ("aside", False, None),  # between the two renames: target restored from the aside copy by the next run
        ("renamed", False, "new"),
        ("deleting", False, "new"),
    ],
)
def test_sigkill_while_replacing_leaves_a_whole_output(tmp_path, point, exchange, after_kill):
    target = tmp_path / "out"
    with atomic_path(target, directory=True) as tmp:
        for i in range(2000):
            (tmp / f"old-{i:04d}").write_text("old")
    old = names(target)

    def state() -> str | None:
        if not target.exists():
            return None
        return {tuple(old): "old", (MARKER, "new.txt"): "new"}.get(tuple(names(target)), "broken")

    result = subprocess.run([sys.executable, "-c", KILLER, str(target), point, "1" if exchange else "0",
                             str(Path(io.__file__).parents[1])])
    assert result.returncode == -signal.SIGKILL
    assert state() == after_kill
    assert len(names(tmp_path)) == 3  # the output (or the aside copy), a leftover and the lock of the killed run
    check_writable(target, overwrite=True, directory=True)  # the next run for the same target
    assert names(tmp_path) == ["out"]
    assert state() == (after_kill or "old")


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_a_directory_output_and_every_file_in_it_get_the_umask_permissions(tmp_path, umask):
    """Libraries write some files private (transformers: model.safetensors 0600); a shared output stays readable."""
    previous = os.umask(umask)
    try:
        with atomic_path(tmp_path / "out", directory=True) as tmp:
            (tmp / "sub").mkdir(mode=0o700)
            for name in ("private.bin", "sub/nested.json"):
                descriptor = os.open(tmp / name, os.O_CREAT | os.O_WRONLY, 0o600)
                os.close(descriptor)
            (tmp / "run.sh").write_text("")
            os.chmod(tmp / "run.sh", 0o700)
    finally:
        os.umask(previous)
    mode = {path.relative_to(tmp_path / "out").as_posix(): stat.S_IMODE(path.stat().st_mode)
            for path in (tmp_path / "out").rglob("*")}
    assert mode == {"private.bin": 0o666 & ~umask, "sub": 0o777 & ~umask, "sub/nested.json": 0o666 & ~umask,
                    "run.sh": 0o777 & ~umask, MARKER: 0o666 & ~umask}
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask


# ---------------------------------------------------------------- issue 33: what a killed run leaves, faked
def dead_run_leftovers(directory: Path, name: str, kinds: tuple[str, ...]) -> Path:
    """The leftovers of a run killed while writing ``directory / name``: its lock file (with the identity of a pid that
    no longer exists, its ``flock`` gone with it) and the ``kinds`` among ``tmp`` (the new output, whole) and ``old``
    (the previous output moved aside). Returns their common stem."""
    pid = dead_pid()
    stem = directory / f".{name}.{io._host()}-{pid}.0123abcd"
    Path(f"{stem}.lock").write_text(json.dumps({**io._identity(), "pid": str(pid)}))
    for kind in kinds:
        Path(f"{stem}.{kind}").mkdir()
        (Path(f"{stem}.{kind}") / MARKER).write_text("{}")
        (Path(f"{stem}.{kind}") / f"{'new' if kind == 'tmp' else 'old'}.txt").write_text(kind)
    return stem


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "no-flock"])
@pytest.mark.parametrize("next_run", ["check_writable", "reserve"])
@pytest.mark.parametrize("state, kinds, output, after", [
    ("a: killed while writing", ("tmp",), False, None),
    ("a: killed while writing over an output", ("tmp",), True, "current.txt"),
    ("b: killed between the two renames", ("tmp", "old"), False, "old.txt"),  # the old output is restored
    ("b: killed between the two renames, nothing new yet", ("old",), False, "old.txt"),
    ("c: killed while deleting the old output", ("old",), True, "current.txt"),
    ("c: killed after both renames", ("tmp", "old"), True, "current.txt"),
])
def test_the_next_run_cleans_or_restores_what_a_killed_run_left(tmp_path, monkeypatch, flock, next_run, state, kinds,
                                                                 output, after):
    if not flock:  # the identity in the lock file decides: this host, boot and namespace, and its pid is gone
        def no_flock(fd, operation):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

        monkeypatch.setattr(io.fcntl, "flock", no_flock)
    out = tmp_path / "out"
    if output:
        out.mkdir()
        (out / MARKER).write_text("{}")
        (out / "current.txt").write_text("current")
    stem = dead_run_leftovers(tmp_path, "out", kinds)
    if next_run == "check_writable":
        check_writable(out, overwrite=True, directory=True)
    else:
        io.reserve(out, overwrite=True, directory=True).release()
    assert names(tmp_path) == ([] if after is None else ["out"])  # no .tmp, .old or .lock left
    if after is not None:
        assert names(out) == sorted([MARKER, after])
    if after == "old.txt":  # restored, not deleted: without --overwrite the next run is told it exists
        with pytest.raises(OutputExistsError, match=r"out already exists; pass --overwrite"):
            check_writable(out, overwrite=False, directory=True)
    assert not any(os.path.lexists(f"{stem}.{kind}") for kind in ("tmp", "old", "lock"))


def test_a_leftover_that_cannot_be_removed_keeps_its_lock_for_the_next_run(tmp_path, monkeypatch):
    stem = dead_run_leftovers(tmp_path, "out", ("tmp",))
    monkeypatch.setattr(io, "_remove", lambda path: None)  # e.g. a read-only folder inside the temporary
    assert clean_leftovers(tmp_path / "out") == []
    assert names(tmp_path) == sorted([f"{stem.name}.lock", f"{stem.name}.tmp"])  # not an orphan without its lock
    monkeypatch.undo()
    assert clean_leftovers(tmp_path / "out") == [Path(f"{stem}.tmp")]
    assert names(tmp_path) == []
