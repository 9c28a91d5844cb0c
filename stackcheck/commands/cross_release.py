"""Cross-release checkpoints in every matrix run: the writer set (sets.toml's `cross_release`, transformers 4.57) saves
its quantized checkpoints once per machine into the cache, and each set's cross-release cells read them
(quantized_checkpoint's `test_checkpoint_saved_by_transformers_4_reloads`).

The cache folder is keyed by the writer's pins and torch, the family definitions and the machine, so another of any
reads no stale export; a stamp in it names the architectures written. Layout and cost: docs/running.md,
"Cross-release checkpoints"."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from stackcheck.core import hostinfo, results
from stackcheck.core.locking import folder_locked
from stackcheck.core.protocol import CROSS_RELEASE_OPTION, cache_root, option
from stackcheck.core.versions import VersionSet, cross_release_writer
from stackcheck.models import architectures
from stackcheck.models.architectures import Architecture
from stackcheck.runner import envs
from stackcheck.runner.lane import CPU_LANE, arch_options, build_all, family_targets, new_run_id, parallel_options, run_pytest

FAMILY = "quantized_checkpoint"
WRITER_TEST = "test_saved_checkpoint_reloads_bit_exact"  # the writer's cells: each leaves its checkpoint in the exchange
STAMP = "written.json"  # {architecture name: digest of its config} of every architecture the writer ran on


@dataclass(frozen=True)
class Plan:
    """The writer set, its cache folder, and the run's architectures it has not written there yet."""

    writer: VersionSet
    folder: Path
    missing: list[Architecture]


def key(writer: VersionSet) -> str:
    """What the writer's exports depend on: its pins and torch, the family definitions, this machine and Python."""
    requirements, inherit = envs.environment_requirements(writer)
    host_torch = metadata.version("torch") if inherit else None
    text = json.dumps([requirements, host_torch, results.fingerprint(), hostinfo.cpu_facts(), sys.version_info[:2]])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def written(folder: Path) -> dict[str, str]:
    stamp = folder / STAMP
    return json.loads(stamp.read_text()) if stamp.is_file() else {}


def digest(arch: Architecture) -> str:
    return hashlib.sha256(arch.digest_text().encode()).hexdigest()[:12]


def intact(folder: Path, writer: VersionSet, arch: Architecture) -> bool:
    """`arch` is written there and each of its exports still finds the bf16 checkpoint it quantized (the tiny
    checkpoints' cache, which a user may clear)."""
    exports = (json.loads(meta.read_text()) for meta in (folder / "base-checkpoints" / arch.name / writer.slug).glob("*/export.json"))
    return written(folder).get(arch.name) == digest(arch) and all(Path(meta["source_checkpoint"]).exists()
                                                                   for meta in exports if "source_checkpoint" in meta)


def plan(sets: list[VersionSet], families: list[str] | None, arch_spec: str | None, off: bool) -> Plan | None:
    """The cross-release step of a run of `sets`: None where it is off (`--no-cross-release`), where the run leaves out
    quantized_checkpoint, names no writer or no built-in architecture, or where the writer is one of the run's sets (its
    cells read it as today)."""
    writer = cross_release_writer()
    if off or writer is None or (families is not None and FAMILY not in families) or writer.name in {s.name for s in sets}:
        return None
    # The built-in architectures alone: a configuration of the user's may be one transformers 4 cannot build, and the
    # run is about the user's sets (its model type is checked against theirs).
    builtin = architectures.builtin()
    archs = [a for a in architectures.resolve(arch_spec) if builtin.get(a.name) == a]
    if not archs:
        return None
    folder = cache_root() / "cross-release" / f"{writer.slug}-{key(writer)}"
    return Plan(writer, folder, [a for a in archs if not intact(folder, writer, a)])


def prepare(found: Plan | None, find_links=(), no_index: bool = False) -> list[str]:
    """The child's option that names the writer's exports (none where there is no step): first, where the cache lacks
    some of the run's architectures, the writer set built and its writer cells run (CPU lane) into the cache."""
    if found is None:
        return []
    if not found.missing:
        print(f"== cross-release: set {found.writer.name}'s checkpoints reused from {found.folder}", flush=True)
        return [option(CROSS_RELEASE_OPTION, found.folder)]
    unusable: dict[str, str] = {}
    python = build_all([found.writer], find_links, no_index, unusable=unusable).get(found.writer.name)
    if python is None:
        print(f"stackcheck: cross-release: set {found.writer.name} is unusable here; its cells are skipped", file=sys.stderr, flush=True)
        return []
    # Two runs at once: the second waits, then writes what the first did not (not the folder itself: the writer's results lock it).
    with folder_locked(found.folder.parent):
        missing = [arch for arch in found.missing if not intact(found.folder, found.writer, arch)]
        if missing:
            write(python, replace(found, missing=missing))
    return [option(CROSS_RELEASE_OPTION, found.folder)]


def write(python: Path, found: Plan) -> None:
    """Run the writer's cells (CPU lane) on the missing architectures into the cache, and stamp those written."""
    started = time.monotonic()
    builtin = architectures.builtin()
    spec = ",".join(a.name if builtin.get(a.name) == a else a.source for a in found.missing)
    code = run_pytest(python, found.writer, family_targets([FAMILY]),
                      ["-q", CPU_LANE, *arch_options(spec), "-k", WRITER_TEST,
                       *parallel_options([], workers=min(len(found.missing), os.cpu_count() or 1))],
                      found.folder / "matrix.json", run=new_run_id())
    if code in (0, 1):  # 1: some writer cells are not `pass`; each left its export or its refusal
        (found.folder / STAMP).write_text(json.dumps(written(found.folder) | {a.name: digest(a) for a in found.missing}, indent=2))
    print(f"== cross-release: set {found.writer.name} wrote its checkpoints for {', '.join(a.name for a in found.missing)} "
          f"into {found.folder} in {time.monotonic() - started:.1f} s (pytest exit {code})", flush=True)
