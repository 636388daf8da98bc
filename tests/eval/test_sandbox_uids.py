"""HumanEval sandbox uids as root: unique per machine across evaluations, never an account's or a running process's."""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ompmoe.eval.sandbox_uids import DEFAULT_FIRST_UID, acquire_uids, release_uids

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="uid switching needs root (CI and this machine run as root)")

HOLD = """
import sys, time
from ompmoe.eval.sandbox_uids import acquire_uids
slots = acquire_uids({count})
print(" ".join(str(slot.uid) for slot in slots), flush=True)
time.sleep(60)
"""

EVALUATION = """
import json, sys, time
from ompmoe.eval.humaneval import allow_execution, run_program
problem = {{"task_id": "T/0", "prompt": "def one():\\n", "entry_point": "one",
           "test": "def check(candidate):\\n    assert candidate() == 1\\n"}}
body = "    return 1\\nimport os, time\\ntime.sleep({sleep})\\nprint(os.getuid())\\n"
with allow_execution():
    outcomes = [run_program(problem, body, timeout=8.0) for _ in range({runs})]
print(json.dumps(outcomes))
"""


def holder(count: int) -> tuple[subprocess.Popen, list[int]]:
    process = subprocess.Popen([sys.executable, "-c", HOLD.format(count=count)], stdout=subprocess.PIPE, text=True)
    return process, [int(uid) for uid in process.stdout.readline().split()]


def test_slots_are_unique_across_processes_and_freed_when_the_holder_dies():
    other, theirs = holder(2)
    try:
        mine = acquire_uids(2)
        try:
            assert len(set(theirs)) == 2 and not set(theirs) & {slot.uid for slot in mine}
        finally:
            release_uids(mine)
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    again = acquire_uids(2)  # the kernel dropped the dead holder's locks
    try:
        assert [slot.uid for slot in again] == sorted(theirs)  # the lowest free candidates, taken first before
    finally:
        release_uids(again)


def test_never_an_account_nor_a_uid_with_running_processes():
    first = DEFAULT_FIRST_UID
    child = os.fork()
    if child == 0:  # a process of the first candidate uid, running before the sandbox starts
        try:
            os.setgid(first)
            os.setuid(first)
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        time.sleep(0.2)
        slots = acquire_uids(3)
        try:
            uids = [slot.uid for slot in slots]
            assert first not in uids and 65534 not in uids
            for uid in uids:
                with pytest.raises(KeyError):
                    pwd.getpwuid(uid)
        finally:
            release_uids(slots)
        assert os.waitpid(child, os.WNOHANG) == (0, 0)  # still alive: nothing swept it
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_two_evaluations_at_once_do_not_kill_each_others_programs():
    evaluations = [subprocess.Popen([sys.executable, "-c", EVALUATION.format(sleep=1.5, runs=2)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [process.communicate(timeout=120) for process in evaluations]
    for (out, err), process in zip(results, evaluations):
        assert process.returncode == 0, err[-2000:]
        assert out.strip() == '["passed", "passed"]', textwrap.shorten(err, 2000)
