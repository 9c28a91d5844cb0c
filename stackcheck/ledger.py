"""The ledger of known upstream bugs (ledger.toml) and the verdict every test result gets from it."""

from __future__ import annotations

import fnmatch
import re
import tomllib
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from stackcheck import REPO_ROOT

LEDGER_FILE = Path(__file__).with_name("ledger.toml")

PASS, KNOWN_BUG, NEW_FAILURE, FIXED, ERROR, SKIPPED = "pass", "known_bug", "new_failure", "fixed", "error", "skipped"
# Worst first: a family's cell in the report shows the worst verdict among its tests.
SEVERITY = [NEW_FAILURE, ERROR, KNOWN_BUG, FIXED, PASS, SKIPPED]


@dataclass(frozen=True)
class Signature:
    exception: str
    message: str
    frame: str

    def matches_type_and_frame(self, failure: Failure) -> bool:
        return self.exception in failure.exception_mro and any(f.endswith(self.frame) for f in failure.frames)

    def matches(self, failure: Failure) -> bool:
        return self.matches_type_and_frame(failure) and re.search(self.message, failure.message) is not None


@dataclass(frozen=True)
class Bug:
    id: str
    summary: str
    links: tuple[str, ...]
    upstream_status: str
    affected: dict[str, str]
    signature: Signature

    def affects(self, versions: dict[str, str]) -> bool:
        """True when every pinned constraint holds for the installed versions."""
        for package, spec in self.affected.items():
            installed = versions.get(package)
            if installed is None or not SpecifierSet(spec).contains(Version(installed), prereleases=True):
                return False
        return True


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

    @classmethod
    def from_exception(cls, exc: BaseException) -> Failure:
        frames = tuple(f"{_short_path(f.filename)}:{f.name}" for f in traceback.extract_tb(exc.__traceback__))
        mro = tuple(k.__name__ for k in type(exc).__mro__)
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        return cls(type(exc).__name__, mro, str(message), frames)

    def signature(self) -> str:
        first_line = self.message.strip().splitlines()[0] if self.message.strip() else ""
        where = next((f for f in reversed(self.frames) if not f.startswith("torch/")), self.frames[-1] if self.frames else "?")
        return f"{self.exception_type}: {first_line[:200]} @ {where}"


def _short_path(filename: str) -> str:
    path = filename.replace("\\", "/")
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    root = str(REPO_ROOT).replace("\\", "/") + "/"
    return path[len(root) :] if path.startswith(root) else path


@dataclass
class Verdict:
    verdict: str
    bug: str | None = None
    signature: str | None = None
    note: str | None = None
    links: list[str] = field(default_factory=list)


class Ledger:
    def __init__(self, path: Path = LEDGER_FILE):
        data = tomllib.loads(path.read_text())
        self.bugs = {
            bug_id: Bug(
                id=bug_id,
                summary=entry["summary"],
                links=tuple(entry["links"]),
                upstream_status=entry["upstream_status"],
                affected=dict(entry["affected"]),
                signature=Signature(**entry["signature"]),
            )
            for bug_id, entry in data["bugs"].items()
        }
        self.families = {
            fam_id: Family(fam_id, entry["title"], tuple(self._bug_ref(ref) for ref in entry["bugs"]))
            for fam_id, entry in data["families"].items()
        }

    def _bug_ref(self, ref: str | dict) -> tuple[Bug, tuple[str, ...]]:
        if isinstance(ref, str):
            return self.bugs[ref], ("*",)
        return self.bugs[ref["id"]], tuple(ref["tests"])

    def judge(self, family: str, test_name: str, versions: dict[str, str], failure: Failure | None) -> Verdict:
        """Verdict for a test that passed (failure is None) or failed with `failure`."""
        candidates = self.families[family].bugs_for(test_name)
        if failure is None:
            expected = [bug for bug in candidates if bug.affects(versions)]
            if expected:
                bug = expected[0]
                return Verdict(FIXED, bug.id, note=f"passes although the ledger says these versions have {bug.id}", links=list(bug.links))
            return Verdict(PASS)
        signature = failure.signature()
        for bug in candidates:
            if bug.signature.matches(failure):
                note = None if bug.affects(versions) else "known signature on versions the ledger marks unaffected"
                return Verdict(KNOWN_BUG, bug.id, signature, note, list(bug.links))
        for bug in candidates:
            if bug.signature.matches_type_and_frame(failure):
                return Verdict(NEW_FAILURE, bug.id, signature, f"new signature of known bug {bug.id}", list(bug.links))
        return Verdict(NEW_FAILURE, None, signature)
