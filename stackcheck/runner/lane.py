"""pytest in a set's own environment: the runner the matrix, the bench, the gate and bisect share, and
`run`, the chosen family tests of one set on the CPU lane read back as the cells the plugin recorded."""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.runner import envs, signals
from stackcheck.core import results
from stackcheck.process import warmer
from stackcheck.core.cell import Cell
from stackcheck.models import architectures
from stackcheck.core.ledger import ERROR, Ledger, family_modules, family_path
from stackcheck.core.protocol import ARCH_OPTION, BASELINE_OPTION, BENCH_REPEAT_OPTION, BENCH_SIZE_OPTION, BENCH_SMOKE_OPTION, LANES_OPTION, LAUNCHED_AT_ENV, RESULTS_OPTION, RUN_ENV, SET_OPTION, SET_RECORD_ENV, COMMAND_PID_ENV, TIMING_OPTION, option
from stackcheck.core.versions import UsageError, VersionSet


def lanes_option(lanes: tuple[str, ...]) -> str:
    return option(LANES_OPTION, ",".join(lanes))


# The CPU lane alone (GPU cells would only be skipped on a CPU host).
CPU_LANE = lanes_option(("cpu",))


ARCH_HELP = ("architectures under test: built-in names (gemma4 and fixtures/architectures/*.json), comma-separated, or a "
             "path to a config.json or to a folder with one, a Hub snapshot (shrunk to a tiny model of the same structure; "
             "no weights needed). Default: every built-in one")
ARCH_PREFIX = option(ARCH_OPTION, "")  # `--stackcheck-arch=`, as arch_options passes it


def arch_options(spec: str | None) -> list[str]:
    """The pytest option that runs the families on `--arch SPEC` (none: every built-in architecture), checked
    here, before any environment is built: an unknown name, a config.json that is not JSON or cannot be
    shrunk, or (where this interpreter has transformers) a model_type it cannot build is a usage error."""
    if not spec:
        return []
    try:
        chosen = architectures.resolve(spec)
    except architectures.ArchitectureError as exc:
        raise UsageError(str(exc)) from None
    builtin = architectures.builtin()
    own = [a for a in chosen if builtin.get(a.name) != a]
    if own and importlib.util.find_spec("transformers"):  # else the set's transformers decides, in its cells
        from transformers import CONFIG_MAPPING

        for arch in own:
            if arch.model_type not in CONFIG_MAPPING:
                raise UsageError(f"--arch {arch.source}: model_type '{arch.model_type}' is not one this transformers can build")
    return [option(ARCH_OPTION, ",".join(a.source if a in own else a.name for a in chosen))]


# Run in a set's environment: its transformers' version and the model types it builds.
MODEL_TYPES_CODE = ("import json, transformers; from transformers import CONFIG_MAPPING; "
                    "print(json.dumps([transformers.__version__, sorted(CONFIG_MAPPING.keys())]))")
MODEL_TYPES_FILE = "stackcheck-model-types.json"  # beside a set's environment, which never changes once built


def transformers_model_types(python: Path) -> tuple[str, set[str]] | None:
    """(version, model types) of the transformers in `python`'s environment, asked once per stackcheck environment
    (it imports torch: seconds); None where it cannot be asked (the set's cells then say what happens)."""
    cache = python.parent.parent / MODEL_TYPES_FILE
    if cache.is_file():
        version, model_types = json.loads(cache.read_text())
        return version, set(model_types)
    found = subprocess.run([str(python), "-c", MODEL_TYPES_CODE], capture_output=True, text=True, cwd=REPO_ROOT)
    try:
        version, model_types = json.loads(found.stdout)
    except ValueError:
        return None
    if envs.ENVS_DIR in python.parents:
        cache.write_text(json.dumps([version, model_types]))
    return version, set(model_types)


def check_model_types(python: Path, vset: VersionSet, options: list[str]) -> None:
    """The `model_type` of each config of the user's under test is one the set's transformers builds: else one line
    (UsageError) before pytest starts, where a host without transformers could not tell (`arch_options`)."""
    spec = next((given.removeprefix(ARCH_PREFIX) for given in options if given.startswith(ARCH_PREFIX)), None)
    builtin = architectures.builtin()
    own = [a for a in architectures.resolve(spec) if builtin.get(a.name) != a] if spec else []
    known = transformers_model_types(python) if own else None
    if not known:
        return  # no config of the user's, or a transformers that cannot say
    version, model_types = known
    for arch in own:
        if arch.model_type not in model_types:
            close = difflib.get_close_matches(arch.model_type, model_types, n=1)
            raise UsageError(f"--arch {arch.source}: model_type '{arch.model_type}' is not one transformers {version} (set "
                             f"{vset.name}) can build" + (f"; did you mean '{close[0]}'?" if close else ""))


# Options whose value is the next argument, so that it is not read as a test path.
VALUE_OPTIONS = ("-k", "-m", "-n", "-p", "-c", "-o", "--dist", "--rootdir", "--basetemp", "--confcutdir", "--deselect", "--ignore")


def named_paths(pytest_args: list[str]) -> list[str]:
    """The test paths (or ids) among pytest options: an argument that is no option's value and names a file or
    folder of the checkout."""
    return [arg for previous, arg in zip([None, *pytest_args], pytest_args)
            if not arg.startswith("-") and previous not in VALUE_OPTIONS and (REPO_ROOT / arg.split("::", 1)[0]).exists()]


def chooses_parallelism(pytest_args: list[str]) -> bool:
    """Whether pytest options say how (or whether) xdist runs: `-n N`, `--dist`, `--tx`, `-p no:xdist`, or a debugger."""
    for previous, arg in zip([None, *pytest_args], pytest_args):
        if arg.startswith(("-n", "--numprocesses", "--dist", "--tx")) or arg in ("-d", "--pdb", "--trace", "-pno:xdist"):
            return True
        if previous == "-p" and arg == "no:xdist":
            return True
    return False


def parallel_options(pytest_args: list[str], workers: int | None = None, pools: bool = False) -> list[str]:
    """The xdist options of a run whose pytest options choose none: one worker per core (`workers` to say otherwise),
    each idle worker taking the next test, longest first (stackcheck.child.schedule); with warm rank pools (`pools`), the
    cells of a pool group all on one worker (`--dist loadgroup`, the order kept: stackcheck.child.schedule). Nothing where
    the options already choose (`-n 0` runs in one process), where they name tests (`-- tests/families/test_x.py`,
    `-k`: a few tests are not worth a second worker's start-up), nor inside an xdist worker (the harness's own tests
    under CI's workers: the cores are taken)."""
    count = workers or os.cpu_count() or 1
    narrowed = bool(named_paths(pytest_args)) or any(arg == "-k" or arg.startswith("-k") for arg in pytest_args)
    if chooses_parallelism(pytest_args) or narrowed or os.environ.get("PYTEST_XDIST_WORKER") or count < 2:
        return []
    if pools:
        return ["-n", str(count), "--dist", "loadgroup", "--no-loadscope-reorder"]
    return ["-n", str(count), "--dist", "load", "--maxschedchunk", "1"]


def rank_pools(default: bool) -> tuple[bool, dict[str, str]]:
    """Whether a command's pytest runs put their two-rank cells on warm rank pools (stackcheck.distributed.pool), and
    the STACKCHECK_RANK_POOL they get: the user's 0 or 1, else `default`; another value is a usage error, before
    anything is built."""
    from stackcheck.process import warm

    try:
        on = warm.setting(default)
    except warm.SettingError as exc:
        raise UsageError(str(exc)) from None
    return on, {warm.POOL_ENV: "1" if on else "0"}


def lane_args(lanes: tuple[str, ...]) -> list[str]:
    """pytest options of a family run in `lanes` (("cpu",), or ("gpu", "cpu") on a GPU host); the cache
    plugin would share state between runs."""
    return ["-q", "-p", "no:cacheprovider", lanes_option(lanes)]


def new_run_id() -> str:
    """An id for one pytest run, which the recorder stamps on each cell it records (results.cells_of_run)."""
    return uuid.uuid4().hex[:12]


def run_pytest(python: Path, vset: VersionSet, targets: list[str], extra: list[str], results_path: Path | None,
               baseline: str | None = None, env: dict[str, str] | None = None, run: str | None = None) -> int:
    """`baseline`: the set of this run whose trained adapter this set loads (stackcheck.child.exchange); `env`:
    variables added to the process's environment; `run`: the run's id (`new_run_id`), stamped on its cells."""
    # A family module that fails to import gets error cells; the other families still run.
    check_model_types(python, vset, extra)
    command = [str(python), "-m", "pytest", *targets, option(SET_OPTION, vset.name), "--continue-on-collection-errors", *extra]
    if results_path:
        command.append(option(RESULTS_OPTION, results_path))
    if baseline:
        command.append(option(BASELINE_OPTION, baseline))
    print("+", " ".join(command), flush=True)
    variables = envs.bytecode_cache(dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}),
                                         **{LAUNCHED_AT_ENV: repr(time.time()), RUN_ENV: run or new_run_id(),
                                            SET_RECORD_ENV: json.dumps(vset.to_dict()),
                                            COMMAND_PID_ENV: str(os.getpid())}))
    warming = warmer.start(python, xdist_workers(extra), variables)
    try:
        return signals.call(command, cwd=REPO_ROOT, env=variables)  # its own process group, stopped with the command
    finally:
        warmer.stop(warming, variables)


def xdist_workers(options: list[str]) -> int:
    """How many xdist workers `options` start (`-n N`, `-nN`, `--numprocesses=N`); 0 for none or `auto`."""
    for flag, value in zip(options, [*options[1:], ""]):
        for prefix in ("-n", "--numprocesses="):
            given = value if flag in ("-n", "--numprocesses") else flag.removeprefix(prefix) if flag.startswith(prefix) else ""
            if given.isdigit():
                return int(given)
    return 0


def check_ledger() -> None:
    """The ledger loads and every family module has an entry (and every entry a module), checked before
    any environment is built; a LedgerError is a usage error."""
    Ledger().check_modules(family_modules())


# The signature's start on the one cell per family of a release whose set is unusable (the backtest groups them).
UNUSABLE_SIGNATURE = "set unusable"


def record_unbuildable(results_path: Path, vset: VersionSet, reason: str, unusable: bool = False) -> None:
    """A release whose environment cannot be built, or one of whose libraries does not import there (`unusable`: a
    probe of bisect or history, a finding there, not a usage error), gets one cell per family saying so, never a cell
    per test; an unusable release is kept in the probe store (it is so on every run), one not built is not."""
    results.record_set(results_path, vset.name, {"env": "unusable" if unusable else "not built"})
    what = UNUSABLE_SIGNATURE if unusable else "environment not built"
    results.record_cells(results_path, [
        Cell(vset.name, family, family_path(family), "cpu", str(ERROR), signature=f"{what}: {reason}", note="setup broke")
        for family in family_modules()
    ])


def build_all(sets: list[VersionSet], find_links=(), no_index: bool = False, groups: tuple[str, ...] = (),
              unusable: dict[str, str] | None = None) -> dict[str, Path]:
    """Every set's environment (its python, by set name), all built before any runs: a set that cannot be built
    stops the command before anything ran or was recorded (envs.EnvBuildError: one line, exit 2). With `unusable`,
    a set whose pins cannot be installed together, or one of whose libraries does not import, is named there with
    the reason and one line instead (its cells are not run; exitcodes.UNUSABLE)."""
    pythons = {}
    for vset in sets:
        try:
            python = envs.build(vset, find_links, no_index, groups=groups)
        except envs.EnvBuildError as exc:
            if unusable is None or not CONFLICT.search(str(exc)) or MISSING.search(str(exc)):
                raise envs.EnvBuildError(f"set {vset.name}: environment not built, nothing was run or recorded: {exc}") from None
            unusable[vset.name] = f"its pins cannot be installed together ({exc})"
        else:
            try:
                installed = envs.versions_in(python, vset)  # an environment that cannot say is not built (exit 2)
            except envs.EnvBuildError as exc:
                raise envs.EnvBuildError(f"set {vset.name}: environment not built, nothing was run or recorded: {exc}") from None
            problem = envs.import_problem(python) if unusable is not None else None
            if unusable is not None and problem is not None:
                unusable[vset.name] = problem
            else:
                pythons[vset.name] = python
                print(f"== set {vset.name} installed: {installed}", flush=True)
        if unusable and vset.name in unusable:
            print(f"stackcheck: set {vset.name} is unusable: {unusable[vset.name]}; its cells are not run", file=sys.stderr, flush=True)
    return pythons


# How uv and pip say that pins cannot be installed together (not a network or index failure).
CONFLICT = re.compile(r"No solution found|ResolutionImpossible|conflicting dependencies|are incompatible|unsatisfiable")
# ... unless a pin names a release the index does not have: a usage error (a typo), not an unusable set.
MISSING = re.compile(r"no version of|No matching distribution|not found in the package registry")


def bench_set(vset: VersionSet, python: Path, size: str, results_dir: Path, repeat: int = 0, smoke: bool = False,
              pytest_args=()) -> bool:
    """Run tests/benchmarks in the set's environment (`build_all` with envs.BENCH_GROUPS) into <set>.json; True
    when every benchmark ran."""
    output = results_dir / f"{vset.slug}.json"
    output.unlink(missing_ok=True)  # a report never mixes this run with an older one
    options = ["-q", "-m", "benchmark", f"--benchmark-json={output}", option(BENCH_SIZE_OPTION, size),
               option(BENCH_REPEAT_OPTION, repeat), *([BENCH_SMOKE_OPTION] if smoke else [])]
    started = time.monotonic()
    code = run_pytest(python, vset, ["tests/benchmarks"], [*options, *pytest_args], None)
    print(f"== set {vset.name}: pytest exit {code}, bench {time.monotonic() - started:.1f} s", flush=True)
    return code == 0


def family_targets(families: list[str] | None) -> list[str]:
    """Test module paths of the named families (every family in the ledger when None)."""
    known = family_modules()
    for family in families or []:
        if family not in known:
            raise UsageError(f"unknown family '{family}' (families: {', '.join(known)})")
    return [family_path(f) for f in families or known]


TEST_ID = re.compile(r"tests/(?:families|contract/\w+)/test_(?P<family>\w+)\.py::(?P<function>\w+)(?P<params>\[.+\])?")
TEST_ID_FORM = ("tests/families/test_<family>.py::<test> (or tests/contract/<phase>/test_<family>.py::<test>), optionally "
                "with its [parameters] as pytest prints them")


@dataclass(frozen=True)
class TestId:
    """A family test as pytest names it. Without parameters it names every cell of the test (each lane and
    parametrization); with them, the one cell. The parameters are pytest's, not read here."""

    __test__ = False  # not a pytest test class
    family: str
    text: str

    def names(self, cell_test: str) -> bool:
        return cell_test == self.text or ("[" not in self.text and cell_test.startswith(self.text + "["))


def family_test(text: str) -> TestId:
    """The one grammar of `--test` in every command, checked before anything is built: the form, the family,
    and a test function of that name in the family's module."""
    match = TEST_ID.fullmatch(text)
    if not match:
        raise UsageError(f"'{text}' is not a family test id: {TEST_ID_FORM}")
    (module,) = family_targets([match["family"]])  # an unknown family is a usage error
    tree = ast.parse((REPO_ROOT / module).read_text())
    functions = [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    if match["function"] not in functions:
        raise UsageError(f"{module} has no test {match['function']} (its tests: {', '.join(functions)})")
    return TestId(match["family"], text)


def run(vset: VersionSet, targets: list[str], results_path: Path, find_links=(), no_index: bool = False,
        baseline: str | None = None, env: dict[str, str] | None = None, options: Sequence[str] = (),
        python: Path | None = None) -> list[Cell]:
    """Run `targets` for `vset` on the CPU lane into results_path and return its cells. An environment
    that cannot be built gets an `error` cell in every family instead (a probe's finding). `options`: pytest
    options of the run (`arch_options`); `python`: the set's environment when `build_all` built it already."""
    return run_timed(vset, targets, results_path, find_links, no_index, baseline, env=env, options=options, python=python)[0]


def run_timed(vset: VersionSet, targets: list[str], results_path: Path, find_links=(), no_index: bool = False,
              baseline: str | None = None, lanes: tuple[str, ...] = ("cpu",), env: dict[str, str] | None = None,
              options: Sequence[str] = (), python: Path | None = None) -> tuple[list[Cell], dict[str, float | None]]:
    """`run`, in `lanes`, with what it cost in seconds: environment (built or reused), start-up
    (interpreter, imports, collection), fixtures (tiny checkpoints built), tests, exit; and in all."""
    check_ledger()
    started = time.monotonic()
    costs: dict[str, float | None] = {}
    try:
        python = python or envs.build(vset, find_links, no_index)
    except envs.EnvBuildError as exc:
        # Pins the resolver cannot install together are so on every run: the set is unusable (kept); anything else
        # (the network, a pin the index lacks) may build next time.
        conflict = bool(CONFLICT.search(str(exc))) and not MISSING.search(str(exc))
        record_unbuildable(results_path, vset, f"its pins cannot be installed together ({exc})" if conflict else str(exc), unusable=conflict)
        costs["environment"] = time.monotonic() - started
    else:
        costs["environment"] = time.monotonic() - started
        problem = envs.import_problem(python)
        if problem is not None:
            print(f"stackcheck: set {vset.name} is unusable: {problem}; its cells are not run", file=sys.stderr, flush=True)
            record_unbuildable(results_path, vset, problem, unusable=True)
            costs["total"] = time.monotonic() - started
            return [c for c in results.load(results_path)["cells"] if c.set_name == vset.name], costs
        with tempfile.TemporaryDirectory(prefix="stackcheck-timing-") as scratch:
            timing = Path(scratch) / "timing.json"
            launched = time.monotonic()
            run_pytest(python, vset, targets, [*lane_args(lanes), *options, option(TIMING_OPTION, timing)], results_path, baseline, env)
            ended = time.monotonic() - launched
            split = json.loads(timing.read_text()) if timing.exists() else {}
        costs |= {key: split.get(key) for key in ("startup", "fixtures", "tests")}
        costs["exit"] = ended - split["until_exit"] if split.get("until_exit") is not None else None
    costs["total"] = time.monotonic() - started
    return [c for c in results.load(results_path)["cells"] if c.set_name == vset.name], costs
