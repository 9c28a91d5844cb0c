"""What the command side and the pytest child say to each other, in one place both import.

The command side (stackcheck.cli and the runner in stackcheck.runner.lane) starts pytest in a set's environment with the
`--stackcheck-*` options below and the `STACKCHECK_*` variables; the child (stackcheck.child.plugin, its xdist workers,
the bench plugin, the progress line, a distributed job's ranks) reads them. This module imports nothing of
stackcheck but REPO_ROOT, so the child never imports command-side modules for a name.

Also here: the default places the commands write to (results/, results/matrix.json).
"""

from __future__ import annotations

from stackcheck import REPO_ROOT

# pytest options of stackcheck.child.plugin.
SET_OPTION = "--stackcheck-set"  # the version set's name the cells are recorded under
RESULTS_OPTION = "--stackcheck-results"  # the matrix.json each cell is recorded in as soon as it has a verdict
LANES_OPTION = "--stackcheck-lanes"  # comma-separated lanes the run holds (cpu, gpu)
ARCH_OPTION = "--stackcheck-arch"  # architectures under test: built-in names, or a config.json
BASELINE_OPTION = "--stackcheck-baseline"  # the set of this run whose trained adapter this set loads
TIMING_OPTION = "--stackcheck-timing"  # a JSON file the child writes its run's cost split to
EXHAUSTIVE_OPTION = "--stackcheck-exhaustive"  # every combination of a contract test's axes, not a pairwise cover
# pytest options of stackcheck.child.bench.
BENCH_SIZE_OPTION = "--stackcheck-bench-size"
BENCH_REPEAT_OPTION = "--stackcheck-bench-repeat"
BENCH_SMOKE_OPTION = "--stackcheck-bench-smoke"

# Variables the command side sets for the child.
LAUNCHED_AT_ENV = "STACKCHECK_LAUNCHED_AT"  # time.time() at launch: where the start-up share of a run's cost begins
RUN_ENV = "STACKCHECK_RUN"  # this pytest run's id: the recorder stamps each cell it records with it
PROGRESS_ENV = "STACKCHECK_PROGRESS"  # the long run's state, for the child's live progress line (stackcheck.core.progress)
REPRO_PARAMS_ENV = "STACKCHECK_REPRO_PARAMS"  # where `repro`'s collecting child writes a test's parameters
SCAN_IN_ENV = "STACKCHECK_SCAN_IN"  # `scan --python P` runs itself again under P, which this names
DIST_LANE_ENV = "STACKCHECK_DIST_LANE"  # a distributed job's lane, for its ranks (stackcheck.distributed.rank)
RANK_POOL_ENV = "STACKCHECK_RANK_POOL"  # 1: warm rank pools and the warm resume process (stackcheck.process.warm)
COMMAND_PID_ENV = "STACKCHECK_COMMAND_PID"  # the command's process id: the child ends when it is gone (stackcheck.child.signals)
WARMING_ENV = "STACKCHECK_WARMING"  # the bytecode warmer's marker and process id, for the workers (stackcheck.process.warmer)
# Variables a user (or a harness test) sets.
FIXTURES_ENV = "STACKCHECK_FIXTURES"  # the fixtures folder (a harness test breaks a precondition through it)
CACHE_ENV = "STACKCHECK_CACHE"  # where the tiny checkpoints are cached
WHEEL_DIRS_ENV = "STACKCHECK_WHEEL_DIRS"  # local wheel folders the environments take torch from
BENCH_SLOWDOWN_ENV = "STACKCHECK_BENCH_SYNTHETIC_SLOWDOWN"  # test-only: slows every timed bench call

# Where the commands write by default.
RESULTS_DIR = REPO_ROOT / "results"
MATRIX_FILE = "matrix.json"
DEFAULT_RESULTS = RESULTS_DIR / MATRIX_FILE


def option(name: str, value: object) -> str:
    """`--stackcheck-x=value`, as the command side passes an option to the child."""
    return f"{name}={value}"
