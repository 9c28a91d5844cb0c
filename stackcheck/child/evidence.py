"""What a family test's verdict was judged from, kept on its cell as plain data (the cell's `evidence`), and the
same judgement made again from it. The verdicts plugin judges every test through `judge`; history, bisect and the
backtest judge stored cells again under today's ledger (`rejudge`), so a ledger change re-runs nothing.

Three shapes: `{"test": failure}` (None: it passed), `{"setup": failure, "outer": signature}` (a fixture broke; the
failure is what broke it) and `{"ranks": [outcome, ...]}` (a distributed job), each with the `model_type` of the
architecture the test built (None: none). Skips carry none: no ledger decides them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

from stackcheck.core.cell import Cell
from stackcheck.core.ledger import ERROR, KNOWN_BUG, Failure, Judgement, Ledger
from stackcheck.distributed.outcome import RankOutcome, judge_ranks

KEY = "evidence"  # the cell's key (stackcheck.core.cell.OPTIONAL_KEYS)
Judge = Callable[[Failure | None], Judgement]


def _plain(data: dict) -> dict:
    """JSON's types only (an enum as its value, a tuple as a list): a cell crosses xdist's wire and lands in JSON."""
    return json.loads(json.dumps(data, default=str))


def of_test(failure: Failure | None) -> dict:
    return _plain({"test": failure.to_json() if failure else None})


def of_setup(cause: Failure, outer: Failure | None) -> dict:
    """A setup that broke: `cause` is what broke it (a FixtureError's cause), `outer` the FixtureError itself
    (None where the setup raised the cause directly)."""
    return _plain({"setup": cause.to_json(), "outer": outer.signature() if outer else None})


def of_ranks(outcomes: list[RankOutcome]) -> dict:
    return _plain({"ranks": [o.to_json() for o in outcomes]})


def judge(evidence: dict, judge_failure: Judge) -> tuple[Judgement, list[dict] | None]:
    """The verdict `evidence` gives under `judge_failure` (the ledger's judgement of a failure of this cell's test),
    and a distributed job's rank records (None for any other test)."""
    if "ranks" in evidence:
        return judge_ranks([RankOutcome.from_json(o) for o in evidence["ranks"]], judge_failure)
    if "setup" in evidence:
        return _judge_setup(Failure.from_json(evidence["setup"]), evidence.get("outer"), judge_failure), None
    failure = evidence["test"]
    return judge_failure(Failure.from_json(failure) if failure is not None else None), None


def _judge_setup(cause: Failure, outer: str | None, judge_failure: Judge) -> Judgement:
    """A fixture that could not be built is judged like a test: what broke it is a `known_bug` where the ledger knows
    it in these versions. Anything else says nothing about the scenario under test: `error`, setup broke, never
    `new_failure`."""
    judgement = judge_failure(cause)
    if judgement.verdict == KNOWN_BUG:
        return dataclasses.replace(judgement, note=f"in the test's setup: {outer}" if outer else "in the test's setup")
    return Judgement(ERROR, signature=outer or cause.signature(), note="setup broke")


def rejudge(cell: Cell, ledger: Ledger, versions: dict[str, str]) -> Cell:
    """`cell` judged again from its evidence under `ledger`, with the versions its set had installed; a cell without
    evidence (a skip, a lost cell, one recorded before cells kept it) as it was."""
    evidence = cell.evidence
    if evidence is None:
        return cell
    test_name = cell.test.split("::", 1)[-1]

    def judge_failure(failure: Failure | None) -> Judgement:
        return ledger.judge(cell.family, test_name, versions, failure, evidence.get("model_type"))

    judgement, ranks = judge(evidence, judge_failure)
    return cell.replace(verdict=str(judgement.verdict), bug=judgement.bug, signature=judgement.signature,
                        note=judgement.note, ranks=ranks if ranks is not None else cell.ranks)
