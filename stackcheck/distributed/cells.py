"""The pytest side of the distributed lane: a family test's `ranks` fixture (stackcheck.child.plugin) launches its job
through `Ranks`, and `WORLD_SIZES` parametrizes it.

A cell's CPU variant (two gloo ranks) runs in the CPU lane, or is a visible skip: `cpu_costly=REASON` (CI's 2 cores
would pay for nothing the GPU lane does not show; STACKCHECK_DIST_CPU=all runs it) or `gpu_only=REASON` (it cannot
run on the CPU). The three kinds: docs/internals.md, "distributed/cells.py".
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from stackcheck.distributed import launcher, pool
from stackcheck.core.protocol import DIST_CPU_ENV
from stackcheck.process import warm
from stackcheck.distributed.outcome import RankOutcome, raise_unless_passed

RANKS = pytest.StashKey[list]()  # a distributed cell's rank outcomes, on its item
POOL_GROUP = pytest.StashKey[str]()  # the warm pool group its cells share (pool_group), on its item

# The GPU lane runs world sizes 1 and 2 (NCCL), 2 skipped with the count on a host with one GPU; the CPU lane
# runs CPU_WORLD_SIZE ranks over gloo, and reads world size 1 as skipped.
CPU_WORLD_SIZE = 2
WORLD_SIZES = pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.gpus(2))], ids=["ws1", "ws2"])
# Several times a tiny job's time on 2 shared cores (docs/speed.md, "Numbers behind constants"): a rank that takes this
# long hangs.
DEFAULT_TIMEOUT = 180.0
# STACKCHECK_DIST_CPU=all: the CPU lane also runs the cells left out of the default run for their cost.
CPU_SELECTION_ENV = DIST_CPU_ENV
# `@pytest.mark.ranks_engine(ENGINE)` names the engine a test launches where it is not the test's `engine` parameter;
# ENGINE is a name, or a function of the test's parameters that gives it.
ENGINE_MARK = "ranks_engine"


def pool_group(item: pytest.Item) -> str | None:
    """The pool group (stackcheck.distributed.pool.group: engine, world size, lane) of a test item whose cell launches
    a job that a warm pool would run, from its parametrization as the cell passes it to `ranks`: its `lane` and
    `world_size` parameters, and its `engine` parameter or ENGINE_MARK. None where it launches no job (no `ranks`
    fixture, a CPU world size other than CPU_WORLD_SIZE, which skips) or names no engine. A wrong group costs only
    scheduling (the pool itself is keyed at launch); `Ranks` warns where the launched job is not the item's group."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "ranks" not in getattr(item, "fixturenames", ()) or "world_size" not in params:
        return None
    lane, world_size = params.get("lane", "cpu"), params["world_size"]
    if lane == "cpu" and world_size != CPU_WORLD_SIZE:
        return None
    mark = item.get_closest_marker(ENGINE_MARK)
    engine = (mark.args[0](params) if callable(mark.args[0]) else mark.args[0]) if mark else params.get("engine")
    return pool.group(engine, world_size, lane) if engine else None


def every_cpu_variant() -> bool:
    """Whether STACKCHECK_DIST_CPU=all asks for every CPU variant; another value is a user error (one line)."""
    value = os.environ.get(CPU_SELECTION_ENV, "")
    if value not in ("", "all"):
        raise pytest.UsageError(f"{CPU_SELECTION_ENV}={value!r}: the only value is 'all' (every cell's CPU variant)")
    return value == "all"


class Ranks:
    """Launches one job for a cell, and leaves every rank's outcome on the test item for the plugin to record."""

    def __init__(self, node: pytest.Item, lane: str, workdir: Path):
        self.node, self.lane, self.workdir = node, lane, workdir

    def deepspeed_config(self, config: dict) -> Path:
        """The cell's DeepSpeed JSON (a user's ds_config.json), written in the cell's folder, for its engine options'
        `deepspeed_config_file`. `accelerate launch` passes the file's path to the ranks (ACCELERATE_DEEPSPEED_CONFIG_FILE)
        and never reads it; the ranks' Accelerator reads it when the cell builds one. So on a warm pool the path is one
        more variable of the cell (launcher.options_environment), and cells of other configs share the engine's pool,
        each reading its own config, as a launch of its own would. A family proves the engine it got on every rank (its
        stage, precision, accumulation, offload)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / "ds_config.json"
        path.write_text(json.dumps(config, indent=1))
        return path

    def __call__(self, target: str, world_size: int, engine: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 gpu_only: str | None = None, cpu_costly: str | None = None, engine_options: dict | None = None,
                 **kwargs) -> list[RankOutcome]:
        """Run `target` (MODULE:FUNCTION of the test's module, called with `kwargs` on every rank); raise
        RanksFailed unless every rank passed. Returns the outcomes (with what each rank's function returned).
        `gpu_only`: why the cell has no gloo variant; `cpu_costly`: why its gloo variant is left out of the default
        CPU lane (both visible skips: docs/internals.md, "distributed/cells.py"). `engine_options`: keys of the engine's accelerate
        config changed for this cell (`fsdp_config` entries by their name), as a user edits the file."""
        if self.lane == "cpu" and world_size != CPU_WORLD_SIZE:
            pytest.skip(f"CPU lane: the gloo variant runs {CPU_WORLD_SIZE} ranks")
        if self.lane == "cpu" and gpu_only:
            pytest.skip(f"CPU lane: GPU lane only ({gpu_only})")
        if self.lane == "cpu" and cpu_costly and not every_cpu_variant():
            pytest.skip(f"CPU lane: left out of the default run ({cpu_costly}); {CPU_SELECTION_ENV}=all runs it")
        launch = pool.launch if warm.enabled() else launcher.launch  # STACKCHECK_RANK_POOL=1: a warm rank pool
        expected = self.node.stash.get(POOL_GROUP, None)
        if expected and expected != pool.group(engine, world_size, self.lane):
            warnings.warn(f"{self.node.nodeid}: its job ({pool.group(engine, world_size, self.lane)}) is not its xdist group "
                          f"({expected}): fix its {ENGINE_MARK} mark", pytest.PytestWarning, stacklevel=2)
        outcomes = launch(target, self.workdir / "job", world_size, engine, self.lane, timeout, kwargs, engine_options)
        self.node.stash[RANKS] = outcomes
        raise_unless_passed(outcomes)
        return outcomes
