"""`stackcheck bisect`: the first release (or commit) of one package where a family's verdicts flip,
"first broken in" or "first fixed in".

Every other library stays pinned to a base set; each candidate gets its own environment (`<base>+<package>==<version>`).
A probe is good when its verdicts equal the good endpoint's; an `error`, `skipped` or flaky probe is skipped, as
`git bisect skip` does; probes come from the store `history` fills. The rules: docs/internals.md,
"commands/releases/bisect.py"; how to run it: docs/running.md.
"""

from __future__ import annotations

import datetime
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from stackcheck import REPO_ROOT
from stackcheck.runner import lane
from stackcheck.core import results
from stackcheck.core.cell import Cell
from stackcheck.commands.releases.probes import DEFAULT_STORE, Prober, ProbeStore
from stackcheck.core.ledger import ERROR, FIXED, PASS, SKIPPED
from stackcheck.core.versions import PACKAGES, UsageError, default_set, index_versions, parse_pin, resolve

GOOD, BAD, UNTESTABLE = "good", "bad", "untestable"


@dataclass(frozen=True)
class Candidate:
    label: str  # a version, or a commit's short hash
    pin: str  # the --with token that installs it


@dataclass
class Probe:
    candidate: str
    run: int  # 2 for the re-run of a flipped probe
    side: str  # GOOD, BAD or UNTESTABLE
    cells: list[Cell]
    reason: str | None
    seconds: float

    def to_record(self) -> dict:
        """The probe in the bisect record: each cell's test, verdict, bug and signature, what the answer compares."""
        return {"candidate": self.candidate, "run": self.run, "side": self.side, "reason": self.reason, "seconds": self.seconds,
                "cells": [{"test": c.test, "verdict": c.verdict, "bug": c.bug, "signature": c.signature} for c in self.cells]}


def version_option(text: str, what: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise UsageError(f"{what} '{text}' is not a valid version") from None


def release_candidates(package: str, good: Version, bad: Version, listed: list[Version]) -> list[Candidate]:
    """The releases from the older endpoint to the newer one, both included, oldest first."""
    for end in (good, bad):
        if end not in listed:
            raise UsageError(f"{package} {end} is not among the releases (newest: {', '.join(map(str, sorted(listed)[-6:]))})")
    between = sorted(v for v in set(listed) if min(good, bad) <= v <= max(good, bad))
    return [Candidate(str(v), f"{package}=={v}") for v in between]


def _git(clone: Path, *args: str) -> str:
    completed = subprocess.run(["git", "-C", str(clone), *args], capture_output=True, text=True)
    if completed.returncode != 0:
        raise UsageError(f"git {' '.join(args)} in {clone}: {completed.stderr.strip() or completed.returncode}")
    return completed.stdout.strip()


def _is_ancestor(clone: Path, older: str, newer: str) -> bool:
    return subprocess.run(["git", "-C", str(clone), "merge-base", "--is-ancestor", older, newer]).returncode == 0


def git_candidates(package: str, clone: Path, good: str, bad: str) -> tuple[list[Candidate], bool]:
    """The first-parent commits from the older endpoint to the newer one, both included, oldest first,
    each installed from the clone as a dev build (`NAME@git+file://CLONE@SHA`); and whether the good
    endpoint is the newer one."""
    clone = clone.resolve()
    good_sha, bad_sha = (_git(clone, "rev-parse", "--verify", f"{ref}^{{commit}}") for ref in (good, bad))
    if _is_ancestor(clone, good_sha, bad_sha):
        older, newer = good_sha, bad_sha
    elif _is_ancestor(clone, bad_sha, good_sha):
        older, newer = bad_sha, good_sha
    else:
        raise UsageError(f"neither of {good} and {bad} is an ancestor of the other in {clone}")
    shas = [older, *_git(clone, "rev-list", "--reverse", "--first-parent", "--ancestry-path", f"{older}..{newer}").split()]
    return [Candidate(sha[:12], f"{package}@git+file://{clone}@{sha}") for sha in shas], newer == good_sha


def search(count: int, newer_side: Callable[[int], bool | None]) -> tuple[int, int]:
    """Bisect indices 0..count-1, index 0 known to be on the older endpoint's side and count-1 on the
    newer's. newer_side(i) says which side i is on, or None when i is untestable; untestable indices are
    skipped for their nearest untried neighbour. Returns (last older-side index, first newer-side
    index): adjacent, unless every index between them was untestable."""
    older, newer = 0, count - 1
    untestable: set[int] = set()
    while True:
        untried = [i for i in range(older + 1, newer) if i not in untestable]
        if not untried:
            return older, newer
        middle = (older + newer) / 2
        index = min(untried, key=lambda i: (abs(i - middle), i))
        side = newer_side(index)
        if side is None:
            untestable.add(index)
        elif side:
            newer = index
        else:
            older = index


def signature_shape(signature: str | None) -> str:
    """A signature with its numbers blanked: a measured error or an index is not a new signature."""
    return re.sub(r"\d+(\.\d+)?", "#", signature or "")


def observed(cells: list[Cell], signatures: bool = False) -> tuple:
    """What a probe saw, comparable across versions: each test's verdict (`fixed` as `pass`) and bug, and
    with `signatures` its signature shape too."""
    return tuple(sorted((c.test, PASS if c.verdict == FIXED else c.verdict, c.bug or "")
                        + ((signature_shape(c.signature),) if signatures else ()) for c in cells))


def _untestable_reason(cells: list[Cell], expected_tests: set[str] | None) -> str | None:
    if not cells:
        return "no test result recorded (collection failed?)"
    unreached = [c for c in cells if c.verdict in (ERROR, SKIPPED)]
    if unreached:
        return f"{unreached[0].verdict}: {unreached[0].signature or unreached[0].test}"
    if expected_tests is not None and {c.test for c in cells} != expected_tests:
        return "ran other tests than the good endpoint"
    return None


class Bisection:
    """One bisect run: probes candidates through `run_cells` and writes `record` to `output` after each."""

    def __init__(self, candidates: list[Candidate], good_is_newer: bool, run_cells: Callable[[Candidate, int], list[Cell]],
                 record: dict, output: Path | None = None, signatures: bool = False):
        """`run_cells(candidate, run)`: the cells of a probe's run 1, or of its re-run (2), which must really run;
        `signatures`: a changed signature is a flip too (not only a changed verdict or bug)."""
        self.candidates, self.good_is_newer, self.run_cells, self.output = candidates, good_is_newer, run_cells, output
        self.signatures = signatures
        self.good_outcome: tuple | None = None
        self.good_tests: set[str] | None = None
        self.record = dict(record, candidates=[c.label for c in candidates], status="running", answer=None, probes=[], signatures=signatures,
                           direction="first fixed in" if good_is_newer else "first broken in")
        self.started = time.monotonic()
        self._write()

    def _outcome(self, cells: list[Cell]) -> tuple:
        return observed(cells, self.signatures)

    def _write(self) -> None:
        self.record["seconds"] = round(time.monotonic() - self.started, 1)
        if self.output:
            results.write_json(self.output, self.record)

    def _probe(self, candidate: Candidate, run: int) -> Probe:
        started = time.monotonic()
        cells = self.run_cells(candidate, run)
        reason = _untestable_reason(cells, self.good_tests)
        if reason:
            side = UNTESTABLE
        elif self.good_outcome is None or self._outcome(cells) == self.good_outcome:
            side = GOOD
        else:
            side = BAD
        probe = Probe(candidate.label, run, side, cells, reason, round(time.monotonic() - started, 1))
        self.record["probes"].append(probe.to_record())
        self._write()
        print(f"== bisect: {candidate.label} (run {run}): {side}" + (f", {reason}" if reason else ""), flush=True)
        return probe

    def _newer_side(self, index: int) -> bool | None:
        """Which side candidate `index` is on; a flip (newer side) is run again to rule out a flake."""
        candidate = self.candidates[index]
        first = self._probe(candidate, 1)
        if first.side == UNTESTABLE:
            return None
        if (first.side == GOOD) != self.good_is_newer:
            return False
        second = self._probe(candidate, 2)
        if self._outcome(second.cells) != self._outcome(first.cells):
            self.record["probes"][-1].update(side=UNTESTABLE, reason="flaky: its two runs disagree")
            self._write()
            return None
        return True

    def _finish(self, status: str, answer: dict | None = None) -> dict:
        self.record.update(status=status, answer=answer)
        self._write()
        return self.record

    def run(self) -> dict:
        try:
            return self._run()
        except BaseException as exc:  # the probes so far stay on disk, with why the run stopped
            self._finish(f"stopped: {exc.__class__.__name__}: {exc}")
            raise

    def _run(self) -> dict:
        """Verify both endpoints (and re-run the newer, which flips from the older), then search."""
        good, bad = (self.candidates[-1], self.candidates[0]) if self.good_is_newer else (self.candidates[0], self.candidates[-1])
        good_probe = self._probe(good, 1)
        if good_probe.side == UNTESTABLE:
            return self._finish(f"the good endpoint {good.label} is untestable: {good_probe.reason}")
        self.good_outcome, self.good_tests = self._outcome(good_probe.cells), {c.test for c in good_probe.cells}
        bad_probe = self._probe(bad, 1)
        if bad_probe.side == GOOD:
            return self._finish(f"the endpoints do not differ: {bad.label} gives the same verdicts as {good.label}")
        if bad_probe.side == UNTESTABLE:
            return self._finish(f"the bad endpoint {bad.label} is untestable: {bad_probe.reason}")
        newer_first = good_probe if self.good_is_newer else bad_probe
        if self._outcome(self._probe(self.candidates[-1], 2).cells) != self._outcome(newer_first.cells):
            return self._finish(f"the newer endpoint {self.candidates[-1].label} is flaky: its two runs disagree")
        older, newer = search(len(self.candidates), self._newer_side)
        labels = [c.label for c in self.candidates]
        answer = {"first": labels[newer], "last_before": labels[older], "untestable_between": labels[older + 1 : newer]}
        return self._finish("answered" if newer == older + 1 else "ambiguous: the untestable candidates hide the flip", answer)


def summary(record: dict) -> str:
    """The answer and its evidence, as printed at the end of a run."""
    what = record["test"] or f"family {record['family']}"
    lines = [f"bisect {record['package']} on {what}, other libraries from {record['base']}: "
             f"good {record['good']}, bad {record['bad']}, {len(record['candidates'])} candidates"]
    answer = record["answer"]
    if record["status"] == "answered":
        lines.append(f"{record['direction']} {record['package']} {answer['first']} (last before it: {answer['last_before']})")
    elif answer:
        lines.append(f"{record['status']}: {record['direction']} one of {', '.join(answer['untestable_between'] + [answer['first']])}")
    else:
        lines.append(record["status"])
    lines.append(f"{len({p['candidate'] for p in record['probes']})} candidates probed in "
                 f"{len(record['probes'])} runs, {record['seconds']:.0f} s")
    lines.append("candidate     run  side        s  verdicts and signatures")
    for probe in record["probes"]:
        seen = sorted({(c["verdict"], c.get("signature") or "") for c in probe["cells"]})
        text = "; ".join(f"{verdict} {signature}".strip() for verdict, signature in seen) or probe["reason"]
        lines.append(f"{probe['candidate']:<13} {probe['run']:>3}  {probe['side']:<10} {probe['seconds']:>3.0f}  {text}")
    return "\n".join(lines)


def default_output(package: str, family: str, test: str | None) -> Path:
    name = f"{package}-{family}" + (f"-{re.sub(r'[^A-Za-z0-9_.-]+', '_', test.split('::', 1)[1])}" if test else "")
    return REPO_ROOT / "results" / f"bisect-{name}.json"


def run(args) -> int:
    """The `bisect` command: 0 with an answer, 1 without one (endpoints alike, untestable, ambiguous)."""
    package = args.package.lower()
    if package not in PACKAGES:
        raise UsageError(f"unknown package '{args.package}' (known: {', '.join(PACKAGES)})")
    if any(parse_pin(token).package == package for token in args.overrides):
        raise UsageError(f"--with pins {package}, the package being bisected")
    test = lane.family_test(args.test) if args.test else None
    family = test.family if test else args.family
    lane.family_targets([family])  # an unknown family is a usage error
    (base,) = resolve([args.sets or default_set().name])
    if args.git:
        candidates, good_is_newer = git_candidates(package, args.git, args.good, args.bad)
        source = f"first-parent commits of {args.git.resolve()}"
    else:
        good, bad = version_option(args.good, "--good"), version_option(args.bad, "--bad")
        if args.candidates:
            listed, source = [version_option(v, "--candidates") for v in args.candidates.split(",")], "--candidates"
        else:
            listed, source = index_versions(package, pre=args.pre or good.is_prerelease or bad.is_prerelease), "the package index"
        candidates, good_is_newer = release_candidates(package, good, bad, listed), good > bad
    if len(candidates) < 2:
        raise UsageError("--good and --bad name the same candidate")
    record = {"package": package, "family": family, "test": args.test, "base": base.name, "overrides": args.overrides,
              "good": args.good, "bad": args.bad, "source": source,
              "started": datetime.datetime.now().isoformat(timespec="seconds")}
    output = args.output or default_output(package, family, args.test)
    print(f"== bisect {package} over {len(candidates)} candidates from {source}; writing {output}", flush=True)

    store = ProbeStore(args.store or DEFAULT_STORE)
    prober = Prober(store, args.find_links, args.no_index, options=tuple(lane.arch_options(args.arch)))

    def run_cells(candidate: Candidate, run: int) -> list[Cell]:
        (vset,) = resolve([base.name], [*args.overrides, candidate.pin])
        cells = prober.probe(candidate.label, vset, [family], fresh=run > 1).cells  # a flake check runs again
        return [c for c in cells if not test or test.names(c.test)]

    record = Bisection(candidates, good_is_newer, run_cells, record, output).run()
    print(summary(record))
    print(f"wrote {output}")
    return 0 if record["status"] == "answered" else 1
