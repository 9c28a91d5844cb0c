"""`stackcheck report`: one self-contained HTML page from the results it is given, for someone deciding whether an
upgrade may land. Its first view fits one screen for a full run: what upgrading changes, then a family x (set, lane)
grid whose squares are strips of one tiny cell per architecture (the worst verdict there), with filters kept in the
URL. Below: each cell's tests with their upstream bug, ledger entry and repro command, the history sweeps as one heat
map per package with each known bug's first bad and first fixed release, and the bench as plots.

It reads results files (stackcheck.core.results, stackcheck.commands.releases.history, stackcheck.bench.compare check their shape)
and the checkout's ledger; it imports no library under test. The page is rendered with jinja2 and its plots with
plotly, whose JavaScript is inlined once: nothing is fetched when the page is viewed. Both come with the `report`
extra (`pip install -e '.[report]'`); `nox -s report` installs them in a session of its own.
"""

from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.runner import inputs
from stackcheck.core import results
from stackcheck.core.cell import NOT_RUN
from stackcheck.core.ledger import SEVERITY, Ledger
from stackcheck.core.versions import PACKAGES, UsageError, load_sets

RESULTS_DIR = REPO_ROOT / "results"
DEFAULT_OUTPUT = RESULTS_DIR / "report.html"
INSTALL_HINT = "pip install -e '.[report]' (or run `nox -s report`, which installs them itself)"

# Verdict colours: red for what a gate fails on, orange for known bugs, green for passes, greys for the rest.
VERDICT_COLOURS = {
    "new_failure": "#d62728", "error": "#8c1c13", "fixed": "#9467bd", "known_bug": "#ff7f0e", "not_affected": "#bcd9a3",
    "pass": "#2ca02c", "skipped": "#c7c7c7", "not_applicable": "#ececec", NOT_RUN: "#cfe0f3",
}
# The page's verdicts, worst first: the ledger's, then a cell the run never reached (no verdict on record, docs/results.md).
PAGE_VERDICTS = [*SEVERITY, NOT_RUN]
VERDICT_WORDS = {
    "new_failure": "a failure no ledger entry explains: a regression, or a bug nobody has filed yet",
    "error": "the test could not reach its scenario, its setup broke, or the cell was lost",
    "fixed": "passes where the ledger expects a bug: the bug is fixed on these versions and the ledger is stale",
    "known_bug": "fails with a bug the ledger names, on versions inside its affected range",
    "not_affected": "the versions predate the bug, so its scenario does not exist",
    "pass": "the scenario was reached and the property holds",
    "skipped": "did not run here (no GPU, a CPU without the code path, ...), with the reason",
    "not_applicable": "the architecture lacks the structure the scenario needs",
    NOT_RUN: "not run: the run stopped before this cell (Ctrl-C, a signal, -x), and no earlier verdict is on record; never an error",
}


# ---------------------------------------------------------------------------------------------- reading the inputs

def add_arguments(parser) -> None:
    """The `report` command's options (stackcheck.cli adds the command)."""
    parser.add_argument("--matrix", action="append", type=Path, metavar="JSON",
                        help="a matrix.json (repeat to merge several; default: results/matrix.json if it exists)")
    parser.add_argument("--history", action="append", type=Path, metavar="JSON",
                        help="a history sweep's json (repeatable; default: results/history-*.json)")
    parser.add_argument("--bench", action="append", type=Path, metavar="PATH",
                        help="a bench folder of <set>.json or one such file (repeatable; default: results/bench/ if it has any)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="HTML",
                        help="the page to write (default: results/report.html)")


def gather(args) -> tuple[dict, list[tuple[str, dict]], dict[str, dict]]:
    """(the merged matrix, [(name, history record)], {set: bench run}) from the options, or from results/ when none
    names an input. A named file that is missing or not of its kind is a usage error."""
    from stackcheck.bench import compare as bench_compare
    from stackcheck.commands.releases import history

    named = args.matrix or args.history or args.bench
    matrix_files = [Path(p) for p in args.matrix or []] or ([] if named else [p for p in [RESULTS_DIR / "matrix.json"] if p.is_file()])
    history_files = [Path(p) for p in args.history or []] or ([] if named else sorted(RESULTS_DIR.glob("history-*.json")))
    bench_paths = [Path(p) for p in args.bench or []] or ([] if named else [p for p in [RESULTS_DIR / "bench"] if p.is_dir()])
    matrix = results.empty()
    for path in matrix_files:
        data = results.load_checked(inputs.existing_file("--matrix", path.expanduser().resolve()))
        data.setdefault("fingerprint", None)
        if matrix["cells"] or matrix["sets"]:
            matrix["fingerprint"] = data["fingerprint"]  # a page may show results of several checkouts side by side
        try:
            results.merge_into(matrix, data)
        except ValueError as exc:
            raise UsageError(f"--matrix {path}: {exc}") from None
    sweeps = []
    for path in history_files:
        path = inputs.existing_file("--history", path.expanduser().resolve())
        sweeps.append((path.stem, results.read_checked_json(path, history._map_problem, "history map")))
    bench: dict[str, dict] = {}
    for path in bench_paths:
        path = path.expanduser().resolve()
        if path.is_dir():
            files = sorted(path.glob("*.json"))
        else:
            files = [inputs.existing_file("--bench", path)]
        for file in files:
            run = bench_compare.load(file)
            bench[run.get("stackcheck", {}).get("set") or file.stem] = run
    if not (matrix["cells"] or sweeps or bench):
        where = "the files named" if named else f"{RESULTS_DIR} (no matrix.json, history-*.json or bench/)"
        raise UsageError(f"report: nothing to show in {where}: run `nox -s matrix` first, or name files with --matrix, --history, --bench")
    return matrix, sweeps, bench


# ------------------------------------------------------------------------------------------------------ the model

def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-")


def set_order(names) -> list[str]:
    try:
        declared = list(load_sets()[0])
    except UsageError:
        declared = []
    return sorted(names, key=lambda name: (declared.index(name.split("+", 1)[0]) if name.split("+", 1)[0] in declared else len(declared), name))


# A set's name is its base set and the pins added with --with (`seed+accelerate==1.14.0`), as versions.resolve names it.
ADDED_PIN = re.compile(r"\+(?=[A-Za-z0-9][A-Za-z0-9._-]*\s*(?:===|==|=|@))")


def repro_command(set_name: str, test: str) -> str:
    """The command that turns one cell into a standalone reproduction (`stackcheck repro`)."""
    base, *pins = ADDED_PIN.split(set_name)
    words = ["python", "-m", "stackcheck", "repro", "--sets", base, *[w for pin in pins for w in ("--with", pin)], "--test", test]
    return " ".join(_quote(word) for word in words)


def _quote(word: str) -> str:
    return word if re.fullmatch(r"[A-Za-z0-9_./=:,+@-]+", word) else "'" + word.replace("'", "'\\''") + "'"


def grid_model(matrix: dict, ledger: Ledger) -> dict:
    """The grid: columns (set, lane), rows (family, arch), and per grid square its cells, worst verdict and counts."""
    cells = [*matrix["cells"], *(matrix.get("not_run") or [])]
    sets = set_order(matrix["sets"] or {c.set_name for c in cells})
    lanes = [lane for lane in results.LANES if any(c.lane == lane for c in cells)]
    columns = [(name, lane) for name in sets for lane in lanes if any(c.set_name == name and c.lane == lane for c in cells)]
    families = [f for f in ledger.families if any(c.family == f for c in cells)]
    families += sorted({c.family for c in cells} - set(families))
    # One fixed order for every strip: the architectures by name, the cells of no model last.
    archs = sorted({c.arch for c in cells if c.arch}) + ([None] if any(c.arch is None for c in cells) else [])
    rows = [(family, arch) for family in families for arch in archs if any(c.family == family and c.arch == arch for c in cells)]
    squares: dict[tuple, dict] = {}
    for cell in cells:
        key = (cell.family, cell.arch, cell.set_name, cell.lane)
        squares.setdefault(key, {"cells": []})["cells"].append(cell)
    for index, (_key, square) in enumerate(sorted(squares.items(), key=lambda item: (rows.index(item[0][:2]), columns.index(item[0][2:])))):
        mine = sorted(square["cells"], key=lambda c: (PAGE_VERDICTS.index(c.verdict), c.test))
        square["cells"] = mine
        square["verdict"] = mine[0].verdict  # the worst: a square not run reads so only where none of its cells has a verdict
        square["counts"] = {v: sum(c.verdict == v for c in mine) for v in PAGE_VERDICTS if any(c.verdict == v for c in mine)}
        square["bugs"] = sorted({c.bug for c in mine if c.bug})
        square["id"] = f"g-{index}"
    set_versions = {}
    for name in sets:
        entry = matrix["sets"].get(name, {})
        set_versions[name] = {package: entry[package] for package in PACKAGES if isinstance(entry.get(package), str)}
    set_counts = {name: {v: n for v in PAGE_VERDICTS if (n := sum(c.verdict == v for c in cells if c.set_name == name))} for name in sets}
    return {"sets": sets, "columns": columns, "set_counts": set_counts, "rows": rows, "squares": squares, "versions": set_versions,
            "families": families, "archs": archs, "device": {name: matrix["sets"].get(name, {}).get("device", "") for name in sets}}


def changes(grid: dict) -> list[dict]:
    """Per later set, each (family, arch, lane) whose worst verdict differs from the first set's: what an upgrade
    from the first set to it changes, better or worse."""
    if len(grid["sets"]) < 2:
        return []
    first, found = grid["sets"][0], []
    for later in grid["sets"][1:]:
        for family, arch in grid["rows"]:
            for lane in results.LANES:
                before = grid["squares"].get((family, arch, first, lane))
                after = grid["squares"].get((family, arch, later, lane))
                if before and after and before["verdict"] != after["verdict"]:
                    worse = SEVERITY.index(after["verdict"]) < SEVERITY.index(before["verdict"]) and after["verdict"] != "fixed"
                    found.append({"from": first, "to": later, "family": family, "arch": arch, "lane": lane, "before": before,
                                  "after": after, "worse": worse})
    return found


def change_lines(found: list[dict]) -> list[dict]:
    """The changes as the page lists them: one line per family, pair of sets, verdicts and bugs left or brought,
    naming its architectures and the lanes where exactly these change; regressions first (the 80 changes of the
    committed two-set CPU run make 35 lines)."""
    lines: dict[tuple, dict] = {}
    for change in found:
        before, after = change["before"], change["after"]
        gone = [bug for bug in before["bugs"] if bug not in after["bugs"]]
        came = [bug for bug in after["bugs"] if bug not in before["bugs"]]
        key = (change["from"], change["to"], change["family"], change["lane"], before["verdict"], after["verdict"], tuple(gone), tuple(came))
        line = lines.setdefault(key, {**{k: change[k] for k in ("from", "to", "family", "worse")}, "lanes": [change["lane"]],
                                      "before": before["verdict"], "after": after["verdict"], "gone": gone, "came": came, "squares": []})
        line["squares"].append((change["arch"], after["id"]))
        line["count"] = len(line["squares"])
    merged: dict[tuple, dict] = {}  # the same change on every lane it shows on: one line
    for (*head, lane, before, after, gone, came), line in lines.items():
        key = (*head, before, after, gone, came, tuple(arch for arch, _ in line["squares"]))
        if key in merged:
            merged[key]["lanes"].append(lane)  # its links stay the first lane's squares
            merged[key]["count"] += line["count"]
        else:
            merged[key] = line
    return sorted(merged.values(), key=lambda line: not line["worse"])


def bug_history(states: list[str | None], labels: list[str]) -> dict:
    """A bug's first bad and first fixed release over a sweep, from its state per release (None: not probed).
    first bad: the first release where it is present (`≤ X` when present from the range's start); first fixed: the
    first release, after the last one where it is present, where its test passes (absent)."""
    probed = [(label, state) for label, state in zip(labels, states) if state]
    present = [i for i, (_, state) in enumerate(probed) if state == "present"]
    if not present:
        return {"first_bad": None, "first_fixed": None, "note": "never present in this range"}
    first_bad = probed[present[0]][0]
    if present[0] == 0:
        first_bad = f"≤ {first_bad}"  # present from the range's start
    elif any(state == "masked" for _, state in probed[:present[0]]):
        first_bad = f"{first_bad} (masked before)"  # its tests failed otherwise first: it may be older
    fixed = next((label for label, state in probed[present[-1] + 1:] if state == "absent"), None)
    back = any(state == "absent" for _, state in probed[present[0]:present[-1]])
    note = "absent, then present again (a regression)" if back else ""
    if fixed is None:
        note = note or ("still present at the range's end" if present[-1] == len(probed) - 1 else "masked after its last showing")
    return {"first_bad": first_bad, "first_fixed": fixed, "note": note}


def history_model(name: str, record: dict) -> dict:
    from stackcheck.commands.releases import history

    rows = history.rows_of(record)
    sweep = record["sweep"]
    states = history.bug_rows(rows, sweep["families"])
    labels = [label for label, _ in rows]
    bugs = [{"id": bug, "states": mine, **bug_history(mine, labels)} for bug, mine in states.items()]
    bugs.sort(key=lambda bug: bug["first_bad"] is None)  # the bugs that show in the range first, in the ledger's order
    # Each family's worst verdict per release (None: not probed, or no cell of it): the map the backtest draws.
    rank = {str(verdict): index for index, verdict in enumerate(SEVERITY)}
    worst = [{family: min((c.verdict for c in probe.cells if c.family == family), key=rank.__getitem__, default=None)
              for family in sweep["families"]} if probe else {} for _label, probe in rows]
    families = [{"id": family, "verdicts": [w.get(family) for w in worst]} for family in sweep["families"]]
    return {"name": name, "id": slug(name), "sweep": sweep, "labels": labels, "bugs": bugs, "families": families}


def version_choices(set_versions: dict[str, dict[str, str]]) -> dict[str, list[str]]:
    """Per library, the versions the sets have, oldest first: the version filter's choices."""
    from packaging.version import InvalidVersion, Version

    def order(text: str):
        try:
            return (0, Version(text), text)
        except InvalidVersion:
            return (1, Version("0"), text)

    found: dict[str, set[str]] = {}
    for versions in set_versions.values():
        for library, version in versions.items():
            found.setdefault(library, set()).add(version)
    return {library: sorted(mine, key=order) for library, mine in found.items()}


# ---------------------------------------------------------------------------------------------------------- plots

def _require_plotting():
    try:
        import jinja2  # noqa: F401
        import plotly  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"report needs jinja2 and plotly ({exc.name} is missing here, in {sys.executable}): {INSTALL_HINT}") from None


def history_figure(model: dict) -> str:
    """The sweep's heat map: one row per known bug, one column per release, coloured by the bug's state."""
    import plotly.graph_objects as go
    from stackcheck.commands.releases.history import BUG_STATES

    states = list(BUG_STATES)
    codes = {state: index for index, state in enumerate(states)}
    n = len(states)
    scale = [[edge, colour] for index, colour in enumerate(BUG_STATES.values()) for edge in (index / n, (index + 1) / n)]
    bugs = list(reversed(model["bugs"]))  # plotly draws the first row at the bottom
    z = [[codes[s] if s else None for s in bug["states"]] for bug in bugs]
    text = [[s or "not probed" for s in bug["states"]] for bug in bugs]
    figure = go.Figure(go.Heatmap(
        z=z, x=model["labels"], y=[bug["id"] for bug in bugs], text=text, zmin=-0.5, zmax=n - 0.5, colorscale=scale,
        xgap=1, ygap=1, hovertemplate="%{y}<br>" + model["sweep"]["package"] + " %{x}: %{text}<extra></extra>",
        colorbar={"tickvals": list(range(n)), "ticktext": states, "title": {"text": "state"}},
    ))
    figure.update_xaxes(type="category", title=model["sweep"]["package"], tickangle=-60)
    figure.update_yaxes(type="category", automargin=True)
    figure.update_layout(height=max(260, 26 * len(bugs) + 170), margin={"l": 10, "r": 10, "t": 10, "b": 10},
                         template="plotly_white")
    return figure.to_html(full_html=False, include_plotlyjs=False, div_id=f"heat-{model['id']}",
                          config={"responsive": True, "displaylogo": False})


def family_figure(model: dict) -> str:
    """The sweep's family map: one row per family, one column per release, coloured by the worst verdict of the
    family's cells there (the page's verdict colours)."""
    import plotly.graph_objects as go

    verdicts = [v for v in PAGE_VERDICTS if v != NOT_RUN]
    codes = {verdict: index for index, verdict in enumerate(verdicts)}
    n = len(verdicts)
    scale = [[edge, VERDICT_COLOURS[v]] for index, v in enumerate(verdicts) for edge in (index / n, (index + 1) / n)]
    rows = list(reversed(model["families"]))
    figure = go.Figure(go.Heatmap(
        z=[[codes[v] if v else None for v in row["verdicts"]] for row in rows], x=model["labels"], y=[row["id"] for row in rows],
        text=[[v or "no cell" for v in row["verdicts"]] for row in rows], zmin=-0.5, zmax=n - 0.5, colorscale=scale, xgap=1, ygap=1,
        hovertemplate="%{y}<br>" + model["sweep"]["package"] + " %{x}: %{text}<extra></extra>",
        colorbar={"tickvals": list(range(n)), "ticktext": verdicts, "title": {"text": "worst verdict"}},
    ))
    figure.update_xaxes(type="category", title=model["sweep"]["package"], tickangle=-60)
    figure.update_yaxes(type="category", automargin=True)
    figure.update_layout(height=max(260, 18 * len(rows) + 170), margin={"l": 10, "r": 10, "t": 10, "b": 10}, template="plotly_white")
    return figure.to_html(full_html=False, include_plotlyjs=False, div_id=f"families-{model['id']}",
                          config={"responsive": True, "displaylogo": False})


def history_width(model: dict) -> int:
    """The narrowest the heat map is drawn (CSS px): room for the bug ids, a readable column per release and the
    colour bar. A narrower screen scrolls the map inside its own box instead of squeezing it."""
    return 7 * max((len(bug["id"]) for bug in model["bugs"]), default=10) + 14 * len(model["labels"]) + 160


def bench_figures(bench: dict[str, dict]) -> list[dict]:
    """One grouped bar chart per bench metric, one bar per set (absolute numbers of one run), with a panel per model
    size (its own y axis): a tiny model's bars would vanish beside a realistic model's."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots
    from stackcheck.bench import compare as bench_compare
    from stackcheck.bench.report import METRICS

    names = set_order(bench)
    summaries = {name: bench_compare.summarize(bench[name]) for name in names}
    cases = list(dict.fromkeys(key for summary in summaries.values() for key in summary))
    figures = []
    for metric, title, unit, scale in METRICS:
        mine = [case for case in cases if any(metric in summaries[name].get(case, {}) for name in names)]
        if not mine:
            continue
        sizes = list(dict.fromkeys(case.split("/", 1)[0] for case in mine))  # case keys are "<size>/<case>"
        width = [sum(case.split("/", 1)[0] == size for case in mine) for size in sizes]
        figure = make_subplots(rows=1, cols=len(sizes), subplot_titles=sizes, column_widths=width, horizontal_spacing=0.06)
        for column, size in enumerate(sizes, 1):
            here = [case for case in mine if case.split("/", 1)[0] == size]
            for index, name in enumerate(names):
                values = [summaries[name].get(case, {}).get(metric) for case in here]
                figure.add_trace(go.Bar(
                    name=name, x=[case.split("/", 1)[-1] for case in here], legendgroup=name, showlegend=column == 1,
                    marker_color=qualitative.Plotly[index % len(qualitative.Plotly)],
                    y=[v / scale if isinstance(v, (int, float)) else None for v in values],
                    hovertemplate=f"{name} {size}/%{{x}}: %{{y:,.1f}} {unit}<extra></extra>"), row=1, col=column)
        figure.update_layout(barmode="group", height=360, margin={"l": 10, "r": 10, "t": 40, "b": 10}, template="plotly_white",
                             legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.2})
        figure.update_xaxes(tickangle=-45, automargin=True)
        figure.update_yaxes(automargin=True, rangemode="tozero")
        figure.update_yaxes(title_text=unit, row=1, col=1)
        figures.append({"id": f"bench-{metric}", "title": title, "sizes": sizes, "html": figure.to_html(
            full_html=False, include_plotlyjs=False, div_id=f"bench-{metric}", config={"responsive": True, "displaylogo": False})})
    return figures


# ------------------------------------------------------------------------------------------------------- the page

def render(matrix: dict, sweeps: list[tuple[str, dict]], bench: dict[str, dict], ledger: Ledger | None = None) -> str:
    """The page's HTML, whole."""
    _require_plotting()
    import jinja2
    from plotly.offline import get_plotlyjs

    ledger = ledger or Ledger()
    grid = grid_model(matrix, ledger)
    histories = [history_model(name, record) for name, record in sweeps]
    for model in histories:
        model["figure"], model["width"] = history_figure(model), history_width(model)
        model["family_figure"] = family_figure(model)
    plots = bench_figures(bench) if bench else []
    bug_ids = {bug for square in grid["squares"].values() for bug in square["bugs"]}
    bug_ids |= {bug["id"] for model in histories for bug in model["bugs"]}
    families = list(dict.fromkeys([family for family, _arch in grid["rows"]] + [f for _n, r in sweeps for f in r["sweep"]["families"]]))
    family_bugs = {family: list(dict.fromkeys(bug.id for bug, _ in ledger.families[family].bugs)) if family in ledger.families else []
                   for family in families}
    bug_ids |= {bug for mine in family_bugs.values() for bug in mine}
    bugs = [ledger.bugs[b] for b in ledger.bugs if b in bug_ids]
    unknown = sorted(b for b in bug_ids if b not in ledger.bugs)  # named by results of another checkout's ledger
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent), autoescape=True,
                                     undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    template = environment.get_template("page.html.j2")
    libraries = [p for p in PACKAGES if any(p in v for v in grid["versions"].values())]
    return template.render(
        grid=grid, changes=change_lines(changes(grid)), families=families, family_bugs=family_bugs, histories=histories, plots=plots, bugs=bugs, unknown_bugs=unknown, ledger=ledger,
        verdicts=PAGE_VERDICTS, colours=VERDICT_COLOURS, words=VERDICT_WORDS, libraries=libraries,
        families_of={bug.id: ledger.families_of(bug) for bug in bugs}, repro=repro_command, slug=slug,
        total_cells=len(matrix["cells"]), plotly_js=get_plotlyjs() if (histories or plots) else "",
        css=(Path(__file__).parent / "page.css").read_text(), js=(Path(__file__).parent / "page.js").read_text(),
        data_json=json.dumps({"versions": grid["versions"], "choices": version_choices(grid["versions"])}, sort_keys=True).replace("</", "<\\/"),
        escape=html.escape,
    )


def run(args) -> int:
    from stackcheck.runner.inputs import check_writable

    output = Path(args.output).expanduser().resolve()
    if output.is_dir():
        raise UsageError(f"--output {output} is a folder; name the page to write")
    if output.suffix != ".html":
        raise UsageError(f"--output {output}: name an .html file")
    check_writable("--output", output.parent)
    _require_plotting()
    matrix, sweeps, bench = gather(args)
    page = render(matrix, sweeps, bench)
    output.parent.mkdir(parents=True, exist_ok=True)
    results._write_atomic(output, page)
    print(f"wrote {output} ({len(page) / 1e6:.1f} MB: {len(matrix['cells'])} cells of {len(matrix['sets'])} sets, "
          f"{len(sweeps)} history sweeps, bench of {len(bench)} sets)")
    return 0
