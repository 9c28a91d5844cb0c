"""Signals on the command side. SIGTERM and SIGHUP (`timeout`, `kill`, a CI job's cancel, `docker stop`, a closed
terminal) stop a command as Ctrl-C does: `Interrupted`, a KeyboardInterrupt, ends it with one line saying what was
kept and the exit code 128 + the signal's number (stackcheck.runner.exitcodes). Each pytest child runs in a process
group of its own (`call`), which the command stops with Ctrl-C's SIGINT whatever signal stopped the command, so that
its xdist workers and the processes they started stop with it, and the recorder writes what waits; a child that does
not end within STOP_SECONDS, or a second signal, gets SIGKILL. The child's side: stackcheck.child.signals."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager

STOPPING = (signal.SIGTERM, signal.SIGHUP)
# How long a stopped child may take to end: the recorder's last write and xdist's teardown take a second or two.
STOP_SECONDS = 30.0
LIVE: set[subprocess.Popen] = set()  # the children started by `call` and not ended yet (a thread's too: history's probes)
OWN_GROUP: set[subprocess.Popen] = set()  # those in a process group of their own (no debugger reads the terminal)
INTERRUPTED: set[subprocess.Popen] = set()  # those already sent SIGINT
RECEIVED: list[int] = []  # the stop signals `_raise` received, the last one raised again in threads' calls
DEBUGGERS = ("--pdb", "--trace")  # a debugger reads the terminal: its child stays in the terminal's process group


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C's KeyboardInterrupt is."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum, frame):
    """Every child is told at once (the main thread's and those of threads, which wait on theirs: history's probes),
    then the interruption is raised in the main thread."""
    RECEIVED.append(signum)
    for child in list(LIVE):
        _interrupt(child)
    raise Interrupted(signum)


def _interrupt(child: subprocess.Popen) -> None:
    """SIGINT, once, to a child's process group, as a terminal's Ctrl-C reaches it (a second one could cut short the
    recorder's last write)."""
    if child in OWN_GROUP and child not in INTERRUPTED:
        INTERRUPTED.add(child)
        try:
            os.killpg(child.pid, signal.SIGINT)
        except ProcessLookupError:
            pass


@contextmanager
def handled():
    """Ctrl-C, SIGTERM and SIGHUP tell every child (`_raise`) and raise `Interrupted` while the block runs; the handlers
    before it come back after (nox calls the command in its own process). Outside the main thread, where no handler can
    be set, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # A signal ignored when the command started stays ignored (`nohup` ignores SIGHUP on purpose, a shell's background
    # job SIGINT); SIGINT is taken over only from Python's own Ctrl-C handler.
    previous = {signum: signal.signal(signum, _raise) for signum in (signal.SIGINT, *STOPPING)
                if signal.getsignal(signum) not in (signal.SIG_IGN, None)
                and (signum != signal.SIGINT or signal.getsignal(signum) is signal.default_int_handler)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def signal_of(interruption: KeyboardInterrupt) -> signal.Signals:
    return signal.Signals(getattr(interruption, "signum", signal.SIGINT))


def described(interruption: KeyboardInterrupt) -> str:
    """What the line adds after "interrupted": nothing for Ctrl-C, " by SIGTERM" or " by SIGHUP"."""
    received = signal_of(interruption)
    return "" if received == signal.SIGINT else f" by {received.name}"


def call(command: list[str], **popen) -> int:
    """`subprocess.call` of a pytest child in a process group of its own; stopped (`stop`) when the command is
    interrupted, and the interruption raised again, in a thread's call too (a probe cut short is no probe)."""
    own_group = not any(arg in DEBUGGERS for arg in command)
    child = subprocess.Popen(command, **popen, process_group=0 if own_group else None)
    if own_group:
        OWN_GROUP.add(child)
    LIVE.add(child)
    try:
        code = child.wait()
    except KeyboardInterrupt:
        stop(child)
        raise
    else:
        if child in INTERRUPTED:  # told to stop from the main thread while a thread waited: its results are cut short
            raise Interrupted(RECEIVED[-1] if RECEIVED else signal.SIGINT)
        return code
    finally:
        LIVE.discard(child)
        OWN_GROUP.discard(child)
        INTERRUPTED.discard(child)


def _ended(pid: int, seconds: float) -> bool:
    """Whether process `pid` ended within `seconds`, left unreaped (so that its group id cannot be taken meanwhile)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped already
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def stop(child: subprocess.Popen) -> None:
    """SIGINT to the child's process group, as a terminal's Ctrl-C reaches it; SIGKILL to what is left of the group
    once the child ended, after STOP_SECONDS, or on a second signal. A debugger's child, in the terminal's group,
    had the terminal's Ctrl-C already."""
    if child not in OWN_GROUP:
        child.wait()
        return
    try:
        _interrupt(child)
        _ended(child.pid, STOP_SECONDS)
    except KeyboardInterrupt:  # a second signal: no more waiting
        pass
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()


def stop_all() -> None:
    """Every child still running (those started by threads, which no interruption reaches), stopped."""
    for child in list(LIVE):
        stop(child)
