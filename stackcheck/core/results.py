"""results/matrix.json (written cell by cell, so a crash loses nothing) and the matrix.md rendered from it.

matrix.json holds `sets`, `cells` (the verdicts), `fingerprint`, and `not_run`: the cells a run collected that have no
verdict of it and none from before (stackcheck.core.cell.NOT_RUN). A collected cell never takes the place of a recorded
verdict: a run killed at any moment (SIGKILL included) leaves every earlier verdict on disk, its own recorded ones
beside them, and the rest listed as not run. Every write is atomic (a temporary file renamed over the old one)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.core import hostinfo
from stackcheck.core.cell import KEYS, NOT_RUN, NOT_RUN_NOTE, Cell, arch_of, lane_of  # noqa: F401 - lane_of and arch_of are read from here too
from stackcheck.core.explore import SHRUNK_KEY
from stackcheck.core.locking import folder_locked
from stackcheck.core.ledger import CONTRACT_DIR, FAMILIES_DIR, SEVERITY, SKIPPED, Ledger, Verdict, family_paths
from stackcheck.core.versions import UsageError, load_sets

LANES = ("gpu", "cpu")
CELL_KEYS = KEYS  # every recorded cell has them (stackcheck.core.cell); a distributed job's also has `ranks`
# What a verdict means besides the libraries: the ledger and the judging of a failure against it, and the
# family tests with what they build and run.
DEFINITION_FILES = ("stackcheck/ledger.toml", "stackcheck/core/ledger.py", "stackcheck/child/*.py", "stackcheck/harness/scenario.py", "stackcheck/harness/*.py", "stackcheck/core/hostinfo.py", "stackcheck/models/*.py", "fixtures/*.json", "fixtures/architectures/*.json", "tests/families/*.py",
                    "tests/contract/*/*.py", "stackcheck/distributed/*.py", "fixtures/distributed/*")


LEDGER_FILE = "stackcheck/ledger.toml"


def family_fingerprints(families: Sequence[str]) -> dict[str, str]:
    """Each family's digest of what its cells' outcomes depend on, for the probe store (history, bisect, backtest): the
    shared definitions and the family's own module, not the ledger (stored cells are judged again under today's,
    stackcheck.child.evidence) nor other families' modules. A change to one family re-runs that family alone."""
    paths = family_paths()
    modules = set(paths.values())
    shared = hashlib.sha256()
    for path in sorted(p for pattern in DEFINITION_FILES for p in REPO_ROOT.glob(pattern) if p.is_file()):
        if path.relative_to(REPO_ROOT).as_posix() != LEDGER_FILE and path not in modules:
            shared.update(f"{path.relative_to(REPO_ROOT)}\0".encode() + path.read_bytes())
    found = {}
    for family in families:
        digest = shared.copy()
        if family in paths:
            digest.update(paths[family].read_bytes())
        found[family] = digest.hexdigest()[:16]
    return found


def family_of(nodeid: str) -> str | None:
    """The family of a test node id (or of a module path) under tests/families or tests/contract/<phase>, else None."""
    return _family_of_module(nodeid.split("::", 1)[0])


@functools.cache
def _family_of_module(module: str) -> str | None:
    path = Path(module)
    homes = (FAMILIES_DIR.relative_to(REPO_ROOT), CONTRACT_DIR.relative_to(REPO_ROOT))
    if not (path.parent == homes[0] or path.parent.parent == homes[1]) or not path.stem.startswith("test_"):
        return None
    return path.stem.removeprefix("test_")


def fingerprint() -> str:
    """Digest of the family definitions, stored in matrix.json so results of different ones never merge."""
    digest = hashlib.sha256()
    for path in sorted(p for pattern in DEFINITION_FILES for p in REPO_ROOT.glob(pattern) if p.is_file()):
        digest.update(f"{path.relative_to(REPO_ROOT)}\0".encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def empty() -> dict:
    return {"sets": {}, "cells": [], "not_run": []}


def _decoded(data: dict) -> dict:
    """matrix.json's data with its cells (and not-run cells; none in a file from before them) as `Cell`s."""
    return dict(data, cells=[Cell.from_dict(cell) for cell in data["cells"]],
                not_run=[Cell.from_dict(cell) for cell in data.get("not_run") or []])


def load(path: Path) -> dict:
    """matrix.json's data (sets, cells as `Cell`s, fingerprint); empty when there is no file."""
    return _decoded(json.loads(path.read_text())) if path.exists() else empty()


def _locked(path: Path):
    """Exclusive use of the results files in `path`'s folder, between processes (the matrix's pytest workers, two
    runs into one file)."""
    return folder_locked(path.parent)


def new_file_mode() -> int:
    """The mode open() gives a new file: 0666 less the process's umask (from /proc where Linux has it: os.umask can
    only be read by setting it, which would race with the threads writing probes)."""
    try:
        status = Path("/proc/self/status").read_text()
        mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def _write_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all. The file keeps its mode; a new one gets the umask's, as open() would give
    (a temporary file is created 0600)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = new_file_mode()
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        os.fchmod(handle.fileno(), mode)
    os.replace(tmp, path)


def _encode(value):
    if isinstance(value, Cell):
        return value.to_dict()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


CELL_LISTS = ("cells", "not_run")  # the lists of cells in matrix.json, written one cell to a line


def dumps(data: dict) -> str:
    """`data` as JSON, keys sorted, indented; a list of cells one cell to a line (an empty `not_run` is left out). Each
    cell is encoded by json's C encoder, which `indent` would turn off: matrix.json is written again within a second of
    every verdict (6.5 ms for one set's 1243 cells, against 13 ms indented throughout; docs/speed.md)."""
    data = {key: value for key, value in data.items() if not (key == "not_run" and not value)}
    lists = {key: data[key] for key in CELL_LISTS if isinstance(data.get(key), list) and data[key]}
    if not lists:
        return json.dumps(data, indent=2, sort_keys=True, default=_encode) + "\n"
    parts = []
    for key in sorted(data):
        if key in lists:
            cells = ",\n".join("    " + json.dumps(cell, sort_keys=True, default=_encode) for cell in lists[key])
            parts.append(f'  "{key}": [\n{cells}\n  ]')
        else:
            parts.append(f"  {json.dumps(key)}: " + json.dumps(data[key], indent=2, sort_keys=True, default=_encode).replace("\n", "\n  "))
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write_json(path: Path, data: dict) -> None:
    """`data` as JSON, written whole or not at all (a `Cell` as matrix.json holds it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, dumps(data))


def save(path: Path, data: dict, markdown: bool = True) -> None:
    """matrix.json, and the matrix.md rendered from it unless `markdown` is false (a verdict of a run that renders it
    again later: rendering is most of a cell's recording, 37 ms of 57 ms for one set's 1243 cells)."""
    write_json(path, data)
    if markdown:
        _write_atomic(path.with_suffix(".md"), render_markdown(data))


def write_markdown(path: Path, run_fingerprint: str | None = None) -> None:
    """matrix.md rendered again from the matrix.json a run recorded into (the one it was moved to where another
    run's definitions took `path` over)."""
    run_fingerprint = run_fingerprint or fingerprint()
    with _locked(path):
        path, data = _taken_over(path, load(path), run_fingerprint)
        if path.exists():
            _write_atomic(path.with_suffix(".md"), render_markdown(data))


def merge_into(target: dict, incoming: dict) -> dict:
    """Add `incoming` to `target`; a cell with the same (set, lane, test) replaces the older one.

    A whole results file carries the fingerprint of its family definitions, and only merges into results
    of the same ones; a cells-only update (no fingerprint key) adds to whatever the target is."""
    if "fingerprint" in incoming:
        if (target["sets"] or target["cells"]) and target.get("fingerprint") != incoming["fingerprint"]:
            raise ValueError(
                f"results of different family definitions (fingerprint {target.get('fingerprint')} vs "
                f"{incoming['fingerprint']}): run every set from the same checkout"
            )
        target["fingerprint"] = incoming["fingerprint"]
    for name, versions in incoming["sets"].items():
        if name in target["sets"] and target["sets"][name] != versions:
            raise ValueError(f"set '{name}' was run with different versions: {target['sets'][name]} vs {versions}")
        target["sets"][name] = versions
    fresh = {cell.key: cell for cell in incoming["cells"]}
    target["cells"] = [cell for cell in target["cells"] if cell.key not in fresh]
    target["cells"].extend(fresh.values())
    target["cells"].sort(key=lambda c: (c.set_name, c.family, c.lane, c.test))
    # A verdict ends a cell's not-run state; a not-run cell never takes a verdict's place.
    judged = {cell.key for cell in target["cells"]}
    waiting = {cell.key: cell for cell in [*target.get("not_run", []), *incoming.get("not_run", [])] if cell.key not in judged}
    target["not_run"] = sorted(waiting.values(), key=lambda c: (c.set_name, c.family, c.lane, c.test))
    return target


def _taken_over(path: Path, data: dict, run_fingerprint: str) -> tuple[Path, dict]:
    """Where a run of `run_fingerprint` records: `path`, or, when a run of other definitions took it over meanwhile
    (and moved this run's earlier cells aside), the file they were moved to."""
    if data.get("fingerprint", run_fingerprint) == run_fingerprint:
        return path, data
    stale = stale_path(path, run_fingerprint)
    print(f"stackcheck: {path} was taken over by a run of other family definitions; this run's cells go to {stale}",
          file=sys.stderr)
    return stale, load(stale)


def _set_entry(data: dict, path: Path, name: str, versions: dict[str, str], platform: dict[str, str] | None) -> None:
    """Record the versions and platform set `name` runs with in `data`. A set recorded before with other versions
    or on another platform loses all its cells, every lane's: none may stay listed under pins it did not run."""
    entry: dict[str, str | dict[str, str]] = dict(versions)
    if platform:
        entry |= {"device": hostinfo.device_name(platform), "platform": platform}
    previous = data["sets"].get(name)
    if previous is not None and previous != entry:
        dropped = [c for c in data["cells"] if c.set_name == name]
        data["cells"] = [c for c in data["cells"] if c.set_name != name]
        data["not_run"] = [c for c in data.get("not_run", []) if c.set_name != name]
        if dropped:
            print(f"stackcheck: set '{name}' now runs other versions or on another platform; its {len(dropped)} "
                  f"earlier cells are dropped from {path}", file=sys.stderr)
    data["sets"][name] = entry


OLDER = "older"  # the stale file's name for results of a stackcheck from before fingerprints


def _claim(path: Path, data: dict, current: str) -> dict:
    """`data` of `path` for a run of the definitions `current`: results of other definitions are moved aside, and so
    are those of a stackcheck that wrote no fingerprint (an older one: its cells cannot be told current)."""
    older = "fingerprint" not in data and bool(data["sets"] or data["cells"])
    if older or data.get("fingerprint", current) != current:
        stale = stale_path(path, OLDER if older else data["fingerprint"])
        os.replace(path, stale)
        whose = "an older stackcheck (no fingerprint)" if older else "other family definitions"
        print(f"stackcheck: {path} held results of {whose}; moved to {stale}", file=sys.stderr)
        data = empty()
    data["fingerprint"] = current
    return data


def record_set(path: Path, name: str, versions: dict[str, str], platform: dict[str, str] | None = None) -> None:
    """Record the versions and platform a set runs with (see `_set_entry`)."""
    with _locked(path):
        data = _claim(path, load(path), fingerprint())
        _set_entry(data, path, name, versions, platform)
        save(path, data)


def begin_run(path: Path, name: str, versions: dict[str, str], platform: dict[str, str] | None, collected: list[Cell],
              run_fingerprint: str | None = None, verdicts: Sequence[Cell] = ()) -> None:
    """A run of set `name` starts: in one step, record the set's versions and platform, list each cell the run
    collected that has no verdict on record as not run (`Cell.not_run`, until its verdict comes), and record
    `verdicts` known already (family modules that did not import). A cell with a verdict on record keeps it until this
    run's verdict replaces it: stopped or killed at any moment, the run loses no earlier verdict. Nothing else of the
    set is touched: cells of tests the run did not collect (another `-k`, architecture, lane or family) stay. A family
    whose module imports again loses its module-level cells (`Cell.module_level`) in the run's lanes."""
    run_fingerprint = run_fingerprint or fingerprint()
    with _locked(path):
        data = _claim(path, load(path), run_fingerprint)
        _set_entry(data, path, name, versions, platform)
        runs = {(cell.family, cell.lane) for cell in [*collected, *verdicts]}
        data["cells"] = [c for c in data["cells"] if not (c.set_name == name and c.module_level and (c.family, c.lane) in runs)]
        waiting = [c.replace(verdict=NOT_RUN, signature=None, bug=None, note=NOT_RUN_NOTE, seconds=0.0) for c in collected]
        merge_into(data, {"sets": {}, "cells": list(verdicts), "not_run": waiting})
        save(path, data)


def stale_path(path: Path, other_fingerprint: str) -> Path:
    """Where results of other family definitions go when a run of these definitions takes `path` over."""
    return path.with_name(f"{path.stem}.stale-{other_fingerprint}.json")


def record_cells(path: Path, cells: list[Cell], run_fingerprint: str | None = None, markdown: bool = True) -> None:
    """Add cells of a run of the definitions `run_fingerprint` (default: the checkout's). If a run of other
    definitions took the file over meanwhile (and moved this run's earlier cells aside), these cells follow
    them there. `markdown`: render matrix.md too (see `save`)."""
    run_fingerprint = run_fingerprint or fingerprint()
    with _locked(path):
        path, data = _taken_over(path, load(path), run_fingerprint)
        data.setdefault("fingerprint", run_fingerprint)
        merge_into(data, {"sets": {}, "cells": list(cells)})
        save(path, data, markdown)


def cells_of_run(path: Path, set_name: str, run: str) -> list[Cell]:
    """The cells of set `set_name` that the pytest run `run` recorded (stackcheck.core.protocol.RUN_ENV)."""
    return [c for c in load(path)["cells"] if c.set_name == set_name and c.run == run]


def ran_in_lane(path: Path, set_name: str, lane: str, run: str | None = None) -> bool:
    """Whether at least one of the set's cells in `lane` (of the pytest run `run`, when named) ran to a verdict
    (was not skipped)."""
    return any(c.set_name == set_name and c.lane == lane and c.verdict != SKIPPED and (run is None or c.run == run)
               for c in load(path)["cells"])


def merge_files(inputs: list[Path], output: Path) -> dict:
    """Merge per-job matrix.json files into `output` (and its matrix.md). Idempotent: a file given twice,
    or the merge run again, changes nothing."""
    merged = empty()
    for path in inputs:
        data = load_checked(path)
        data.setdefault("fingerprint", None)  # a file from before fingerprints never merges with one after
        try:
            merge_into(merged, data)
        except ValueError as exc:
            raise UsageError(f"cannot merge {path}: {exc}") from None
    save(output, merged)
    return merged


def read_checked_json(path: Path, shape_problem, kind: str) -> dict:
    """JSON from disk that `shape_problem(data)` finds nothing wrong with; else a usage error naming the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    problem = shape_problem(data)
    if problem:
        raise UsageError(f"{path} is not a stackcheck {kind}: {problem}")
    return data


def load_checked(path: Path) -> dict:
    """A matrix.json from outside this run, checked for everything merge_into and render_markdown read."""
    return _decoded(read_checked_json(path, _shape_problem, "matrix.json"))


def _shape_problem(data) -> str | None:
    if not isinstance(data, dict) or not {"sets", "cells"} <= data.keys():
        return "it has no `sets` and `cells`"
    if not isinstance(data["sets"], dict):
        return "`sets` is not an object"
    for name, entry in data["sets"].items():
        if not isinstance(entry, dict) or not all(isinstance(v, str) for k, v in entry.items() if k != "platform"):
            return f"set '{name}' is not an object of version strings"
        if not isinstance(entry.get("platform", {}), dict):
            return f"set '{name}': `platform` is not an object"
    if not isinstance(data["cells"], list):
        return "`cells` is not a list"
    if not isinstance(data.get("not_run", []), list):
        return "`not_run` (the cells a run collected and has no verdict of) is not a list"
    for index, cell in enumerate(data.get("not_run", [])):
        if not isinstance(cell, dict) or cell.get("verdict") != NOT_RUN or not {"set", "family", "test", "lane"} <= cell.keys():
            return f"not_run {index} is not a not-run cell (set, family, test, lane, verdict {NOT_RUN})"
    required = [key for key in CELL_KEYS if key not in ("arch", "signature", "bug", "note")]  # None where no bug matched (or no model), or absent in older files
    texts = [key for key in required if key != "seconds"]
    for index, cell in enumerate(data["cells"]):
        if not isinstance(cell, dict):
            return f"cell {index} is not an object"
        missing = [key for key in required if key not in cell]
        if missing:
            return f"cell {index} has no {', '.join(missing)}"
        if not all(isinstance(cell[key], str) for key in texts) or not isinstance(cell["seconds"], (int, float)):
            return f"cell {index}: {', '.join(texts)} must be strings and seconds a number"
        if cell["verdict"] not in SEVERITY:
            return f"cell {index}: unknown verdict '{cell['verdict']}' (verdicts: {', '.join(SEVERITY)})"
        if not isinstance(cell.get("ranks", []), list):
            return f"cell {index}: `ranks` (a distributed job's outcome per rank) is not a list"
        if not isinstance(cell.get("run", ""), str):
            return f"cell {index}: `run` (the id of the run that recorded it) is not a string"
    return None


def worst(verdicts: list[str]) -> str:
    return min(verdicts, key=lambda verdict: SEVERITY.index(Verdict(verdict)))


VERSION_COLUMNS = ("python", "torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "device")
PLATFORM_COLUMNS = ("cpu", "cpu_flags", "bnb_cpu_packed_path", "torch_cpu_capability", "gpu", "gpu_driver", "cuda", "os")


def _escape(text: object) -> str:
    return str(text or "").replace("|", "\\|").replace("\n", " ")


def render_markdown(data: dict, ledger: Ledger | None = None) -> str:
    ledger = ledger or Ledger()
    declared = list(load_sets()[0])  # named sets in sets.toml order, ad-hoc sets after them
    sets = sorted(data["sets"], key=lambda name: (declared.index(name) if name in declared else len(declared), name))
    every = [*data["cells"], *data.get("not_run", [])]  # a not-run cell is shown as such, beside the verdicts
    families = [f for f in ledger.families if any(c.family == f for c in every)]
    families += sorted({c.family for c in every} - set(families))
    lines = ["# stackcheck matrix", ""]
    lines += ["| set | " + " | ".join(VERSION_COLUMNS) + " |", "|---" * (len(VERSION_COLUMNS) + 1) + "|"]
    for name in sets:
        lines.append(f"| {name} | " + " | ".join(_escape(data["sets"][name].get(k)) for k in VERSION_COLUMNS) + " |")
    lines += ["", "Platform each set ran on (what chooses a library's code path: `bnb_cpu_packed_path` is bitsandbytes' "
              "AVX512-BF16 packed 4-bit CPU kernel):", ""]
    lines += ["| set | " + " | ".join(PLATFORM_COLUMNS) + " |", "|---" * (len(PLATFORM_COLUMNS) + 1) + "|"]
    for name in sets:
        platform = data["sets"][name].get("platform")
        facts = [platform.get(k, "n/a") for k in PLATFORM_COLUMNS] if platform else ["not recorded"] * len(PLATFORM_COLUMNS)
        lines.append(f"| {name} | " + " | ".join(_escape(fact) for fact in facts) + " |")
    columns = [(name, lane) for name in sets for lane in LANES if any(c.set_name == name and c.lane == lane for c in every)]
    archs = list(dict.fromkeys(c.arch for c in every))  # in the order the run listed them
    lines += ["", "One row per family and architecture (`-`: the family's tests build no model).", ""]
    lines += ["| family | arch | " + " | ".join(f"{name} ({lane})" for name, lane in columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for family in families:
        for arch in [a for a in archs if any(c.family == family and c.arch == a for c in every)]:
            row = [family, arch or "-"]
            for name, lane in columns:
                cells = [c for c in every if c.set_name == name and c.lane == lane and c.family == family and c.arch == arch]
                row.append(_summary(cells, ledger) if cells else "**missing**")
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Cells", "", "| set | lane | arch | test | verdict | bug | signature | note | s |", "|---" * 9 + "|"]
    for c in sorted(every, key=lambda c: (c.set_name, c.family, c.lane, c.test)):
        lines.append(
            f"| {c.set_name} | {c.lane} | {c.arch or '-'} | `{c.test}` | {_word(c.verdict)} | {c.bug or ''} | {_escape(c.signature)} "
            f"| {_escape('; '.join(filter(None, [c.note, shrunk_note(c)])))} | {c.seconds:.1f} |"
        )
    return "\n".join(lines) + "\n"


def shrunk_note(cell: Cell) -> str | None:
    """What shrinking found for an explored cell (explore mode: docs/running.md), in a few words; None for another cell."""
    shrunk = cell.extra.get(SHRUNK_KEY)
    if not isinstance(shrunk, dict):
        return None
    if not shrunk.get("reproduced"):
        return "not shrunk: its failure did not come back when run again"
    changed = ", ".join(f"{name}={str(vid).removeprefix(name + '.')}" for name, vid in shrunk.get("changed", {}).items())
    return f"shrunk to {changed or 'every axis at its first value'} ({shrunk.get('verdict')}): `{shrunk.get('command')}`"


def _word(verdict: str) -> str:
    return "not run" if verdict == NOT_RUN else verdict


def summary_counts(cells: list[Cell]) -> str:
    """Every verdict among the cells with its count, worst first, then the cells not run: nothing (skipped included)
    is hidden."""
    return ", ".join(f"{sum(c.verdict == v for c in cells)} {_word(v)}" for v in [*SEVERITY, NOT_RUN] if any(c.verdict == v for c in cells))


def _summary(cells: list[Cell], ledger: Ledger) -> str:
    judged = [c.verdict for c in cells if c.verdict != NOT_RUN]
    verdict = worst(judged) if judged else NOT_RUN
    bugs = sorted({c.bug for c in cells if c.verdict == verdict and c.bug})
    links = [f"[{b}]({ledger.bugs[b].links[0]})" if b in ledger.bugs else b for b in bugs]
    return f"**{_word(verdict)}** " + (" ".join(links) + " " if links else "") + f"({summary_counts(cells)})"
