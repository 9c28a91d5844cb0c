"""`stackcheck repro`: an issue-ready folder for a failing cell, checked by running it.

For each cell it writes `<output>/<set>/<test>/` with a standalone `repro.py` (stackcheck.commands.triage.repro_script),
`environment.md` and `issue.md`, then runs `repro.py` in the cell's own environment and says whether it fails with
the cell's signature (`check.txt` keeps that run's output). Loaded by pytest as a plugin
(`-p stackcheck.commands.triage.repro`), it writes a test's parameters and fixtures for the script. Each file:
docs/internals.md, "commands/triage/repro.py"; docs/running.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.runner import envs, lane
from stackcheck.core import protocol, results
from stackcheck.core.ledger import KNOWN_BUG, NEW_FAILURE, Ledger, family_path
from stackcheck.core.cell import Cell
from stackcheck.commands.triage import repro_script
from stackcheck.core.versions import PACKAGES, UsageError, VersionSet, default_set, resolve, slug

FAILING = (KNOWN_BUG, NEW_FAILURE)
PARAMS_ENV = protocol.REPRO_PARAMS_ENV
RUN_TIMEOUT_S = 900
TRACE_TAIL_LINES = 30
FACTS_CODE = ("import json; from stackcheck.core import hostinfo, versions; "
              "print(json.dumps({'versions': versions.installed_versions(), 'platform': hostinfo.platform_facts()}))")
GITHUB_REPOSITORIES = {"huggingface/transformers": "transformers", "huggingface/peft": "peft", "huggingface/accelerate": "accelerate",
                       "bitsandbytes-foundation/bitsandbytes": "bitsandbytes", "pytorch/pytorch": "torch"}


@dataclass(frozen=True)
class Outcome:
    cell: Cell
    folder: Path
    reproduced: bool
    detail: str


def gpu_host() -> bool:
    try:
        envs.cuda_device()
    except UsageError:
        return False
    return True


def cells_from(path: Path, sets: list[str] | None) -> list[Cell]:
    data = results.load_checked(path)
    chosen = [c for c in data["cells"] if c.verdict in FAILING and (sets is None or c.set_name in sets)]
    if not chosen:
        raise UsageError(f"{path} has no failing cell{' of set ' + ', '.join(sets) if sets else ''}")
    return chosen


def version_set(name: str) -> VersionSet:
    """The set a cell ran on, from its name: a named set, or one with `+PIN` overrides (versions.resolve)."""
    base, *pins = re.split(rf"\+(?=(?:{'|'.join(PACKAGES)})\s*(?:==|@|=))", name)
    return resolve([base], pins)[0]


def run_cells(python: Path, cell_set: VersionSet, test: lane.TestId, scratch: Path) -> list[Cell]:
    """Run a family test (each of its cells, or the one its parameters name) in its set's environment and read back its cells."""
    matrix = scratch / "matrix.json"
    matrix.unlink(missing_ok=True)
    subprocess.run([str(python), "-m", "pytest", test.text, "-q", "-p", "no:cacheprovider", protocol.option(protocol.SET_OPTION, cell_set.name),
                    protocol.option(protocol.RESULTS_OPTION, matrix)], cwd=REPO_ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True)
    cells = [c for c in results.load(matrix)["cells"] if test.names(c.test)]
    if not cells:
        raise UsageError(f"no cell {test.text} in set {cell_set.name}: check its parameters ({lane.TEST_ID_FORM})")
    return cells


def collected(python: Path, test: str, scratch: Path) -> dict:
    out = scratch / "params.json"
    out.unlink(missing_ok=True)
    subprocess.run([str(python), "-m", "pytest", test, "--collect-only", "-q"], cwd=REPO_ROOT,
                   env=dict(os.environ, **{PARAMS_ENV: str(out)}, HF_HUB_OFFLINE="1"), capture_output=True)
    if not out.exists():
        raise UsageError(f"pytest collects no single test {test}")
    return json.loads(out.read_text())


def blamed_library(cell: Cell, ledger: Ledger, trace: str) -> str:
    """Which library the evidence points at, and why, in a sentence or two."""
    reasons = []
    frames = re.findall(r'File "[^"]*(?:site|dist)-packages/([^/"]+)/([^"]+)", line \d+, in (\w+)', trace)
    libraries = [(package, f"{package}/{path}:{function}") for package, path, function in frames if package in PACKAGES]
    if libraries:
        package, where = libraries[-1]
        outside_torch = [lib for lib in libraries if lib[0] != "torch"]
        reasons.append(f"the exception is raised in {where}"
                       + (f", below {outside_torch[-1][1]}" if package == "torch" and outside_torch else ""))
    else:
        reasons.append("the failure is the test's own assertion: the libraries returned, with the wrong result")
    if cell.bug:
        bug = ledger.bugs[cell.bug]
        repositories = [GITHUB_REPOSITORIES[m] for link in bug.links if (m := next((r for r in GITHUB_REPOSITORIES if f"github.com/{r}/" in link), None))]
        if repositories:
            reasons.append(f"the ledger files it under `{bug.id}`, whose upstream reference is in {repositories[0]} ({bug.links[0]})")
    return "; ".join(reasons) + "."


def _expected(cell: Cell) -> str:
    import ast

    tree = ast.parse((REPO_ROOT / family_path(cell.family)).read_text())  # tests/families or tests/contract/<phase>
    function = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == cell.function), None)
    text = (function and ast.get_docstring(function)) or ast.get_docstring(tree) or ""
    return text.split("\n\n", 1)[0].replace("\n", " ")


def model_built(script: str, arch: dict | None) -> str:
    """What the script builds, in the words of issue.md: the architecture under test, or the seed's tiny Gemma 4."""
    if arch:
        model_class = (arch["config"].get("architectures") or ["AutoModelForCausalLM"])[0]
        path = Path(arch["source"])
        source = f"{path.parent.name}/{path.name}" if path.is_absolute() else str(path)  # no path of this machine
        return f": it builds a tiny random {model_class} (`{arch['name']}`, shrunk from {source}) from its config, no network"
    return ": it builds a tiny random Gemma 4 from its config, no network" if "FIXTURES = " in script else ""


SITE_PACKAGES = re.compile(r"/[^\s\"']*/(site-packages|dist-packages)/")


def portable(text: str, folder: Path) -> str:
    """`text` without the paths of this machine, for an issue others read: the export folder is the script's own
    (`repro.py`), an environment's libraries are `site-packages/...`, the clone is `stackcheck/`, the home `~`."""
    text = SITE_PACKAGES.sub(r"\1/", text.replace(f"{folder}/", "").replace(str(folder), "."))
    for path, shown in ((REPO_ROOT, "stackcheck"), (Path.home(), "~")):
        text = text.replace(f"{path}/", f"{shown}/") if str(path) != "/" else text
    return text


def write_issue(folder: Path, cell: Cell, versions: dict, platform: dict, ledger: Ledger, trace: str, reproduced: bool,
                arch: dict | None = None) -> None:
    """`arch`: the architecture under test, as the script has it (None: the test builds no model of one)."""
    bug = ledger.bugs.get(cell.bug) if cell.bug else None
    script = (folder / "repro.py").read_text()
    title = (bug.summary.split(". ")[0] if bug else f"{cell.function}: {cell.failure}")[:150]
    lines = [f"# {title}", "",
             f"Found by stackcheck on the `{cell.set_name}` set: `{cell.test}` ({cell.verdict}{', ' + cell.bug if cell.bug else ''}).", "",
             "## Versions", "", ", ".join(f"{k} {v}" for k, v in versions.items() if k in ("python", *PACKAGES)),
             "(the platform: environment.md)", "",
             "## Expected", "", _expected(cell), "",
             "## Actual", "", f"```\n{cell.failure}\n```", "",
             f"The standalone script below {'reproduces it' if reproduced else 'did NOT reproduce it when stackcheck ran it'} "
             "(`python repro.py`" + model_built(script, arch) + ").", "",
             "## Trace (tail)", "", "```", *trace[trace.rfind("Traceback (most recent call last)"):].strip().splitlines()[-TRACE_TAIL_LINES:],
             "```", "",
             "## Where the evidence points", "", blamed_library(cell, ledger, trace), ""]
    if bug:
        lines += ["## Upstream references", "", *[f"- {link}" for link in bug.links], "", bug.upstream_status, ""]
    lines += ["## Script", "", "<details><summary>repro.py</summary>", "", "```python",
              script.rstrip(), "```", "", "</details>", ""]
    (folder / "issue.md").write_text(portable("\n".join(lines), folder))
    facts = "\n".join(f"| {k} | {v} |" for k, v in {**versions, **platform}.items())
    (folder / "environment.md").write_text(f"# Environment of `{cell.test}` on `{cell.set_name}`\n\n| fact | value |\n|---|---|\n{facts}\n")


def export(cell: Cell, cell_set: VersionSet, python: Path, output: Path, recorded: dict, ledger: Ledger) -> Outcome:
    folder = output / slug(cell.set_name) / slug(cell.test.split("::", 1)[1])
    folder.mkdir(parents=True, exist_ok=True)
    wanted = collected(python, cell.test, folder)
    header = (f'"""Reproduces stackcheck cell {cell.test} on set {cell.set_name} ({cell.verdict}'
              f'{": " + cell.bug if cell.bug else ""}).\n\nExpected failure: {cell.failure}\n"""')
    try:
        script = repro_script.build(cell.family, cell.function, wanted["params"], wanted["fixtures"], cell.lane, header,
                                    wanted["arch"])
    except repro_script.ReproUnsupported as exc:
        return Outcome(cell, folder, False, f"not exported: {exc}")
    (folder / "repro.py").write_text(script)
    (folder / "params.json").unlink(missing_ok=True)
    try:
        run = subprocess.run([str(python), "repro.py"], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=RUN_TIMEOUT_S, env=dict(os.environ, PYTHONPATH="", HF_HUB_OFFLINE="1"))
        trace = run.stdout
    except subprocess.TimeoutExpired:
        trace = f"repro.py ran past {RUN_TIMEOUT_S} s"
    (folder / "check.txt").write_text(trace)
    said = re.findall(r"^REPRODUCED (.*)$", trace, re.M)
    reproduced = bool(said) and said[-1].strip()[:200] == cell.failure.strip()[:200]
    detail = "reproduced" if reproduced else f"NOT reproduced: the script ended with {said[-1] if said else trace.strip().splitlines()[-1:] or 'no output'}"
    write_issue(folder, cell, recorded.get("versions", {}), recorded.get("platform", {}), ledger, trace, reproduced, wanted["arch"])
    return Outcome(cell, folder, reproduced, detail)


def run(args) -> int:
    """The `repro` command: 0 when every export reproduces its cell, 1 otherwise (2 on a usage error)."""
    if bool(args.test) == bool(args.source):
        raise UsageError("name a test (--sets SET --test ID) or a results file (--from matrix.json [--sets A,B])")
    if args.source and args.overrides:  # its cells were recorded on their sets' pins, and are reproduced on them
        raise UsageError("--with pins the set of --test; a results file's cells are reproduced on the pins they were recorded "
                         "with (to see them on another pin: matrix --sets SET --with PIN, then repro --from its results)")
    test = lane.family_test(args.test) if args.test else None  # before any environment is built
    ledger = Ledger()
    cells = cells_from(args.source, args.sets.split(",") if args.sets else None) if args.source else None
    recorded_sets = results.load_checked(args.source)["sets"] if args.source else {}
    if args.test and args.sets and "," in args.sets:
        raise UsageError("--test runs on one set: name it with --sets SET")
    names = sorted({c.set_name for c in cells}) if cells else [args.sets or default_set().name]
    sets = {name: resolve([name], args.overrides)[0] if cells is None else version_set(name) for name in names}  # pins checked before any build
    outcomes = []
    for name in names:
        cell_set = sets[name]
        print(f"== repro: set {cell_set.name}: its environment", flush=True)
        python = envs.build(cell_set, args.find_links, args.no_index)
        if cells is None:
            assert test is not None, "no results file (--from), so --test names the cells"
            args.output.mkdir(parents=True, exist_ok=True)
            print(f"== repro: running {test.text} in set {cell_set.name} for its cells", flush=True)
            chosen = run_cells(python, cell_set, test, args.output)
            recorded = json.loads(subprocess.run([str(python), "-c", FACTS_CODE], cwd=REPO_ROOT, capture_output=True, text=True).stdout)
        else:
            chosen = [c for c in cells if c.set_name == name]
            entry = recorded_sets.get(name, {})
            recorded = {"versions": {k: v for k, v in entry.items() if isinstance(v, str)}, "platform": entry.get("platform", {})}
        for cell in chosen:
            if cell.lane == "gpu" and not gpu_host():
                outcomes.append(Outcome(cell, args.output, False, "not exported: a GPU-lane cell needs a GPU host"))
                continue
            if cell.verdict not in FAILING:
                outcomes.append(Outcome(cell, args.output, False, f"not exported: the cell is {cell.verdict}, not failing"))
                continue
            print(f"== repro: {cell.test}: cutting repro.py and running it in set {cell_set.name}", flush=True)
            outcomes.append(export(cell, cell_set, python, args.output, recorded, ledger))
            print(f"{cell.set_name} {cell.test}: {outcomes[-1].detail} -> {outcomes[-1].folder}", flush=True)
    for outcome in outcomes:
        if not outcome.detail.startswith(("reproduced", "NOT")):
            print(f"{outcome.cell.set_name} {outcome.cell.test}: {outcome.detail}", flush=True)
    print(f"{sum(o.reproduced for o in outcomes)} of {len(outcomes)} cells reproduced by their standalone script")
    return 0 if outcomes and all(o.reproduced for o in outcomes) else 1
