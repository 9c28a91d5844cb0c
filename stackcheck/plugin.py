"""pytest plugin: gives every family test a verdict from the ledger and records it as soon as it is known.

Known bugs are reported to pytest as strict xfails (like peft's `xfail(raises=...)`), so the run stays
green while a known bug reproduces and turns red on a new failure, an unreached scenario, or a test
that passes where the ledger says it should not (`fixed`: update the ledger).

Every family test runs in two lanes, `[cpu]` and `[gpu]`; a test marked `gpu` runs in the GPU lane only.
The lane decides `scenario.main_device()`, so the CPU lane means the same on a GPU host as in CI.
"""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

import pytest

from stackcheck import REPO_ROOT, results, scenario
from stackcheck.ledger import ERROR, FIXED, KNOWN_BUG, SKIPPED, Failure, Ledger, Verdict
from stackcheck.scenario import ScenarioNotReached
from stackcheck.versions import PACKAGES

FAMILIES_DIR = REPO_ROOT / "tests" / "families"
CELL_KEY = "stackcheck_cell"


def installed_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "absent"
    return versions


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.machine()})"


def family_of(item: pytest.Item) -> str | None:
    path = Path(str(item.path))
    if path.parent != FAMILIES_DIR or not path.stem.startswith("test_"):
        return None
    return path.stem.removeprefix("test_")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stackcheck")
    group.addoption("--stackcheck-set", default="local", help="name of the version set under test")
    group.addoption("--stackcheck-results", default=None, help="matrix.json to record each cell in")


def pytest_configure(config: pytest.Config) -> None:
    config.stackcheck_ledger = Ledger()
    config.stackcheck_versions = installed_versions()
    path = config.getoption("--stackcheck-results")
    if path and not hasattr(config, "workerinput"):  # the xdist controller (or a plain run) owns the file
        results.record_set(Path(path), config.getoption("--stackcheck-set"), config.stackcheck_versions, device_name())
        config.pluginmanager.register(Recorder(Path(path)), "stackcheck-recorder")


def pytest_report_header(config: pytest.Config) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in config.stackcheck_versions.items())
    return [f"stackcheck set '{config.getoption('--stackcheck-set')}': {versions}"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if family_of(metafunc.definition) is None:
        return
    gpu_lane = pytest.param("gpu", marks=pytest.mark.gpu)
    lanes = [gpu_lane] if metafunc.definition.get_closest_marker("gpu") else ["cpu", gpu_lane]
    metafunc.parametrize("lane", lanes, indirect=True)


@pytest.fixture(autouse=True)
def lane(request: pytest.FixtureRequest):
    """The lane of a family test (`cpu` for everything else); the GPU lane needs a CUDA device."""
    import torch

    name = getattr(request, "param", "cpu")
    if name == "gpu" and not torch.cuda.is_available():
        pytest.skip("GPU lane: torch sees no CUDA device")
    scenario.use_lane(name)
    yield name
    scenario.use_lane("cpu")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        family = family_of(item)
        if family:
            item.add_marker(getattr(pytest.mark, family))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    family = family_of(item)
    if family is None or not _is_final_phase(report):
        return
    verdict = _judge(item, call, report, family)
    lane = "gpu" if item.get_closest_marker("gpu") else "cpu"
    report.user_properties.append(
        (
            CELL_KEY,
            {
                "set": item.config.getoption("--stackcheck-set"),
                "family": family,
                "test": item.nodeid,
                "lane": lane,
                "verdict": verdict.verdict,
                "signature": verdict.signature,
                "bug": verdict.bug,
                "note": verdict.note,
            },
        )
    )
    if verdict.verdict == KNOWN_BUG:
        report.outcome = "skipped"
        report.wasxfail = f"known_bug {verdict.bug}: {verdict.signature}"
    elif verdict.verdict == FIXED:
        report.outcome = "failed"
        report.longrepr = f"[fixed] {verdict.note}; links: {' '.join(verdict.links)}"


def _is_final_phase(report: pytest.TestReport) -> bool:
    """The call phase decides, unless setup already failed or skipped."""
    return report.when == "call" or (report.when == "setup" and not report.passed)


def _judge(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport, family: str):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return Verdict(SKIPPED, note=reason)
    excinfo = call.excinfo
    if report.when == "setup" or (excinfo and excinfo.errisinstance(ScenarioNotReached)):
        failure = Failure.from_exception(excinfo.value)
        return Verdict(ERROR, signature=failure.signature(), note="setup broke" if report.when == "setup" else None)
    failure = Failure.from_exception(excinfo.value) if excinfo else None
    return item.config.stackcheck_ledger.judge(family, item.name, item.config.stackcheck_versions, failure)


class Recorder:
    """Writes each cell to matrix.json the moment its verdict is known, with setup + call seconds."""

    def __init__(self, path: Path):
        self.path = path
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        cell = dict(report.user_properties).get(CELL_KEY)
        if cell is not None:
            results.record_cell(self.path, dict(cell, seconds=round(self.seconds[report.nodeid], 2)))
