"""Exit codes: one rule for every command, so that a pipeline can gate on them.

Every command exits 0 when it found nothing its rule counts as failing, 1 when it did (its report says what), 2 on a
usage error (one line on stderr; nothing was run, and nothing recorded changed), 3 when stackcheck itself failed, 4 when
a set is unusable (a library that does not import, pins that cannot be installed together),
128 + the signal when stopped by one (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP: the shell's convention, so that a CI step
or `timeout` tells them apart), 141 when the reader of its output went away. Which findings fail is each command's row of COMMANDS; where users need another choice,
`--fail-on` names the outcomes that fail instead of the default.

docs/exit-codes.md is generated from this module by `python -m stackcheck docs` (or `python -m stackcheck.runner.exitcodes
> docs/exit-codes.md`); a harness test keeps the two equal.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass

OK, FAILED, USAGE, INTERNAL, UNUSABLE, INTERRUPTED, READER_GONE = 0, 1, 2, 3, 4, 130, 141
HUNG_UP, TERMINATED = 128 + signal.SIGHUP, 128 + signal.SIGTERM  # 129, 143


def interrupted(received: signal.Signals) -> int:
    """The exit code of a command stopped by `received` (SIGINT, SIGTERM, SIGHUP): 128 + its number, as a shell says."""
    return 128 + int(received)


CODES = {
    OK: "the command ran and found nothing its rule counts as failing",
    FAILED: "the command ran and found something its rule counts as failing (the rows below); its report says what",
    USAGE: "a usage error: a wrong input, or a set whose environment could not be built (uv's or pip's reason in the "
           "line). One line on stderr; nothing was run, and nothing recorded was changed",
    INTERNAL: "stackcheck itself failed: a traceback, which is a bug of stackcheck to report",
    UNUSABLE: "a set is unusable (matrix, gpu-matrix): a library of it does not import in its environment, or its pins cannot "
              "be installed together. One line names the set, the library, its version and why; its cells are not run, "
              "the other sets run, and a failing cell of theirs makes the exit 1 instead",
    HUNG_UP: "stopped by SIGHUP (the terminal closed), as by Ctrl-C",
    INTERRUPTED: "interrupted (Ctrl-C): one line says what finished before and where it is kept; the pytest children and "
                 "their workers are stopped, every verdict recorded before (this run's and earlier runs') stays, and the "
                 "cells not reached read not run (docs/results.md)",
    TERMINATED: "stopped by SIGTERM (`kill`, `timeout`, a CI job's cancel, `docker stop`), as by Ctrl-C. A SIGKILL that "
                "follows (`timeout -k`, `docker stop` after its grace period) leaves the results as their last write left "
                "them: nothing recorded before is lost",
    READER_GONE: "the program reading the output went away (`stackcheck doctor | head`), as a shell's own commands do",
}

# What a verdict command's cells and the install commands' known bugs can be counted as (`--fail-on`).
NEW_FAILURE, ERROR, FIXED, FIXABLE, KNOWN_BUG = "new_failure", "error", "fixed", "fixable", "known_bug"
OUTCOMES = {
    NEW_FAILURE: "a cell whose failure the ledger does not know (or knows outside its affected range): look at it",
    ERROR: "a cell without an answer (scenario not reached, setup broke, its worker crashed), or a set whose run did not "
           "complete; a cell not run (the run stopped or was killed before it) is none: it is listed apart, not counted",
    FIXED: "a cell that passes where the ledger expects a bug: the ledger is stale, update it",
    FIXABLE: "a known bug that a release fixes (the ledger's range has an upper bound): an upgrade leaves it",
    KNOWN_BUG: "any known bug, fixable or not",
}
# What the tests themselves count as failing (the plugin fails a test on these, and a known bug is an xfail).
TEST_FAIL_ON = (NEW_FAILURE, ERROR, FIXED)
# What an install is asked about (doctor): a bug that an upgrade removes is something to do; one without a fix is
# not, so an install whose only bugs have no fix passes.
INSTALL_FAIL_ON = (FIXABLE,)
# What a model is asked about (scan): the problems it finds in the model and the options; the known bugs it lists
# are the install's, which doctor's exit code covers, so "no problems found" exits 0.
SCAN_FAIL_ON = ()


@dataclass(frozen=True)
class Rule:
    commands: tuple[str, ...]
    fails_on: str  # what exit 1 means for them
    fail_on: tuple[str, ...] | None = None  # the default `--fail-on`, where the command takes the flag


COMMANDS = (
    Rule(("matrix", "gpu-matrix"), "a cell this run recorded is one of `--fail-on`; a set's run did not complete (counted as "
         "`error`); gpu-matrix: no GPU cell of a set ran (`error`). `-k` that selects nothing is a usage error (2)", TEST_FAIL_ON),
    Rule(("tests",), "a test fails, as pytest says: a family cell that is `new_failure`, `error` or `fixed` (a known bug "
         "is an xfail), or a harness test. pytest's usage error and an empty selection are 2"),
    Rule(("gate", "watch"), "a regression: the candidate has a `new_failure` or `error` cell in a family, a family that "
         "passed on the baseline no longer does or was not run, or (gate --bench) a ratio is past its threshold. "
         "`fixed` in the candidate is an improvement"),
    Rule(("doctor",), "a known bug of `--fail-on` affects the install", INSTALL_FAIL_ON),
    Rule(("scan",), "a problem in the model, adapter or options (always); or a known bug of `--fail-on` affects the install", SCAN_FAIL_ON),
    Rule(("repro",), "a cell did not reproduce with its signature, or was not exported"),
    Rule(("bisect",), "no answer: the endpoints give the same verdicts, a probe could not decide, or the answer is ambiguous"),
    Rule(("history",), "a release in the range has no probe"),
    Rule(("backtest",), "a cell is open: a `new_failure`, `error` or `fixed` that no ledger entry explains inside its range"),
    Rule(("bench",), "a set's benchmarks failed or are missing"),
    Rule(("docs",), "with `--check`, a generated page is not current"),
    Rule(("versions", "wheelhouse", "merge", "refresh-latest", "report"), "never: they succeed (0) or refuse (2)"),
)


def rule(command: str) -> Rule:
    return next(r for r in COMMANDS if command in r.commands)


def parse_fail_on(text: str) -> tuple[str, ...]:
    """`--fail-on`: comma-separated outcomes, or `none` (exit 1 never, for what the command finds)."""
    from stackcheck.core.versions import UsageError

    names = [name.strip() for name in text.split(",")]
    if names == ["none"]:
        return ()
    unknown = [name for name in names if name not in OUTCOMES]
    if unknown or not all(names):
        raise UsageError(f"--fail-on {text!r}: expected outcomes among {', '.join(OUTCOMES)}, comma-separated, or none")
    return tuple(dict.fromkeys(names))


FAIL_ON_HELP = ("outcomes that make the exit code 1, comma-separated: " + ", ".join(OUTCOMES)
                + "; or none (default: {default}; docs/exit-codes.md)")


def fixed_in_a_release(bug) -> bool:
    """Whether a release fixes a ledger bug: its affected range has an upper bound (< or <=), which an upgrade leaves."""
    return any(spec.operator in ("<", "<=") for specifiers in bug.affected.values() for spec in specifiers)


def outcomes_of_cell(verdict: str, bug) -> set[str]:
    """The outcomes a cell counts as: its verdict's, and for a known bug whether a release fixes it (`bug`: the
    ledger's Bug, or None)."""
    if verdict == KNOWN_BUG:
        return {KNOWN_BUG} | ({FIXABLE} if bug is not None and fixed_in_a_release(bug) else set())
    return {verdict} & {NEW_FAILURE, ERROR, FIXED}


def from_pytest(code: int) -> int:
    """pytest's exit code in the terms of this rule: 0 and 1 as they are, its usage error (4) and an empty selection
    (5) are usage errors, an interruption (2) is 130, an internal error (3) is 3; anything else (a crash) is 1."""
    return {0: OK, 1: FAILED, 2: INTERRUPTED, 3: INTERNAL, 4: USAGE, 5: USAGE}.get(code, FAILED)


def markdown() -> str:
    """docs/exit-codes.md."""
    lines = ["# Exit codes", "", "<!-- Generated by `python -m stackcheck docs` from stackcheck/runner/exitcodes.py: edit that, not this page. -->", "",
             "One rule for every command, so that a CI step can gate on it:", "",
             "| code | meaning |", "|---|---|"]
    lines += [f"| {code} | {meaning} |" for code, meaning in sorted(CODES.items())]
    lines += ["", "What exit 1 means, command by command (`--fail-on` where a command takes it, with its default):", "",
              "| command | exit 1 when | `--fail-on` default |", "|---|---|---|"]
    for r in COMMANDS:
        default = (", ".join(r.fail_on) or "none") if r.fail_on is not None else "-"
        lines.append(f"| {', '.join(f'`{c}`' for c in r.commands)} | {r.fails_on} | {default} |")
    lines += ["", "The outcomes `--fail-on` takes (`none`: never exit 1 for what the command finds):", "",
              "| outcome | counts |", "|---|---|"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in OUTCOMES.items()]
    lines += ["", "Why the defaults differ: a verdict command (`matrix`) fails where the tests fail (`tests` is pytest itself): a "
              "known bug that reproduces is the ledger's expectation met. `doctor` asks what to change in an install: a "
              "bug that an upgrade removes is something to do, one without a fix is not, so an install whose only bugs "
              "have no fix exits 0. `scan` asks about a model: it fails on the problems it finds there, and lists the "
              "install's known bugs without failing on them (`--fail-on fixable` does), so \"no problems found\" is exit 0. `--fail-on known_bug` fails on every known bug; `matrix --fail-on "
              "new_failure,error,fixed,fixable` also on the known bugs that an upgrade of the set would remove.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
