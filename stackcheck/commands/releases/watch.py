"""`stackcheck watch`: what the newest releases change, found and explained with nobody asking (the
scheduled CI job runs it).

The newest releases against the recorded `latest` set through the gate; for each flipped family, a bisect of each
package that moved; the answers in summary.md and the CI job summary. Every probe goes through the probe store.
Exit code: 1 on a regression, as `gate`; else 0. The steps: docs/internals.md, "commands/releases/watch.py".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from packaging.version import Version

from stackcheck import REPO_ROOT
from stackcheck.commands import gate
from stackcheck.runner import lane
from stackcheck.core import results
from stackcheck.core.cell import Cell
from stackcheck.core.ledger import family_modules
from stackcheck.commands.releases.bisect import Bisection, observed, release_candidates, summary, version_option
from stackcheck.commands.releases.probes import DEFAULT_STORE, Probe, Prober, ProbeStore
from stackcheck.core.versions import LIBRARIES, UsageError, VersionSet, index_versions, resolve

DEFAULT_OUTPUT = REPO_ROOT / "results" / "watch"
LATEST = "latest"


def releases_from(path: Path | None):
    """The index to ask: package -> releases, oldest first; from a JSON file {package: [versions]} when given."""
    if path is None:
        return index_versions

    def listed(package: str) -> list[Version]:
        known = results.read_checked_json(path, _releases_problem, "release list")
        if package not in known:
            raise UsageError(f"{path} lists no releases of {package}")
        return sorted(version_option(v, str(path)) for v in known[package])

    return listed


def _releases_problem(data) -> str | None:
    if not isinstance(data, dict) or not all(isinstance(v, list) and v and all(isinstance(x, str) for x in v) for v in data.values()):
        return "it is not an object of package: [release, ...], each list naming at least one release"
    return None


def as_results(vset: VersionSet, probe: Probe) -> dict:
    """A probe as gate.compare reads a set's results: its cells typed (the probe store keeps them as on disk)."""
    return {"sets": {vset.name: {k: v for k, v in probe.versions.items() if isinstance(v, str)}},
            "cells": list(probe.cells)}


def flipped_families(before: list[Cell], after: list[Cell], families: list[str]) -> dict[str, bool]:
    """Families whose cells differ, each with whether the verdicts or bugs differ (else only a signature)."""
    flips = {}
    for family in families:
        old = [c for c in before if c.family == family]
        new = [c for c in after if c.family == family]
        if observed(old, signatures=True) != observed(new, signatures=True):
            flips[family] = observed(old) != observed(new)
    return flips


def pinned_release(vset: VersionSet, package: str) -> Version:
    """The release a named set pins `package` to (sets.toml pins releases, never URLs)."""
    version = vset.pins[package].version
    assert version is not None, f"set {vset.name} pins {package} to a release"
    return Version(version)


def run(args) -> int:
    (baseline,) = resolve([args.sets or LATEST])
    index = releases_from(args.releases)
    moved = {}
    for package in LIBRARIES:
        newest = index(package)[-1]
        if newest != pinned_release(baseline, package):
            moved[package] = newest
    args.output.mkdir(parents=True, exist_ok=True)
    if not moved:
        return _finish(args.output, f"## stackcheck watch: nothing new\n\nEvery library is at its newest release in `{baseline.name}`.\n", 0)
    lane.check_ledger()
    prober = Prober(ProbeStore(args.store or DEFAULT_STORE), args.find_links, args.no_index)
    (candidate,) = resolve([baseline.name], [f"{p}=={v}" for p, v in moved.items()])
    families = family_modules()
    before, after = (prober.probe(vset.name, vset, families) for vset in (baseline, candidate))
    findings = gate.compare(as_results(baseline, before), as_results(candidate, after))
    text = gate.render_summary(as_results(baseline, before), as_results(candidate, after), findings)
    status = {f.subject: f.status for f in findings if f.check == "families"}
    flips = flipped_families(before.cells, after.cells, families)
    records = []
    for family, verdicts in flips.items():
        for package, newest in moved.items():
            old = pinned_release(baseline, package)
            candidates = release_candidates(package, old, newest, index(package))
            good_is_newer = status.get(family) == gate.IMPROVEMENT

            def run_cells(candidate, run, family=family):  # a flake check (run 2) runs again, never from the store
                return prober.probe(candidate.label, resolve([baseline.name], [candidate.pin])[0], [family], fresh=run > 1).cells

            record: dict[str, Any] = {"package": package, "family": family, "test": None, "base": baseline.name, "overrides": [],
                                      "good": str(newest if good_is_newer else old), "bad": str(old if good_is_newer else newest),
                                      "source": "the package index" if args.releases is None else str(args.releases)}
            output = args.output / f"bisect-{package}-{family}.json"
            records.append(Bisection(candidates, good_is_newer, run_cells, record, output, signatures=not verdicts).run())
    text += render_answers(records)
    regression = any(f.status == gate.REGRESSION for f in findings)
    return _finish(args.output, text, 1 if regression else 0)


def render_answers(records: list[dict]) -> str:
    lines = ["", "## Where each flip comes from", ""]
    if not records:
        return "\n".join(lines + ["No family flipped: nothing to bisect.", ""])
    lines += ["| family | package | compared | answer |", "|---|---|---|---|"]
    for record in records:
        answer = record["answer"]
        found = (f"{record['direction']} {record['package']} {answer['first']} (last before it: {answer['last_before']})"
                 if record["status"] == "answered" else record["status"])
        compared = "signatures" if record.get("signatures") else "verdicts"
        lines.append(f"| {record['family']} | {record['package']} | {compared} | {found} |")
    lines += ["", "<details><summary>bisect evidence</summary>", "", "```"]
    lines += [summary(record) + "\n" for record in records]
    lines += ["```", "", "</details>", ""]
    return "\n".join(lines)


def _finish(output: Path, text: str, code: int) -> int:
    (output / "summary.md").write_text(text)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as handle:
            handle.write(text)
    print(text)
    return code
