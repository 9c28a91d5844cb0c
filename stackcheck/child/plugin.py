"""pytest plugin: gives every family test a verdict from the ledger and records it as soon as it is known.

Known bugs are reported to pytest as strict xfails (like peft's `xfail(raises=...)`), so the run stays
green while a known bug reproduces and turns red on a new failure, an unreached scenario, or a test
that passes where the ledger says it should not (`fixed`: update the ledger).

Every family test runs in two lanes, `[cpu]` and `[gpu]`; a test marked `gpu` runs in the GPU lane only,
one marked `cpu` is skipped in the GPU lane (a visible cell, with the reason), and so is one marked `gpus(n)`
on a host with fewer GPUs. `--stackcheck-lanes` chooses
the lanes a run holds. The lane decides the `device` fixture, so the CPU lane means the same on a GPU host as in CI.

Every family test that uses the model under test (the `under_test` fixture: an architecture on the lane's
device) runs once per architecture (`--stackcheck-arch`, default every built-in one), its id's second
parameter: `test_x[cpu-llama3-nf4]`. A test marked `needs(structure, ...)` (or whose module is) reads
`not_applicable` on an architecture without those structures, as does a test asking an architecture for an
adapter it does not define.

No cell vanishes: when collection finishes, every expected cell is recorded as lost, and each verdict
replaces its placeholder as it comes. A crashed worker or process leaves its cells as `error` (cell lost);
a family module that fails to import gets an `error` cell per lane.

Under pytest-xdist (`-n N`) on a GPU host, every worker sees every GPU a plain run sees, its own first: worker k's
CUDA_VISIBLE_DEVICES is the host's list rotated by k (`worker_gpus`), set before anything in the worker initialises
CUDA. One-GPU cells (`cuda:0`, a world-size-1 job's rank) spread round robin over the GPUs, and a cell that needs
k GPUs (`gpus(k)`, a `ws2` job, whose ranks inherit the worker's list) gets k of them, as without xdist. Each worker
keeps to its share of the CPU cores (torch threads, and the processes torch.compile's inductor compiles in: none
beyond the worker with one core each), unless OMP_NUM_THREADS (TORCHINDUCTOR_COMPILE_THREADS) says otherwise, and
waits for its GPUs asleep rather than spinning a core (stackcheck.process.gpu_wait).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from stackcheck.process import cuda_driver, gpu_wait, warm, warmer
from stackcheck.child import exchange
from stackcheck.core import hostinfo, results
from stackcheck.core.cell import LOST, Cell, detail_of, lane_of
from stackcheck.distributed.cells import Ranks, pool_group
from stackcheck.child import axes
from stackcheck.process import resume as resume_process
from stackcheck.distributed.outcome import RanksFailed, judge_ranks
from stackcheck.models import architectures, tiny
from stackcheck.core.ledger import ERROR, FIXED, KNOWN_BUG, NEW_FAILURE, NOT_AFFECTED, NOT_APPLICABLE, SKIPPED, Failure, Judgement, Ledger, LedgerError, family_modules
from stackcheck.models.tiny import FixtureError, NotApplicable
from stackcheck.core.protocol import ARCH_OPTION, BASELINE_OPTION, LANES_OPTION, LAUNCHED_AT_ENV, RESULTS_OPTION, RUN_ENV, SET_OPTION, TIMING_OPTION
from stackcheck.core.results import family_of
from stackcheck.core.versions import installed_versions

CELL_KEY = "stackcheck_cell"
WORKER_GPU_KEY = "stackcheck_cuda_visible_devices"
WORKER_THREADS_KEY = "stackcheck_cpu_threads"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stackcheck")
    group.addoption(SET_OPTION, default="local", help="name of the version set under test")
    group.addoption(RESULTS_OPTION, default=None, help="matrix.json to record each cell in")
    group.addoption(LANES_OPTION, default=",".join(results.LANES), help="comma-separated lanes to run (cpu, gpu)")
    group.addoption(ARCH_OPTION, default=None,
                    help="architectures under test: built-in names, comma-separated, or a config.json (default: every built-in one)")
    group.addoption(BASELINE_OPTION, default=None,
                    help=f"the set of this run whose trained adapter this set loads (stackcheck.child.exchange; needs {RESULTS_OPTION})")
    group.addoption(TIMING_OPTION, default=None,
                    help="JSON file to write the run's cost breakdown to: start-up, fixture build, tests, exit")


def visible_gpus() -> list[str]:
    """The GPUs this run may use: CUDA_VISIBLE_DEVICES when set, else every device the CUDA driver counts (as torch
    does, without importing it in the controller: stackcheck.process.cuda_driver)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [gpu.strip() for gpu in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()]
    return [str(index) for index in range(len(cuda_driver.device_names() or []))]


def worker_gpus(gpus: list[str], worker: int) -> str:
    """Worker `worker`'s CUDA_VISIBLE_DEVICES: every GPU of `gpus`, rotated so that the worker's own comes first.

    Not one GPU per worker: a cell that needs two GPUs (a `gpus(2)` test in the worker's process, a `ws2` job whose
    ranks inherit the list) would see one and read skipped. Not an exclusive lease either: no family's verdict
    depends on having a GPU to itself (the families compare numerics and each process's own allocator bytes, and the
    tiny models take megabytes), while the in-process `gpus(2)` tests need the GPUs in the worker's own process,
    which a lease handed to launched ranks cannot give."""
    first = worker % len(gpus)
    return ",".join(gpus[first:] + gpus[:first])


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: the controller calls it for each worker it starts
def pytest_configure_node(node) -> None:
    gpus = visible_gpus()
    if gpus:
        node.workerinput[WORKER_GPU_KEY] = worker_gpus(gpus, int(node.workerinput["workerid"].removeprefix("gw")))
    workers = getattr(node.config.option, "numprocesses", None)
    if "OMP_NUM_THREADS" not in os.environ and isinstance(workers, int) and workers > 1:
        # Each worker's share of the cores: with torch's default (every core) N workers spin against each
        # other. gpu-matrix on the H100 host's 16 cores, -n 8: 144 s per set by default, 58 s with 2 threads each.
        node.workerinput[WORKER_THREADS_KEY] = max(1, (os.cpu_count() or 1) // workers)


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", {})
    if WORKER_GPU_KEY in workerinput:
        os.environ["CUDA_VISIBLE_DEVICES"] = workerinput[WORKER_GPU_KEY]
    if workerinput:
        warmer.wait_for_torch()  # before a worker first imports torch: it reads the bytecode the warmer wrote
    if WORKER_THREADS_KEY in workerinput:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(workerinput[WORKER_THREADS_KEY])  # for what the worker starts
        torch.set_num_threads(workerinput[WORKER_THREADS_KEY])
        # inductor (transformers compiles the forward of a static cache's generate on CUDA) otherwise starts a pool of
        # one process per core in every worker that compiles: on one H100's 16 cores the GPU lane of cached_decoding,
        # device_memory, qlora_step and lora_gradients took 72.1 s with the pools and 64.3 s compiling in the worker.
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(workerinput[WORKER_THREADS_KEY]))
    if int(workerinput.get("workercount", 1)) > 1:
        gpu_wait.for_a_shared_host()  # its GPUs' waits asleep, for the worker and what it starts (stackcheck.process.gpu_wait)
    try:
        config.stackcheck_ledger = Ledger()
    except LedgerError as exc:
        raise pytest.UsageError(str(exc)) from None
    warm.enabled()  # STACKCHECK_RANK_POOL other than 0 or 1: pytest's usage error, before anything runs
    # The pool groups' mark (pool_group), pytest-xdist's, registered here too for a run without xdist (-p no:xdist).
    config.addinivalue_line("markers", "xdist_group(name): the tests run on one xdist worker under --dist loadgroup")
    config.addinivalue_line("markers", f"{resume_process.MARK}(resumes): the test resumes in a warm resume process where its "
                            "parameters make resumes(params) true (stackcheck.process.resume)")
    for family in config.stackcheck_ledger.families.values():
        config.addinivalue_line("markers", f"{family.id}: {family.title}")
    config.stackcheck_lanes = [lane for lane in config.getoption(LANES_OPTION).split(",") if lane]
    if not set(config.stackcheck_lanes) <= set(results.LANES):
        raise pytest.UsageError(f"{LANES_OPTION}: unknown lane in {config.stackcheck_lanes} (lanes: {', '.join(results.LANES)})")
    try:
        config.stackcheck_architectures = architectures.resolve(config.getoption(ARCH_OPTION))
    except architectures.ArchitectureError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stackcheck_arch_names = [arch.name for arch in config.stackcheck_architectures]
    config.stackcheck_versions = installed_versions()
    if config.getoption(TIMING_OPTION) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Timing(Path(config.getoption(TIMING_OPTION))), "stackcheck-timing")
    path = config.getoption(RESULTS_OPTION)
    if path and not hasattr(config, "workerinput"):  # the xdist controller (or a plain run) owns the file
        # Nothing is written before collection finishes: a run that pytest refuses, or that collects nothing, changes nothing.
        recorder = Recorder(Path(path), config.getoption(SET_OPTION), config.stackcheck_lanes, config.stackcheck_arch_names,
                            config.stackcheck_versions, lambda: platform_of(config))
        config.pluginmanager.register(recorder, "stackcheck-recorder")
        read_platform_early(config)


def platform_of(config: pytest.Config) -> dict[str, str]:
    """The run's platform facts (hostinfo.platform_facts), read once, when first asked for: they import bitsandbytes
    (4 to 6 s of CPU on this project's 2-core machine), which a process that neither records results nor reports
    them (an xdist worker, a `-q` run, a run of tests that never load a model) need not pay for."""
    if not hasattr(config, "stackcheck_platform"):
        pending = getattr(config, "stackcheck_platform_pending", None)
        config.stackcheck_platform = pending.result() if pending is not None else hostinfo.platform_facts()
    return config.stackcheck_platform


def read_platform_early(config: pytest.Config) -> None:
    """Start reading the platform facts in a thread of their own, in a process that will record them. An xdist
    controller records them once the first worker has collected; read only then (importing torch and bitsandbytes,
    CUDA's first call: seconds on a fresh machine), they waited for the workers' collection instead of overlapping it.
    Measured on one H100 (16 workers, docs/speed.md, session 18): the first tests started 5.4 to 7.1 s after the
    last worker had collected before (two fresh machines); after, 3.7 s on a fresh machine, 0.9 and 2.2 s with warm
    caches, and 5.1 and 5.9 s on the slowest machine of the session. The rest of that wait was found later: every
    worker's collection rebuilt the run's placeholders (`Recorder._start`). This project's 2-core machine: 1.4 s
    with 6 workers, bitsandbytes' fact cached beside the environment."""
    import threading
    from concurrent.futures import Future

    pending = config.stackcheck_platform_pending = Future()

    def read() -> None:
        try:
            pending.set_result(hostinfo.platform_facts())
        except BaseException as exc:  # noqa: BLE001 - raised again where the facts are asked for
            pending.set_exception(exc)

    threading.Thread(target=read, name="stackcheck-platform", daemon=True).start()


def pytest_report_header(config: pytest.Config) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in config.stackcheck_versions.items())
    facts = ", ".join(f"{k} {v}" for k, v in platform_of(config).items())
    return [f"stackcheck set '{config.getoption(SET_OPTION)}': {versions}", f"stackcheck platform: {facts}"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if family_of(metafunc.definition.nodeid) is None:
        return
    gpu_lane = pytest.param("gpu", marks=pytest.mark.gpu)
    lanes = [gpu_lane] if metafunc.definition.get_closest_marker("gpu") else ["cpu", gpu_lane]
    metafunc.parametrize("lane", lanes, indirect=True)
    if axes.parametrize(metafunc, metafunc.config.stackcheck_architectures):  # a contract test's pairwise cells
        return
    if "under_test" in metafunc.fixturenames:
        archs = metafunc.config.stackcheck_architectures
        metafunc.parametrize("arch", archs, ids=[arch.name for arch in archs], indirect=True)


def gpu_lane_skip_reason(node: pytest.Item, gpu_count: int) -> str | None:
    """Why a test cannot run in the GPU lane of a host where torch sees `gpu_count` GPUs, if it cannot."""
    if node.get_closest_marker("cpu"):
        return "GPU lane: the test is about a CPU code path"
    if gpu_count == 0:
        return "GPU lane: torch sees no CUDA device"
    if (needs := node.get_closest_marker("gpus")) and gpu_count < needs.args[0]:
        return f"GPU lane: needs {needs.args[0]} GPUs, torch sees {gpu_count}"
    return None


@pytest.fixture(autouse=True)
def lane(request: pytest.FixtureRequest):
    """The lane of a family test (`cpu` for everything else)."""
    import torch

    name = getattr(request, "param", "cpu")
    if name == "gpu" and (reason := gpu_lane_skip_reason(request.node, torch.cuda.device_count())):
        pytest.skip(reason)
    return name


@pytest.fixture
def device(lane: str):
    """The lane's device: CUDA device 0 in the GPU lane, the CPU in the CPU lane (on every host)."""
    from stackcheck.harness import scenario  # torch's: imported where tests run, never by an xdist controller (it starts the workers)

    return scenario.lane_device(lane)


@pytest.fixture
def arch(request: pytest.FixtureRequest) -> architectures.Architecture:
    """The architecture under test (a parameter of every family test that uses the model)."""
    return request.param


@pytest.fixture
def under_test(request: pytest.FixtureRequest, arch, device) -> UnderTest:
    """The model under test: the architecture on the lane's device. A test whose bug needs structures the
    architecture lacks (`needs` marks, module-level ones included) stops here as not applicable."""
    from stackcheck.harness.scenario import UnderTest

    subject = UnderTest(arch, device)
    for mark in request.node.iter_markers("needs"):
        subject.require_structures(mark.args)
    return subject


@pytest.fixture
def adapter_exchange(request: pytest.FixtureRequest, arch) -> exchange.AdapterExchange:
    """Where this set leaves the adapter it trains on `arch`, and finds its baseline's: beside the results
    file, one folder per architecture."""
    config = request.config
    path = config.getoption(RESULTS_OPTION)
    return exchange.AdapterExchange(exchange.folder_beside(Path(path)) / arch.name if path else None,
                                    config.getoption(SET_OPTION), config.getoption(BASELINE_OPTION))


@pytest.fixture
def ranks(request: pytest.FixtureRequest, lane: str, tmp_path: Path) -> Ranks:
    """Launches the test's distributed job (stackcheck.distributed): `ranks("module:function", world_size,
    engine)`. Each rank's outcome goes into the cell; a rank that did not pass fails the test with all of them."""
    return Ranks(request.node, lane, tmp_path)


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselect: the ledger is checked against everything collected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ledger = config.stackcheck_ledger
    by_family: dict[str, list[pytest.Item]] = {}
    for item in items:
        family = family_of(item.nodeid)
        if family:
            by_family.setdefault(family, []).append(item)
    # A run narrowed to some architectures does not collect the tests a pattern for another one names.
    every_architecture = set(config.stackcheck_arch_names) >= set(architectures.builtin())
    try:
        ledger.check_modules(family_modules())
        for family, family_items in by_family.items():
            if every_architecture and not _selected_within_module(config, family):
                ledger.check_patterns(family, [item.name for item in family_items])
    except LedgerError as exc:
        raise pytest.UsageError(str(exc)) from None
    kept, dropped = [], []
    resume_groups = resume_process.groups(items)
    for item in items:
        family = family_of(item.nodeid)
        if family:
            item.add_marker(getattr(pytest.mark, family))
        if group := pool_group(item):  # the cells that can share a warm rank pool: one xdist worker (stackcheck.child.schedule)
            item.add_marker(pytest.mark.xdist_group(group))
            item.stackcheck_pool_group = group
        elif group := resume_groups.get(item.nodeid):  # the cells that can share a warm resume process: one worker too
            item.add_marker(pytest.mark.xdist_group(group))
        (dropped if family and lane_of(item.nodeid) not in config.stackcheck_lanes else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _selected_within_module(config: pytest.Config, family: str) -> bool:
    """Whether the run names single tests of the family's module, so that some of its tests are not collected."""
    return any("::" in arg and family_of(arg) == family for arg in config.args)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    family = family_of(item.nodeid)
    if family is None or not _is_final_phase(report):
        return
    judgement = _judge(item, call, report, family)
    cell = Cell.judged(item.config.getoption(SET_OPTION), family, item.nodeid, item.config.stackcheck_arch_names, judgement)
    if judgement.verdict in (NEW_FAILURE, ERROR) and call.excinfo is not None:  # kept for whoever researches it
        cell = cell.replace(detail=detail_of(str(call.excinfo.value)))
    if hasattr(item, "stackcheck_ranks"):  # a distributed job's cell records every rank
        cell = cell.replace(ranks=getattr(item, "stackcheck_rank_records", None) or judge_ranks(item.stackcheck_ranks, None)[1])
    report.user_properties.append((CELL_KEY, cell.to_dict()))  # plain data: xdist sends it from the worker
    if judgement.verdict == KNOWN_BUG:
        report.outcome = "skipped"
        report.wasxfail = f"known_bug {judgement.bug}: {judgement.signature}"
    elif judgement.verdict == NOT_AFFECTED:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"not affected: {judgement.note}")
    elif judgement.verdict == NOT_APPLICABLE:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, judgement.note)
    elif judgement.verdict == FIXED:
        report.outcome = "failed"
        report.longrepr = f"[fixed] {judgement.note}; links: {' '.join(judgement.links)}"


def _is_final_phase(report: pytest.TestReport) -> bool:
    """The call phase decides, unless setup already failed or skipped."""
    return report.when == "call" or (report.when == "setup" and not report.passed)


def _judge(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport, family: str) -> Judgement:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return Judgement(SKIPPED, note=reason)
    excinfo = call.excinfo
    if excinfo and excinfo.errisinstance(NotApplicable):
        return Judgement(NOT_APPLICABLE, note=f"not applicable: {excinfo.value}")
    arch = item.callspec.params.get("arch") if hasattr(item, "callspec") else None

    def judge(failure: Failure | None) -> Judgement:
        return item.config.stackcheck_ledger.judge(family, item.name, item.config.stackcheck_versions, failure,
                                                   arch.model_type if arch else None)

    if report.when == "setup" or (excinfo and excinfo.errisinstance(FixtureError)):
        return _judge_setup(excinfo.value, judge)

    if excinfo and excinfo.errisinstance(RanksFailed):  # each rank judged as a test of its own, then combined
        judgement, item.stackcheck_rank_records = judge_ranks(excinfo.value.outcomes, judge)
        return judgement
    from stackcheck.harness.scenario import ScenarioNotReached

    not_reached = bool(excinfo and excinfo.errisinstance(ScenarioNotReached))
    return judge(Failure.from_exception(excinfo.value, not_reached) if excinfo else None)


def _judge_setup(exc: BaseException, judge) -> Judgement:
    """A fixture that could not be built (or a setup that broke) is judged by the ledger like a test: what broke it
    (a FixtureError's cause) is a `known_bug` where the ledger knows it in these versions. Anything else says nothing
    about the scenario under test: `error`, setup broke, never `new_failure`."""
    cause = exc.__cause__ if isinstance(exc, FixtureError) and exc.__cause__ is not None else exc
    judgement = judge(Failure.from_exception(cause))
    if judgement.verdict == KNOWN_BUG:
        return dataclasses.replace(judgement, note=f"in the test's setup: {Failure.from_exception(exc).signature()}"
                                   if cause is not exc else "in the test's setup")
    return Judgement(ERROR, signature=Failure.from_exception(exc).signature(), note="setup broke")


class Recorder:
    """Writes each cell to matrix.json within FLUSH_EVERY seconds of its verdict, with setup + call seconds; runs in
    the process that owns the results file (the xdist controller, or a plain run). Each write reads and writes the
    whole file under its lock, so verdicts that come within FLUSH_EVERY of each other share one write: on a GPU host's
    16 workers (2631 cells a set) one write per verdict kept the controller busy and the workers waiting for their
    next test (a mean of 32 and 37 s of waiting a worker, docs/speed.md). A thread writes what waits when no verdict
    comes.

    Nothing is written until collection finishes. Then, in one step (results.begin_run), the set's versions are
    recorded and each collected cell gets a placeholder (`error`, cell lost), which its verdict replaces as it comes:
    a crashed process leaves its cells lost, never missing. Only the collected cells are replaced: a `-k`, another
    architecture, lane or family keeps every other cell, a run that collects nothing changes nothing. A run that stops
    early (Ctrl-C, -x, --maxfail) puts back the cells its placeholders replaced."""

    STOPPED = "cell not run: the run stopped before this cell (Ctrl-C, -x or --maxfail)"
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
        self.placeholders: dict[tuple[str, str, str], Cell] = {}  # the run's cells still waiting for a verdict
        self.replaced: dict[tuple[str, str, str], Cell] = {}  # what the placeholders replaced
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
            for cell in cells:
                self.placeholders.pop(cell.key, None)
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
            # (building every worker's placeholders anyway held the first tests back: 12 workers of 1243 cells,
            # 3.3 s of the controller before, 0.95 s after, on this project's machine)
            return
        cells = [self._lost(nodeid, family) for nodeid in nodeids if (family := family_of(nodeid))] + self.unimportable
        if not cells:
            return
        self.started = True
        self.replaced = results.begin_run(self.path, self.set_name, self.versions, self.platform(), cells, self.fingerprint)
        self.placeholders = {cell.key: cell for cell in cells if cell not in self.unimportable}

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
        """Cells the run never reached (it stopped early; a crashed process never gets here) get back what they
        replaced, or say that they were not run; matrix.md shows every verdict."""
        self.stop.set()
        if self.writer is not None:
            self.writer.join()
        with self.lock:
            self._flush()
        if self.placeholders:
            back = [self.replaced.get(key) or cell.replace(signature=self.STOPPED) for key, cell in self.placeholders.items()]
            results.end_run(self.path, back, self.run, self.fingerprint)
            self.placeholders = {}
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
