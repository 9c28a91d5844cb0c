"""A warm rank pool (STACKCHECK_RANK_POOL=1; `matrix` and `gpu-matrix` turn it on): start a job's ranks once, run
many cells on them.

A two-rank cell's cost is nearly all start-up and teardown, so a pool is one job, launched exactly as `launcher`
launches a cell's, whose ranks run many cells in turn with the same files, outcomes and signatures, resetting what a
cell leaves between cells. One pool per key; a cell that does not pass tears its pool down. How it works:
docs/internals.md, "distributed/pool.py"; what it cuts and misses: docs/speed.md, "A warm rank pool".
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.distributed import launcher, rank as rank_side
from stackcheck.distributed.outcome import RankOutcome, RankState
from stackcheck.process.warm import lasting_environment

# Two warm pools of two ranks each hold four interpreters with torch, transformers and DeepSpeed imported.
MAX_POOLS = 2
# How long the ranks of a cell that failed on every rank have to reset and answer the fence (a tiny collective) before
# the pool is ended instead.
FENCE_SECONDS = 20.0


def group(engine: str | None, world_size: int, lane: str) -> str:
    """The engine, world size and lane part of a pool's key, as one name: the xdist group of the cells that can share
    a pool (their engine options and environment may still part them)."""
    return f"ranks-{engine or 'torchrun'}-ws{world_size}-{lane}"


@dataclass
class Pool:
    key: tuple
    folder: Path
    job: subprocess.Popen
    world_size: int
    started: float = field(default_factory=time.monotonic)
    cells: int = 0  # handed over so far

    def alive(self) -> bool:
        return self.job.poll() is None


_pools: OrderedDict[tuple, Pool] = OrderedDict()


def key_of(world_size: int, engine: str | None, lane: str, engine_options: dict | None, env: dict) -> tuple:
    return (sys.executable, group(engine, world_size, lane), json.dumps(engine_options, sort_keys=True, default=str),
            lasting_environment(env))


def start(key: tuple, world_size: int, engine: str | None, lane: str, engine_options: dict | None, env: dict) -> Pool:
    while len(_pools) >= MAX_POOLS:
        close(next(iter(_pools.values())))
    folder = Path(tempfile.mkdtemp(prefix="stackcheck-pool-"))
    (folder / rank_side.OWNER_FILE).write_text(str(os.getpid()))
    line = launcher.command("", folder, world_size, engine, launcher.free_port(), engine_options, rank_args=["--pool", str(folder)])
    with (folder / "launcher.log").open("w") as log:
        job = subprocess.Popen(line, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    pool = _pools[key] = Pool(key, folder, job, world_size)
    return pool


def close(pool: Pool) -> None:
    """Kill the pool's job (launcher, agent, every rank) and remove its folder."""
    _pools.pop(pool.key, None)
    launcher.reap(pool.job, pool.folder, pool.world_size)
    shutil.rmtree(pool.folder, ignore_errors=True)


@atexit.register
def close_all() -> None:
    for pool in list(_pools.values()):
        close(pool)


def launch(target: str, outdir: Path, world_size: int = 2, engine: str | None = None, lane: str = "cpu",
           timeout: float = 240.0, kwargs: dict | None = None, engine_options: dict | None = None) -> list[RankOutcome]:
    """launcher.launch on a warm pool: the same arguments, the same outcomes (a fresh pool that lost its port is
    started again, as a fresh job is)."""
    return launcher.launch(target, outdir, world_size, engine, lane, timeout, kwargs, engine_options, once=launch_once)


def launch_once(target: str, outdir: Path, world_size: int, engine: str | None, lane: str, timeout: float,
                kwargs: dict | None, engine_options: dict | None) -> list[RankOutcome]:
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "call.json").write_text(json.dumps(kwargs or {}))
    env = launcher.job_environment(lane)
    overlay = launcher.options_environment(engine, engine_options, world_size, env, outdir)
    if overlay is not None:  # the options change only the ranks' environment: the engine's own pool, given it
        engine_options = None
    key = key_of(world_size, engine, lane, engine_options, env)
    pool = _pools.get(key)
    if pool is not None and not pool.alive():
        close(pool)
        pool = None
    if pool is None:
        pool = start(key, world_size, engine, lane, engine_options, env)
    _pools.move_to_end(key)
    hand_over(pool, target, outdir, overlay or {})
    hung_after = launcher.wait(pool.job, outdir, world_size, timeout)
    states = launcher.written_states(outdir, world_size)
    if hung_after is None and pool.alive() and len(states) == world_size:
        if set(states.values()) == {RankState.PASSED}:
            return launcher.outcomes(outdir, world_size, None, None)
        if set(states.values()) == {RankState.FAILED} and kept(pool):
            return launcher.outcomes(outdir, world_size, None, None)
    if hung_after is not None:
        launcher.dump_stacks(outdir, world_size)
    close_after(pool, outdir)
    return launcher.outcomes(outdir, world_size, hung_after, pool.job.returncode)


def kept(pool: Pool) -> bool:
    """After a cell whose every rank raised on its own (none died, hung or was stopped): keep the pool if each rank's
    fence (rank.fence) found the process group whole within FENCE_SECONDS; the caller ends it otherwise."""
    index = pool.cells - 1
    rank_side.keep_path(pool.folder, index).write_text("")
    answers = [rank_side.fence_path(pool.folder, index, rank) for rank in range(pool.world_size)]
    deadline = time.monotonic() + FENCE_SECONDS
    while not all(path.exists() for path in answers):
        if time.monotonic() >= deadline or not pool.alive():
            return False
        time.sleep(launcher.POLL_SECONDS)
    return all(json.loads(path.read_text())["whole"] for path in answers) and pool.alive()


def hand_over(pool: Pool, target: str, outdir: Path, environment: dict) -> None:
    """The pool's next cell, as a file its ranks wait for (replaced atomically, so never half read), with the
    variables its engine options change (launcher.options_environment), which its ranks set for it alone."""
    path = rank_side.job_path(pool.folder, pool.cells)
    scratch = path.with_name(f".{path.name}.tmp")
    scratch.write_text(json.dumps({"target": target, "outdir": str(outdir.resolve()), "environment": environment}))
    scratch.replace(path)
    pool.cells += 1


def close_after(pool: Pool, outdir: Path) -> None:
    """Tear the pool down after a cell that did not pass, keeping in the cell's folder what a per-cell launch leaves
    there: the launcher's output, and the output of a rank that died before it took the cell."""
    launcher.reap(pool.job, pool.folder, pool.world_size)
    for name in ["launcher.log", *(rank_side.log_path(Path(), rank).name for rank in range(pool.world_size))]:
        if not (outdir / name).exists() and (pool.folder / name).exists():
            shutil.copyfile(pool.folder / name, outdir / name)
    _pools.pop(pool.key, None)
    shutil.rmtree(pool.folder, ignore_errors=True)
