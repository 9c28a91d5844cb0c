"""`stackcheck backtest`: every release of each library in stackcheck/backtest.toml, pinned alone on its base set,
through the families its releases can change (history's sweep and probe store, so it resumes and a ledger change
re-runs nothing), then one page: each library's map (family × release) and the disposition of every cell that does
not pass. A cell no ledger entry explains inside its measured range (`fixed`, `new_failure`, `error`) is open until it
is researched into the ledger; the command exits 1 while any is. How: docs/internals.md, "commands/releases/backtest.py".
"""

from __future__ import annotations

import os
import re
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from stackcheck import REPO_ROOT
from stackcheck.commands.releases import history, watch
from stackcheck.commands.releases.probes import DEFAULT_STORE, Prober, ProbeStore
from stackcheck.core import results
from stackcheck.core.cell import Cell
from stackcheck.core.ledger import FIXED, NEW_FAILURE, ERROR, KNOWN_BUG, NOT_AFFECTED, NOT_APPLICABLE, PASS, SKIPPED, Bug, Ledger, family_modules
from stackcheck.core.versions import PACKAGES, UsageError, resolve
from stackcheck.runner import lane

PLAN = REPO_ROOT / "stackcheck" / "backtest.toml"
DEFAULT_OUTPUT = REPO_ROOT / "results" / "backtest.json"
OPEN = (NEW_FAILURE, ERROR, FIXED)  # verdicts the backtest leaves open until the ledger explains them
UNUSABLE = "unusable"  # the page's word for a release one of whose libraries does not import with its base set
UNUSABLE_PREFIX = f"{lane.UNUSABLE_SIGNATURE}: "  # the signature of such a release's one cell per family
# How each verdict's cells are disposed of, in the page's order.
DISPOSED = (KNOWN_BUG, NOT_AFFECTED, NOT_APPLICABLE, SKIPPED)


@dataclass(frozen=True)
class Library:
    name: str
    start: str
    end: str
    base: str
    families: tuple[str, ...] | None  # None: every family
    variables: tuple[tuple[str, str], ...] = ()  # STACKCHECK_ variables of its probes
    leave_out: tuple[str, ...] = ()  # families of "all" this sweep leaves out (the plan says why)
    only: tuple[str, ...] = ()  # the releases of the range it sweeps, where not every one (the plan says why)
    arch: tuple[str, ...] = ()  # its architectures, where not the plan's

    def family_list(self) -> list[str]:
        chosen = list(self.families) if self.families is not None else family_modules()
        return [f for f in chosen if f not in self.leave_out]


def load_plan(path: Path = PLAN) -> tuple[list[Library], list[str]]:
    """The plan's libraries, in its order, and the architectures of every sweep."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"backtest plan {path}: {exc}") from None
    libraries = []
    for name, entry in data.get("libraries", {}).items():
        if name not in PACKAGES:
            raise UsageError(f"backtest plan: unknown library '{name}' (known: {', '.join(PACKAGES)})")
        families = entry.get("families", "all")
        variables = entry.get("variables", {})
        if not all(key.startswith("STACKCHECK_") for key in variables):
            raise UsageError(f"backtest plan: {name}.variables may set STACKCHECK_ variables alone")
        libraries.append(Library(name, entry["from"], entry["to"], entry.get("base", "seed"),
                                 None if families == "all" else tuple(families), tuple(sorted(variables.items())),
                                 tuple(entry.get("leave_out", ())), tuple(entry.get("only", ())), tuple(entry.get("arch", ()))))
    return libraries, list(data.get("arch", []))


def map_path(folder: Path, library: str, lanes: tuple[str, ...] = ("cpu",)) -> Path:
    """A library's map: history-<library>.json for the CPU lane (history's own name), history-<library>-gpu.json for
    the GPU lane alone, history-<library>-gpu-cpu.json for both."""
    return folder / (f"history-{library}.json" if lanes == ("cpu",) else f"history-{library}-{'-'.join(lanes)}.json")


def lanes_of(text: str | None) -> tuple[str, ...]:
    """--lanes: `cpu` (the default), `gpu`, or both, in the order gpu, cpu."""
    chosen = set((text or "cpu").split(","))
    if not chosen <= {"gpu", "cpu"}:
        raise UsageError(f"--lanes {text}: name gpu, cpu or both")
    return tuple(lane_name for lane_name in ("gpu", "cpu") if lane_name in chosen)


def sweep_library(library: Library, arch: str | None, store: ProbeStore, args) -> dict:
    """Run (or take from the store) every release of `library` and write its history map beside the output."""
    families = library.family_list()
    lane.family_targets(families)  # an unknown family is a usage error
    lanes = lanes_of(args.lanes)
    listed = [str(v) for v in watch.releases_from(args.releases)(library.name)] if args.releases else None
    if library.only:
        listed = [v for v in listed or library.only if v in library.only]
    start, end = library.start, library.end
    if listed:  # an offline host's list may hold a part of the range only
        ordered = sorted(listed, key=Version)
        start, end = max(start, ordered[0], key=Version), min(end, ordered[-1], key=Version)
    releases = history.releases_in_range(library.name, start, end, ",".join(listed) if listed else None)
    jobs = args.jobs or history.default_jobs()
    threads = max(1, (os.cpu_count() or 1) // jobs)
    prober = Prober(store, args.find_links, args.no_index, lanes, threads, tuple(lane.arch_options(arch)), dict(library.variables))
    sets = {release: resolve([library.base], [f"{library.name}=={release}"])[0] for release in releases}
    sweep = {"package": library.name, "from": releases[0], "to": releases[-1], "base": library.base, "overrides": [],
             "arch": [a for a in (arch or "").split(",") if a],
             "families": families, "lanes": list(lanes), "platform": prober.key(sets[releases[0]])["platform"],
             "fingerprint": results.fingerprint(), "jobs": jobs, "threads": threads, "cores": os.cpu_count()}
    started = time.monotonic()
    rows = history.sweep_releases(prober, sets, families, jobs)
    sweep["seconds"] = round(time.monotonic() - started, 1)
    path = map_path(args.maps, library.name, lanes)
    earlier = results.read_checked_json(path, history._map_problem, "history map") if path.exists() else None
    record = merged(earlier, history.map_record(sweep, rows))
    results.write_json(path, record)  # at once: a later library's crash keeps it
    return record


# What two sweeps of a library must share for one map to hold the releases of both.
SHAPE = ("package", "base", "overrides", "families", "lanes", "arch", "platform")


def shape(record: dict) -> dict:
    """SHAPE's values of a map; its architectures read from its cells where the sweep predates recording them."""
    return {key: record["sweep"].get(key) for key in SHAPE if key != "arch"} | {"arch": sorted(architectures_of(record))}


def merged(earlier: dict | None, record: dict) -> dict:
    """This sweep's map, with the releases that an earlier sweep of the same shape (SHAPE) probed and this one did
    not: a map grows over sessions and `--releases` lists. Each release keeps the digest of the family definitions it
    ran under (the page says when they differ); a sweep of another shape replaces the map."""
    if earlier is None or shape(earlier) != shape(record):
        return record
    fresh = {r["release"] for r in record["releases"] if r["probe"]}
    kept = [r for r in earlier["releases"] if r["probe"] and r["release"] not in fresh]
    for r in kept:
        r["probe"]["definitions"] = r["probe"].get("definitions") or earlier["sweep"].get("fingerprint")
    held = {r["release"] for r in kept}
    releases = sorted([*kept, *(r for r in record["releases"] if r["probe"] or r["release"] not in held)],
                      key=lambda r: Version(r["release"]))
    sweep = dict(record["sweep"], **{"from": releases[0]["release"], "to": releases[-1]["release"],
                                     "seconds": round(record["sweep"].get("seconds", 0) + earlier["sweep"].get("seconds", 0), 1)})
    return history.map_record(sweep, history.rows_of({"sweep": sweep, "releases": releases}))


# ------------------------------------------------------------------------------------------------------ the page

_NUMBERS = re.compile(r"\d+(\.\d+)?(e-?\d+)?")
_PATHS = re.compile(r" ?\((?:/|[A-Za-z]:\\)[^)]*\)|(?:/[\w.+-]+)+/")  # a file's place on the machine that ran it


def unusable_reason(cell: Cell) -> str:
    """Why a release's set did not import, without the machine's paths."""
    return _PATHS.sub("", (cell.signature or "").removeprefix(UNUSABLE_PREFIX))


def reason_of(cell: Cell) -> str:
    """What groups a cell with others of its kind: its bug, else its note or signature with numbers blanked."""
    if cell.verdict == KNOWN_BUG:
        return cell.bug or ""
    text = cell.signature if cell.verdict in OPEN and cell.signature else (cell.note or cell.signature or "")
    text = text.split("\n", 1)[0]
    return _NUMBERS.sub("#", text)[:220]


def spans(labels: list[str], present: set[str]) -> str:
    """Releases of `labels` (oldest first) in `present`, as runs: `5.0.0…5.4.0, 5.6.2`."""
    runs: list[list[str]] = []
    previous_in = False
    for label in labels:
        if label in present:
            if previous_in:
                runs[-1][1] = label
            else:
                runs.append([label, label])
        previous_in = label in present
    return ", ".join(first if first == last else f"{first}…{last}" for first, last in runs)


def dispositions(record: dict, ledger: Ledger, rows: list | None = None) -> list[dict]:
    """Every cell that does not pass in one library's map, grouped by verdict, family and reason, with the releases
    it shows on and what disposes of it (`open`: nothing yet). `rows`: the map's rows judged under `ledger` already."""
    rows = rows if rows is not None else history.rows_of(record, ledger)
    labels = [label for label, _ in rows]
    groups: dict[tuple[str, str, str], dict] = {}
    for label, probe in rows:
        for cell in probe.cells if probe else []:
            if cell.verdict == PASS:
                continue
            unusable = (cell.signature or "").startswith(UNUSABLE_PREFIX)
            verdict = UNUSABLE if unusable else cell.verdict
            # An unusable release is one row, whatever the families: its reason is the set's, not a family's.
            key = (verdict, "every family", unusable_reason(cell)) if unusable else (verdict, cell.family, reason_of(cell))
            group = groups.setdefault(key, {"verdict": verdict, "family": key[1], "reason": key[2], "bug": cell.bug,
                                            "releases": set(), "cells": 0, "arch": set(), "example": cell})
            group["releases"].add(label)
            group["cells"] += 1
            if cell.arch:
                group["arch"].add(cell.arch)
    found = []
    for group in groups.values():
        group["span"] = spans(labels, group.pop("releases"))
        group["arch"] = sorted(group["arch"])
        group["disposition"] = disposition(group, ledger)
        group["open"] = group["verdict"] in OPEN
        found.append(group)
    order = {verdict: index for index, verdict in enumerate([*OPEN, UNUSABLE, *DISPOSED])}
    found.sort(key=lambda g: (order.get(g["verdict"], 99), g["family"], g["reason"]))
    return found


def disposition(group: dict, ledger: Ledger) -> str:
    verdict, bug = group["verdict"], ledger.bugs.get(group["bug"] or "")
    if verdict == KNOWN_BUG:
        if bug is None:
            return f"known bug {group['bug']}, which this ledger no longer lists"
        evidence = "; ".join(f"`{bound}` {kind}" for bound, kind in bound_kinds(bug))
        return f"known bug inside its range ({bug.describe_range()}){': ' + evidence if evidence else ''}"
    if verdict == UNUSABLE:
        return "the release does not import with its base set: one line for the set, its cells not run"
    if verdict in (NOT_AFFECTED, NOT_APPLICABLE, SKIPPED):
        return {NOT_AFFECTED: "the release predates the API or the bug", NOT_APPLICABLE: "the architecture lacks the structure",
                SKIPPED: "not run on this lane or host"}[verdict]
    example: Cell = group["example"]
    return f"open: {example.note or 'no ledger entry explains it'}"


def bound_kinds(bug: Bug) -> list[tuple[str, str]]:
    """Each bound of the bug's range and the kind of its evidence: measured, with a reason, or awaiting the sweep."""
    words = {"measured": "measured", "reason": "with a reason", "awaits": "awaiting the sweep"}
    return [(bound, words[proof.state]) for bound, proof in bug.bounds.items()]


CODE_ORDER = (NEW_FAILURE, ERROR, FIXED, KNOWN_BUG, NOT_AFFECTED, PASS, SKIPPED, NOT_APPLICABLE)


def family_spans(record: dict, ledger: Ledger, rows: list | None = None) -> list[tuple[str, str]]:
    """Each family's states over the releases as runs of the same verdict codes (history's letters)."""
    rows = rows if rows is not None else history.rows_of(record, ledger)
    found = []
    for family in record["sweep"]["families"]:
        runs: list[list[str]] = []
        for label, probe in rows:
            if probe is None:
                continue
            code = history.cell_code([c for c in probe.cells if c.family == family])
            if runs and runs[-1][0] == code:
                runs[-1][2] = label
            else:
                runs.append([code, label, label])
        found.append((family, ", ".join(f"{code} {first}" + (f"…{last}" if last != first else "") for code, first, last in runs)))
    return found


def architectures_of(record: dict) -> list[str]:
    """The architectures a map's cells were built on (its sweep's, where it names them)."""
    return record["sweep"].get("arch") or sorted({c["arch"] for r in record["releases"] if r["probe"] for c in r["probe"]["cells"] if c.get("arch")})


def definitions_note(record: dict) -> str:
    """Where a map's releases ran under more than one version of the family definitions (sweeps of several sessions),
    which ran under which: a verdict is the definitions' as much as the release's."""
    by: dict[str, list[str]] = {}
    for r in record["releases"]:
        if r["probe"]:
            by.setdefault(r["probe"].get("definitions") or record["sweep"].get("fingerprint") or "?", []).append(r["release"])
    if len(by) < 2:
        return ""
    return " Family definitions (digests) by release: " + "; ".join(f"`{digest}` {spans([r['release'] for r in record['releases']], set(labels))}"
                                                               for digest, labels in by.items()) + "."


def render_markdown(records: list[dict], ledger: Ledger, arch: str | None, judged: list | None = None) -> str:
    """The page; `judged`: each record's rows judged under `ledger` already (judging 30,000 cells takes seconds)."""
    judged = judged or [history.rows_of(record, ledger) for record in records]
    letters = ", ".join(f"{code} {verdict}" for verdict, code in history.VERDICT_CODES.items())
    lines = ["# The backtest: every release of the stack's libraries", "",
             "Generated by `python -m stackcheck backtest` from the plan in `stackcheck/backtest.toml`: each library's releases "
             "pinned alone on its base set, judged under the ledger of this checkout (a cell that does not pass is open until "
             "the ledger explains it; `fixed` and a `new_failure` naming a known bug are open too). "
             f"Letters: {letters}.", ""]
    summary = ["| library | releases | base | lanes | architectures | families | cells | fixed | new_failure naming a known bug | open |",
               "|---|---|---|---|---|---|---|---|---|---|"]
    sections = []
    for record, rows in zip(records, judged):
        sweep = record["sweep"]
        groups = dispositions(record, ledger, rows)
        probed = [r for r in record["releases"] if r["probe"]]
        cells = sum(len(r["probe"]["cells"]) for r in probed)
        opened = sum(g["cells"] for g in groups if g["open"])
        fixed = sum(g["cells"] for g in groups if g["verdict"] == FIXED)
        named = sum(g["cells"] for g in groups if g["verdict"] == NEW_FAILURE and g["bug"])
        arch_text = ", ".join(architectures_of(record)) or "–"
        summary.append(f"| {sweep['package']} | {sweep['from']}…{sweep['to']} ({len(probed)} probed) | "
                       f"{sweep['base']} | {', '.join(sweep['lanes'])} | {arch_text} | {len(sweep['families'])} | {cells} | {fixed} | {named} | {opened} |")
        sections += [f"## {sweep['package']}", "",
                     f"{sweep['package']} {sweep['from']} to {sweep['to']} on `{sweep['base']}`, lanes {', '.join(sweep['lanes'])}, "
                     f"platform {', '.join(f'{k} {v}' for k, v in sweep['platform'].items())}; architectures "
                     f"{', '.join(architectures_of(record)) or '–'}; releases {', '.join(r['release'] for r in record['releases'] if r['probe'])}."
                     f"{definitions_note(record)}", "",
                     "### Map (each family's verdict letters, worst first, as runs of releases)", "",
                     "| family | releases |", "|---|---|"]
        sections += [f"| {family} | {text} |" for family, text in family_spans(record, ledger, rows)]
        sections += ["", "### Every cell that does not pass", "",
                     "| verdict | family | cells | releases | architectures | bug or reason | disposition |", "|---|---|---|---|---|---|---|"]
        for group in groups:
            reason = f"`{group['bug']}`" if group["verdict"] == KNOWN_BUG else group["reason"].replace("|", "\\|")
            sections.append(f"| {'**' + group['verdict'] + '**' if group['open'] else group['verdict']} | {group['family']} | "
                            f"{group['cells']} | {group['span']} | {', '.join(group['arch']) or '–'} | {reason} | "
                            f"{group['disposition'].replace('|', '/')} |")
        sections.append("")
    return "\n".join(lines + summary + [""] + sections)


def page_record(records: list[dict], ledger: Ledger, judged: list | None = None) -> dict:
    """The backtest as JSON: per library its sweep, each family's runs and the dispositions (cells dropped)."""
    out = []
    for record, rows in zip(records, judged or [history.rows_of(record, ledger) for record in records]):
        groups = [{**{k: v for k, v in g.items() if k != "example"}, "test": g["example"].test, "set": g["example"].set_name}
                  for g in dispositions(record, ledger, rows)]
        out.append({"sweep": record["sweep"], "releases": [r["release"] for r in record["releases"]],
                    "probed": [r["release"] for r in record["releases"] if r["probe"]],
                    "families": dict(family_spans(record, ledger, rows)), "dispositions": groups})
    return {"libraries": out}


def run(args) -> int:
    """The `backtest` command: 0 when every cell that does not pass is disposed of, 1 while any is open."""
    libraries, plan_arch = load_plan(args.plan or PLAN)
    if args.libraries:
        chosen = args.libraries.split(",")
        unknown = set(chosen) - {lib.name for lib in libraries}
        if unknown:
            raise UsageError(f"--libraries: {', '.join(sorted(unknown))} not in the plan ({', '.join(lib.name for lib in libraries)})")
        libraries = [lib for lib in libraries if lib.name in chosen]
    arch = args.arch or ",".join(plan_arch) or None
    output: Path = args.output
    output.parent.mkdir(parents=True, exist_ok=True)
    records = []
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: at least one probe must run")
    if args.render_only:
        for library in libraries:
            for lanes in (("cpu",), ("gpu",), ("gpu", "cpu")):
                path = map_path(args.maps, library.name, lanes)
                if path.exists():
                    records.append(results.read_checked_json(path, history._map_problem, "history map"))
    else:
        lane.check_ledger()
        store = ProbeStore(args.store or DEFAULT_STORE)
        for library in libraries:
            print(f"== backtest: {library.name} {library.start}…{library.end} on {library.base}", flush=True)
            records.append(sweep_library(library, args.arch or ",".join(library.arch) or arch, store, args))
    if not records:
        raise UsageError(f"no history maps in {args.maps} to draw (run `backtest` without --render-only first)")
    ledger = Ledger()
    judged = [history.rows_of(record, ledger) for record in records]  # each map judged once, under this ledger
    for record, rows in zip(records, judged):
        history.render(record, map_path(args.maps, record["sweep"]["package"], tuple(record["sweep"]["lanes"])), rows)
    results.write_json(output, page_record(records, ledger, judged))
    output.with_suffix(".md").write_text(render_markdown(records, ledger, arch, judged))
    opened = sum(g["cells"] for record, rows in zip(records, judged) for g in dispositions(record, ledger, rows) if g["open"])
    print(f"wrote {output} and {output.with_suffix('.md')}: {len(records)} libraries, {opened} cells open")
    if opened:
        print(f"stackcheck: {opened} cells are open (new_failure, error or fixed no ledger entry explains): see the page", file=sys.stderr)
    return 1 if opened else 0


