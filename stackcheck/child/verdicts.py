"""pytest plugin: every family test's verdict from the ledger (stackcheck.core.ledger.Ledger.judge), carried to the
recorder in the report. Known bugs are strict xfails, so the run stays green while a known bug reproduces and turns
red on a new failure, an unreached scenario, or a `fixed` test. Before any test runs, the ledger is checked against
what was collected, and each cell that can share a warm process is put on one xdist worker. docs/architecture.md,
"The ledger and the verdict"."""

from __future__ import annotations

import pytest

from stackcheck.child import evidence, keys
from stackcheck.core.cell import Cell, detail_of, lane_of
from stackcheck.core.ledger import ERROR, FIXED, KNOWN_BUG, NEW_FAILURE, NOT_AFFECTED, NOT_APPLICABLE, SKIPPED, Failure, Judgement, LedgerError, family_modules
from stackcheck.core.results import family_of
from stackcheck.distributed.cells import POOL_GROUP, RANKS, pool_group
from stackcheck.distributed.outcome import RanksFailed, judge_ranks
from stackcheck.models import architectures
from stackcheck.models.tiny import FixtureError, NotApplicable
from stackcheck.process import resume as resume_process
from stackcheck.child.axes import explored_record  # explore mode: an explored cell's record
from stackcheck.core.explore import EXPLORED_KEY


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselect: the ledger is checked against everything collected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ledger = config.stash[keys.LEDGER]
    by_family: dict[str, list[pytest.Item]] = {}
    for item in items:
        family = family_of(item.nodeid)
        if family:
            by_family.setdefault(family, []).append(item)
    # A run narrowed to some architectures does not collect the tests a pattern for another one names.
    every_architecture = set(config.stash[keys.ARCH_NAMES]) >= set(architectures.builtin())
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
            item.stash[POOL_GROUP] = group
        elif group := resume_groups.get(item.nodeid):  # the cells that can share a warm resume process: one worker too
            item.add_marker(pytest.mark.xdist_group(group))
        (dropped if family and lane_of(item.nodeid) not in config.stash[keys.LANES] else kept).append(item)
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
    judgement, found = _judge(item, call, report, family)
    cell = Cell.judged(item.config.stash[keys.SET].name, family, item.nodeid, item.config.stash[keys.ARCH_NAMES], judgement)
    cell = cell.replace(evidence=found)
    if judgement.verdict in (NEW_FAILURE, ERROR) and call.excinfo is not None:  # kept for whoever researches it
        cell = cell.replace(detail=detail_of(str(call.excinfo.value)))
    if (explored := explored_record(item)) is not None:  # an explored cell keeps its configuration (the command side shrinks it)
        cell = cell.replace(extra={**cell.extra, EXPLORED_KEY: explored})
    if RANKS in item.stash:  # a distributed job's cell records every rank
        cell = cell.replace(ranks=item.stash.get(keys.RANK_RECORDS, None) or judge_ranks(item.stash[RANKS], None)[1])
    report.user_properties.append((keys.CELL_KEY, cell.to_dict()))  # plain data: xdist sends it from the worker
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


def _judge(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport, family: str) -> tuple[Judgement, dict | None]:
    """The test's verdict, and what it was judged from (stackcheck.child.evidence; None for a skip)."""
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return Judgement(SKIPPED, note=reason), None
    excinfo = call.excinfo
    if excinfo and excinfo.errisinstance(NotApplicable):
        return Judgement(NOT_APPLICABLE, note=f"not applicable: {excinfo.value}"), None
    if report.when == "setup" or (excinfo and excinfo.errisinstance(FixtureError)):
        exc = excinfo.value
        # What broke a fixture (a FixtureError's cause) is judged: a known bug where the ledger knows it.
        cause = exc.__cause__ if isinstance(exc, FixtureError) and exc.__cause__ is not None else exc
        found = evidence.of_setup(Failure.from_exception(cause), Failure.from_exception(exc) if cause is not exc else None)
    elif excinfo and excinfo.errisinstance(RanksFailed):  # each rank judged as a test of its own, then combined
        found = evidence.of_ranks(excinfo.value.outcomes)
    else:
        from stackcheck.harness.scenario import ScenarioNotReached

        not_reached = bool(excinfo and excinfo.errisinstance(ScenarioNotReached))
        found = evidence.of_test(Failure.from_exception(excinfo.value, not_reached) if excinfo else None)
    arch = item.callspec.params.get("arch") if hasattr(item, "callspec") else None
    found["model_type"] = arch.model_type if arch else None

    def judge(failure: Failure | None) -> Judgement:
        return item.config.stash[keys.LEDGER].judge(family, item.name, item.config.stash[keys.VERSIONS], failure,
                                                   found["model_type"])

    judgement, ranks = evidence.judge(found, judge)
    if ranks is not None:
        item.stash[keys.RANK_RECORDS] = ranks
    return judgement, found
