"""`stackcheck history`: every release of one package in a range, the other libraries pinned to a base set,
through every family: the compatibility map (results/history-<package>.json, with .md and .png beside it).

Probes go through the store `bisect` and `watch` read too, so a re-run with nothing changed ends in seconds; a
transition is a release whose state (verdict, bug, signature with numbers blanked) differs from the one before it.
How: docs/internals.md, "commands/releases/history.py"; measured sweeps: docs/history-runs.md.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.child import evidence
from stackcheck.runner import envs, lane
from stackcheck.core import results
from stackcheck.core.cell import Cell
from stackcheck.core.ledger import SEVERITY, Bug, Ledger, Verdict, family_modules
from stackcheck.models import architectures
from stackcheck.commands.releases.bisect import Candidate, observed, release_candidates, version_option
from stackcheck.core.progress import Progress
from stackcheck.commands.releases.probes import DEFAULT_STORE, Probe, Prober, ProbeStore
from stackcheck.core.versions import PACKAGES, UsageError, VersionSet, default_set, index_versions, parse_pin, resolve

VERDICT_CODES = {Verdict.NEW_FAILURE: "N", Verdict.ERROR: "E", Verdict.FIXED: "F", Verdict.KNOWN_BUG: "K",
                 Verdict.NOT_AFFECTED: "A", Verdict.PASS: "P", Verdict.SKIPPED: "S",
                 Verdict.NOT_APPLICABLE: "-"}
VERDICT_TRANSITION, SIGNATURE_TRANSITION = "verdict", "signature"
COST_PARTS = ("environment", "startup", "fixtures", "tests", "exit", "total")


@dataclass(frozen=True)
class Transition:
    family: str
    before: str  # the release before
    after: str  # the first release with the new state
    kind: str  # VERDICT_TRANSITION or SIGNATURE_TRANSITION
    old: list[Cell]
    new: list[Cell]


def by_family(cells: list[Cell]) -> dict[str, list[Cell]]:
    families: dict[str, list[Cell]] = {}
    for cell in cells:
        families.setdefault(cell.family, []).append(cell)
    return families


def transitions(rows: list[tuple[str, list[Cell] | None]], families: list[str]) -> list[Transition]:
    """The releases where a family's state changes, from rows of (release, cells or None when not probed),
    oldest first. A release without cells is passed over: the next probed one is compared with the last."""
    found = []
    for family in families:
        last: tuple[str, list[Cell]] | None = None
        for label, cells in rows:
            if cells is None:
                continue
            mine = by_family(cells).get(family, [])
            if last is not None:
                old = last[1]
                if observed(old) != observed(mine):
                    found.append(Transition(family, last[0], label, VERDICT_TRANSITION, old, mine))
                elif observed(old, signatures=True) != observed(mine, signatures=True):
                    found.append(Transition(family, last[0], label, SIGNATURE_TRANSITION, old, mine))
            last = (label, mine)
    return found


def cell_code(cells: list[Cell]) -> str:
    """The verdicts among a family's cells, worst first, as letters (VERDICT_CODES)."""
    present = {c.verdict for c in cells}
    return "/".join(VERDICT_CODES[Verdict(v)] for v in SEVERITY if v in present) or "–"


def render_markdown(sweep: dict, rows: list[tuple[str, Probe | None]], families: list[str]) -> str:
    ledger = Ledger()
    cells_rows = [(label, probe.cells if probe else None) for label, probe in rows]
    found = transitions(cells_rows, families)
    marks = {(t.family, t.after): t.kind for t in found}
    lines = [
        f"# {sweep['package']} releases × families",
        "",
        f"Every {sweep['package']} release from {sweep['from']} to {sweep['to']} ({len(rows)} releases), the other libraries "
        f"from `{sweep['base']}`{' with ' + ', '.join(sweep['overrides']) if sweep['overrides'] else ''}; "
        f"lanes: {', '.join(sweep['lanes'])}; platform: {', '.join(f'{k} {v}' for k, v in sweep['platform'].items())}; "
        f"family definitions {sweep['fingerprint']}.",
        "",
        "Each cell holds the verdicts of the family's tests, worst first: " + ", ".join(f"{code} {verdict}" for verdict, code in VERDICT_CODES.items())
        + ". **Bold**: the verdicts or bugs differ from the release above (bisect's flip); † the signature alone differs.",
        "",
        "| release | " + " | ".join(families) + " |",
        "|---" * (len(families) + 1) + "|",
    ]
    for label, probe in rows:
        if probe is None:
            lines.append(f"| {label} | " + " | ".join("not probed" for _ in families) + " |")
            continue
        mine = by_family(probe.cells)
        codes = []
        for family in families:
            code = cell_code(mine.get(family, []))
            kind = marks.get((family, label))
            codes.append(f"**{code}**" if kind == VERDICT_TRANSITION else f"{code} †" if kind == SIGNATURE_TRANSITION else code)
        lines.append(f"| {label} | " + " | ".join(codes) + " |")
    lines += ["", "## Known bugs", "", "Each known bug of these families, release by release: present (a test fails with it), "
              "absent (one of its tests passes), masked (its tests fail otherwise first), not applicable (the versions predate it, "
              "or its tests do not run here). The map's PNG draws the same.", ""]
    labels = [label for label, _ in rows]
    lines += [f"- `{bug}`: {bug_spans(labels, states)}" for bug, states in bug_rows(rows, families).items()]
    lines += ["", "## Transitions", ""]
    if not found:
        lines += ["No family changes state in this range.", ""]
    for family in families:
        changes = [t for t in found if t.family == family]
        if not changes:
            continue
        title = ledger.families[family].title if family in ledger.families else family
        lines += [f"### {family}", "", title, ""]
        for t in changes:
            lines.append(f"- **{t.before} → {t.after}** ({t.kind}):")
            lines += [f"  - {line}" for line in _cell_changes(t.old, t.new)]
        lines.append("")
    lines += ["## Cost per release (seconds)", "",
              f"This run probed {sum(1 for _, p in rows if p and not p.reused)} releases in {sweep['seconds']:.0f} s on "
              f"{sweep['cores']} cores, up to {sweep['jobs']} at a time with {sweep['threads']} CPU thread"
              f"{'s' if sweep['threads'] > 1 else ''} each, and took {sum(1 for _, p in rows if p and p.reused)} from the store "
              "(each row gives the seconds of the run that probed it).", "",
              "Environment: built or reused (a reused probe costs nothing); start-up: interpreter, imports and collection; "
              "fixtures: tiny checkpoints built; tests: every setup, call and teardown, less the fixtures. "
              "`beside` is how many probes ran at once, sharing the machine's cores.", "",
              "| release | " + " | ".join(COST_PARTS) + " | beside | from |", "|---" * (len(COST_PARTS) + 3) + "|"]
    for label, probe in rows:
        if probe is None:
            continue
        costs = [f"{probe.costs[p]:.1f}" if probe.costs.get(p) is not None else "–" for p in COST_PARTS]
        lines.append(f"| {label} | " + " | ".join(costs) + f" | {probe.concurrent} | {'store' if probe.reused else 'this run'} |")
    return "\n".join(lines) + "\n"


def _cell_changes(old: list[Cell], new: list[Cell]) -> list[str]:
    before = {c.test: c for c in old}
    after = {c.test: c for c in new}
    lines = []
    for test in sorted(before.keys() | after.keys()):
        a, b = before.get(test), after.get(test)
        if a and b and observed([a], signatures=True) == observed([b], signatures=True):
            continue
        name = test.split("::", 1)[-1]
        lines.append(f"`{name}`: {_describe(a)} → {_describe(b)}")
    return lines


def _describe(cell: Cell | None) -> str:
    if cell is None:
        return "absent"
    text = cell.verdict + (f" ({cell.bug})" if cell.bug else "")
    return text + (f" `{cell.signature[:140]}`" if cell.signature else "")


# A known bug at one release, from the cells of the tests the ledger runs it in (see `bug_state`).
BUG_STATES = {"present": "#ff7f0e", "masked": "#7f7f7f", "absent": "#2ca02c", "not applicable": "#f4f4f4"}


def bug_state(bug: Bug, cells: list[Cell], ledger: Ledger, model_types: dict[str, str]) -> str:
    """`present`: a failing cell names the bug; else `absent`: one of its tests passes (on an architecture the bug
    lives on); else `masked`: they fail before telling (an error, another bug, a new failure); else `not applicable`:
    the versions predate it, its tests are skipped here, or none ran."""
    mine = [c for c in cells if c.family in ledger.families
            and bug.lives_on(model_types.get(c.arch) if c.arch else None)  # None: a test that builds no model
            and bug in ledger.families[c.family].bugs_for(c.test.split("::", 1)[-1])]
    if any(c.bug == bug.id and c.verdict in (Verdict.KNOWN_BUG, Verdict.NEW_FAILURE) for c in mine):
        return "present"
    if any(c.verdict in (Verdict.PASS, Verdict.FIXED) for c in mine):
        return "absent"
    if any(c.verdict in (Verdict.ERROR, Verdict.NEW_FAILURE, Verdict.KNOWN_BUG) for c in mine):
        return "masked"
    return "not applicable"


def bug_rows(rows: list[tuple[str, Probe | None]], families: list[str]) -> dict[str, list[str | None]]:
    """Each known bug of the swept families: its state at each release (None where not probed)."""
    ledger = Ledger()
    model_types = {name: arch.model_type for name, arch in architectures.builtin().items()}
    bugs = {bug.id: bug for family in families if family in ledger.families for bug, _ in ledger.families[family].bugs}
    return {bug_id: [bug_state(bug, probe.cells, ledger, model_types) if probe else None for _label, probe in rows]
            for bug_id, bug in bugs.items()}


def bug_spans(labels: list[str], states: list[str | None]) -> str:
    """A bug's states over the releases as runs: `present 5.6.2…5.10.0, absent 5.11.0…5.23.0`."""
    spans: list[list] = []
    for label, state in zip(labels, states):
        if state is None:
            continue
        if spans and spans[-1][0] == state:
            spans[-1][2] = label
        else:
            spans.append([state, label, label])
    return ", ".join(f"{state} {first}" + (f"…{last}" if last != first else "") for state, first, last in spans)


def render_heat_map(sweep: dict, rows: list[tuple[str, Probe | None]], families: list[str], path: Path) -> str | None:
    """The map as a PNG: one row per known bug of the swept families, releases across, coloured by the bug's
    state (BUG_STATES); a black frame where the state differs from the release before, so each fix and each
    regression is a change of colour. Returns a note when it cannot draw."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: wrote the map without its PNG (pip install 'stackcheck[bench]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch, Rectangle

    states = bug_rows(rows, families)
    bugs = list(states)
    grid = [[to_rgb(BUG_STATES[state]) if state else (1, 1, 1) for state in states[bug]] for bug in bugs]
    figure, axes = plt.subplots(figsize=(max(6.0, 0.42 * len(rows) + 3.5), 0.32 * len(bugs) + 2.2))
    axes.imshow(grid, aspect="auto", interpolation="nearest")
    for y, bug in enumerate(bugs):
        probed = [(x, state) for x, state in enumerate(states[bug]) if state]
        for (_, before), (x, state) in zip(probed, probed[1:]):
            if state != before:
                axes.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2))
    axes.set_xticks(range(len(rows)), [label for label, _ in rows], rotation=90, fontsize=8)
    axes.set_yticks(range(len(bugs)), bugs, fontsize=8)
    axes.set_title(f"{sweep['package']} {sweep['from']}…{sweep['to']}, other libraries from {sweep['base']} "
                   f"({', '.join(sweep['lanes'])} lane{'s' if len(sweep['lanes']) > 1 else ''}): each known bug per release", fontsize=9)
    legend = [Patch(color=colour, label=state) for state, colour in BUG_STATES.items()]
    legend += [Patch(facecolor="white", edgecolor="black", linewidth=2, label="state changes here")]
    axes.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


def default_jobs() -> int:
    """Probes side by side: one per core, each on one CPU thread. Measured on 2 cores, 4 releases: one at a
    time 23.8 s per release, two at a time with one thread each 13.1 s, two with torch's default threads
    (oversubscribed) slower still (docs/history-runs.md)."""
    return os.cpu_count() or 1


def releases_in_range(package: str, start: str, end: str, candidates: str | None = None, pre: bool = False) -> list[str]:
    """The releases from `start` to `end`, both included, oldest first: from the package index, or from a
    comma-separated `candidates` list."""
    first, last = version_option(start, "--from"), version_option(end, "--to")
    if first > last:
        raise UsageError(f"--from {first} is newer than --to {last}")
    listed = ([version_option(v, "--candidates") for v in candidates.split(",")] if candidates
              else index_versions(package, pre=pre or first.is_prerelease or last.is_prerelease))
    return [c.label for c in release_candidates(package, first, last, listed)]


def default_output(package: str) -> Path:
    return REPO_ROOT / "results" / f"history-{package}.json"


def map_record(sweep: dict, rows: list[tuple[str, Probe | None]]) -> dict:
    """The map as JSON: the sweep, each release's probe (None: not probed) and the transitions."""
    releases = [{"release": label, "probe": dict(asdict(probe), cells=[c.to_dict() for c in probe.cells]) if probe else None}
                for label, probe in rows]
    found = transitions([(label, probe.cells if probe else None) for label, probe in rows], sweep["families"])
    return {"sweep": sweep, "releases": releases, "transitions": [asdict(t) for t in found]}


def rows_of(record: dict, ledger: Ledger | None = None) -> list[tuple[str, Probe | None]]:
    """The map's releases and probes, each cell judged again under today's ledger from its evidence (a cell
    recorded without it keeps its verdict): a ledger change redraws the map without a probe."""
    ledger = ledger or Ledger()
    rows: list[tuple[str, Probe | None]] = []
    for r in record["releases"]:
        stored = r["probe"]
        if not stored:
            rows.append((r["release"], None))
            continue
        versions = stored.get("versions") or {}
        cells = [evidence.rejudge(Cell.from_dict(c), ledger, versions) for c in stored["cells"]]
        rows.append((r["release"], Probe(**dict(stored, cells=cells))))
    return rows


def _map_problem(data) -> str | None:
    if not isinstance(data, dict) or not {"sweep", "releases"} <= data.keys():
        return "it has no `sweep` and `releases`"
    return None


def render(record: dict, output: Path, rows: list[tuple[str, Probe | None]] | None = None) -> str | None:
    """Write the map's JSON, Markdown and PNG, its cells judged under today's ledger (`rows`: judged already); a note
    when the PNG could not be drawn."""
    rows, sweep = rows if rows is not None else rows_of(record), record["sweep"]
    results.write_json(output, map_record(sweep, rows))
    output.with_suffix(".md").write_text(render_markdown(sweep, rows, sweep["families"]))
    return render_heat_map(sweep, rows, sweep["families"], output.with_suffix(".png"))


def run(args) -> int:
    """The `history` command: 0 when every release in the range has a probe, 1 otherwise."""
    package = args.package.lower()
    output = args.output or default_output(package)
    if args.render_only:
        record = results.read_checked_json(output, _map_problem, "history map")
        note = render(record, output)
        print(f"stackcheck: {note}" if note else f"wrote {output.with_suffix('.md')} and {output.with_suffix('.png')}")
        return 0
    if package not in PACKAGES:
        raise UsageError(f"unknown package '{args.package}' (known: {', '.join(PACKAGES)})")
    if not (args.start and args.end):
        raise UsageError("--from and --to name the range to sweep")
    if any(parse_pin(token).package == package for token in args.overrides):
        raise UsageError(f"--with pins {package}, the package being swept")
    families = [f for f in (args.families or "").split(",") if f] or family_modules()
    lane.family_targets(families)  # an unknown family is a usage error
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: at least one probe must run")
    lanes = ("gpu", "cpu") if args.gpu else ("cpu",)
    (base,) = resolve([args.sets or default_set().name], args.overrides)
    candidates = [Candidate(release, f"{package}=={release}") for release in releases_in_range(package, args.start, args.end, args.candidates, args.pre)]
    lane.check_ledger()
    jobs = args.jobs or default_jobs()
    threads = max(1, (os.cpu_count() or 1) // jobs)
    prober = Prober(ProbeStore(args.store or DEFAULT_STORE), args.find_links, args.no_index, lanes, threads,
                    tuple(lane.arch_options(args.arch)))
    sets = {c.label: resolve([base.name], [c.pin])[0] for c in candidates}
    sweep = {"package": package, "from": candidates[0].label, "to": candidates[-1].label, "base": base.name, "overrides": args.overrides,
             "families": families, "lanes": list(lanes), "platform": prober.key(sets[candidates[0].label])["platform"],
             "fingerprint": results.fingerprint(), "jobs": jobs, "threads": threads, "cores": os.cpu_count()}
    started = time.monotonic()
    rows = sweep_releases(prober, sets, families, jobs)
    sweep["seconds"] = round(time.monotonic() - started, 1)
    note = render(map_record(sweep, rows), output)
    missing = [label for label, probe in rows if probe is None]
    ran = sum(1 for _label, probe in rows if probe and not probe.reused)
    print(f"== history: {len(rows)} releases ({ran} run, {len(rows) - ran - len(missing)} from the store) in {sweep['seconds']:.0f} s")
    print(f"wrote {output}, {output.with_suffix('.md')}" + (f"; {note}" if note else f" and {output.with_suffix('.png')}"))
    if missing:
        print(f"stackcheck: releases without a probe: {', '.join(missing)}", file=sys.stderr)
    return 1 if missing else 0


def sweep_releases(prober: Prober, sets: dict[str, VersionSet], families: list[str], jobs: int) -> list[tuple[str, Probe | None]]:
    """Every release's probe, oldest first: from the store, or run with `jobs` at once while the next
    environments build. On an interruption the probes in flight are stopped and not stored (their cells were cut
    short: `signals.call` raises in their threads too), and the queued ones are dropped."""
    found: dict[str, Probe | None] = {label: stored for label, vset in sets.items() if (stored := prober.stored(label, vset, families))}
    todo = [label for label in sets if label not in found]
    print(f"== history: {len(sets)} releases, {len(found)} from the store, {len(todo)} to run, "
          f"{min(jobs, len(todo))} at a time", flush=True)
    if not todo:
        return [(label, found.get(label)) for label in sets]
    started = time.monotonic()
    tracker = Progress("history", len(todo), "probe")
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="build") as builders, \
            ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="probe") as probers:
        built = {label: builders.submit(_build_timed, prober, sets[label]) for label in todo}

        def probe(label: str) -> Probe | None:
            try:
                environment = built[label].result()
            except envs.EnvBuildError as exc:
                print(f"stackcheck: {label}: environment not built: {exc}", flush=True)
                environment = None
            result = prober.probe(label, sets[label], families, concurrent=min(jobs, len(todo)), environment=environment,
                                  env=tracker.env(live=jobs == 1))  # probes side by side would share one terminal line
            print(f"== history: {label} {'done' if result.built else 'not probed'} ({time.monotonic() - started:.0f} s into the sweep)", flush=True)
            tracker.finished(label, len(result.cells))
            return result if result.built else None  # a release whose wheels have not arrived is not in the map yet

        futures = [probers.submit(probe, label) for label in todo]
        try:
            for label, future in zip(todo, futures):
                found[label] = future.result()
        except BaseException:
            for pool in (probers, builders):
                pool.shutdown(wait=True, cancel_futures=True)
            raise
    return [(label, found.get(label)) for label in sets]


def _build_timed(prober: Prober, vset: VersionSet) -> float:
    started = time.monotonic()
    prober.build(vset)
    return time.monotonic() - started
