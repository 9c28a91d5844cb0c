"""A warm rank pool (STACKCHECK_RANK_POOL=1; `matrix` and `gpu-matrix` turn it on): start a job's ranks once, run
many cells on them.

A two-rank cell costs 20 to 100 s, nearly all of it start-up (two interpreters importing torch, transformers, peft
and DeepSpeed, `accelerate launch`, the process group) and teardown; the tiny models' work takes milliseconds. A
pool is one job, launched exactly as `launcher` launches a cell's (`accelerate launch --config_file` with the
engine's file, or torchrun; the same supervisor on every rank), whose workers run `python -m
stackcheck.distributed.rank --pool FOLDER`: each takes the pool's cells in turn from FOLDER/job-K.json and runs
each as a cell's worker runs its function (the cell's call.json, rank-N.json, .pid, .log and .stacks files in the
cell's own folder, the same outcomes and Failure signatures). Between cells the ranks keep their imported modules and
their process group, and reset what a cell leaves behind (rank.leave_the_cell).

One pool per key: everything that makes two launches differ (the interpreter, the engine, the world size, the lane,
the whole environment the job inherits, which names the visible devices and a guard's PYTHONPATH, and the engine's
changed options where they change more than the ranks' environment). Options that `accelerate launch` only turns into
the ranks' variables (an FSDP state dict type, RAM-efficient loading, ZeRO-3's init flag: read when the cell builds
its Accelerator and loads its model) run on the engine's own pool, the rank setting them for that cell
(launcher.options_environment): on one H100 a set's pools fell from 23 (29 ranks, 469 CPU-seconds) to 11 (16 ranks,
327), every verdict the same (docs/speed.md, session 18). A cell whose every rank raised on its own (a known bug often
does: both ranks hit the same line) keeps its pool once each rank has reset and a tiny collective found the process
group whole (rank.fence). Any other cell that does not pass (a rank died, hung, or was stopped while another failed:
every outcome exactly as `launcher` gives it, stacks included) tears its pool down, and the next cell of that key
starts a fresh one; so does a pool whose job ended. At most MAX_POOLS stay warm in a process (the oldest goes first),
and every pool is torn down when the process exits; a pool whose owner died (a crashed or interrupted pytest) ends
itself within a second.

The matrix commands run their pytest children with pools on unless STACKCHECK_RANK_POOL=0 (the same switch puts
trainer_resume's resumes on a warm process: stackcheck.process.resume); plain pytest and the
harness's tests (`stackcheck tests`, CI) keep one launch per cell unless STACKCHECK_RANK_POOL=1. A warm rank is not
a fresh one: see docs/speed.md, "A warm rank pool", for what it cuts, what it measured, and what it still misses.
Under xdist every worker has its own pools, so the cells that share a pool's `group` (engine, world size, lane) carry
that xdist group (stackcheck.distributed.cells.pool_group) and run on one worker (stackcheck.child.schedule).
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
