"""`stackcheck gate`: run a baseline set and a candidate set (say, the baseline with one library bumped)
through the same families; fail on a regression, pass on improvements alone.

The comparison is pure: `compare(baseline, candidate)` takes two sets' results and returns findings, one list per
check in CHECKS; with `--bench SIZE`, `bench_ratios` also fails tokens/s and VRAM ratios past
`bench_compare.THRESHOLDS` (the thresholds: docs/internals.md, "commands/gate.py"; docs/running.md, "Gate an upgrade").
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from stackcheck.runner import envs, lane
from stackcheck.core import results
from stackcheck.core.cell import Cell
from stackcheck.bench import compare as bench_compare
from stackcheck.core.ledger import ERROR, FIXED, NEW_FAILURE, NOT_AFFECTED, PASS
from stackcheck.core.progress import Progress
from stackcheck.core.protocol import MATRIX_FILE, RESULTS_DIR
from stackcheck.core.versions import PACKAGES, UsageError, default_set, resolve

DEFAULT_OUTPUT = RESULTS_DIR / "gate"
REGRESSION, IMPROVEMENT, CHANGE, SAME = "regression", "improvement", "change", "same"
PASSING = (PASS, FIXED, NOT_AFFECTED)  # `fixed` passed too (the ledger only expected a bug there); `not_affected` has no bug


@dataclass(frozen=True)
class Finding:
    check: str  # which comparison found it: "families" (later, say, "vram")
    subject: str  # what it is about: a family id
    baseline: str
    candidate: str
    status: str  # REGRESSION, IMPROVEMENT, CHANGE or SAME
    detail: str = ""


def _cells_by_family(data: dict) -> dict[str, list[Cell]]:
    """The cells of each family on each architecture (`family [arch]`; a family that builds no model: `family`),
    so that the gate compares like with like."""
    families: dict[str, list[Cell]] = {}
    for cell in data["cells"]:
        subject = f"{cell.family} [{cell.arch}]" if cell.arch else cell.family
        families.setdefault(subject, []).append(cell)
    return families


def _label(cells: list[Cell]) -> str:
    """The worst verdict with its bugs, and when the cells differ, every verdict's count (skips included)."""
    verdict = results.worst([c.verdict for c in cells])
    bugs = sorted({c.bug for c in cells if c.verdict == verdict and c.bug})
    counts = f" [{results.summary_counts(cells)}]" if len({c.verdict for c in cells}) > 1 else ""
    return verdict + (f" ({', '.join(bugs)})" if bugs else "") + counts


def _describe(cell: Cell) -> str:
    return " ".join(part for part in (f"`{cell.test}`: {cell.verdict}", cell.signature, cell.note and f"({cell.note})") if part)


def family_verdicts(baseline: dict, candidate: dict) -> list[Finding]:
    """A family regresses when the candidate has a new_failure or error in it, when it passed on the
    baseline and no longer passes, or when the candidate did not run it; it improves when it passes on
    the candidate only."""
    before, after = _cells_by_family(baseline), _cells_by_family(candidate)
    findings = []
    for family in sorted(before.keys() | after.keys()):
        old, new = before.get(family, []), after.get(family, [])
        old_label, new_label = (_label(cells) if cells else "not run" for cells in (old, new))
        broken = [c for c in new if c.verdict in (NEW_FAILURE, ERROR)]
        old_passes = bool(old) and results.worst([c.verdict for c in old]) in PASSING
        new_passes = bool(new) and results.worst([c.verdict for c in new]) in PASSING
        if broken or not new or (old_passes and not new_passes):
            status = REGRESSION
            detail = "; ".join(_describe(c) for c in broken or new)
        elif new_passes and not old_passes:
            status, detail = IMPROVEMENT, "fixed"
        else:
            status = SAME if old_label == new_label else CHANGE
            detail = "; ".join(_describe(c) for c in new if c.verdict not in PASSING and c.note)
        findings.append(Finding("families", family, old_label, new_label, status, detail))
    return findings


def bench_ratios(baseline: dict, candidate: dict) -> list[Finding]:
    """Each problem bench_compare finds in the candidate's bench run against the baseline's is a regression."""
    if "bench" not in baseline or "bench" not in candidate:
        return []
    return [
        Finding("bench", problem.split(":", 1)[0], "baseline", "candidate", REGRESSION, problem)
        for problem in bench_compare.compare(candidate["bench"], baseline["bench"])
    ]


CHECKS: list[Callable[[dict, dict], list[Finding]]] = [family_verdicts, bench_ratios]


def compare(baseline: dict, candidate: dict, checks=CHECKS) -> list[Finding]:
    return [finding for check in checks for finding in check(baseline, candidate)]


def one_set(data: dict, name: str) -> dict:
    """The results of one set out of a matrix.json that holds several."""
    return {"sets": {name: data["sets"].get(name, {})}, "cells": [c for c in data["cells"] if c.set_name == name]}


def render_summary(baseline: dict, candidate: dict, findings: list[Finding]) -> str:
    """Markdown for a CI job summary: the verdict, what changed in the stack, then every finding."""
    (base_name, base_versions), (cand_name, cand_versions) = (next(iter(d["sets"].items())) for d in (baseline, candidate))
    regressions = [f for f in findings if f.status == REGRESSION]
    fixed = [f.subject for f in findings if f.check == "families" and f.status == IMPROVEMENT]
    bumped = [f"{p} {base_versions.get(p, '?')} → {cand_versions.get(p, '?')}" for p in PACKAGES
              if base_versions.get(p) != cand_versions.get(p)]
    lines = [
        f"## stackcheck gate: {'FAIL' if regressions else 'PASS'}",
        "",
        f"Baseline `{base_name}`, candidate `{cand_name}`: {', '.join(bumped) or 'same library versions'}.",
        "",
        f"- regressions: {', '.join(f'{f.check}/{f.subject}' for f in regressions) or 'none'}",
        f"- fixed families: {', '.join(fixed) or 'none'}",
        "",
        "| check | subject | baseline | candidate | status | detail |",
        "|---|---|---|---|---|---|",
    ]
    for f in findings:
        detail = f.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {f.check} | {f.subject} | {f.baseline} | {f.candidate} | **{f.status}** | {detail} |")
    return "\n".join(lines) + "\n"


def _bench(vset, python, args) -> dict:
    """The set's bench JSON, measured in this gate run (both sets on the same machine, one after the other)."""
    smoke = args.bench == "smoke"
    folder = args.output / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    output = folder / f"{vset.slug}.json"
    lane.bench_set(vset, python, "tiny" if smoke else args.bench, folder, smoke=smoke)
    return json.loads(output.read_text()) if output.exists() else {"benchmarks": [], "stackcheck": {}}


def run(args) -> int:
    """The `gate` command: 1 on any regression, 0 otherwise (2, through the CLI, on a usage error or an environment
    that cannot be built: both sets' environments are built before either runs)."""
    (baseline,) = resolve([args.sets or default_set().name])
    (candidate,) = resolve([args.candidate or baseline.name], args.overrides)
    if candidate == baseline:
        raise UsageError("the candidate is the baseline: bump a library with --with PIN or name --candidate SET")
    targets = lane.family_targets([f for f in (args.families or "").split(",") if f] or None)
    options = lane.arch_options(args.arch)
    lane.check_ledger()
    pythons = lane.build_all([baseline, candidate], args.find_links, args.no_index)
    bench_pythons = lane.build_all([baseline, candidate], args.find_links, args.no_index, envs.BENCH_GROUPS) if args.bench else {}
    matrix = args.output / MATRIX_FILE
    matrix.unlink(missing_ok=True)  # the comparison reads this run's cells only
    tracker = Progress("gate", 2, "set")
    for vset in (baseline, candidate):
        print(f"== gate: {vset.name}", flush=True)
        # The candidate loads the adapter the baseline trained, as a user does after upgrading.
        cells = lane.run(vset, targets, matrix, baseline=baseline.name, env=tracker.env(), options=options,
                         python=pythons[vset.name])
        tracker.finished(vset.name, len(cells))
    data = results.load(matrix)
    before, after = one_set(data, baseline.name), one_set(data, candidate.name)
    if args.bench:
        for vset, side in ((baseline, before), (candidate, after)):
            side["bench"] = _bench(vset, bench_pythons[vset.name], args)
    findings = compare(before, after)
    summary = render_summary(before, after, findings)
    (args.output / "summary.md").write_text(summary)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as handle:
            handle.write(summary)
    print(summary)
    print(f"wrote {args.output / 'summary.md'} and {matrix}", flush=True)  # where the summary above is kept
    return 1 if any(f.status == REGRESSION for f in findings) else 0
