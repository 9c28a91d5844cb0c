"""Shrinking, the command side of explore mode (`matrix --explore N --seed S`): each explored cell of a set that failed
(`new_failure` or `error`) is shrunk to a minimal configuration by running the real test (stackcheck.core.explore's
shrink, the shrinks of a set side by side: each round one pytest child in the set's environment runs every cell the
shrinks ask), recorded on the cell in matrix.json (`shrunk`), and printed with the line that reproduces it. How it
works: docs/internals.md, "commands/explore.py"; docs/running.md, "Explore and shrink".
"""

from __future__ import annotations

import shlex
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stackcheck.core import explore, results
from stackcheck.core.cell import Cell
from stackcheck.core.explore import EXPLORED_KEY, SHRUNK_KEY, Config
from stackcheck.core.ledger import ERROR, KNOWN_BUG, NEW_FAILURE
from stackcheck.core.versions import VersionSet
from stackcheck.models import architectures
from stackcheck.runner import lane

SHRUNK = (NEW_FAILURE, ERROR)  # the explored cells shrunk
FAILS = (NEW_FAILURE, ERROR, KNOWN_BUG)  # a configuration "still fails" with one of these and the same signature
SPREAD_FROM = 8  # a round of at least this many cells runs on one xdist worker per core


@dataclass(frozen=True)
class Target:
    """One failing explored cell and what its record says of its axes."""

    cell: Cell
    order: dict[str, list[str]]  # axis -> value ids, the first the pairs'
    pairwise: list[str]  # the axes of the pairs' cell ids
    invalid: list[dict[str, str]]

    @classmethod
    def of(cls, cell: Cell) -> Target:
        record = cell.extra[EXPLORED_KEY]
        return cls(cell, {name: list(values) for name, values in record["axes"]}, list(record["pairwise"]), list(record["invalid"]))

    @property
    def config(self) -> Config:
        return {name: self.cell.extra[EXPLORED_KEY]["config"][name] for name in self.order}

    def node_id(self, config: Config) -> str:
        """The explored cell of `config`, in the failing cell's test and lane."""
        return f"{self.cell.test.partition('[')[0]}[{self.cell.lane}-{explore.cell_id(tuple(config[name] for name in self.order))}]"

    def as_explored(self, other: Cell) -> str | None:
        """A cell of the same test and lane under the node id its configuration has as an explored cell (a pair's cell
        holds every other axis at its first value); None for another test's or lane's."""
        base, _, params = other.test.partition("[")
        if base != self.cell.test.partition("[")[0] or other.lane != self.cell.lane:
            return None
        if other.extra.get(EXPLORED_KEY):
            return other.test
        tokens = params.rstrip("]").split("-")[1:]
        if len(tokens) != len(self.pairwise) or any(vid not in self.order[name] for name, vid in zip(self.pairwise, tokens)):
            return None
        return self.node_id({**{name: values[0] for name, values in self.order.items()}, **dict(zip(self.pairwise, tokens))})


def reproducing_line(command: str, vset: VersionSet, overrides: Sequence[str], arch_spec: str | None, config: Config, node_id: str) -> str:
    """The command line that runs the one explored cell `node_id` of configuration `config` (a `matrix` run of the
    node id alone, on its architecture where that is a built-in one, else on the run's `--arch`)."""
    base = vset.name.split("+", 1)[0]
    builtin = config.get("arch") in architectures.builtin()
    arch = config["arch"] if builtin else arch_spec
    words = ["python", "-m", "stackcheck", command, "--sets", base, *[w for pin in overrides for w in ("--with", pin)],
             *(["--arch", arch] if arch else []), "--", node_id]
    return " ".join(shlex.quote(word) for word in words)


def run_round(python: Path, vset: VersionSet, node_ids: list[str], options: list[str]) -> dict[str, Cell]:
    """The cells of one round: a pytest child in the set's environment that runs `node_ids` (explored cells, collected
    because the command line names them), recorded in a scratch matrix.json and read back by node id."""
    with tempfile.TemporaryDirectory(prefix="stackcheck-shrink-") as scratch:
        path = Path(scratch) / "matrix.json"
        spread = lane.parallel_options([]) if len(node_ids) >= SPREAD_FROM else []
        lane.run_pytest(python, vset, node_ids, ["-q", "-p", "no:cacheprovider", *options, *spread], path)
        return {cell.test: cell for cell in results.load(path)["cells"]} if path.exists() else {}


def shrink_failures(python: Path, vset: VersionSet, ran: list[Cell], options: list[str], command: str, overrides: Sequence[str],
                    arch_spec: str | None) -> list[Cell]:
    """Shrink every explored cell of `ran` (one set's run) that is `new_failure` or `error`, side by side; return them
    with what shrinking found (`shrunk`), each printed with the line that reproduces its minimal configuration.
    `options`: the run's pytest options (lanes, architectures); the outcomes `ran` holds answer without a run, but
    each failing cell's own configuration is run again first (a failure that does not come back is not shrunk)."""
    targets = [Target.of(cell) for cell in ran if cell.verdict in SHRUNK and cell.extra.get(EXPLORED_KEY)]
    if not targets:
        return []
    print(f"== explore: shrinking {len(targets)} failing explored cells of set {vset.name}", flush=True)
    started = time.monotonic()
    failing = {target.cell.test for target in targets}
    known: dict[str, Cell] = {}
    for target in targets:
        for cell in ran:
            node = target.as_explored(cell)
            if node is not None and cell.test not in failing:
                known[node] = cell
    rounds = 0

    def answer(configs: list[Config], askers: list[int]) -> list[bool]:
        nonlocal rounds
        nodes = [targets[i].node_id(config) for config, i in zip(configs, askers)]
        wanted = list(dict.fromkeys(node for node in nodes if node not in known))
        if wanted:
            rounds += 1
            print(f"== explore: shrink round {rounds}: {len(wanted)} cells ({len(nodes) - len(wanted)} answered by cells already run)", flush=True)
            found = run_round(python, vset, wanted, options)
            for node in wanted:
                known[node] = found.get(node) or Cell(vset.name, targets[0].cell.family, node, targets[0].cell.lane, ERROR,
                                                      signature="not collected")
        return [known[node].verdict in FAILS and explore.same_failure(known[node].signature, targets[i].cell.signature)
                for node, i in zip(nodes, askers)]

    shrunk = explore.drive([explore.shrink_steps(t.config, t.order, t.invalid) for t in targets], answer)
    updated = []
    for target, found in zip(targets, shrunk):
        cell = target.cell
        record: dict[str, object]
        if not found.reproduced:
            record = {"reproduced": False, "asked": found.asked}
            print(f"explored {cell.test}: its failure did not come back when run again; not shrunk", flush=True)
        else:
            node = target.node_id(found.config)
            minimal = known[node]
            changed = {name: vid for name, vid in found.config.items() if vid != target.order[name][0]}
            line = reproducing_line("gpu-matrix" if cell.lane == "gpu" else command, vset, overrides, arch_spec, found.config, node)
            record = {"reproduced": True, "asked": found.asked, "config": found.config, "changed": changed, "cell": node,
                      "verdict": minimal.verdict, "bug": minimal.bug, "signature": minimal.signature, "command": line}
            moved = ", ".join(f"{name}={vid.removeprefix(name + '.')}" for name, vid in changed.items()) or "every axis at its first value"
            print(f"explored {cell.test} ({cell.verdict}: {cell.signature}) shrinks to {len(changed)} of {len(found.config)} axes "
                  f"off their first value ({moved}), {minimal.verdict}{' ' + minimal.bug if minimal.bug else ''}; reproduce it with:",
                  flush=True)
            print(line, flush=True)
        updated.append(cell.replace(extra={**cell.extra, SHRUNK_KEY: record}))
    print(f"== explore: {len(targets)} shrunk in {rounds} rounds, {time.monotonic() - started:.0f} s", flush=True)
    return updated
