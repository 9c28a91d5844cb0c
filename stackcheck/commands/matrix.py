"""`matrix`, `gpu-matrix` and `tests`: the families on each set, one pytest child per set (stackcheck.runner.lane),
every set's environment built before any runs; the exit code follows the rule of stackcheck.runner.exitcodes over the
cells the run recorded."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from stackcheck.commands import cross_release, explore
from stackcheck.core import results
from stackcheck.core.cell import Cell
from stackcheck.core.ledger import Ledger
from stackcheck.core.progress import Progress
from stackcheck.core.protocol import ARCH_OPTION, EXPLORE_OPTION, SEED_OPTION, option
from stackcheck.core.versions import UsageError
from stackcheck.models import architectures
from stackcheck.runner import envs, exitcodes
from stackcheck.runner.inputs import check_file_option, selected_sets
from stackcheck.runner.lane import CPU_LANE, arch_options, build_all, check_ledger, family_targets, named_paths, new_run_id, parallel_options, rank_pools, run_pytest


def gpu_device(on_the_cpu: str) -> str:
    """GPU 0's name; without a GPU, one line (exit 2) that names what runs on the CPU instead."""
    try:
        return envs.cuda_device()
    except UsageError as exc:
        raise UsageError(f"{exc}: {on_the_cpu}") from None


def run(args) -> int:
    """`matrix` runs the CPU lane; `gpu-matrix` both lanes, and fails when no GPU cell really ran. Every set's
    environment is built before any set runs; the exit code follows --fail-on over the cells this run recorded."""
    check_file_option("--results", args.results)
    if args.results.exists():
        results.load_checked(args.results)  # the sets record into it: a corrupt one would fail only after a build
    fail_on = exitcodes.parse_fail_on(args.fail_on) if args.fail_on is not None else exitcodes.rule(args.command).fail_on
    assert fail_on is not None, "matrix and gpu-matrix take --fail-on: their rule has its default (exitcodes.COMMANDS)"
    gpu = args.command == "gpu-matrix"
    pools, pools_env = rank_pools(default=True)  # the two-rank cells on warm rank pools unless STACKCHECK_RANK_POOL=0
    if gpu:
        print(f"== device: {gpu_device('`matrix` runs the CPU lane alone')}", flush=True)
    sets = selected_sets(args)
    check_ledger()
    families = args.families.split(",") if args.families else None
    explore_options = explore_arguments(args)
    targets = family_targets(families)
    if named_paths(args.pytest_args):  # tests named after `--` (one cell's node id, say) run alone, not with their whole families
        targets = []
    lanes = ["gpu", "cpu"] if gpu else ["cpu"]
    args.results.parent.mkdir(parents=True, exist_ok=True)
    unusable: dict[str, str] = {}
    writer = cross_release.plan(sets, families, args.arch, args.no_cross_release or bool(named_paths(args.pytest_args)))
    pythons = build_all(sets, args.find_links, args.no_index, unusable=unusable)
    sets = [vset for vset in sets if vset.name not in unusable]
    reads = cross_release.prepare(writer, args.find_links, args.no_index) if sets else []  # the writer's checkpoints, once per machine
    incomplete, cells = [], []
    tracker = Progress(args.command, len(sets), "set")
    ledger = Ledger()
    for vset in sets:
        print(f"== set {vset.name}: {', '.join(f'{k} {v}' for k, v in vset.pins.items())}", flush=True)
        started, run = time.monotonic(), new_run_id()
        selection = [] if gpu else [CPU_LANE]
        # Every set after the first loads the adapter the first one trained (stackcheck.child.exchange).
        code = run_pytest(pythons[vset.name], vset, targets, ["-q", *selection, *arch_options(args.arch), *explore_options, *reads,
                                                              *parallel_options(args.pytest_args, pools=pools), *args.pytest_args],
                          args.results, sets[0].name, tracker.env() | pools_env, run=run)
        ran = results.cells_of_run(args.results, vset.name, run)
        if args.explore and code in (0, 1):  # each explored cell that failed, shrunk by running the test again
            shrunk = explore.shrink_failures(pythons[vset.name], vset, ran, [*selection, *arch_options(args.arch)], args.command,
                                             args.overrides, args.arch)
            if shrunk:
                results.record_cells(args.results, shrunk)
                ran = results.cells_of_run(args.results, vset.name, run)
        cells += ran
        tracker.finished(vset.name, len(ran))
        if code == 4:  # pytest's usage error: it printed the reason (a bad pytest argument, or the ledger)
            raise UsageError(f"set {vset.name}: pytest refused the run (its ERROR line above); nothing was recorded")
        if code == 5:
            raise UsageError(f"set {vset.name}: the selection collected no test; nothing was run or recorded")
        print(f"== set {vset.name}: pytest exit {code}, {'+'.join(lanes)} lanes {time.monotonic() - started:.1f} s", flush=True)
        if code not in (0, 1):  # 1 only means some cells are not `pass`; their verdicts are recorded
            incomplete.append(vset.name)
        elif gpu and not results.ran_in_lane(args.results, vset.name, "gpu", run):
            print(f"stackcheck: set {vset.name}: every GPU cell was skipped or missing", file=sys.stderr)
            incomplete.append(vset.name)
    if sets:
        print(f"wrote {args.results} and {args.results.with_suffix('.md')}")
    if incomplete:
        print(f"stackcheck: sets without a complete run: {', '.join(incomplete)}", file=sys.stderr)
    code = failing_cells(cells, ledger, fail_on, incomplete)
    if unusable and code == exitcodes.OK:
        print(f"stackcheck: exit {exitcodes.UNUSABLE}: unusable sets: {', '.join(unusable)} (docs/exit-codes.md)", file=sys.stderr)
        return exitcodes.UNUSABLE
    return code


def explore_arguments(args) -> list[str]:
    """The child's options of `--explore N --seed S` (none without --explore); a count below 1, or a seed without
    --explore, is a usage error."""
    if args.explore is None:
        if args.seed is not None:
            raise UsageError("--seed S is the seed of --explore N: name --explore too")
        return []
    if args.explore < 1:
        raise UsageError(f"--explore {args.explore}: explore samples N configurations beyond the pairs, N at least 1")
    if args.seed is not None and args.seed < 0:
        raise UsageError(f"--seed {args.seed}: a seed is 0 or more")
    return [option(EXPLORE_OPTION, args.explore), option(SEED_OPTION, args.seed or 0)]


def failing_cells(cells: list[Cell], ledger: Ledger, fail_on: tuple[str, ...], incomplete: Sequence[str] = ()) -> int:
    """The exit code of a verdict command by the rule (stackcheck.runner.exitcodes): 1 when a cell (or an incomplete run,
    an `error`) is one of the `fail_on` outcomes, saying which and how many; else 0."""
    found: dict[str, int] = {}
    for cell in cells:
        for outcome in exitcodes.outcomes_of_cell(cell.verdict, ledger.bugs.get(cell.bug) if cell.bug else None):
            found[outcome] = found.get(outcome, 0) + 1
    if incomplete:
        found[exitcodes.ERROR] = found.get(exitcodes.ERROR, 0) + len(incomplete)
    failing = {outcome: count for outcome, count in found.items() if outcome in fail_on}
    if failing:
        print(f"stackcheck: exit 1: {', '.join(f'{count} {outcome}' for outcome, count in failing.items())} "
              f"(--fail-on {','.join(fail_on)}; docs/exit-codes.md)", file=sys.stderr)
        return exitcodes.FAILED
    return exitcodes.OK


def tests(args) -> int:
    (vset,) = selected_sets(args)
    pools, pools_env = rank_pools(default=False)  # the harness's tests: one launch per cell unless STACKCHECK_RANK_POOL=1
    groups = envs.BENCH_GROUPS + (() if args.no_index else envs.REPORT_GROUPS)
    python = build_all([vset], args.find_links, args.no_index, groups)[vset.name]
    # CI's run: the families on the seed's architecture unless --arch widens it (new architectures still have
    # unexplained new failures, which `matrix` shows: see docs/architectures.md).
    arch = arch_options(args.arch) or [option(ARCH_OPTION, architectures.SEED_ARCHITECTURE)]
    # Every test, one xdist worker per core (docs/speed.md); a run that names its tests runs those, in one process.
    targets = [] if named_paths(args.pytest_args) else ["tests"]
    code = run_pytest(python, vset, targets, [*arch, *parallel_options(args.pytest_args, pools=pools), *args.pytest_args],
                      None, env=pools_env)
    if code in (4, 5):
        raise UsageError("pytest refused the run (its ERROR line above)" if code == 4 else "the selection collected no test")
    return exitcodes.from_pytest(code)
