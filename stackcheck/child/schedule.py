"""The order a parallel run (pytest-xdist) hands its tests out in: longest first, from the seconds a run measured.

Long cells start at once on every worker and short ones fill the gaps at the end; with warm rank pools, the cells
that share a pool go to one worker as an xdist group. A stale durations file only costs balance, never a verdict.
`python -m stackcheck.child.schedule PATH` says where a recorded run's time and CPU went. A pytest plugin
(pyproject's addopts). How it works: docs/internals.md, "child/schedule.py"; how to measure: docs/speed.md.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

from stackcheck import REPO_ROOT

DURATIONS_FILE = REPO_ROOT / "tests" / "durations.json"
GPU_DURATIONS_FILE = REPO_ROOT / "tests" / "durations-gpu.json"
RECORD_OPTION = "--stackcheck-record-durations"
# Tests under this many seconds are left out of the file: their order does not matter.
RECORD_FROM_SECONDS = 0.5


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("stackcheck").addoption(
        "--stackcheck-durations", action="append", default=None, metavar="PATH",
        help="the measured seconds a parallel run orders its tests by, longest first; repeat for several files "
             f"(default: {DURATIONS_FILE.relative_to(REPO_ROOT)} and {GPU_DURATIONS_FILE.relative_to(REPO_ROOT)})")
    parser.getgroup("stackcheck").addoption(
        RECORD_OPTION, default=None, metavar="PATH",
        help="write each test's seconds (setup + call + teardown, over RECORD_FROM_SECONDS) to PATH at the end: the "
             f"file a parallel run orders its tests by ({DURATIONS_FILE.relative_to(REPO_ROOT)})")


# `@pytest.mark.shares(NAME)`: the test reads a result that the tests of group NAME build once per run, shared on disk
# by the xdist workers (stackcheck.core.locking.run_folder); whichever of them runs first builds it, under a lock.
SHARES_MARK = "shares"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{SHARES_MARK}(name): reads a result built once per run for the tests of group `name` "
                                       "(stackcheck.core.locking.run_folder): ordered after every other test but the group's first")
    if config.getoption(RECORD_OPTION) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Recorder(Path(config.getoption(RECORD_OPTION))), "stackcheck-durations")
    if config.getoption(RECORD_OPTION):
        config.pluginmanager.register(CpuMeter(), "stackcheck-cpu-meter")
    if loadgroup(config):
        config.stash[GROUPS_FOLDER] = Path(tempfile.mkdtemp(prefix="stackcheck-groups-"))


def measured(path: Path) -> dict[str, float]:
    """The seconds in a durations file; nothing where it is missing or not one (only the order would suffer)."""
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text())["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def measured_cpu(path: Path) -> tuple[dict[str, float], dict | None]:
    """The CPU seconds per test and the host's busy core-seconds in a durations file (empty and None where it has
    none: a file written before they were recorded, or on a host without /proc/stat)."""
    try:
        content = json.loads(path.read_text())
        cpu = {str(k): float(v) for k, v in content.get("cpu_seconds", {}).items()}
        host = content.get("host")
        return cpu, host if isinstance(host, dict) else None
    except (OSError, ValueError, TypeError, AttributeError):
        return {}, None


def function_of(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def expected_seconds(nodeids: list[str], known: dict[str, float]) -> dict[str, float]:
    """Each test's expected seconds: its own, else the mean of its function's known tests, else its module's, else 0."""
    by_function, by_module = defaultdict(list), defaultdict(list)
    for nodeid, seconds in known.items():
        by_function[function_of(nodeid)].append(seconds)
        by_module[module_of(nodeid)].append(seconds)

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    return {nodeid: known[nodeid] if nodeid in known
            else mean(by_function.get(function_of(nodeid)) or by_module.get(module_of(nodeid)) or [])
            for nodeid in nodeids}


def xdist_group(item) -> str | None:
    mark = item.get_closest_marker(GROUP_MARK) if hasattr(item, "get_closest_marker") else None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default")) if mark else None


def longest_first(items: list, expected: dict[str, float], grouped: bool = False) -> list:
    """`items`, the costliest first; ties keep the collection's order. `grouped` (--dist loadgroup): the tests of an
    xdist group together, where the sum of their seconds puts them, longest first within it. Of the tests that share
    a result (the `shares` mark), the first in that order builds it and the others go last: handed out beside it,
    they would only wait on its lock, a worker idle for the whole build (whatever the durations file says each costs)."""
    if grouped:
        groups = {item.nodeid: xdist_group(item) for item in items}
        totals: dict[str, float] = defaultdict(float)
        for item in items:
            if groups[item.nodeid]:
                totals[groups[item.nodeid]] += expected[item.nodeid]
        order = sorted(items, key=lambda item: (-(totals[groups[item.nodeid]] if groups[item.nodeid] else expected[item.nodeid]),
                                                groups[item.nodeid] or "", -expected[item.nodeid]))  # stable
    else:
        order = sorted(items, key=lambda item: -expected[item.nodeid])  # stable
    builders, readers = set(), set()
    for item in order:
        mark = item.get_closest_marker(SHARES_MARK) if hasattr(item, "get_closest_marker") else None
        if mark:
            (readers.add(item.nodeid) if mark.args[0] in builders else builders.add(mark.args[0]))
    return sorted(order, key=lambda item: item.nodeid in readers)  # stable: the readers last, in their order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # a plain run, or the controller (which collects nothing)
        return
    paths = config.getoption("--stackcheck-durations") or [DURATIONS_FILE, GPU_DURATIONS_FILE]
    known = {nodeid: seconds for path in paths for nodeid, seconds in measured(Path(path)).items()}
    grouped = GROUPS_KEY in config.workerinput
    items[:] = longest_first(items, expected_seconds([item.nodeid for item in items], known), grouped)
    if grouped:  # for the controller's scheduler, before this worker reports its collection
        groups = {item.nodeid: group for item in items if (group := xdist_group(item))}
        folder = Path(config.workerinput[GROUPS_KEY])
        scratch = folder / f".{config.workerinput['workerid']}.tmp"
        scratch.write_text(json.dumps(groups))
        scratch.replace(folder / f"{config.workerinput['workerid']}.json")


# --dist loadgroup, with the groups kept (docs/internals.md, "child/schedule.py").
GROUP_MARK = "xdist_group"
GROUPS_KEY = "stackcheck_groups"  # the folder each worker writes its {nodeid: group} into, in its workerinput
GROUPS_FOLDER = pytest.StashKey[Path]()  # that folder, on the controller's config


def loadgroup(config: pytest.Config) -> bool:
    return getattr(config.option, "dist", "no") == "loadgroup" and not hasattr(config, "workerinput")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's: the controller, for each worker it starts
def pytest_configure_node(node) -> None:
    folder = node.config.stash.get(GROUPS_FOLDER, None)
    if folder is not None:
        node.workerinput[GROUPS_KEY] = str(folder)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if not loadgroup(config):
        return None
    from xdist.scheduler import LoadGroupScheduling

    class KeptGroups(LoadGroupScheduling):
        """xdist's LoadGroupScheduling, the groups read from the workers' marks instead of their node ids."""

        groups: dict[str, str] | None = None

        def schedule(self) -> None:
            if self.groups is None:  # every worker has reported its collection, so has written its groups
                self.groups = {}
                for path in sorted(Path(config.stash[GROUPS_FOLDER]).glob("*.json")):
                    self.groups.update(json.loads(path.read_text()))
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            group = (self.groups or {}).get(nodeid)
            return f"{GROUP_MARK}:{group}" if group else nodeid

    return KeptGroups(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(GROUPS_FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def from_results(path: Path, lane: str = "gpu") -> dict[str, float]:
    """The seconds of a results file's cells (matrix.json) of one lane, per test: the longest over its sets (a cell's
    seconds are its test's: setup, call and teardown)."""
    seconds: dict[str, float] = {}
    for cell in json.loads(path.read_text()).get("cells", []):
        if cell.get("lane") == lane and isinstance(cell.get("seconds"), (int, float)) and cell["seconds"] >= RECORD_FROM_SECONDS:
            seconds[cell["test"]] = max(seconds.get(cell["test"], 0.0), round(float(cell["seconds"]), 1))
    return seconds


def write(path: Path, seconds: dict[str, float], comment: str, cpu: dict[str, float] | None = None,
          host: dict | None = None) -> None:
    """A durations file: the seconds the order reads, and where measured, each test's CPU seconds (every test, short
    ones too) and the host's busy core-seconds over the run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    content = {"_comment": comment, "seconds": dict(sorted(seconds.items()))}
    if cpu:
        content["cpu_seconds"] = dict(sorted(cpu.items()))
    if host:
        content["host"] = host
    path.write_text(json.dumps(content, indent=1) + "\n")


# A test's CPU seconds, on its teardown report (the process that ran it measures; the one that records reads).
CPU_PROPERTY = "stackcheck_cpu_seconds"


def cpu_seconds() -> float:
    """This process's CPU seconds and those of the children it has waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def host_busy() -> tuple[float, float] | None:
    """(core-seconds the host's CPUs were busy since boot, wall seconds now) from Linux's /proc/stat; None elsewhere."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), time.monotonic()


class CpuMeter:
    """In the process that runs the tests: each test's CPU seconds, from its start to its teardown's report."""

    def __init__(self):
        self.started: dict[str, float] = {}

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self.started[nodeid] = cpu_seconds()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        if call.when == "teardown" and item.nodeid in self.started:
            report.user_properties.append((CPU_PROPERTY, round(cpu_seconds() - self.started.pop(item.nodeid), 3)))
        return report


class Recorder:
    """Adds up each test's phases and its CPU seconds, in the process that sees every report (the controller, or a
    plain run), and the host's busy core-seconds from the session's start to its end."""

    def __init__(self, path: Path):
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = {}
        self.host_start = host_busy()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        cpu = dict(report.user_properties).get(CPU_PROPERTY)
        if isinstance(cpu, (int, float)):
            self.cpu[report.nodeid] = cpu

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        kept = {nodeid: round(seconds, 1) for nodeid, seconds in self.seconds.items() if seconds >= RECORD_FROM_SECONDS}
        end = host_busy()
        host = None
        if self.host_start and end:
            host = {"cores": os.cpu_count(), "wall_seconds": round(end[1] - self.host_start[1], 1),
                    "busy_core_seconds": round(end[0] - self.host_start[0], 1)}
        write(self.path, kept, "seconds per test (setup + call + teardown) of one measured run: "
                               "the order a parallel run hands tests out in (stackcheck.child.schedule)",
              cpu={nodeid: round(value, 2) for nodeid, value in self.cpu.items()}, host=host)


# ------------------------------------------------------------------------------------------- where the time goes

def makespan(seconds: list[float], workers: int) -> float:
    """When the last of `workers` workers finishes, handed the tests longest first, each to the first worker free
    (what --dist load --maxschedchunk 1 does with a longest-first collection): a simulation, start-up left out."""
    import heapq

    free_at = [0.0] * max(workers, 1)
    for value in sorted(seconds, reverse=True):
        heapq.heapreplace(free_at, free_at[0] + value)
    return max(free_at)


def breakdown(seconds: dict[str, float], workers: int, top: int = 10, cpu: dict[str, float] | None = None,
              host: dict | None = None) -> str:
    """A recorded run's test-seconds by folder and by module, its longest tests, and the floor of a run on `workers`
    workers: no schedule finishes before its longest test, nor before the test-seconds shared out evenly. Where the
    run measured CPU: the tests' CPU seconds, the host's busy core-seconds, and the floor the cores set."""
    total = sum(seconds.values())
    by_folder, by_module = defaultdict(float), defaultdict(float)
    for nodeid, value in seconds.items():
        by_folder[module_of(nodeid).rsplit("/", 1)[0]] += value
        by_module[module_of(nodeid)] += value
    longest = sorted(seconds.items(), key=lambda item: -item[1])
    floor = max(longest[0][1] if longest else 0.0, total / workers)
    lines = [f"{len(seconds)} tests over {RECORD_FROM_SECONDS} s, {total:.0f} test-seconds; floor on {workers} workers: {floor:.0f} s",
             f"longest first on {workers} workers (simulated, start-up left out): {makespan(list(seconds.values()), workers):.0f} s"]
    if cpu:
        spent = sum(cpu.values())
        lines.append(f"CPU: {spent:.0f} core-seconds in the tests' processes and the children they waited for ({len(cpu)} tests); "
                     f"shared out over {workers} cores: {spent / workers:.0f} s")
    if host and host.get("cores") and host.get("wall_seconds"):
        busy, wall, cores = host["busy_core_seconds"], host["wall_seconds"], host["cores"]
        lines.append(f"host: {busy:.0f} core-seconds busy over the run's {wall:.0f} s on {cores} cores ({busy / (wall * cores):.0%}, "
                     f"every process on it); no run of this work on {cores} cores ends before {busy / cores:.0f} s")
    lines += ["", "by folder:"]
    lines += [f"  {value:7.0f} s {100 * value / total:5.1f}%  {name}" for name, value in sorted(by_folder.items(), key=lambda i: -i[1])]
    lines += ["", f"the {top} costliest modules:"]
    lines += [f"  {value:7.0f} s  {name}" for name, value in sorted(by_module.items(), key=lambda i: -i[1])[:top]]
    lines += ["", f"the {top} longest tests:"]
    lines += [f"  {value:7.1f} s  {name}" for name, value in longest[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m stackcheck.child.schedule",
                                     description="Where a recorded run's time went (a file written by --stackcheck-record-durations).")
    parser.add_argument("path", nargs="?", type=Path, default=DURATIONS_FILE, help="the durations file (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="the workers the floor is for (default: the cores)")
    parser.add_argument("--from-results", type=Path, metavar="MATRIX_JSON", action="append",
                        help="read the GPU lane's cells' seconds from results files (matrix.json) instead; repeatable")
    parser.add_argument("--write", type=Path, metavar="PATH", help=f"with --from-results: write them as a durations file ({GPU_DURATIONS_FILE.relative_to(REPO_ROOT)})")
    args = parser.parse_args(argv)
    if args.from_results:
        known = {}
        for path in args.from_results:
            if not path.is_file():
                parser.error(f"{path}: no such results file")
            for nodeid, value in from_results(path).items():
                known[nodeid] = max(known.get(nodeid, 0.0), value)
        if args.write:
            write(args.write, known, "seconds per GPU-lane cell of a GPU run's results, the longest over its sets: the order a "
                                     "parallel GPU run hands tests out in (stackcheck.child.schedule)")
        cpu, host = None, None
    else:
        known, cpu, host = measured(args.path), *measured_cpu(args.path)
    if not known:
        parser.error(f"{args.path}: no durations file (write one with {RECORD_OPTION}=PATH)")
    print(breakdown(known, max(args.workers, 1), cpu=cpu, host=host))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
