"""The recorder (each cell written to matrix.json within a second of its verdict, a placeholder for every expected
cell first, so that none is ever missing) and the run's cost split (--stackcheck-timing). Both run in the process
that owns the results file: the xdist controller, or a plain run. docs/results.md; docs/speed.md for the costs."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from stackcheck.child.keys import CELL_KEY
from stackcheck.core import results
from stackcheck.core.cell import LOST, Cell
from stackcheck.core.protocol import LAUNCHED_AT_ENV, RUN_ENV
from stackcheck.core.results import family_of
from stackcheck.models import tiny


class Recorder:
    """Writes each cell to matrix.json within FLUSH_EVERY seconds of its verdict, with setup + call seconds; runs in
    the process that owns the results file (the xdist controller, or a plain run). Each write reads and writes the
    whole file under its lock, so verdicts that come within FLUSH_EVERY of each other share one write: on a GPU host's
    16 workers (2631 cells a set) one write per verdict kept the controller busy and the workers waiting for their
    next test (a mean of 32 and 37 s of waiting a worker, docs/speed.md). A thread writes what waits when no verdict
    comes.

    Nothing is written until collection finishes. Then, in one step (results.begin_run), the set's versions are
    recorded and each collected cell without a verdict on record is listed as not run, apart from the verdicts; a
    verdict on record stays until this run's replaces it. So the file on disk is whole at every moment: a run stopped
    (Ctrl-C, SIGTERM, -x, --maxfail) or killed (SIGKILL, a crash) leaves the verdicts it recorded, every earlier one
    of the cells it did not reach, and its other cells not run; nothing needs putting back. Only the collected cells
    are touched: a `-k`, another architecture, lane or family keeps every other cell, a run that collects nothing
    changes nothing."""

    FLUSH_EVERY = 1.0
    # matrix.json takes every verdict within FLUSH_EVERY; matrix.md, rendered from it, follows within this many seconds,
    # and at the run's end.
    MARKDOWN_EVERY = 10.0

    def __init__(self, path: Path, set_name: str, lanes: list[str], arch_names: list[str], versions: dict[str, str],
                 platform: Callable[[], dict[str, str]]):
        self.path, self.set_name, self.lanes, self.arch_names = path, set_name, lanes, arch_names
        self.versions, self.platform = versions, platform
        self.fingerprint = results.fingerprint()
        self.run = os.environ.get(RUN_ENV)
        self.seconds: dict[str, float] = {}
        self.started = False
        self.unimportable: list[Cell] = []  # cells of family modules that did not import, until the run starts
        self.rendered = time.monotonic()  # when matrix.md was last rendered (begin_run renders it)
        self.pending: list[Cell] = []  # verdicts not yet written, oldest first
        self.flushed = time.monotonic()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.writer: threading.Thread | None = None

    def _lost(self, nodeid: str, family: str, signature: str = LOST, note: str | None = None) -> Cell:
        return Cell.lost(self.set_name, family, nodeid, self.arch_names, signature, note, self.run)

    def _record(self, cells: list[Cell]) -> None:
        with self.lock:
            self.pending += cells
            if time.monotonic() - self.flushed >= self.FLUSH_EVERY:
                self._flush()
        if self.writer is None:
            self.writer = threading.Thread(target=self._write_waiting, name="stackcheck-recorder", daemon=True)
            self.writer.start()

    def _flush(self) -> None:
        """Write the waiting verdicts (the caller holds the lock)."""
        self.flushed = time.monotonic()
        if not self.pending:
            return
        markdown = self.flushed - self.rendered >= self.MARKDOWN_EVERY
        cells, self.pending = self.pending, []
        results.record_cells(self.path, cells, self.fingerprint, markdown)
        if markdown:
            self.rendered = time.monotonic()

    def _write_waiting(self) -> None:
        while not self.stop.wait(self.FLUSH_EVERY):
            with self.lock:
                if time.monotonic() - self.flushed >= self.FLUSH_EVERY:
                    self._flush()

    def _start(self, nodeids: list[str]) -> None:
        if self.started:  # under xdist every worker reports the same collection: the first one starts the run
            # (building every worker's placeholders anyway held the first tests back: docs/speed.md, session 18)
            return
        collected = [Cell.not_run(self.set_name, family, nodeid, self.arch_names, self.run)
                     for nodeid in nodeids if (family := family_of(nodeid))]
        if not collected and not self.unimportable:
            return
        self.started = True
        results.begin_run(self.path, self.set_name, self.versions, self.platform(), collected, self.fingerprint, self.unimportable)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._start([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids: list[str]) -> None:
        self._start(ids)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        family = family_of(report.nodeid)
        if not report.failed or family is None:
            return
        error = str(report.longrepr).strip().splitlines()
        signature = f"family module does not import: {error[-1] if error else 'collection failed'}"
        cells = [self._lost(f"{report.nodeid}[{lane}]", family, signature, "setup broke").replace(lane=lane) for lane in self.lanes]
        if self.started:
            self._record(cells)
        else:
            self.unimportable += [cell for cell in cells if cell not in self.unimportable]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        recorded = dict(report.user_properties).get(CELL_KEY)
        cell = Cell.from_dict(recorded) if recorded is not None else None
        family = family_of(report.nodeid)
        if cell is None and family and report.failed and report.when not in ("setup", "call", "teardown"):
            lines = str(report.longrepr).strip().splitlines()  # xdist's report of a crashed worker
            cell = self._lost(report.nodeid, family, f"cell lost: {lines[0] if lines else 'worker crashed'}")
        if cell is not None:
            self._record([cell.replace(seconds=round(self.seconds[report.nodeid], 2), run=self.run)])

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """The verdicts still waiting are written; cells the run never reached stay as they are on disk (their earlier
        verdict, or not run); matrix.md shows every cell."""
        self.stop.set()
        if self.writer is not None:
            self.writer.join()
        with self.lock:
            self._flush()
        if self.started:
            results.write_markdown(self.path, self.fingerprint)


class Timing:
    """A run's cost split, written to --stackcheck-timing at exit: start-up (interpreter, imports and
    collection, from the runner's launch), fixture build (the tiny checkpoints this process built), tests
    (every setup, call and teardown, less the fixture build). Under xdist the tests run in the workers: start-up
    lasts until the last worker has collected, tests are the workers' seconds added up (more than the wall time
    they took), and fixture build is unknown (null)."""

    def __init__(self, path: Path):
        self.path = path
        launched = os.environ.get(LAUNCHED_AT_ENV)
        self.launched = float(launched) if launched else None
        self.collected: float | None = None
        self.phases = 0.0

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected = time.time()

    @pytest.hookimpl(optionalhook=True)  # under xdist: start-up ends when the last worker has collected
    def pytest_xdist_node_collection_finished(self, node, ids: list[str]) -> None:
        self.collected = time.time()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.phases += report.duration

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        distributed = bool(getattr(config.option, "numprocesses", None))
        fixtures = None if distributed else sum(seconds for _name, seconds in tiny.BUILT)
        startup = self.collected - self.launched if self.launched and self.collected else None
        self.path.write_text(json.dumps({
            "startup": startup, "fixtures": fixtures, "tests": self.phases - (fixtures or 0.0),
            "until_exit": time.time() - self.launched if self.launched else None,
        }))
