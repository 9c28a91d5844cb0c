"""The ledger of known upstream bugs (ledger.toml) and the verdict every test result gets from it.

The ledger is checked when it loads (`LedgerError` names the entry and the key), so a typo fails loudly
instead of quietly filing failures under the wrong bug. `Ledger.judge` is a pure function of the test,
the installed versions and the failure, detached from the live traceback.
"""

from __future__ import annotations

import ast
import fnmatch
import math
import re
import sysconfig
import tomllib
import traceback
from collections.abc import Set as AbstractSet
from typing import Any
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, Specifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from stackcheck import REPO_ROOT
from stackcheck.core.hostinfo import CPU_FLAGS
from stackcheck.core.versions import PACKAGES

LEDGER_FILE = Path(__file__).parents[1] / "ledger.toml"
FAMILIES_DIR = REPO_ROOT / "tests" / "families"  # bug families: tests/families/test_<id>.py
# Contract families: invariants of the user's journey, one folder per phase (tests/contract/<phase>/test_<id>.py).
# Both kinds are families in the ledger's sense: the same verdicts, matrix, gate, bisect and history.
CONTRACT_DIR = REPO_ROOT / "tests" / "contract"
TESTS_PREFIX = "tests/"  # where a silent bug's frame lives: a family's own assertion
# Python 3.11 runs a comprehension in a frame of its own, 3.12 inlines it (PEP 709): dropping these frames
# names the enclosing function on every Python.
COMPREHENSION_FRAMES = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})
# The platform and our own helpers: their frames sit between the failing call and the raise (torch's
# function modes and `Tensor` wrappers, the standard library's containers, `scenario`'s assertion
# helpers), so they never identify a bug. typing_extensions' `deprecated` wraps some of torch's own functions
# (torch.distributed's collectives): its pass-through frame sits between two torch frames.
STDLIB_PREFIX = "stdlib/"
HARNESS_FRAMES = ("torch/", "stackcheck/", STDLIB_PREFIX, "typing_extensions.py:")


class Verdict(StrEnum):
    """Every verdict a cell can get, worst first: a family's summary shows the worst of its cells."""

    NEW_FAILURE = "new_failure"
    ERROR = "error"  # scenario not reached, setup broke, or the cell was lost
    FIXED = "fixed"  # passes where the ledger expects a bug: the ledger is stale, so it outranks known_bug
    KNOWN_BUG = "known_bug"
    NOT_AFFECTED = "not_affected"  # the scenario does not exist yet on versions that predate the bug
    PASS = "pass"
    SKIPPED = "skipped"
    NOT_APPLICABLE = "not_applicable"  # the scenario cannot exist on this architecture (a structure it lacks)


PASS, KNOWN_BUG, NEW_FAILURE, FIXED, ERROR, SKIPPED, NOT_AFFECTED, NOT_APPLICABLE = (
    Verdict.PASS, Verdict.KNOWN_BUG, Verdict.NEW_FAILURE, Verdict.FIXED, Verdict.ERROR, Verdict.SKIPPED, Verdict.NOT_AFFECTED,
    Verdict.NOT_APPLICABLE,
)
SEVERITY = list(Verdict)


class LedgerError(ValueError):
    """ledger.toml is malformed: the message names the entry and what is wrong with it."""


@dataclass(frozen=True)
class Signature:
    """How a failure of the bug looks, by its mechanism: the exception class (anywhere in its MRO), the whole message
    (`message` must match all of it), where it raised (see `Failure.raising_frame`), and for a numeric bug the band of
    measured values it is known at.

    Where it raised: one of `frames`, or any function of one of `modules` (the library files the bug raises in). A
    release that moves the raise to another function of the same file (transformers 5.14.0 moved the offloaded save's
    lookup out of `remove_tied_weights_from_state_dict`) is the same mechanism; another file is another one."""

    exception: str
    message: str
    frames: tuple[str, ...]  # `frame` in ledger.toml: one frame, or a list of the frames the bug raises from
    band: tuple[float, float] | None = None
    modules: tuple[str, ...] = ()  # `module` in ledger.toml; by default the files of its library frames

    @property
    def frame(self) -> str:
        return self.frames[0]

    def raised_where(self, failure: Failure) -> bool:
        """Raised by one of its frames, or in one of its modules."""
        return (any(failure.raising_frame_for(frame) == frame for frame in self.frames)
                or any(module_of(failure.raising_frame_for(module)) == module for module in self.modules))

    @property
    def library_level(self) -> bool:
        """Raised by a library's own frame, not by a family's assertion: the bug is known wherever it fires, in any
        family, a contract family or a user's config reaching it from another direction."""
        return not any(frame.startswith(TESTS_PREFIX) for frame in self.frames)

    def matches_type_and_frame(self, failure: Failure) -> bool:
        return self.exception in failure.exception_mro and any(failure.raising_frame_for(frame) == frame for frame in self.frames)

    def matches_message(self, failure: Failure) -> bool:
        return re.fullmatch(self.message, failure.message, re.DOTALL) is not None

    def in_band(self, failure: Failure) -> bool:
        if self.band is None:
            return failure.measured is None
        return failure.measured is not None and math.isfinite(failure.measured) and self.band[0] <= failure.measured <= self.band[1]

    def matches(self, failure: Failure) -> bool:
        return (self.exception in failure.exception_mro and self.raised_where(failure) and self.matches_message(failure)
                and self.in_band(failure))

    def same_message_elsewhere(self, failure: Failure) -> bool:
        """Its whole message (and band), raised by another mechanism: another exception class or another module."""
        return self.matches_message(failure) and self.in_band(failure) and not self.matches(failure)


@dataclass(frozen=True)
class Bound:
    """The evidence for one bound of a bug's `affected` range: the release just outside it and the first inside it,
    measured by `run`; or the `reason` it cannot be measured; or the two releases that will measure it (`awaits`)."""

    outside: str | None = None
    inside: str | None = None
    run: str | None = None
    reason: str | None = None
    awaits: tuple[str, ...] = ()

    @property
    def state(self) -> str:
        return "measured" if self.run else "reason" if self.reason else "awaits"


@dataclass(frozen=True)
class Bug:
    id: str
    summary: str
    links: tuple[str, ...]
    upstream_status: str
    affected: dict[str, SpecifierSet]
    signature: Signature
    cpu_flag: str | None = None  # shows only on a CPU with this extension (hostinfo.CPU_FLAGS)
    architectures: tuple[str, ...] = ()  # the model types whose code it lives in (`model_type`); empty: every architecture
    workaround: str | None = None  # what a user does meanwhile, without changing versions
    # The model types where it is measured to show, for a library-level bug whose showing depends on the model's
    # size (a 4-bit merge's rounding against the adapter): a pass elsewhere is no evidence of a fix. Empty: wherever
    # it lives.
    expected_on: tuple[str, ...] = ()
    bounds: dict[str, Bound] = field(default_factory=dict)  # by bound_key: the evidence of each bound of `affected`
    reported: bool = True  # False: found here and filed nowhere upstream yet (docs/findings.md lists it, with its issue text)

    @property
    def silent(self) -> bool:
        """Nothing raises: the library returned, and only a family's own assertion sees the weights, the memory or
        the numbers are wrong."""
        return (self.signature.exception in ("AssertionError", "ToleranceExceeded")
                and all(frame.startswith(TESTS_PREFIX) for frame in self.signature.frames))

    def lives_on(self, model_type: str | None) -> bool:
        """Whether the bug can show on an architecture of `model_type` (None: a test that builds no model)."""
        return not self.architectures or model_type is None or model_type in self.architectures

    def expected(self, model_type: str | None, versions: dict[str, str]) -> bool:
        """Whether a pass here says the bug is fixed: it lives here, is measured to show here, and is in range."""
        shows = not self.expected_on or model_type is None or model_type in self.expected_on
        return self.lives_on(model_type) and shows and self.affects(versions)

    def affects(self, versions: dict[str, str]) -> bool:
        """True when every pinned constraint holds for the installed versions."""
        return not self.unmet(versions)

    def unmet(self, versions: dict[str, str]) -> list[tuple[str, Specifier]]:
        """The (package, specifier) clauses of `affected` the installed versions fail."""
        failed = []
        for package, specifiers in self.affected.items():
            installed = versions.get(package)
            for spec in specifiers:
                if installed in (None, "absent") or not spec.contains(Version(installed), prereleases=True):
                    failed.append((package, spec))
        return failed

    def predates(self, versions: dict[str, str]) -> bool:
        """True when the versions fail a lower bound of `affected`: the bug was not introduced yet."""
        return any(spec.operator in (">=", ">") for _package, spec in self.unmet(versions))

    def describe_range(self) -> str:
        return ", ".join(f"{package}{spec}" for package, spec in self.affected.items()) or "every version"


@dataclass(frozen=True)
class Family:
    id: str
    title: str
    bugs: tuple[tuple[Bug, tuple[str, ...]], ...]  # (bug, test-name patterns it applies to)

    def bugs_for(self, test_name: str) -> list[Bug]:
        return [bug for bug, patterns in self.bugs if any(fnmatch.fnmatch(test_name, p) for p in patterns)]


@dataclass(frozen=True)
class Failure:
    """What a verdict needs to know about an exception, detached from the live traceback."""

    exception_type: str
    exception_mro: tuple[str, ...]
    message: str
    frames: tuple[str, ...]  # "path:function", innermost last
    measured: float | None = None  # a numeric assertion's value (scenario.ToleranceExceeded)
    not_reached: bool = False  # the test could not prove its precondition (scenario.ScenarioNotReached)
    api_absent: bool = False  # the release under test has no API the family drives (proof.ApiAbsent, a ScenarioNotReached)

    @classmethod
    def from_exception(cls, exc: BaseException, not_reached: bool = False) -> Failure:
        """The failure of `exc`. An exception that reports a process the test ran failing (a `child_failure`: the
        Failure that process wrote of its own exception) is that failure, below the frames that ran the process: the
        ledger judges what raised in the child (a library's exception, message and frame), not the report of it."""
        frames = tuple(f"{short_path(f.filename)}:{f.name}" for f in traceback.extract_tb(exc.__traceback__)
                       if f.name not in COMPREHENSION_FRAMES)
        child = getattr(exc, "child_failure", None)
        if isinstance(child, Failure):
            return replace(child, frames=frames + child.frames, not_reached=not_reached or child.not_reached)
        mro = tuple(k.__name__ for k in type(exc).__mro__)
        message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        if isinstance(exc, AssertionError):
            # pytest's assertion rewriting appends its own explanation; the ledger describes the test's message.
            message = re.sub(r"\nassert .*\Z", "", message, flags=re.DOTALL)
        # Recognised by name, as a process pytest does not run may import stackcheck again.
        api_absent = "ApiAbsent" in mro and "ScenarioNotReached" in mro
        return cls(type(exc).__name__, mro, message, frames, getattr(exc, "measured", None), not_reached or api_absent, api_absent)

    @classmethod
    def raised_outside_pytest(cls, exc: BaseException) -> Failure:
        """The failure of an exception caught in a process pytest does not run (a rank, a fresh resume), where the
        ScenarioNotReached class may come from another import of stackcheck: recognised by its name."""
        return cls.from_exception(exc, "ScenarioNotReached" in (k.__name__ for k in type(exc).__mro__))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Failure:
        return cls(**{**data, "exception_mro": tuple(data["exception_mro"]), "frames": tuple(data["frames"])})

    @property
    def raising_frame(self) -> str:
        """The innermost frame outside torch and stackcheck's helpers: the code whose call failed.

        Not "any frame on the stack": Gemma 4's forward is on the stack of every forward, so a KeyError
        raised anywhere below it would read as the shared-KV bug. Not the literal innermost frame either:
        a torch wrapper (`torch/utils/_device.py`, `torch/_tensor.py`) may sit below the library's call,
        and which one does changes with torch releases and with the context the call runs in."""
        return next((f for f in reversed(self.frames) if not f.startswith(HARNESS_FRAMES)), self.frames[-1] if self.frames else "?")

    def raising_frame_for(self, expected: str) -> str:
        """The raising frame as a signature naming `expected` sees it. A signature that names a torch frame (a check
        torch itself makes, such as FSDP2 refusing a parameter shared by two groups) is matched against the
        innermost torch frame; every other signature against `raising_frame`."""
        if expected.startswith("torch/"):
            return next((f for f in reversed(self.frames) if f.startswith("torch/")), self.raising_frame)
        return self.raising_frame

    def signature(self) -> str:
        first_line = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.exception_type}: {first_line[:200]} @ {self.raising_frame}"


def module_of(frame: str) -> str:
    """The file of a "path/file.py:function" frame."""
    return frame.rpartition(":")[0] or frame


def short_path(filename: str) -> str:
    """The frame's file as every machine names it: under site-packages, the repository or the standard
    library (`stdlib/collections/__init__.py`, wherever the interpreter lives)."""
    path = filename.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    stdlib = sysconfig.get_paths()["stdlib"].replace("\\", "/") + "/"
    if path.startswith(stdlib):
        return STDLIB_PREFIX + path[len(stdlib) :]
    root = str(REPO_ROOT).replace("\\", "/") + "/"
    if path.startswith(root):
        return path[len(root) :]
    # Another interpreter's standard library (a stack dump read on another machine): .../lib/python3.N/...
    other_stdlib = re.search(r"/lib/python3\.\d+/(.+)$", path)
    return STDLIB_PREFIX + other_stdlib.group(1) if other_stdlib else path


@dataclass
class Judgement:
    verdict: Verdict
    bug: str | None = None
    signature: str | None = None
    note: str | None = None
    links: list[str] = field(default_factory=list)


def family_paths(families_dir: Path = FAMILIES_DIR, contract_dir: Path = CONTRACT_DIR) -> dict[str, Path]:
    """Every family module by family id: the bug families' tests/families/test_<id>.py and the contract families'
    tests/contract/<phase>/test_<id>.py. An id is unique across both (the ledger has one table of families)."""
    found: dict[str, Path] = {}
    for path in sorted([*families_dir.glob("test_*.py"), *contract_dir.glob("*/test_*.py")]):
        family = path.stem.removeprefix("test_")
        if family in found:
            raise LedgerError(f"families: two modules for family '{family}': {found[family]} and {path}")
        found[family] = path
    return found


def family_path(family: str) -> str:
    """The module of a family as pytest names it from the repository root (tests/.../test_<id>.py); a family with
    no module yet is named where a bug family would live."""
    path = family_paths().get(family, FAMILIES_DIR / f"test_{family}.py")
    return path.relative_to(REPO_ROOT).as_posix()


def family_needs(family: str, families_dir: Path | None = None) -> frozenset[str]:
    """The model structures a family's module needs (its module-level `pytestmark = pytest.mark.needs(...)`), read
    without importing it: what `doctor` and `scan` narrow the known bugs by, with no library imported."""
    path = families_dir / f"test_{family}.py" if families_dir else family_paths().get(family)
    if path is None or not path.is_file():
        return frozenset()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
                and isinstance(node.value, ast.Call) and getattr(node.value.func, "attr", None) == "needs"):
            return frozenset(arg.value for arg in node.value.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str))
    return frozenset()


def family_modules(families_dir: Path = FAMILIES_DIR, contract_dir: Path = CONTRACT_DIR) -> list[str]:
    """The family ids that have a module (bug families and contract families)."""
    return sorted(family_paths(families_dir, contract_dir))


def _require(condition: object, where: str, what: str) -> None:
    if not condition:
        raise LedgerError(f"ledger.toml: {where}: {what}")


def _keys(entry: Any, where: str, required: set[str], optional: AbstractSet[str] = frozenset()) -> dict[str, Any]:
    _require(isinstance(entry, dict), where, "expected a table")
    _require(required <= entry.keys(), where, f"missing {', '.join(sorted(required - entry.keys()))}")
    _require(entry.keys() <= required | optional, where, f"unknown key {', '.join(sorted(entry.keys() - required - optional))}")
    return entry


def _parse_bug(bug_id: str, entry: Any, packages: tuple[str, ...]) -> Bug:
    where = f"bugs.{bug_id}"
    _keys(entry, where, {"summary", "links", "upstream_status", "affected", "signature"},
          {"cpu_flag", "architectures", "workaround", "expected_on", "bounds", "reported"})
    _require(isinstance(entry.get("reported", True), bool), where, "reported must be true or false")
    architectures, expected_on = entry.get("architectures", []), entry.get("expected_on", [])
    for key, value in (("architectures", architectures), ("expected_on", expected_on)):
        _require(isinstance(value, list) and all(isinstance(x, str) for x in value), where,
                 f"{key} must be a list of model types (config.json's model_type)")
    _require(not (architectures and expected_on), where, "expected_on is for bugs of every architecture; architectures already narrows this one")
    _require(isinstance(entry.get("workaround", ""), str), where, "workaround must be a string")
    _require(entry.get("cpu_flag") in (None, *CPU_FLAGS), where, f"cpu_flag must be one of {', '.join(CPU_FLAGS)}")
    _require(isinstance(entry["links"], list) and entry["links"] and all(isinstance(x, str) for x in entry["links"]), where, "links must be a non-empty list of strings")
    affected = {}
    for package, spec in _keys(entry["affected"], f"{where}.affected", set(), set(packages)).items():
        try:
            affected[package] = SpecifierSet(spec)
        except (InvalidSpecifier, TypeError):
            raise LedgerError(f"ledger.toml: {where}.affected.{package}: '{spec}' is not a PEP 440 specifier") from None
    sig = _keys(entry["signature"], f"{where}.signature", {"exception", "message", "frame"}, {"band", "module"})
    try:
        re.compile(sig["message"])
    except (re.error, TypeError) as exc:
        raise LedgerError(f"ledger.toml: {where}.signature.message does not compile: {exc}") from None
    frames = [sig["frame"]] if isinstance(sig["frame"], str) else sig["frame"]
    _require(isinstance(frames, list) and frames and all(isinstance(f, str) and re.fullmatch(r"[^:\s]+\.py:\w+", f) for f in frames),
             where, "signature.frame must be 'path/file.py:function' or a non-empty list of them")
    band = sig.get("band")
    if band is not None:
        _require(isinstance(band, list) and len(band) == 2 and all(isinstance(x, int | float) for x in band) and band[0] <= band[1],
                 where, "signature.band must be [low, high] with low <= high")
        band = (float(band[0]), float(band[1]))
    library_frames = [f for f in frames if not f.startswith(TESTS_PREFIX)]
    modules = sig.get("module", sorted({module_of(f) for f in library_frames}))
    modules = [modules] if isinstance(modules, str) else modules
    _require(isinstance(modules, list) and all(isinstance(m, str) and re.fullmatch(r"[^:\s]+\.py", m)
                                               and not m.startswith((TESTS_PREFIX, "stackcheck/")) for m in modules),
             where, "signature.module must be a library file 'path/file.py' or a list of them")
    _require(library_frames or not modules, where, "signature.module is for a bug a library raises; a family's own assertion is matched by its frame")
    signature = Signature(sig["exception"], sig["message"], tuple(frames), band, tuple(modules))
    bounds = _parse_bounds(where, entry.get("bounds", {}), affected)
    return Bug(bug_id, entry["summary"], tuple(entry["links"]), entry["upstream_status"], affected, signature,
               entry.get("cpu_flag"), tuple(architectures), entry.get("workaround"), tuple(expected_on), bounds,
               entry.get("reported", True))


def bound_key(package: str, spec: Specifier) -> str:
    """How ledger.toml names one bound of `affected`: "peft>=0.19.0"."""
    return f"{package}{spec}"


def _parse_bounds(where: str, table: Any, affected: dict[str, SpecifierSet]) -> dict[str, Bound]:
    """`bounds`: per bound of `affected`, the releases that measured it, or why it cannot be measured. Each measured
    pair is checked against the bound: `outside` fails it, `inside` meets it."""
    _require(isinstance(table, dict), where, "bounds must be a table keyed by bound (\"peft>=0.19.0\")")
    known = {bound_key(package, spec): spec for package, specs in affected.items() for spec in specs}
    bounds = {}
    for key, value in table.items():
        at = f"{where}.bounds.\"{key}\""
        _require(key in known, at, f"names no bound of affected (its bounds: {', '.join(sorted(known)) or 'none'})")
        _keys(value, at, set(), {"outside", "inside", "run", "reason", "awaits"})
        forms = [form for form in (("outside", "inside", "run"), ("reason",), ("awaits",)) if form[0] in value]
        _require(len(forms) == 1 and set(value) == set(forms[0]), at,
                 "give outside, inside and run (measured), or reason (cannot be measured), or awaits (the releases that will measure it)")
        spec = known[key]
        if "awaits" in value:
            _require(isinstance(value["awaits"], list) and len(value["awaits"]) == 2, at, "awaits must be [outside, inside]: two releases")
            pair = value["awaits"]
        elif "reason" in value:
            _require(isinstance(value["reason"], str) and value["reason"].strip(), at, "reason must be a non-empty string")
            pair = None
        else:
            _require(isinstance(value["run"], str) and value["run"].strip(), at, "run must say which run measured it")
            pair = [value["outside"], value["inside"]]
        if pair is not None:
            try:
                outside, inside = (Version(v) for v in pair)
            except (InvalidVersion, TypeError):
                raise LedgerError(f"ledger.toml: {at}: releases must be versions, got {pair}") from None
            _require(not spec.contains(outside, prereleases=True) and spec.contains(inside, prereleases=True), at,
                     f"{outside} must fail {spec} and {inside} meet it")
        bounds[key] = Bound(value.get("outside"), value.get("inside"), value.get("run"), value.get("reason"),
                            tuple(value.get("awaits", ())))
    return bounds


class Ledger:
    def __init__(self, path: Path = LEDGER_FILE):
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise LedgerError(f"{path.name}: {exc}") from None
        _keys(data, "top level", {"families", "bugs"})
        self.bugs = {bug_id: _parse_bug(bug_id, entry, PACKAGES) for bug_id, entry in data["bugs"].items()}
        self.families = {fam_id: self._family(fam_id, entry) for fam_id, entry in data["families"].items()}

    def _family(self, fam_id: str, entry: Any) -> Family:
        where = f"families.{fam_id}"
        _keys(entry, where, {"title", "bugs"})
        refs = []
        for ref in entry["bugs"]:
            if isinstance(ref, str):
                ref = {"id": ref, "tests": ["*"]}
            _keys(ref, f"{where}.bugs", {"id", "tests"})
            _require(ref["id"] in self.bugs, where, f"names unknown bug '{ref['id']}'")
            _require(isinstance(ref["tests"], list) and ref["tests"], where, f"tests of '{ref['id']}' must be a non-empty list")
            refs.append((self.bugs[ref["id"]], tuple(ref["tests"])))
        return Family(fam_id, entry["title"], tuple(refs))

    def check_modules(self, family_modules: list[str]) -> None:
        """Every family module has an entry and every entry a module (module names without `test_`)."""
        missing = sorted(set(family_modules) - self.families.keys())
        _require(not missing, "families", f"no entry for family module(s) {', '.join(f'test_{m}.py' for m in missing)}")
        orphans = sorted(self.families.keys() - set(family_modules))
        _require(not orphans, "families", f"no module tests/families/test_<id>.py or tests/contract/<phase>/test_<id>.py for {', '.join(orphans)}")

    def check_patterns(self, family: str, test_names: list[str]) -> None:
        """Every `tests` pattern of the family matches at least one of its collected tests."""
        for bug, patterns in self.families[family].bugs:
            for pattern in patterns:
                _require(any(fnmatch.fnmatch(name, pattern) for name in test_names),
                         f"families.{family}", f"tests pattern '{pattern}' of '{bug.id}' matches no collected test")

    def lives_on(self, bug: Bug, model_type: str, structures: frozenset[str]) -> bool:
        """Whether `bug` can show on an architecture of `model_type` with `structures`: it is not tied to other
        model types, and one of the families that list it can run there (its module needs no structure the
        architecture lacks). A bug no family lists (known wherever it fires, found by a contract family) lives on
        every architecture its own `architectures` allows."""
        families = [family for family in self.families.values() if any(b.id == bug.id for b, _ in family.bugs)]
        return bug.lives_on(model_type) and (not families or any(family_needs(family.id) <= structures for family in families))

    def judge(self, family: str, test_name: str, versions: dict[str, str], failure: Failure | None,
              model_type: str | None = None) -> Judgement:
        """Verdict for a test that passed (failure is None), could not reach its scenario, or failed, on an
        architecture of `model_type` (None: the test builds no model). A bug of other architectures is never
        expected here, and its signature here is a new failure that names it.

        A known bug is known wherever it fires: a failure that none of the family's own bugs explains is matched
        against every bug of the ledger (its whole signature: exception, message, raising frame, band), so a
        contract family, or a bug family reaching another family's bug from a new direction, files it under that
        bug when the versions are in its range. Only the family's own bugs are ever expected to fail here: a pass
        is `fixed` for them alone."""
        listed = self.families[family].bugs_for(test_name)
        candidates = [bug for bug in listed if bug.lives_on(model_type)]
        if failure is None:
            expected = [bug for bug in candidates if bug.expected(model_type, versions)]
            if expected:
                bug = expected[0]
                return Judgement(FIXED, bug.id, note=f"passes although the ledger says these versions have {bug.id}", links=list(bug.links))
            return Judgement(PASS)
        signature = failure.signature()
        if failure.api_absent:
            # The release under test predates the API the family drives (proof.require_api): nothing to judge.
            return Judgement(NOT_AFFECTED, None, signature, failure.message.removeprefix("scenario not reached: "))
        if failure.not_reached:
            # A known bug that keeps the scenario from being reached (its whole signature, in its range, on an
            # architecture it lives on) is that bug: the cell says why, and says nothing of the family's own property.
            for bug in [*candidates, *(b for b in self.bugs.values() if b not in candidates)]:
                if bug.lives_on(model_type) and bug.affects(versions) and bug.signature.matches(failure):
                    return Judgement(KNOWN_BUG, bug.id, signature, "its scenario was not reached because of this bug", list(bug.links))
            # A test no bug applies to (a control) stands or falls with its family's scenario.
            pool = candidates or [bug for bug, _patterns in self.families[family].bugs]
            if pool and all(bug.predates(versions) for bug in pool):
                bugs = "; ".join(f"{bug.id} needs {bug.describe_range()}" for bug in pool)
                return Judgement(NOT_AFFECTED, None, signature, f"these versions predate the bug: {bugs}")
            return Judgement(ERROR, signature=signature, note="scenario not reached")
        for bug in candidates:
            if bug.signature.matches(failure):
                if bug.affects(versions):
                    return Judgement(KNOWN_BUG, bug.id, signature, None, list(bug.links))
                note = f"known bug outside its affected range ({bug.describe_range()})"
                return Judgement(NEW_FAILURE, bug.id, signature, note, list(bug.links))
        for bug in listed:
            if bug not in candidates and bug.signature.matches(failure):
                note = f"known bug of other architectures ({', '.join(bug.architectures)}), not {model_type}"
                return Judgement(NEW_FAILURE, bug.id, signature, note, list(bug.links))
        if (elsewhere := self._known_elsewhere(family, listed, failure, versions, model_type)) is not None:
            return elsewhere
        numeric = [(bug, bug.signature.band) for bug in candidates if bug.signature.band
                   and bug.signature.matches_type_and_frame(failure) and bug.signature.matches_message(failure)]
        if numeric:
            bug, (low, high) = min(numeric, key=lambda pair: _distance(failure.measured, pair[1]))
            note = f"measured {failure.measured} outside the band [{low}, {high}] of the nearest known bug {bug.id}"
            return Judgement(NEW_FAILURE, bug.id, signature, note, list(bug.links))
        for bug in candidates:
            if bug.signature.matches_type_and_frame(failure):
                return Judgement(NEW_FAILURE, bug.id, signature, f"new signature of known bug {bug.id}", list(bug.links))
        # A bug's whole message from another mechanism (another exception class, or raised in another library module):
        # named, never known. Raised by a test's own code, it names nothing (a short message such as a KeyError's key
        # is no kinship there).
        others = [b for b in self.bugs.values() if b not in candidates]
        for bug in [*candidates, *others] if not failure.raising_frame.startswith(TESTS_PREFIX) else []:
            if bug.signature.same_message_elsewhere(failure):
                where = ", ".join(bug.signature.modules or bug.signature.frames)
                note = (f"new signature of known bug {bug.id}: its message from another mechanism ({failure.exception_type} "
                        f"in {failure.raising_frame}; the bug: {bug.signature.exception} in {where})")
                return Judgement(NEW_FAILURE, bug.id, signature, note, list(bug.links))
        return Judgement(NEW_FAILURE, None, signature)


    def families_of(self, bug: Bug) -> list[str]:
        return [family.id for family in self.families.values() if any(b.id == bug.id for b, _ in family.bugs)]

    def _known_elsewhere(self, family: str, listed: list[Bug], failure: Failure, versions: dict[str, str],
                         model_type: str | None) -> Judgement | None:
        """The verdict of a failure that a bug the family does not list explains, if one does: `known_bug` in its
        range and on an architecture it lives on, else a `new_failure` that names it."""
        matching = [bug for bug in self.bugs.values() if bug not in listed and bug.signature.matches(failure)]
        if not matching:
            return None
        signature = failure.signature()
        for bug in matching:
            if bug.lives_on(model_type) and bug.affects(versions):
                listed_under = ", ".join(self.families_of(bug)) or "no family"
                note = f"known bug {bug.id} (listed under {listed_under}) reached from {family}"
                return Judgement(KNOWN_BUG, bug.id, signature, note, list(bug.links))
        bug = matching[0]
        if not bug.lives_on(model_type):
            note = f"known bug of other architectures ({', '.join(bug.architectures)}), not {model_type}, reached from {family}"
        else:
            note = f"known bug outside its affected range ({bug.describe_range()}), reached from {family}"
        return Judgement(NEW_FAILURE, bug.id, signature, note, list(bug.links))


def _distance(value: float | None, band: tuple[float, float]) -> float:
    if value is None or not math.isfinite(value):
        return math.inf
    return max(band[0] - value, value - band[1], 0.0)
