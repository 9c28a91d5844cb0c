"""The cell: one family test's verdict in one set, lane and architecture, as the plugin records it in
matrix.json and every command reads it back (the matrix, the gate, repro, bisect and history).

On disk a cell is a JSON object with the keys of `KEYS` (always all of them, null where nothing applies),
`ranks` for a distributed job and `run` for the run that recorded it; keys a later stackcheck adds are kept
as they are. `Cell.from_dict(cell.to_dict()) == cell`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from stackcheck.core.ledger import ERROR

# The keys every recorded cell has, in this order (matrix.json's format).
KEYS = ("set", "family", "test", "lane", "arch", "verdict", "signature", "bug", "note", "seconds")
# Keys a cell has only where they apply: a distributed job's ranks (stackcheck.distributed.outcome.rank_record),
# the id of the pytest run that recorded it (stackcheck.core.protocol.RUN_ENV), and the failure's detail.
# `detail`: the tail of a new_failure's or error's message (a child process's output, say), kept for research.
# `evidence`: what the verdict was judged from, to judge it again under another ledger (stackcheck.child.evidence).
OPTIONAL_KEYS = ("ranks", "run", "detail", "evidence")
DETAIL_LINES, DETAIL_CHARS = 30, 3000
LOST = "cell lost: the run ended before this cell's verdict (a crashed worker or process)"
# A cell a run collected and has not given a verdict (yet): kept apart from the verdicts, in matrix.json's `not_run`
# (stackcheck.core.results), never in place of one. A run stopped or killed before the cell leaves it so.
NOT_RUN = "not_run"
NOT_RUN_NOTE = "not run: the run ended before this cell (stopped, killed, or crashed), or is still running"


def detail_of(message: str) -> str | None:
    """What a failure's message says past its first line (which the signature keeps), at most its last
    DETAIL_LINES lines and DETAIL_CHARS characters; None where it says nothing more."""
    rest = message.strip().splitlines()[1:]
    text = "\n".join(rest[-DETAIL_LINES:]).strip()
    return text[-DETAIL_CHARS:] or None


def lane_of(nodeid: str) -> str:
    """The lane is the first parameter of every family test (`test_x[cpu-nf4]`)."""
    params = nodeid.partition("[")[2]
    return params.split("-", 1)[0].rstrip("]") if params else "cpu"


def arch_of(nodeid: str, arch_names: list[str]) -> str | None:
    """The architecture of a family test id, its second parameter (`test_x[cpu-llama3-nf4]`); None for a test
    that builds no model (its second parameter, if any, is no architecture of the run)."""
    params = nodeid.partition("[")[2].rstrip("]").split("-")
    return params[1] if len(params) > 1 and params[1] in arch_names else None


@dataclass(frozen=True)
class Cell:
    set_name: str
    family: str
    test: str  # the pytest node id, or `<module>[<lane>]` for a module that did not import
    lane: str
    verdict: str  # a stackcheck.core.ledger.Verdict's value
    arch: str | None = None  # None: the test builds no model
    signature: str | None = None  # "Type: first line @ raising frame"
    bug: str | None = None
    note: str | None = None
    seconds: float = 0.0
    ranks: list[dict] | None = None
    run: str | None = None
    detail: str | None = None  # the message's last lines beyond the signature's first one (`detail_of`)
    evidence: dict | None = None  # what the verdict was judged from (stackcheck.child.evidence)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # keys of a later format, kept as they are

    @property
    def key(self) -> tuple[str, str, str]:
        """What a cell of a later run replaces: the same set, lane and test."""
        return self.set_name, self.lane, self.test

    @property
    def function(self) -> str:
        """The test function's name."""
        return self.test.split("::", 1)[-1].split("[", 1)[0]

    @property
    def failure(self) -> str:
        """"Type: first line", the signature without its raising frame."""
        return (self.signature or "").rsplit(" @ ", 1)[0]

    @property
    def module_level(self) -> bool:
        """A cell of a whole module (it did not import, or its environment was not built), not of one test."""
        return "::" not in self.test and self.test.partition("[")[0].endswith(".py")

    def replace(self, **changes) -> Cell:
        return dataclasses.replace(self, **changes)

    @classmethod
    def judged(cls, set_name: str, family: str, nodeid: str, arch_names: list[str], judgement, seconds: float = 0.0,
               run: str | None = None) -> Cell:
        """The cell of a test the ledger judged (a stackcheck.core.ledger.Judgement)."""
        return cls(set_name, family, nodeid, lane_of(nodeid), str(judgement.verdict), arch_of(nodeid, arch_names),
                   judgement.signature, judgement.bug, judgement.note, seconds, run=run)

    @classmethod
    def lost(cls, set_name: str, family: str, nodeid: str, arch_names: list[str], signature: str = LOST,
             note: str | None = None, run: str | None = None) -> Cell:
        """An `error` cell with no verdict of its own: a test whose worker crashed, a module that did not import."""
        return cls(set_name, family, nodeid, lane_of(nodeid), str(ERROR), arch_of(nodeid, arch_names), signature, None, note,
                   0.0, run=run)

    @classmethod
    def not_run(cls, set_name: str, family: str, nodeid: str, arch_names: list[str], run: str | None = None) -> Cell:
        """A collected cell without a verdict of its run: matrix.json's `not_run`, apart from the verdicts."""
        return cls(set_name, family, nodeid, lane_of(nodeid), NOT_RUN, arch_of(nodeid, arch_names), None, None, NOT_RUN_NOTE,
                   0.0, run=run)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cell:
        """A cell as matrix.json holds it (checked by stackcheck.core.results.load_checked where it comes from outside)."""
        known = {*KEYS, *OPTIONAL_KEYS}
        return cls(data["set"], data["family"], data["test"], data["lane"], str(data["verdict"]), data.get("arch"),
                   data.get("signature"), data.get("bug"), data.get("note"), data.get("seconds", 0.0),
                   data.get("ranks"), data.get("run"), data.get("detail"), data.get("evidence"), {k: v for k, v in data.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"set": self.set_name, "family": self.family, "test": self.test, "lane": self.lane, "arch": self.arch,
                                "verdict": self.verdict, "signature": self.signature, "bug": self.bug, "note": self.note,
                                "seconds": self.seconds}
        data |= {key: value for key, value in (("ranks", self.ranks), ("run", self.run), ("detail", self.detail),
                                                     ("evidence", self.evidence)) if value is not None}
        return self.extra | data
