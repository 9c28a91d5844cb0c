"""What the command side and the pytest child say to each other, in one place both import.

The command side (stackcheck.cli and the runner in stackcheck.runner.lane) starts pytest in a set's environment with the
`--stackcheck-*` options below and the `STACKCHECK_*` variables; the child (stackcheck.child.plugin, its xdist workers,
the bench plugin, the progress line, a distributed job's ranks) reads them. This module imports nothing of
stackcheck but REPO_ROOT, so the child never imports command-side modules for a name.

Also here: the default places the commands write to (results/, results/matrix.json).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from stackcheck import REPO_ROOT

# pytest options of stackcheck.child.plugin.
SET_OPTION = "--stackcheck-set"  # the version set's name the cells are recorded under
RESULTS_OPTION = "--stackcheck-results"  # the matrix.json each cell is recorded in as soon as it has a verdict
LANES_OPTION = "--stackcheck-lanes"  # comma-separated lanes the run holds (cpu, gpu)
ARCH_OPTION = "--stackcheck-arch"  # architectures under test: built-in names, or a config.json
BASELINE_OPTION = "--stackcheck-baseline"  # the set of this run whose trained adapter this set loads
TIMING_OPTION = "--stackcheck-timing"  # a JSON file the child writes its run's cost split to
EXHAUSTIVE_OPTION = "--stackcheck-exhaustive"  # every combination of a contract test's axes, not a pairwise cover
EXPLORE_OPTION = "--stackcheck-explore"  # N configurations of each contract test's axes beyond its pairwise cover
SEED_OPTION = "--stackcheck-seed"  # the seed EXPLORE_OPTION samples from
CROSS_RELEASE_OPTION = "--stackcheck-cross-release"  # the folder of the cross-release writer's exports (stackcheck.commands.cross_release)
# pytest options of stackcheck.child.bench.
BENCH_SIZE_OPTION = "--stackcheck-bench-size"
BENCH_REPEAT_OPTION = "--stackcheck-bench-repeat"
BENCH_SMOKE_OPTION = "--stackcheck-bench-smoke"

# Every STACKCHECK_* variable, in one registry (docs/variables.md is generated from it): who sets it, what it means.
COMMAND, USER = "the command side", "a user (or a harness test)"


@dataclass(frozen=True)
class Variable:
    name: str
    set_by: str
    meaning: str


VARIABLES: dict[str, Variable] = {}


def _variable(name: str, set_by: str, meaning: str) -> str:
    VARIABLES[name] = Variable(name, set_by, meaning)
    return name


SET_RECORD_ENV = _variable("STACKCHECK_SET", COMMAND, "the version set under test, as the command resolved it (VersionSet.to_dict as JSON): "
                           "the child records its cells under its name")
LAUNCHED_AT_ENV = _variable("STACKCHECK_LAUNCHED_AT", COMMAND, "time.time() at launch: where the start-up share of a run's cost begins")
RUN_ENV = _variable("STACKCHECK_RUN", COMMAND, "this pytest run's id: the recorder stamps each cell it records with it")
PROGRESS_ENV = _variable("STACKCHECK_PROGRESS", COMMAND, "the long run's state, for the child's live progress line (stackcheck.core.progress)")
REPRO_PARAMS_ENV = _variable("STACKCHECK_REPRO_PARAMS", COMMAND, "where `repro`'s collecting child writes a test's parameters")
SCAN_IN_ENV = _variable("STACKCHECK_SCAN_IN", COMMAND, "`scan --python P` runs itself again under P, which this names")
DIST_LANE_ENV = _variable("STACKCHECK_DIST_LANE", COMMAND, "a distributed job's lane, for its ranks (stackcheck.distributed.rank)")
COMMAND_PID_ENV = _variable("STACKCHECK_COMMAND_PID", COMMAND, "the command's process id: the child ends when it is gone (stackcheck.child.signals)")
WARMING_ENV = _variable("STACKCHECK_WARMING", COMMAND, "the bytecode warmer's marker and process id, for the workers (stackcheck.process.warmer)")
GPU_WAIT_ENV = _variable("STACKCHECK_GPU_WAIT", COMMAND, "how a process on a shared GPU host waits for its GPU: `block` (asleep, set by an xdist "
                         "worker for what it starts) or `spin` (CUDA's default; a user may set it) (stackcheck.process.gpu_wait)")
RANK_POOL_ENV = _variable("STACKCHECK_RANK_POOL", USER, "1: two-rank cells on warm rank pools and trainer_resume's resumes on a warm process; 0: a new "
                          "process for each (the matrix commands pass 1 unless the user set 0; plain pytest and CI: 0) (stackcheck.process.warm)")
DIST_CPU_ENV = _variable("STACKCHECK_DIST_CPU", USER, "`all`: the CPU lane also runs the distributed cells left out of the default run for their cost")
FIXTURES_ENV = _variable("STACKCHECK_FIXTURES", USER, "the fixtures folder (a harness test breaks a precondition through it)")
CACHE_ENV = _variable("STACKCHECK_CACHE", USER, "where the tiny checkpoints and the cross-release writer's checkpoints are cached "
                      "(default: .cache/ in the checkout)")
WHEEL_DIRS_ENV = _variable("STACKCHECK_WHEEL_DIRS", USER, "local wheel folders the environments take torch from")
BENCH_SLOWDOWN_ENV = _variable("STACKCHECK_BENCH_SYNTHETIC_SLOWDOWN", USER, "test-only: slows every timed bench call")
CHROMIUM_ENV = _variable("STACKCHECK_CHROMIUM", USER, "the Chromium the report's browser tests and screenshots drive (default: the OS's)")
INSTALL_BROWSER_ENV = _variable("STACKCHECK_INSTALL_BROWSER", USER, "1: `nox -s tests` installs the OS's Chromium where it can (as on CI)")


def variables_page() -> str:
    """docs/variables.md's table, from VARIABLES."""
    rows = [f"| `{v.name}` | {v.set_by} | {v.meaning} |" for v in VARIABLES.values()]
    return "\n".join(["# Environment variables", "", "Every `STACKCHECK_*` variable, from `stackcheck/core/protocol.py` (the one place they are "
                      "declared).", "", "| variable | set by | meaning |", "|---|---|---|", *rows, ""])


# Where the commands write by default.
RESULTS_DIR = REPO_ROOT / "results"
MATRIX_FILE = "matrix.json"
DEFAULT_RESULTS = RESULTS_DIR / MATRIX_FILE


def cache_root() -> Path:
    """The machine's cache: the tiny checkpoints (stackcheck.models.tiny) and the cross-release writer's exports."""
    return Path(os.environ.get(CACHE_ENV, REPO_ROOT / ".cache"))


def option(name: str, value: object) -> str:
    """`--stackcheck-x=value`, as the command side passes an option to the child."""
    return f"{name}={value}"
