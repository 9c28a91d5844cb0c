"""A warm resume process: the trainer_resume family's second process, started once and handed many cells' resumes in
turn (with the warm rank pools: the matrix commands turn both on, STACKCHECK_RANK_POOL=0 turns both off; plain pytest
and the harness's tests start a new process for every resume, stackcheck.harness.checkpoint).

It starts as the per-cell process starts and never trained, resets what a cell leaves between cells, and ends on a
cell that raises or times out. How it works and what proves it equal to a fresh process: docs/internals.md,
"process/resume.py"; what it cuts: docs/speed.md.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.process.warm import enabled as warm_enabled, lasting_environment

# The cells of one lane that share an xdist group (so one warm process): few enough that a group's cells, in turn on
# one worker, stay shorter than the run (a GPU cell's seconds: docs/speed.md, "Numbers behind constants").
CELLS_PER_GROUP = 5
MARK = "resume_process"  # a test that resumes through `resume` (its cells get a `group`)
OK, FAILED = "ok", "failed"


def enabled() -> bool:
    """Whether resumes go to a warm process: with the warm rank pools (STACKCHECK_RANK_POOL, a usage error otherwise)."""
    return warm_enabled()


def groups(items: list) -> dict[str, str]:
    """{node id: xdist group} of the collected items that resume (MARK, whose argument, given the item's parameters,
    says whether its cell resumes): each lane's, in node id order, CELLS_PER_GROUP to a group."""
    counts: dict[str, int] = {}
    found = {}
    for item in sorted(items, key=lambda item: item.nodeid):
        mark = item.get_closest_marker(MARK)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if mark is None or (mark.args and not mark.args[0](params)):
            continue
        lane = params.get("lane", "cpu")
        index = counts[lane] = counts.get(lane, -1) + 1
        found[item.nodeid] = f"resume-{lane}-{index // CELLS_PER_GROUP}"
    return found


@dataclass
class Warm:
    key: tuple
    process: subprocess.Popen
    requests: int  # the write end of the process's call pipe
    answers: int  # the read end of its answer pipe
    log: Path
    started: float = field(default_factory=time.monotonic)
    cells: int = 0

    def alive(self) -> bool:
        return self.process.poll() is None


_warm: dict[tuple, Warm] = {}


def key_of(target: str, env: dict) -> tuple:
    return (sys.executable, target, lasting_environment(env))


def start(key: tuple, env: dict) -> Warm:
    """The warm process for `key` (one at a time in a process: another key's is closed first)."""
    for other in list(_warm.values()):
        close(other)
    call_read, call_write = os.pipe()
    answer_read, answer_write = os.pipe()
    handle, log = tempfile.mkstemp(prefix="stackcheck-resume-", suffix=".log")
    with os.fdopen(handle, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", __name__, str(call_read), str(answer_write), key[1]], cwd=REPO_ROOT,
                                   env=env, stdout=out, stderr=subprocess.STDOUT, pass_fds=(call_read, answer_write),
                                   start_new_session=True)
    os.close(call_read)
    os.close(answer_write)
    warm = _warm[key] = Warm(key, process, call_write, answer_read, Path(log))
    return warm


def close(warm: Warm) -> None:
    """End the process (its call pipe closed: it exits; killed if it does not within seconds) and remove its log."""
    _warm.pop(warm.key, None)
    for fd in (warm.requests, warm.answers):
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        warm.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        kill(warm)
    warm.log.unlink(missing_ok=True)


def kill(warm: Warm) -> None:
    try:
        os.killpg(warm.process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    warm.process.wait()


@atexit.register
def close_all() -> None:
    for warm in list(_warm.values()):
        close(warm)


def resume(target: str, call: Path, env: dict, timeout: float) -> tuple[int, str]:
    """`target` ("module:function", checkpoint.resume_from_call) of `call` in the warm process for `env`: (0, "") once it wrote its
    Record; otherwise what a per-cell process would give, its exit status (1 where it raised: it wrote the Failure
    first) and its output for this cell, the process then ended. Past `timeout` seconds, subprocess.TimeoutExpired,
    as subprocess.run raises it, the process killed."""
    key = key_of(target, env)
    warm = _warm.get(key)
    if warm is not None and not warm.alive():
        close(warm)
        warm = None
    if warm is None:
        warm = start(key, env)
    offset = warm.log.stat().st_size
    try:
        os.write(warm.requests, f"{call}\n".encode())
    except BrokenPipeError:
        pass  # it ended before this call: its status and output below
    warm.cells += 1
    answer = read_answer(warm, timeout)
    if answer == OK:
        return 0, ""
    if answer is None and warm.alive():  # out of time
        kill(warm)
        output = read_from(warm.log, offset)
        close(warm)
        raise subprocess.TimeoutExpired([sys.executable, "-m", __name__], timeout, output=output)
    try:
        returncode = warm.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        kill(warm)
        returncode = warm.process.returncode
    output = read_from(warm.log, offset)
    close(warm)
    return returncode or 1, output


def read_answer(warm: Warm, timeout: float) -> str | None:
    """The process's answer line; None when it ended without one or did not answer within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([warm.answers], [], [], left)
        if not ready:
            return None
        chunk = os.read(warm.answers, 64)
        if not chunk:  # it exited
            return None
        data += chunk
    return data.decode().strip()


def read_from(log: Path, offset: int) -> str:
    try:
        with log.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def serve(calls_fd: int, answers_fd: int, target: str) -> int:
    """The warm process: `target` ("module:function", checkpoint.resume_from_call) of each call file read from
    `calls_fd` in turn, "ok" or
    "failed" written to `answers_fd`; ends at the end of the calls (its owner closed them or died) or after a cell that
    raised."""
    import importlib
    import traceback
    import warnings

    from stackcheck.process import gpu_wait
    from stackcheck.process.isolation import leave_the_cell

    gpu_wait.follow_the_worker()
    module, _, function = target.partition(":")
    resume_from_call = getattr(importlib.import_module(module), function)
    warnings.filterwarnings("ignore")
    environ, cwd = dict(os.environ), os.getcwd()
    with os.fdopen(calls_fd, "r") as calls, os.fdopen(answers_fd, "w") as answers:
        for line in calls:
            try:
                resume_from_call(Path(line.strip()))
            except Exception:  # its Failure is written; the traceback goes to the log, as a per-cell process's does
                traceback.print_exc()
                sys.stdout.flush()
                sys.stderr.flush()
                answers.write(f"{FAILED}\n")
                answers.flush()
                return 1
            sys.stdout.flush()
            sys.stderr.flush()
            leave_the_cell(environ, cwd)
            answers.write(f"{OK}\n")
            answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
