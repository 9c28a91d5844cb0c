"""What each rank of a launched job ended with, and the one verdict of the cell: pure functions, no process.

A rank passed, failed (its `ledger.Failure`, judged like any single-process failure), hung (the launcher's
timeout ran out before it wrote an outcome: `error`, unless the stack its main thread was stuck in is a known bug's,
`hang_failure`), died (exited or was killed without writing one: a
Failure built from its exit status and the tail of its output, judged by the ledger too) or was stopped (the
launcher ended it after another rank failed: no verdict of its own).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path

from stackcheck.core.ledger import ERROR, KNOWN_BUG, PASS, SEVERITY, Failure, Judgement, short_path


class RankState(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    HUNG = "hung"
    DIED = "died"
    STOPPED = "stopped"


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    state: RankState
    failure: Failure | None = None  # FAILED and DIED
    seconds: float | None = None  # HUNG: how long the launcher waited
    stacks: str | None = None  # HUNG (dumped on the launcher's signal) and DIED (faulthandler on a fatal signal)
    result: dict | None = None  # PASSED: what the rank's function returned (its measured numbers)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RankOutcome:
        failure = data.get("failure")
        if failure is not None:
            failure = Failure.from_json(failure)
        return cls(data["rank"], RankState(data["state"]), failure, data.get("seconds"), data.get("stacks"), data.get("result"))

    def write(self, path: Path) -> None:
        """Atomically, so the launcher never reads half an outcome."""
        scratch = path.with_name(f".{path.name}.tmp")
        scratch.write_text(json.dumps(self.to_json(), indent=1))
        scratch.replace(path)

    def describe(self) -> str:
        if self.state == RankState.HUNG:
            return hang_message(self.rank, self.seconds)
        if self.failure is not None:
            return f"rank {self.rank} {self.state}: {self.failure.signature()}"
        return f"rank {self.rank} {self.state}"


def hang_message(rank: int, seconds: float | None) -> str:
    return f"rank {rank} hung after {seconds:.0f} s"


HANG_EXCEPTION = "RankHung"
_STACK_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+ in (?P<function>\S+)\s*$')


def stuck_frames(stacks: str | None) -> tuple[str, ...]:
    """The frames ("path:function", innermost last, as a Failure's) of the thread the rank's stack dump was taken in
    (faulthandler's "Current thread": the main thread, where the launcher's signal lands); none where there is none."""
    if not stacks or "Current thread" not in stacks:
        return ()
    block = stacks.split("Current thread", 1)[1].split("\n\n", 1)[0]
    found = [m for m in map(_STACK_FRAME.match, block.splitlines()) if m]
    return tuple(f"{short_path(m['file'])}:{m['function']}" for m in reversed(found))


def hang_failure(outcome: RankOutcome) -> Failure | None:
    """A hung rank as a Failure the ledger can match (exception RankHung, the hang's message, the frames it was stuck
    in), where its stacks say where: a hang whose raising frame (the innermost outside torch, the standard library
    and the harness) is a known bug's is that bug, whichever family reached it."""
    frames = stuck_frames(outcome.stacks)
    if not frames:
        return None
    return Failure(HANG_EXCEPTION, (HANG_EXCEPTION,), hang_message(outcome.rank, outcome.seconds), frames)


# A collective that failed because a peer's process is gone: gloo's TCP pair reads the connection closed or reset (at
# once, on the CPU lane), NCCL reports the remote process or aborts the communicator.
PEER_LOST = re.compile(r"Connection closed by peer|Connection reset by peer|remote process exited|NCCL communicator was aborted")


def lost_its_peer(outcome: RankOutcome) -> bool:
    return outcome.state == RankState.FAILED and outcome.failure is not None and bool(PEER_LOST.search(outcome.failure.message))


def torn_down(outcomes: list[RankOutcome]) -> list[RankOutcome]:
    """A rank whose only failure is a collective that lost its peer, beside a rank that failed or died on its own, was
    torn down with the job: stopped (its failure kept for the record), as a rank still waiting in the collective when
    the launcher reaps the job is. Without this a gloo job's verdict depended on timing: the waiting rank reads
    'Connection closed by peer' within the launcher's grace on a fast machine and not on a slow one, and an unknown
    signature beside a known bug made the cell a new failure. A job whose only failures are lost peers keeps them."""
    if not any(o.state in (RankState.FAILED, RankState.DIED) and not lost_its_peer(o) for o in outcomes):
        return outcomes
    return [replace(o, state=RankState.STOPPED) if lost_its_peer(o) else o for o in outcomes]


class RanksFailed(Exception):
    """A launched job in which some rank did not pass: carries every rank's outcome to the plugin, which judges
    each and combines them (`judge_ranks`)."""

    def __init__(self, outcomes: list[RankOutcome]):
        self.outcomes = outcomes
        super().__init__("; ".join(o.describe() for o in outcomes if o.state != RankState.PASSED))


def raise_unless_passed(outcomes: list[RankOutcome]) -> None:
    if any(o.state != RankState.PASSED for o in outcomes):
        raise RanksFailed(outcomes)


def judge_rank(outcome: RankOutcome, judge: Callable[[Failure], Judgement]) -> Judgement | None:
    """One rank's verdict; None for a rank stopped by the launcher. `judge` is the ledger's judgement of a failure
    of this test (`Ledger.judge` with the cell's family, test, versions and architecture). A rank that passed
    beside failing ones is a pass, never `fixed`: the bug showed on the others."""
    if outcome.state == RankState.PASSED:
        return Judgement(PASS)
    if outcome.state == RankState.STOPPED:
        return None
    if outcome.state == RankState.HUNG:
        failure = hang_failure(outcome)
        if failure is not None:
            known = judge(failure)
            if known.verdict == KNOWN_BUG:  # only a known bug: an unknown hang stays the harness's error, as before
                return replace(known, note=f"rank hung in {failure.raising_frame}, a known bug's frame; its stacks are in the cell")
        where = f" in {failure.raising_frame}" if failure is not None else ""
        return Judgement(ERROR, signature=hang_message(outcome.rank, outcome.seconds), note=f"rank hung{where}; its stacks are in the cell")
    return judge(outcome.failure)


def combine(judgements: dict[int, Judgement | None]) -> Judgement:
    """The cell's verdict from its ranks' (rank -> judgement, None where stopped): the worst verdict wins, with
    the bug, signature and links of the lowest rank that has it; the note lists every rank. A known bug on one
    rank and a pass on another is the known bug. Every rank stopped, or none at all, is an error."""
    judged = {rank: j for rank, j in sorted(judgements.items()) if j is not None}
    if not judged:
        return Judgement(ERROR, signature="no rank reached a verdict", note="every rank was stopped by the launcher")
    worst_rank, worst = min(judged.items(), key=lambda item: (SEVERITY.index(item[1].verdict), item[0]))
    ranks = "; ".join(f"rank {rank}: {j.verdict}" + (f" {j.bug}" if j.bug else "") if j else f"rank {rank}: stopped"
                      for rank, j in sorted(judgements.items()))
    note = f"rank {worst_rank}: {worst.note}; {ranks}" if worst.note else ranks
    return Judgement(worst.verdict, worst.bug, worst.signature, note, list(worst.links))


def judge_ranks(outcomes: list[RankOutcome], judge: Callable[[Failure], Judgement]) -> tuple[Judgement, list[dict]]:
    """(the cell's combined verdict, each rank's outcome as the cell records it)."""
    judgements = {o.rank: judge_rank(o, judge) for o in outcomes}
    return combine(judgements), [rank_record(o, judgements[o.rank]) for o in outcomes]


def rank_record(outcome: RankOutcome, judgement: Judgement | None) -> dict:
    """One rank's entry in the cell (`ranks`): its state, verdict, signature (a stopped rank's own failure, where it
    had one), and the stacks of a hung or dead rank."""
    signature = judgement.signature if judgement else (outcome.failure.signature() if outcome.failure else None)
    record = {"rank": outcome.rank, "state": str(outcome.state), "verdict": str(judgement.verdict) if judgement else None,
              "signature": signature, "bug": judgement.bug if judgement else None}
    if outcome.stacks:
        record["stacks"] = outcome.stacks
    if outcome.result:
        record["result"] = outcome.result
    return record
