"""Probes: one version set run through some families, kept in a store that `history` and `bisect` share,
so that neither runs a probe the other (or an earlier run) already ran.

A probe is known by its key (what its environment installs, the platform facts that choose a code path, the lanes);
the store (results/probes.json) holds one entry per key, written the moment each probe ends. A family's stored cells
answer while its own definitions are unchanged (`results.family_fingerprints`), judged again under today's ledger
(stackcheck.child.evidence): a changed family re-runs alone, a ledger change re-runs nothing. The key and entry:
docs/internals.md, "commands/releases/probes.py".
"""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.child import evidence
from stackcheck.runner import envs, lane
from stackcheck.core import hostinfo, results
from stackcheck.core.cell import Cell
from stackcheck.core.ledger import Ledger, family_modules
from stackcheck.core.versions import VersionSet


# One store for every command and package: a probe's key says what it ran, whatever asked for it.
DEFAULT_STORE = REPO_ROOT / "results" / "probes.json"


def probe_platform(lanes: tuple[str, ...]) -> dict[str, str]:
    """The facts of this host that can change a verdict in `lanes`: the architecture and the CPU flags that
    choose torch's and bitsandbytes' CPU kernels, and in the GPU lane the GPU (read without importing torch
    when there is no GPU lane)."""
    facts = {"machine": platform.machine(), "cpu_flags": hostinfo.cpu_facts()["cpu_flags"]}
    if "gpu" in lanes:
        facts["gpu"] = envs.cuda_device()
    return facts


def probe_key(vset: VersionSet, lanes: tuple[str, ...], options: tuple[str, ...] = ()) -> dict:
    """What a probe's cells depend on besides the family definitions: the environment, the platform facts that
    choose a code path, the lanes and the pytest options (the architectures under test, `lane.arch_options`)."""
    requirements, inherit = envs.environment_requirements(vset)
    if inherit:  # the host's torch, whose version then belongs to the key
        requirements = [f"torch=={importlib.metadata.version('torch')} (the host's)", *requirements]
    return {"requirements": sorted(requirements), "platform": probe_platform(lanes), "lanes": sorted(lanes),
            "options": list(options)}


@dataclass
class Probe:
    """What a probe found: its cells and whether they came from the store rather than a run."""

    label: str
    cells: list[Cell]
    reused: bool
    costs: dict = field(default_factory=dict)
    concurrent: int = 1  # probes running at once when it ran
    versions: dict = field(default_factory=dict)  # what its environment had installed
    built: bool = True  # False: its environment could not be built, and its cells say so
    definitions: str | None = None  # the digest of the family definitions it ran under (results.fingerprint)


class ProbeStore:
    """The JSON file of probes; safe to use from the threads of one process."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._prints: dict[str, str] | None = None  # today's family fingerprints, read once
        self._ledger: Ledger | None = None
        if path.exists():
            self._load()  # a damaged store is a usage error before anything runs

    def _load(self) -> dict:
        if not self.path.exists():
            return {"probes": []}
        return results.read_checked_json(self.path, _shape_problem, "probe store")

    def entry(self, key: dict) -> dict | None:
        """The stored probe of this key, whatever definitions it ran under."""
        with self._lock:
            data = self._load()
        return next((e for e in data["probes"] if e["key"] == key), None)

    def _fingerprints(self) -> dict[str, str]:
        if self._prints is None:
            self._prints = results.family_fingerprints(family_modules())
        return self._prints

    def current(self, key: dict, families: list[str]) -> list[str]:
        """The families among `families` whose stored cells for `key` ran under today's definitions."""
        stored = self.entry(key)
        if stored is None:
            return []
        have, today = stored.get("fingerprints") or {}, self._fingerprints()
        return [f for f in families if f in have and have[f] == today.get(f)]

    def cells(self, key: dict, families: list[str]) -> list[Cell]:
        """The stored cells of `families` for `key`, judged again under today's ledger."""
        stored = self.entry(key)
        if stored is None:
            return []
        if self._ledger is None:
            self._ledger = Ledger()
        versions = stored.get("versions") or {}
        return [evidence.rejudge(Cell.from_dict(c), self._ledger, versions) for c in stored["cells"] if c["family"] in families]

    def probe(self, key: dict, label: str, families: list[str]) -> Probe | None:
        """The stored probe of this key, with the cells of `families`, when every one of them is current."""
        stored = self.entry(key)
        if stored is None or len(self.current(key, families)) != len(families):
            return None
        return Probe(label, self.cells(key, families), reused=True, costs=stored["costs"], concurrent=stored["concurrent"],
                     versions=stored["versions"], definitions=results.fingerprint())  # every family's current: today's

    def add(self, key: dict, label: str, families: list[str], cells: list[Cell], versions: dict, costs: dict,
            concurrent: int) -> None:
        """Record a probe of `families`: their cells replace those stored for the key; other families' stay while
        their definitions are today's."""
        today = self._fingerprints()
        with self._lock:
            data = self._load()
            old = next((e for e in data["probes"] if e["key"] == key), None)
            have = (old.get("fingerprints") or {}) if old is not None else {}
            kept = {f for f, digest in have.items() if f not in families and today.get(f) == digest}
            entry = {
                "key": key, "label": label,
                # Each family's definitions when its cells were recorded; a family may have no cell.
                "fingerprints": {**{f: have[f] for f in sorted(kept)}, **{f: today[f] for f in families if f in today}},
                "families": sorted(kept | set(families)),
                "versions": versions,
                "cells": [c for c in (old["cells"] if old is not None else []) if c["family"] in kept] + [cell.to_dict() for cell in cells],
                "costs": {name: round(value, 2) if value is not None else None for name, value in costs.items()},
                "concurrent": concurrent, "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            }
            data["probes"] = [e for e in data["probes"] if e["key"] != key] + [entry]
            results.write_json(self.path, data)


def _shape_problem(data) -> str | None:
    if not isinstance(data, dict) or not isinstance(data.get("probes"), list):
        return "it has no `probes` list"
    for index, entry in enumerate(data["probes"]):
        if not isinstance(entry, dict) or not {"key", "label", "families", "cells"} <= entry.keys():
            return f"probe {index} lacks key, label, families or cells"
    return None


class Prober:
    """Runs sets through families in `lanes`, or answers from the store when it holds the probe."""

    def __init__(self, store: ProbeStore | None, find_links=(), no_index: bool = False, lanes: tuple[str, ...] = ("cpu",),
                 threads: int | None = None, options: tuple[str, ...] = (), variables: dict[str, str] | None = None):
        self.store, self.find_links, self.no_index, self.lanes = store, list(find_links), no_index, lanes
        # STACKCHECK_ variables of every probe (the backtest's deepspeed sweep: STACKCHECK_DIST_CPU=all), part of its key
        self.variables = dict(variables or {})
        self.options = tuple(options)  # pytest options of every probe: the architectures (`lane.arch_options`)
        # Each probe's CPU threads (OMP_NUM_THREADS, which torch follows); None leaves torch's default.
        self.threads = threads

    def key(self, vset: VersionSet) -> dict:
        key = probe_key(vset, self.lanes, self.options)
        return key | {"variables": self.variables} if self.variables else key

    def stored(self, label: str, vset: VersionSet, families: list[str]) -> Probe | None:
        return self.store.probe(self.key(vset), label, families) if self.store else None

    def build(self, vset: VersionSet) -> None:
        """Build the set's environment ahead of its probe (the probe then reuses it)."""
        envs.build(vset, self.find_links, self.no_index)

    def probe(self, label: str, vset: VersionSet, families: list[str], concurrent: int = 1,
              environment: float | None = None, env: dict[str, str] | None = None, fresh: bool = False) -> Probe:
        """`environment`: the seconds its environment took when `build` made it ahead of the probe; `env`:
        variables for its pytest process (stackcheck.core.progress); `fresh`: run it even when the store holds it (a
        flake check: the store would answer with the run being checked)."""
        stored = None if fresh else self.stored(label, vset, families)
        if stored is not None:
            assert self.store is not None, "only the store holds a stored probe"
            print(f"== probe {label}: from {self.store.path.name} (same environment, family definitions and platform)", flush=True)
            return stored
        key = self.key(vset)
        current = self.store.current(key, families) if self.store and not fresh else []
        todo = [f for f in families if f not in current]  # the families whose definitions changed since they were stored
        env = {**(env or {}), **self.variables, **({"OMP_NUM_THREADS": str(self.threads)} if self.threads else {})}
        with tempfile.TemporaryDirectory(prefix="stackcheck-probe-") as scratch:
            matrix = Path(scratch) / "matrix.json"
            ran, costs = lane.run_timed(vset, lane.family_targets(todo), matrix, self.find_links, self.no_index,
                                        lanes=self.lanes, env=env, options=list(self.options))
            cells = list(ran)
            installed = {k: v for k, v in results.load(matrix)["sets"].get(vset.name, {}).items() if k != "platform"}
        if environment is not None:
            total, reused = costs["total"], costs["environment"]
            assert total is not None and reused is not None, "run_timed times the environment and the whole run always"
            costs |= {"environment": environment, "total": total - reused + environment}
        # A run that recorded no cell was stopped before any (a signal, a killed child): no probe, as one not built.
        built = installed.get("env") != "not built" and bool(cells)
        if self.store and built:  # an environment that did not build may build next time (a network hiccup)
            self.store.add(key, label, todo, cells, installed, costs, concurrent)
            cells = self.store.cells(key, current) + cells
        return Probe(label, cells, reused=False, costs=costs, concurrent=concurrent, versions=installed, built=built,
                     definitions=results.fingerprint())
