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
keeps to its share of the CPU cores (torch threads), unless OMP_NUM_THREADS says otherwise.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from stackcheck import exchange, hostinfo, results, scenario
from stackcheck.distributed.cells import Ranks
from stackcheck.harness import axes
from stackcheck.distributed.outcome import RanksFailed, judge_ranks
from stackcheck.models import architectures, tiny
from stackcheck.lane import LAUNCHED_AT_ENV
from stackcheck.ledger import (
    ERROR, FIXED, KNOWN_BUG, NOT_AFFECTED, NOT_APPLICABLE, SKIPPED, Failure, Judgement, Ledger, LedgerError, family_modules,
)
from stackcheck.models.tiny import FixtureError, NotApplicable
from stackcheck.results import arch_of, family_of, lane_of
from stackcheck.scenario import ScenarioNotReached, UnderTest
from stackcheck.versions import installed_versions

CELL_KEY = "stackcheck_cell"
WORKER_GPU_KEY = "stackcheck_cuda_visible_devices"
WORKER_THREADS_KEY = "stackcheck_cpu_threads"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stackcheck")
    group.addoption("--stackcheck-set", default="local", help="name of the version set under test")
    group.addoption("--stackcheck-results", default=None, help="matrix.json to record each cell in")
    group.addoption("--stackcheck-lanes", default=",".join(results.LANES), help="comma-separated lanes to run (cpu, gpu)")
    group.addoption("--stackcheck-arch", default=None,
                    help="architectures under test: built-in names, comma-separated, or a config.json (default: every built-in one)")
    group.addoption("--stackcheck-baseline", default=None,
                    help="the set of this run whose trained adapter this set loads (stackcheck.exchange; needs --stackcheck-results)")
    group.addoption("--stackcheck-timing", default=None,
                    help="JSON file to write the run's cost breakdown to: start-up, fixture build, tests, exit")


def visible_gpus() -> list[str]:
    """The GPUs this run may use: CUDA_VISIBLE_DEVICES when set, else every device torch counts."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [gpu.strip() for gpu in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


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
    if WORKER_THREADS_KEY in workerinput:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(workerinput[WORKER_THREADS_KEY])  # for what the worker starts
        torch.set_num_threads(workerinput[WORKER_THREADS_KEY])
    try:
        config.stackcheck_ledger = Ledger()
    except LedgerError as exc:
        raise pytest.UsageError(str(exc)) from None
    for family in config.stackcheck_ledger.families.values():
        config.addinivalue_line("markers", f"{family.id}: {family.title}")
    config.stackcheck_lanes = [lane for lane in config.getoption("--stackcheck-lanes").split(",") if lane]
    if not set(config.stackcheck_lanes) <= set(results.LANES):
        raise pytest.UsageError(f"--stackcheck-lanes: unknown lane in {config.stackcheck_lanes} (lanes: {', '.join(results.LANES)})")
    try:
        config.stackcheck_architectures = architectures.resolve(config.getoption("--stackcheck-arch"))
    except architectures.ArchitectureError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stackcheck_arch_names = [arch.name for arch in config.stackcheck_architectures]
    config.stackcheck_versions = installed_versions()
    config.stackcheck_platform = hostinfo.platform_facts()
    if config.getoption("--stackcheck-timing") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Timing(Path(config.getoption("--stackcheck-timing"))), "stackcheck-timing")
    path = config.getoption("--stackcheck-results")
    if path and not hasattr(config, "workerinput"):  # the xdist controller (or a plain run) owns the file
        recorder = Recorder(Path(path), config.getoption("--stackcheck-set"), config.stackcheck_lanes, config.stackcheck_arch_names)
        results.record_set(recorder.path, recorder.set_name, config.stackcheck_versions, config.stackcheck_platform)
        config.pluginmanager.register(recorder, "stackcheck-recorder")


def pytest_report_header(config: pytest.Config) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in config.stackcheck_versions.items())
    facts = ", ".join(f"{k} {v}" for k, v in config.stackcheck_platform.items())
    return [f"stackcheck set '{config.getoption('--stackcheck-set')}': {versions}", f"stackcheck platform: {facts}"]


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
    return scenario.lane_device(lane)


@pytest.fixture
def arch(request: pytest.FixtureRequest) -> architectures.Architecture:
    """The architecture under test (a parameter of every family test that uses the model)."""
    return request.param


@pytest.fixture
def under_test(request: pytest.FixtureRequest, arch, device) -> UnderTest:
    """The model under test: the architecture on the lane's device. A test whose bug needs structures the
    architecture lacks (`needs` marks, module-level ones included) stops here as not applicable."""
    subject = UnderTest(arch, device)
    for mark in request.node.iter_markers("needs"):
        subject.require_structures(mark.args)
    return subject


@pytest.fixture
def adapter_exchange(request: pytest.FixtureRequest, arch) -> exchange.AdapterExchange:
    """Where this set leaves the adapter it trains on `arch`, and finds its baseline's: beside the results
    file, one folder per architecture."""
    config = request.config
    path = config.getoption("--stackcheck-results")
    return exchange.AdapterExchange(exchange.folder_beside(Path(path)) / arch.name if path else None,
                                    config.getoption("--stackcheck-set"), config.getoption("--stackcheck-baseline"))


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
    for item in items:
        family = family_of(item.nodeid)
        if family:
            item.add_marker(getattr(pytest.mark, family))
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
    cell = _cell(item.config, family, item.nodeid, judgement)
    if hasattr(item, "stackcheck_ranks"):  # a distributed job's cell records every rank
        cell["ranks"] = getattr(item, "stackcheck_rank_records", None) or judge_ranks(item.stackcheck_ranks, None)[1]
    report.user_properties.append((CELL_KEY, cell))
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


def _cell(config: pytest.Config, family: str, nodeid: str, judgement: Judgement) -> dict:
    return {
        "set": config.getoption("--stackcheck-set"), "family": family, "test": nodeid, "lane": lane_of(nodeid),
        "arch": arch_of(nodeid, config.stackcheck_arch_names),
        "verdict": str(judgement.verdict), "signature": judgement.signature, "bug": judgement.bug, "note": judgement.note,
    }


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
    if report.when == "setup" or (excinfo and excinfo.errisinstance(FixtureError)):
        return Judgement(ERROR, signature=Failure.from_exception(excinfo.value).signature(), note="setup broke")
    arch = item.callspec.params.get("arch") if hasattr(item, "callspec") else None

    def judge(failure: Failure | None) -> Judgement:
        return item.config.stackcheck_ledger.judge(family, item.name, item.config.stackcheck_versions, failure,
                                                   arch.model_type if arch else None)

    if excinfo and excinfo.errisinstance(RanksFailed):  # each rank judged as a test of its own, then combined
        judgement, item.stackcheck_rank_records = judge_ranks(excinfo.value.outcomes, judge)
        return judgement
    not_reached = bool(excinfo and excinfo.errisinstance(ScenarioNotReached))
    return judge(Failure.from_exception(excinfo.value, not_reached) if excinfo else None)


class Recorder:
    """Writes each cell to matrix.json the moment its verdict is known, with setup + call seconds; runs in
    the process that owns the results file (the xdist controller, or a plain run)."""

    LOST = "cell lost: the run ended before this cell's verdict (a crashed worker or process)"

    def __init__(self, path: Path, set_name: str, lanes: list[str], arch_names: list[str]):
        self.path, self.set_name, self.lanes, self.arch_names = path, set_name, lanes, arch_names
        self.fingerprint = results.fingerprint()
        self.seconds: dict[str, float] = {}
        self.expected_recorded = False

    def _lost(self, nodeid: str, family: str, signature: str = LOST, note: str | None = None) -> dict:
        return {"set": self.set_name, "family": family, "test": nodeid, "lane": lane_of(nodeid),
                "arch": arch_of(nodeid, self.arch_names), "verdict": str(ERROR),
                "signature": signature, "bug": None, "note": note, "seconds": 0.0}

    def _expect(self, nodeids: list[str]) -> None:
        if self.expected_recorded:
            return
        self.expected_recorded = True
        cells = [self._lost(nodeid, family) for nodeid in nodeids if (family := family_of(nodeid))]
        results.record_cells(self.path, cells, self.fingerprint)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._expect([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids: list[str]) -> None:
        self._expect(ids)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        family = family_of(report.nodeid)
        if not report.failed or family is None:
            return
        error = str(report.longrepr).strip().splitlines()
        signature = f"family module does not import: {error[-1] if error else 'collection failed'}"
        cells = [dict(self._lost(f"{report.nodeid}[{lane}]", family, signature, "setup broke"), lane=lane) for lane in self.lanes]
        results.record_cells(self.path, cells, self.fingerprint)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        cell = dict(report.user_properties).get(CELL_KEY)
        family = family_of(report.nodeid)
        if cell is None and family and report.failed and report.when not in ("setup", "call", "teardown"):
            lines = str(report.longrepr).strip().splitlines()  # xdist's report of a crashed worker
            cell = self._lost(report.nodeid, family, f"cell lost: {lines[0] if lines else 'worker crashed'}")
        if cell is not None:
            results.record_cells(self.path, [dict(cell, seconds=round(self.seconds[report.nodeid], 2))], self.fingerprint)


class Timing:
    """A run's cost split, written to --stackcheck-timing at exit: start-up (interpreter, imports and
    collection, from the runner's launch), fixture build (the tiny checkpoints this process built), tests
    (every setup, call and teardown, less the fixture build). Under xdist the tests run in the workers, so
    the split is of the controller's view and fixture build is unknown (null)."""

    def __init__(self, path: Path):
        self.path = path
        launched = os.environ.get(LAUNCHED_AT_ENV)
        self.launched = float(launched) if launched else None
        self.collected: float | None = None
        self.phases = 0.0

    def pytest_collection_finish(self, session: pytest.Session) -> None:
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
