"""pytest plugin: the live progress line of one unit (a set, a probe) of a long run, in a terminal only (the
controller's, under xdist). The command passes the run's state in stackcheck.core.progress.ENV; without it, or
outside a terminal, the plugin does nothing."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from stackcheck.core.progress import ENV, line

_live: dict = {}


def pytest_configure(config: pytest.Config) -> None:
    state = json.loads(os.environ.get(ENV) or "{}")
    if state.get("live") and sys.stdout.isatty() and config.get_verbosity() <= 0 and not hasattr(config, "workerinput"):
        _live.update(state, started=time.monotonic(), collected=0, finished=set())


def pytest_sessionstart(session: pytest.Session) -> None:
    if _live:  # registered during configure, after this plugin's own configure may have run
        _live["reporter"] = reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter._show_progress_info = False  # pytest's own percentage, written after the live line, would garble it


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    if _live:
        _live["collected"] = len(ids)


def pytest_collection_finish(session: pytest.Session) -> None:
    if _live and session.items:
        _live["collected"] = len(session.items)


@pytest.hookimpl(wrapper=True)
def pytest_report_teststatus(report, config):
    category, letter, word = yield
    return category, "" if _live else letter, word  # the live line takes the place of the letters


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _live or report.when != "teardown" or _live.get("reporter") is None:
        return
    _live["finished"].add(report.nodeid)
    elapsed = _live["elapsed"] + time.monotonic() - _live["started"]
    _live["reporter"].rewrite(line(_live["command"], _live["kind"], _live["units"], _live["units_done"], _live["finished_cells"],
                                   _live["collected"], len(_live["finished"]), elapsed), erase=True)
