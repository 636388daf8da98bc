"""Issue 36: a write that fails midway (file-size limit, full disk, quota, read-only file system) ends in one
``error:`` line naming the output and the cause, exit status 2, the previous output intact; an output another live
run is writing is refused before any work; ``ompmoe report`` exits 2 on bad input like every other command."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import ompmoe.engine.io as io  # noqa: E402
from ompmoe.cli import main  # noqa: E402
from ompmoe.engine.io import (MARKER, OutputInUseError, OutputNotWritableError, atomic_path,  # noqa: E402
                              check_writable)

REPO = Path(__file__).resolve().parents[1]
LIMIT = 2 * 2**20  # RLIMIT_FSIZE: a pruned shipped:tiny-moe (about 12 MiB of weights) cannot be written


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def shipped_stats(tmp_path_factory) -> Path:
    """Statistics of ``shipped:tiny-moe`` on two short random blocks (seconds), in a folder of their own."""
    import ompmoe
    from ompmoe.lightning.calibration_module import CalibrationModule

    module = CalibrationModule("shipped:tiny-moe")
    module.configure_model()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 200, (1, 32), generator=generator) for _ in range(2)]
    path = tmp_path_factory.mktemp("stats") / "stats.safetensors"
    ompmoe.collect_stats(module.model, batches, model_id="shipped:tiny-moe").save(path)
    return path


def previous_output(stats: Path, out: Path) -> dict[str, bytes]:
    """An earlier ``ompmoe prune`` output (plans only) at ``out``; returns its files and bytes."""
    main(["prune", "--stats", str(stats), "--ratio", "0.5", "--output_dir", str(out), "--quiet"])
    assert names(out) == [MARKER, "plan-0.5.json"]
    return snapshot(out)


def ompmoe_command(args: list[str], cwd: Path, limit: int | None = None) -> subprocess.CompletedProcess:
    """``python -m ompmoe ARGS`` offline; with ``limit``, under RLIMIT_FSIZE (SIGXFSZ ignored, as Python itself
    does, so a write past the limit fails with EFBIG instead of killing the process)."""

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "ompmoe", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600, preexec_fn=limited if limit is not None else None)


# ------------------------------------------------------------------------- file-size limit, full disk
def test_python_ignores_sigxfsz_so_a_write_past_the_limit_fails_with_efbig(tmp_path):
    code = ("import resource, signal; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
            "print(signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN)\n"
            "try:\n with open('big', 'wb') as f: f.write(b'x' * 8192)\nexcept OSError as e:\n print(e.errno)")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["True", str(errno.EFBIG)], done.stderr


def test_a_file_size_limit_ends_prune_in_one_line_and_keeps_the_previous_output(tmp_path, shipped_stats):
    out = tmp_path / "out"
    before = previous_output(shipped_stats, out)
    done = ompmoe_command(["prune", "--stats", str(shipped_stats), "--ratio", "0.5", "--model", "shipped:tiny-moe",
                           "--output_dir", str(out), "--overwrite", "--quiet"], tmp_path, limit=LIMIT)
    assert done.returncode == 2, done.stderr[-3000:]
    # the weights' writer names the shard it stopped in (written from the files layer by layer: a part's name)
    assert done.stderr.splitlines() == [
        f"error: [Errno 27] cannot write {out}: File too large (this process may write files of at most 2 MiB: "
        "ulimit -f) while writing model-0.5/model-00001.part.safetensors; the previous output is "
        "unchanged. Raise the limit (ulimit -f) or choose another output path."]
    assert snapshot(out) == before and names(tmp_path) == ["out"]  # no temporary, no lock file left


@pytest.mark.slow
def test_a_file_size_limit_ends_fit_in_one_line_and_keeps_the_previous_output(tmp_path, shipped_stats):
    out = tmp_path / "out"
    before = previous_output(shipped_stats, out)
    done = ompmoe_command(["fit", "-c", str(REPO / "configs" / "tiny.yaml"), "--data.num_blocks", "2",
                           "--data.seq_len", "64", "--overwrite", "--output_dir", str(out), "--quiet"],
                          tmp_path, limit=LIMIT)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        f"error: [Errno 27] cannot write {out}: File too large (this process may write files of at most 2 MiB: "
        "ulimit -f) while writing model/model.safetensors; the previous output is "
        "unchanged. Raise the limit (ulimit -f) or choose another output path."]
    # no temporary, no lock file left (Lightning's default_root_dir, outputs/, may be there)
    assert snapshot(out) == before and "out" in names(tmp_path) and not [n for n in names(tmp_path) if ".out." in n]


@pytest.fixture
def small_file_system(tmp_path):
    """``mount(size)``: a tmpfs of ``size`` bytes mounted for the test, resized when called again (needs root or
    CAP_SYS_ADMIN, else the test is skipped: the RLIMIT_FSIZE tests above cover a failing write everywhere, and the
    disk-space tests at the end the refusal before any work)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if sys.platform != "linux":
        pytest.skip("a tmpfs of a given size is mounted with Linux's mount(8)")

    def mount(size: int) -> Path:
        try:
            again = "remount," if os.path.ismount(mount_point) else ""  # resized, its files kept
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"{again}size={size // 1024}k", "tmpfs",
                                   str(mount_point)], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as error:
            pytest.skip(f"cannot run mount(8) here ({error}); the RLIMIT_FSIZE tests cover write failures")
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}; "
                        "the RLIMIT_FSIZE tests cover write failures")
        return mount_point

    try:
        yield mount
    finally:
        if os.path.ismount(mount_point) and subprocess.run(["umount", str(mount_point)],
                                                           capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def checked_size(stats: Path, ratios: list[float], tmp_path: Path) -> int:
    """What ``ompmoe prune --model shipped:tiny-moe`` checks before any work: at least the bytes its plans' pruned
    models take in the shipped model's files (bf16, as stored), summed over ``ratios`` (its plans made here first)."""
    from ompmoe.engine.disk_space import stored_pruned_bytes_lower_bound
    from ompmoe.engine.lazy_checkpoint import build_skeleton, checkpoint_config
    from ompmoe.engine.names import shipped_model_path
    from ompmoe.engine.planning.plan import PruningPlan

    plans = tmp_path / "plans"
    main(["prune", "--stats", str(stats), "--ratio", json.dumps(ratios), "--output_dir", str(plans), "--quiet"])
    skeleton = build_skeleton(checkpoint_config(shipped_model_path()), dtype=torch.bfloat16)
    kept = [{name: len(experts) for name, experts in PruningPlan.load(plans / f"plan-{r:g}.json").kept_by_layer()
             .items()} for r in ratios]
    return sum(stored_pruned_bytes_lower_bound(shipped_model_path(), skeleton, None, kept=each) for each in kept)


def pruned_model_sizes(stats: Path, tmp_path: Path) -> tuple[int, int]:
    """``(the size ompmoe prune checks before any work, the bytes of the weights it then writes)`` for the shipped
    model at ratio 0.5."""
    checked = checked_size(stats, [0.5], tmp_path)
    main(["prune", "--stats", str(stats), "--ratio", "0.5", "--model", "shipped:tiny-moe", "--output_dir",
          str(tmp_path / "reference"), "--quiet"])
    return checked, sum(f.stat().st_size for f in (tmp_path / "reference" / "model-0.5").glob("*.safetensors"))


def test_a_full_file_system_ends_prune_in_one_line_and_keeps_the_previous_output(
        small_file_system, shipped_stats, tmp_path):
    """A disk that passes the check before any work (its tensors' bytes, with two pages to spare) but not the write
    (the file's header and the other files come on top): a write that still fails is clean."""
    checked, weights = pruned_model_sizes(shipped_stats, tmp_path)
    page = os.sysconf("SC_PAGE_SIZE")
    assert weights - checked > 4 * page  # the safetensors header: room for the test either side
    mount_point = small_file_system(64 * 2**20)
    out = mount_point / "out"
    before = previous_output(shipped_stats, out)
    usage = os.statvfs(mount_point)
    small_file_system((usage.f_blocks - usage.f_bavail) * usage.f_frsize + -(-checked // page) * page + 2 * page)
    assert snapshot(out) == before
    free = os.statvfs(mount_point).f_bavail
    done = ompmoe_command(["prune", "--stats", str(shipped_stats), "--ratio", "0.5", "--model", "shipped:tiny-moe",
                           "--output_dir", str(out), "--overwrite", "--quiet"], mount_point.parent)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        f"error: [Errno 28] cannot write {out}: No space left on device while writing "
        "model-0.5/model-00001.part.safetensors; the previous output is unchanged. Free space on that file system or "
        "choose another output path."]
    assert snapshot(out) == before and names(mount_point) == ["out"]
    assert os.statvfs(mount_point).f_bavail == free  # the partial output is gone, not just hidden


def test_a_file_system_too_small_for_the_model_is_refused_before_any_work(small_file_system, shipped_stats, tmp_path):
    from ompmoe.engine.io import readable_size

    checked, _ = pruned_model_sizes(shipped_stats, tmp_path)
    mount_point = small_file_system(6 * 2**20)
    out = mount_point / "out"
    before = previous_output(shipped_stats, out)
    usage = os.statvfs(mount_point)
    done = ompmoe_command(["prune", "--stats", str(shipped_stats), "--ratio", "0.5", "--model", "shipped:tiny-moe",
                           "--output_dir", str(out), "--overwrite", "--quiet"], mount_point.parent)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        f"error: not enough disk space at {out}: the pruned model needs at least {readable_size(checked)} and its file "
        f"system has {readable_size(usage.f_bavail * usage.f_frsize)} free; free space there, or choose another "
        "--output_dir (without --model, prune writes the plans only)"]
    assert snapshot(out) == before and names(mount_point) == ["out"]


# ------------------------------------------------------------------------- the conversion, in process
@pytest.mark.parametrize(("raised", "code", "cause"), [
    (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC, "No space left on device"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), errno.EDQUOT, "Disk quota exceeded"),
    (OSError(errno.EROFS, "Read-only file system"), errno.EROFS, "Read-only file system"),
    (RuntimeError("Error while writing: I/O error: No space left on device (os error 28)"), errno.ENOSPC,
     "No space left on device (reported by RuntimeError)"),
])
def test_a_failed_write_names_the_output_and_the_cause(tmp_path, raised, code, cause):
    out = tmp_path / "out"
    with atomic_path(out, directory=True) as tmp:
        (tmp / "old.txt").write_text("old")
    with pytest.raises(OutputNotWritableError) as info:
        with atomic_path(out, overwrite=True, directory=True) as tmp:
            (tmp / "half.bin").write_bytes(b"x" * 100)
            raise raised
    assert info.value.errno == code and info.value.__cause__ is raised
    assert str(info.value) == (f"[Errno {code}] cannot write {out}: {cause}; the previous output is unchanged. "
                               f"{io._WRITE_ERRNOS[code]}")
    assert names(tmp_path) == ["out"] and names(out) == [MARKER, "old.txt"]


def test_the_file_being_written_is_named_relative_to_the_output_and_nested_outputs_name_the_outer_one(tmp_path):
    from safetensors import SafetensorError

    with pytest.raises(OutputNotWritableError) as info:
        with atomic_path(tmp_path / "out", directory=True) as tmp:
            (tmp / "model").mkdir()
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "model" / "weights.bin"))
    assert str(info.value) == (f"[Errno 28] cannot write {tmp_path / 'out'}: No space left on device while writing "
                               "model/weights.bin; nothing was written there. Free space on that file system or "
                               "choose another output path.")
    with pytest.raises(OutputNotWritableError) as info:
        with atomic_path(tmp_path / "run", directory=True) as tmp:
            with atomic_path(tmp / "model", directory=True):
                raise SafetensorError("Error while serializing: I/O error: Disk quota exceeded (os error 122)")
    assert str(info.value) == (f"[Errno 122] cannot write {tmp_path / 'run'}: Disk quota exceeded while writing "
                               "model (reported by safetensors.SafetensorError); nothing was written there. Free "
                               "space within your quota or choose another output path.")
    assert names(tmp_path) == []


@pytest.mark.parametrize("bug", [TypeError("save() got an unexpected keyword argument (os error 28)"),
                                 AttributeError("'NoneType' object has no attribute 'write'"),
                                 KeyError("weight"), RuntimeError("shape mismatch"),
                                 ValueError("[Errno 28] in a message of a user error")])
def test_bugs_and_other_errors_are_not_taken_for_write_failures(tmp_path, bug):
    with pytest.raises(type(bug)) as info:
        with atomic_path(tmp_path / "out", directory=True):
            raise bug
    assert info.value is bug and names(tmp_path) == []


def test_a_write_failure_in_prune_exits_2_with_one_line(tmp_path, shipped_stats, monkeypatch, capsys):
    import ompmoe

    out = tmp_path / "out"
    before = previous_output(shipped_stats, out)

    def quota(self, path, *args, **kwargs):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(ompmoe.PruningPlan, "save", quota)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["prune", "--stats", str(shipped_stats), "--ratio", "0.25", "--output_dir", str(out), "--overwrite",
              "--quiet"])
    message = (f"error: [Errno 122] cannot write {out}: Disk quota exceeded; the previous output is unchanged. "
               "Free space within your quota or choose another output path.")
    assert info.value.code == 2 and str(info.value) == message
    assert capsys.readouterr().err.splitlines() == [message]
    assert snapshot(out) == before and names(tmp_path) == ["out"]


# ------------------------------------------------------------------------- an output another run is writing
HOLDER = r"""
import sys, types
target, package = sys.argv[1], sys.argv[2]
stub = types.ModuleType("ompmoe")  # import ompmoe.engine.io alone (seconds faster than torch)
stub.__path__, stub.__version__ = [package], "test"
sys.modules["ompmoe"] = stub
import ompmoe.engine.io as io
with io.atomic_path(target, overwrite=True, directory=True) as tmp:
    (tmp / "part").write_text("half")
    print(tmp.name, flush=True)
    sys.stdin.readline()  # holds the run lock until the test says
    (tmp / "part").write_text("whole")
"""


def holder(target: Path) -> subprocess.Popen:
    """A run writing ``target`` (its lock held) until a line arrives on its stdin."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(target), str(Path(io.__file__).parents[1])],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip().endswith(".tmp")
    return process


def in_use(target: Path, pid: int) -> str:
    return (f"another ompmoe run (pid {pid}) is using {target} (calibrating or writing it); wait for it to finish, or "
            "choose another output path")


def test_an_output_a_live_run_is_writing_is_refused_before_any_work(tmp_path, monkeypatch):
    from reference import ForwardCounter, batches, trainer
    from torch.utils.data import DataLoader

    import ompmoe
    from ompmoe.callbacks import ExpertPruning
    from ompmoe.lightning.calibration_module import CalibrationModule

    out = tmp_path / "out"
    live = holder(out)
    try:
        for overwrite in (False, True):
            with pytest.raises(OutputInUseError) as info:
                check_writable(out, overwrite=overwrite, directory=True)
            assert str(info.value) == in_use(out, live.pid)
            assert info.value.errno == errno.EBUSY and isinstance(info.value, OutputNotWritableError)
        # ompmoe prune: refused before the statistics are read (they do not even exist), exit status 2
        loads = []
        monkeypatch.setattr(ompmoe.MoEStats, "load", lambda *a: loads.append(a))
        with pytest.raises(SystemExit) as exit_info:
            main(["prune", "--stats", str(tmp_path / "none"), "--ratio", "0.5", "--output_dir", str(out),
                  "--overwrite"])
        assert exit_info.value.code == 2 and str(exit_info.value) == f"error: {in_use(out, live.pid)}"
        assert loads == []
        monkeypatch.undo()
        # the ExpertPruning callback (ompmoe fit): refused in setup, before one calibration forward
        counter = ForwardCounter()
        with pytest.raises(OutputInUseError, match=r"^another ompmoe run \(pid \d+\) is using "):
            trainer([counter, ExpertPruning(output_dir=str(out), overwrite=True, plots=False)]).fit(
                CalibrationModule("tiny:qwen3_moe"), DataLoader(batches(2)))
        assert counter.calls == 0
    finally:
        live.communicate("\n", timeout=60)
    assert live.returncode == 0 and (out / "part").read_text() == "whole"  # the live run finished undisturbed
    assert names(tmp_path) == ["out"]


def test_the_lock_of_a_dead_run_does_not_block(tmp_path):
    out = tmp_path / "out"
    killed = holder(out)
    killed.kill()
    killed.wait()
    assert len(names(tmp_path)) == 2  # its temporary and its lock file
    assert check_writable(out, overwrite=False, directory=True) == out
    assert names(tmp_path) == []  # cleaned, not refused


def test_without_flock_a_lock_naming_a_live_process_blocks_and_a_dead_one_does_not(tmp_path, monkeypatch):
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(io.fcntl, "flock", no_flock)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock = tmp_path / f".out.{io._host()}-{sleeper.pid}.0123abcd.lock"
        lock.write_text(json.dumps({**io._identity(), "pid": str(sleeper.pid)}))
        with pytest.raises(OutputInUseError, match=rf"^another ompmoe run \(pid {sleeper.pid}\) is using "):
            check_writable(tmp_path / "out", overwrite=False, directory=True)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert check_writable(tmp_path / "out", overwrite=False, directory=True) == tmp_path / "out"
    assert names(tmp_path) == []


# ------------------------------------------------------------------------- ompmoe report: exit status 2
def test_report_exits_2_with_one_line_on_a_bad_results_file_or_argument(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for argv, line in [
        ([str(bad)], f"error: {bad} has no 'ompmoe' summary; it was not written by "),
        ([str(tmp_path / "none.json")], f"error: cannot read results file {tmp_path / 'none.json'}: No such file"),
        ([], "error: the following arguments are required: results (see ompmoe report --help)"),
        ([str(bad), "--digits", "x"], "error: argument --digits: invalid int value: 'x' (see ompmoe report --help)"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(["report", *argv])
        assert info.value.code == 2 and str(info.value).startswith(line)
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(line)


def test_report_exit_status_as_a_command(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"ompmoe": ')
    done = ompmoe_command(["report", str(bad)], tmp_path)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"error: {bad} is not JSON (Expecting value: line 1 column 12 (char 11)). Re-create it with `ompmoe validate` "
        "/ `ompmoe test` (LMEvalDataModule(output_path=...)), or restore that key."]


# ------------------------------------------------------------------------- a disk too small, found before any work
def test_prune_refuses_models_the_disk_cannot_hold_before_pruning_any(tmp_path, shipped_stats, monkeypatch, capsys):
    """Every ratio's model must fit: two here, from the shipped model's files (bf16, as stored)."""
    import collections
    import shutil

    from ompmoe.engine.io import readable_size

    needed = checked_size(shipped_stats, [0.25, 0.5], tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: collections.namedtuple("Usage", "total used free")(
        2**40, 0, needed - 1))
    out = tmp_path / "out"
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["prune", "--stats", str(shipped_stats), "--ratio", "[0.25,0.5]", "--model", "shipped:tiny-moe",
              "--output_dir", str(out), "--quiet"])
    message = (f"error: not enough disk space at {out}: the 2 pruned models need at least {readable_size(needed)} "
               f"and its file system has {readable_size(needed - 1)} free; free space there, or choose another "
               "--output_dir (without --model, prune writes the plans only)")
    assert info.value.code == 2 and str(info.value) == message
    assert capsys.readouterr().err.splitlines() == [message]
    assert names(tmp_path) == ["plans"]  # the plans made above to size the check


def test_fit_refuses_an_output_the_pruned_model_cannot_fit_before_calibrating(tmp_path, monkeypatch, capsys):
    import collections
    import re
    import shutil

    from ompmoe.lightning.calibration_module import CalibrationModule

    forwards: list[int] = []
    configure = CalibrationModule.configure_model

    def counted(module):
        configure(module)
        module.model.register_forward_hook(lambda *args: forwards.append(1))

    monkeypatch.setattr(CalibrationModule, "configure_model", counted)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: collections.namedtuple("Usage", "total used free")(
        2**40, 0, 2**20))
    out = tmp_path / "out"
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["fit", "-c", str(REPO / "configs" / "tiny.yaml"), "--data.num_blocks", "2", "--data.seq_len", "64",
              "--output_dir", str(out), "--trainer.default_root_dir", str(tmp_path / "logs"), "--quiet"])
    message = str(info.value)
    assert info.value.code == 2 and re.fullmatch(
        rf"error: not enough disk space at {re.escape(str(out))}: the pruned model needs at least [0-9.]+ MiB and its "
        r"file system has 1 MiB free; free space there, or choose another output_dir \(save_model false writes the "
        r"statistics and plan only\)", message), message
    assert capsys.readouterr().err.splitlines()[-1:] == [message]
    assert forwards == [] and not out.exists() and not [n for n in names(tmp_path) if ".out." in n]
