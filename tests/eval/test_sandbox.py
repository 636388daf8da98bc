"""Hostile HumanEval programs: each reported escape is now contained (or scored as failed)."""

from __future__ import annotations

import ast
import os
import signal
import socket
import stat
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from ompmoe.eval import _sandbox_server
from ompmoe.eval.humaneval import MEMORY_ENV, allow_execution, network_isolation_available, run_program, sandbox_config
from ompmoe.eval.sandbox_uids import DEFAULT_FIRST_UID, SEARCHED

PROBLEM = {"task_id": "Test/0", "prompt": "def one():\n", "entry_point": "one",
           "test": "def check(candidate):\n    assert candidate() == 1\n"}
ROOT = os.geteuid() == 0


def run(code: str, timeout: float = 2.0, body: str = "    return 1\n") -> str:
    """Outcome of a program whose function is ``body`` followed by top-level ``code``."""
    with allow_execution():
        return run_program(PROBLEM, body + textwrap.dedent(code), timeout=timeout)


def reported(outcome: str):
    """The value a program reported by raising ``Exception(repr(value))``."""
    assert outcome.startswith("failed: "), outcome
    return ast.literal_eval(outcome[len("failed: "):])


def test_correct_and_wrong_programs():
    assert run("") == "passed"
    assert run("", body="    return 2\n") == "failed: "
    assert run("while True:\n    pass\n", timeout=0.5) == "timed out"


def test_private_workdir_minimal_environment_and_deleted(monkeypatch):
    monkeypatch.setenv("OMPMOE_TEST_SECRET", "hunter2")
    cwd, mode, owner, env = reported(run("""
        import os
        raise Exception(repr((os.getcwd(), os.stat('.').st_mode, os.stat('.').st_uid, dict(os.environ))))
    """))
    assert env == {"PATH": _sandbox_server.SANDBOX_PATH, "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8"}  # no secret
    assert stat.S_IMODE(mode) == 0o700 and Path(cwd).name.startswith("ompmoe-sandbox-")
    if ROOT:  # a dedicated uid of the sandbox range, never an account's
        assert DEFAULT_FIRST_UID <= owner < DEFAULT_FIRST_UID + SEARCHED
    else:
        assert owner == os.geteuid()
    assert not Path(cwd).exists()


def test_forging_the_result_is_scored_failed():
    # The old harness let a program write "passed" into the inherited result pipe: none is inherited now.
    forge = textwrap.dedent("""
        import os
        for fd in range(256):
            try:
                os.write(fd, b"passed\\n")
            except OSError:
                pass
        print("passed")
    """)
    assert run(forge + "os._exit(0)\n", body="    return 2\n") == "failed: the program ended its process (exit status 0)"
    assert run(forge, body="    return 2\n") == "failed: "  # the check still runs and fails
    assert run("import sys\nsys.exit(0)\n", body="    return 2\n") == "failed: 0"
    assert run("import os\nos._exit(0)\n") == "failed: the program ended its process (exit status 0)"


def test_filesystem_as_unprivileged_user(tmp_path):
    outside = tmp_path / "escape.txt"  # root-owned directory, 0700
    outcome = run(f"open({str(outside)!r}, 'w').write('x')\n")
    if ROOT:
        assert outcome == f"failed: [Errno 13] Permission denied: {str(outside)!r}" and not outside.exists()
        assert run("open('/etc/shadow').read()\n") == "failed: [Errno 13] Permission denied: '/etc/shadow'"
        assert run("assert open('/etc/passwd').read()\n") == "passed"  # world-readable files stay readable
    else:  # not root: the program has the user's rights (documented)
        assert outcome == "passed" and outside.read_text() == "x"


def test_resource_limits(monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, "256")
    limits = reported(run("""
        import resource as r
        raise Exception(repr([r.getrlimit(k) for k in (r.RLIMIT_AS, r.RLIMIT_CPU, r.RLIMIT_FSIZE, r.RLIMIT_NOFILE,
                                                         r.RLIMIT_CORE, r.RLIMIT_NPROC)]))
    """, timeout=3.0))
    assert limits == [(256 * 2**20,) * 2, (5, 6), (16 * 2**20,) * 2, (64, 64), (0, 0), (16, 16)]
    assert run("x = bytearray(512 * 2**20)\n") == "failed: "  # MemoryError
    assert run("x = bytearray(64 * 2**20)\n") == "passed"
    assert run("open('big', 'wb').write(bytes(17 * 2**20))\n") == "failed: [Errno 27] File too large"
    assert run("files = [open('f%d' % i, 'w') for i in range(100)]\n").startswith("failed: [Errno 24] Too many open files")
    # A program that swallows the time-limit exception is stopped by RLIMIT_CPU / the server's deadline.
    assert run(SWALLOWS_THE_ALARM, timeout=0.5) == "timed out"


SWALLOWS_THE_ALARM = "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass\n"


def test_a_program_that_swallows_the_alarm_is_stopped_by_the_servers_deadline(monkeypatch):
    """Which mechanism ends it, without a clock: the server reads the child's output against a deadline set at most
    ``timeout + 1`` s after the child starts, and the child is stopped by that deadline (or killed by RLIMIT_CPU,
    ``int(timeout) + 2`` s of CPU), never by the program ending itself."""
    collected = []

    def collect(process, deadline, original=_sandbox_server._collect):
        collected.append(deadline - time.monotonic())  # time left when reading starts: at most timeout + 1
        result = original(process, deadline)
        collected.append(result[1:])
        return result

    monkeypatch.setattr(_sandbox_server, "_collect", collect)
    # In this process (not the server) the child is waited for by run_python itself; reaping any exited child
    # would take other tests' processes too.
    monkeypatch.setattr(_sandbox_server, "_reap_orphans", lambda: None)
    config = sandbox_config()
    program = f"{PROBLEM['prompt']}    return 1\n{SWALLOWS_THE_ALARM}\n{PROBLEM['test']}\ncheck({PROBLEM['entry_point']})"
    assert _sandbox_server.run_python(program, 0.5, config) == "timed out"
    time_left, (returncode, timed_out) = collected
    assert time_left <= 0.5 + 1
    assert timed_out or returncode in (-signal.SIGXCPU, -signal.SIGKILL), (returncode, timed_out)


def test_process_limit_counts_forks():
    forks = reported(run("""
        import os, time
        count = 0
        for _ in range(64):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(10)
                os._exit(0)
            count += 1
        raise Exception(repr(count))
    """, timeout=3.0))
    if ROOT:  # the dedicated sandbox uid is not exempt from RLIMIT_NPROC
        assert forks == 15
    else:  # RLIMIT_NPROC counts all of the user's processes
        assert forks <= 15


def test_forked_child_does_not_outlive_the_timeout():
    shared = Path(tempfile.mkdtemp())
    shared.chmod(0o1777)  # the sandbox user may write here (world-writable, like /tmp)
    try:
        outcome = run(f"""
            import os, time
            pid = os.fork()
            if pid == 0:
                os.setsid()  # leave the process group
                time.sleep(1.5)
                open({str(shared / 'alive')!r}, 'w').write('still running')
                os._exit(0)
            open({str(shared / 'pid')!r}, 'w').write(str(pid))
            while True:
                pass
        """, timeout=0.5)
        assert outcome == "timed out"
        pid = int((shared / "pid").read_text())
        time.sleep(2.0)
        assert not (shared / "alive").exists()
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "State:\tZ" in status.read_text()  # gone, or a zombie awaiting its reaper
    finally:
        for child in shared.iterdir():
            child.unlink()
        shared.rmdir()


def test_no_network_to_a_local_server():
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.5)
        port = server.getsockname()[1]
        outcome = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n")
        if network_isolation_available():
            assert outcome == "failed: [Errno 101] Network is unreachable"
            with pytest.raises(TimeoutError):
                server.accept()
        else:  # documented: without CAP_SYS_ADMIN programs keep the network
            assert outcome == "passed"
    assert sandbox_config()["isolate_network"] is network_isolation_available()


def test_first_uid_validation(monkeypatch):
    from ompmoe.eval.sandbox_uids import first_uid

    monkeypatch.setenv("OMPMOE_SANDBOX_UID", "8")
    with pytest.raises(ValueError) as error:
        first_uid()
    assert str(error.value) == ("OMPMOE_SANDBOX_UID=8 is not a usable first sandbox uid; set it to an integer between "
                                "1000 and 4294963198 that no account uses, e.g. 2000000000.")
    assert sandbox_config()["uids"] is None