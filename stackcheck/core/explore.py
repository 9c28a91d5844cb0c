"""Explore mode, in the style of Hypothesis: configurations of a contract test's axes sampled beyond its pairwise cover
(deterministic from a seed), each an extra cell whose id says it is explored; and shrinking, which moves a failing
configuration's axes back toward their first (simplest) values, one at a time, while the failure stays the same.

Pure: no library, no pytest. The pytest child samples (stackcheck.child.axes), the command side shrinks by running
the real test (stackcheck.commands.explore). How both work: docs/internals.md, "core/explore.py".
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass

# The last token of an explored cell's id (`test_x[cpu-llama3-...-explored]`): never a value id of a cover.
EXPLORED = "explored"
# The keys an explored cell adds to its record in matrix.json (stackcheck.core.cell.Cell keeps them as `extra`).
EXPLORED_KEY, SHRUNK_KEY = "explored", "shrunk"
# Past this many configurations (the product of the axes) the sample is drawn by rejection, not from a list of all.
ENUMERATE_UP_TO = 100_000
ATTEMPTS_PER_SAMPLE = 50

Config = dict[str, str]  # axis -> value id, in the axes' order
Combination = Mapping[str, str]  # an invalid combination: axis -> value id


def refused(config: Mapping[str, str], invalid: Iterable[Combination]) -> bool:
    """Whether `config` (axis -> value id, possibly partial) holds every value of one invalid combination."""
    return any(all(name in config and config[name] == vid for name, vid in combo.items()) for combo in invalid)


def sample(axes: Mapping[str, Sequence[str]], covered: Iterable[Sequence[str]], count: int, seed: int, invalid: Iterable[Combination] = (),
           key: str = "") -> list[tuple[str, ...]]:
    """`count` distinct configurations over `axes` (name -> value ids, in order), none in `covered` (tuples in the axes'
    order: the pairwise cover) and none holding an `invalid` combination, drawn by `random.Random` seeded with the seed and
    `key` (the test's name: each test its own draw). The same arguments give the same cells on every machine and in every
    process (no set's order is read). Fewer where fewer exist."""
    names = list(axes)
    invalid = list(invalid)
    pairs = {tuple(cell) for cell in covered}
    rng = random.Random(f"{seed}:{key}")
    size = 1
    for name in names:
        size *= len(axes[name])
    if size <= ENUMERATE_UP_TO:
        left = [cell for cell in itertools.product(*(axes[name] for name in names))
                if cell not in pairs and not refused(dict(zip(names, cell)), invalid)]
        return rng.sample(left, min(count, len(left)))
    chosen: list[tuple[str, ...]] = []
    seen = set(pairs)
    for _ in range(count * ATTEMPTS_PER_SAMPLE):
        if len(chosen) == count:
            break
        cell = tuple(rng.choice(list(axes[name])) for name in names)
        if cell not in seen and not refused(dict(zip(names, cell)), invalid):
            seen.add(cell)
            chosen.append(cell)
    return chosen


def cell_id(cell: Sequence[str]) -> str:
    """An explored cell's parameter id: its value ids, then `explored` (pytest puts the lane before it)."""
    return "-".join([*cell, EXPLORED])


def parse_id(params: str, axes: Mapping[str, Sequence[str]]) -> tuple[str, ...] | None:
    """The configuration an explored cell's parameter id names (without the lane: `llama3-use_dora.true-...-explored`),
    or None where it names none of `axes` (a pair's id, another test's, a value the axes lack)."""
    tokens = params.split("-")
    if len(tokens) != len(axes) + 1 or tokens[-1] != EXPLORED:
        return None
    cell = tuple(tokens[:-1])
    return cell if all(vid in values for vid, values in zip(cell, axes.values())) else None


# --- shrinking ------------------------------------------------------------------------------------------------


NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def same_failure(signature: str | None, other: str | None) -> bool:
    """Whether two signatures ("Type: first line @ raising frame") are the same failure: the same exception type, first
    line and raising frame, a number in them aside (a measured value or a count moves with the configuration)."""
    if not signature or not other:
        return False
    return NUMBER.sub("#", signature) == NUMBER.sub("#", other)


@dataclass(frozen=True)
class Shrunk:
    config: Config  # the minimal configuration found (the original where nothing shrank)
    reproduced: bool  # whether the original configuration failed again; False: nothing was shrunk
    asked: int  # configurations asked about (a cache may have answered some)


Steps = Generator[list[Config], list[bool], Shrunk]


def shrink_steps(config: Mapping[str, str], order: Mapping[str, Sequence[str]], invalid: Iterable[Combination] = ()) -> Steps:
    """Shrinking as a generator: it yields batches of configurations and is sent, for each batch, whether each still
    fails the same way; it returns the Shrunk. Batches let a caller run many configurations (of many shrinks) in one
    process. The first batch is the original configuration (does it fail again?) with every single move from it.

    A move sets one axis to a value before its current one in `order` (the axis's values, simplest first: the first is
    the pairs' value, the default), simplest first. Each round asks every move from the current configuration, takes the
    first move of each axis that still fails, and tries them all at once; where that combination does not fail the same
    way, the first axis's move alone. It ends when no move still fails: every axis is at its first value, or moving it
    toward its first value loses the failure. A configuration holding an `invalid` combination is never asked."""
    invalid = list(invalid)
    current = dict(config)
    names = list(order)
    missing = [name for name in names if current.get(name) not in order[name]]
    if missing or set(current) != set(names):
        raise ValueError(f"the configuration {config} is not one of the axes {dict(order)}")
    asked = 0
    first = True
    while True:
        moves = [(name, {**current, name: value}) for name in names for value in order[name][:list(order[name]).index(current[name])]]
        moves = [(name, candidate) for name, candidate in moves if not refused(candidate, invalid)]
        batch = ([dict(current)] if first else []) + [candidate for _, candidate in moves]
        if not batch:
            return Shrunk(current, True, asked)
        answers = yield batch
        asked += len(batch)
        if first:
            first = False
            if not answers[0]:
                return Shrunk(current, False, asked)
            answers = answers[1:]
        chosen: dict[str, str] = {}
        for (name, candidate), fails in zip(moves, answers):
            if fails and name not in chosen:
                chosen[name] = candidate[name]
        if not chosen:
            return Shrunk(current, True, asked)
        if len(chosen) > 1 and not refused(combined := {**current, **chosen}, invalid):
            (fails,) = yield [combined]
            asked += 1
            if fails:
                current = combined
                continue
        name = next(iter(chosen))
        current = {**current, name: chosen[name]}


def shrink(config: Mapping[str, str], still_fails: Callable[[Config], bool], order: Mapping[str, Sequence[str]],
           invalid: Iterable[Combination] = ()) -> Shrunk:
    """The minimal configuration of a failing `config`: `shrink_steps` asked one configuration at a time through
    `still_fails` (does this configuration fail the same way?)."""
    steps = shrink_steps(config, order, invalid)
    batch = next(steps)
    while True:
        try:
            batch = steps.send([still_fails(candidate) for candidate in batch])
        except StopIteration as done:
            return done.value


def drive(shrinks: Sequence[Steps], answer: Callable[[list[Config], list[int]], list[bool]]) -> list[Shrunk]:
    """Run several shrinks side by side: each round gathers the batch every unfinished shrink asks, and `answer` gets
    them all at once (the configurations, and which shrink asked each), so that one process runs a round."""
    done: list[Shrunk | None] = [None] * len(shrinks)
    pending: dict[int, list[Config]] = {i: next(steps) for i, steps in enumerate(shrinks)}
    while pending:
        asked = [(i, config) for i, batch in pending.items() for config in batch]
        answers = answer([config for _, config in asked], [i for i, _ in asked])
        following: dict[int, list[Config]] = {}
        for i in pending:
            mine = [fails for (j, _), fails in zip(asked, answers) if j == i]
            try:
                following[i] = shrinks[i].send(mine)
            except StopIteration as finished:
                done[i] = finished.value
        pending = following
    return [shrunk for shrunk in done if shrunk is not None]
