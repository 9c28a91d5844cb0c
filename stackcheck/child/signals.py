"""pytest plugin: SIGTERM and SIGHUP stop the child as Ctrl-C does (a KeyboardInterrupt: the recorder writes the
verdicts that wait, xdist stops its workers), in the controller and in every worker; and the child dies with the
command that started it, so that a SIGKILL of the command (`timeout -k`, `docker stop`) leaves no run behind writing
into its results. The command side: stackcheck.runner.signals."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from stackcheck.core.protocol import COMMAND_PID_ENV

STOPPING = (signal.SIGTERM, signal.SIGHUP)
WATCH_SECONDS = 0.5  # how often the controller checks that the command is still its parent


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _watch_command(command: int) -> None:
    """The command is gone (its children are handed to another parent): this group of processes, the controller, its
    xdist workers and what they started, ends with it. matrix.json stays as its last write left it."""
    while True:
        if os.getppid() != command:
            os.killpg(os.getpid(), signal.SIGKILL)
        threading.Event().wait(WATCH_SECONDS)


def pytest_configure(config: pytest.Config) -> None:
    for signum in STOPPING:
        if signal.getsignal(signum) == signal.SIG_DFL:  # not where the process chose otherwise
            signal.signal(signum, _interrupt)
    command = os.environ.get(COMMAND_PID_ENV, "")
    # Only the controller the command started in a process group of its own (stackcheck.runner.signals.call).
    if command.isdigit() and not hasattr(config, "workerinput") and os.getpgrp() == os.getpid():
        threading.Thread(target=_watch_command, args=(int(command),), name="stackcheck-command-watch", daemon=True).start()
