"""The warm rank pool (stackcheck.distributed.pool, STACKCHECK_RANK_POOL=1) gives the outcomes one launch per cell
gives: the same cells, tiny rank functions over gloo on two CPU ranks, run on one pool and launched one by one."""

import os
import time
from pathlib import Path

import pytest

from stackcheck.distributed import launcher, pool
from stackcheck.process import warm
from stackcheck.distributed.outcome import RankState

HERE = "tests.harness.test_rank_pool"


# The rank functions: a user's script's shape, an Accelerator (the launch's config) and its collectives.

def rank_gathers(job: str, value: int) -> dict:
    """Every rank's value gathered through accelerate; what accelerate's state reads of the launch."""
    import torch
    from stackcheck.distributed import rank as rank_side

    accelerator = rank_side.accelerator()
    gathered = accelerator.gather(torch.tensor([value + accelerator.process_index]))
    return {"gathered": gathered.tolist(), "processes": accelerator.num_processes, "type": str(accelerator.distributed_type),
            "pid": os.getpid()}


def rank_one_raises(job: str, value: int) -> dict:
    """Rank 1 raises once rank 0 has its outcome on disk (else rank 0 may read stopped: see test_distributed)."""
    result = rank_gathers(job, value)
    if int(os.environ["RANK"]) == 1:
        deadline = time.monotonic() + 120
        while not (Path(job) / "rank-0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError(f"rank one's own error after gathering {result['gathered']}")
    return result


def rank_both_raise(job: str, value: int) -> dict:
    """Every rank raises on its own after a collective, as a known bug on the code path every rank runs does."""
    result = rank_gathers(job, value)
    raise RuntimeError(f"every rank's own error after gathering {result['gathered']}")


def no_process_of(folder) -> bool:
    """No process still has the folder on its command line (the pool's launcher, agent, supervisors and workers)."""
    import subprocess

    return subprocess.run(["pgrep", "-f", str(folder)], capture_output=True, text=True).stdout.strip() == ""


def comparable(outcomes) -> list[tuple]:
    """What a cell's verdict reads of each rank: state, failure (signature, message, frames) and result, the rank's pid aside."""
    return [(o.rank, o.state, o.failure and (o.failure.signature(), o.failure.message, o.failure.frames),
             o.result and {k: v for k, v in o.result.items() if k != "pid"}) for o in outcomes]


CELLS = [("rank_gathers", 1), ("rank_both_raise", 2), ("rank_gathers", 3), ("rank_one_raises", 4)]
EVERY_RANK_RAISES, ONE_RANK_RAISES = 1, 3


def test_a_warm_pool_gives_the_outcomes_of_one_launch_per_cell(tmp_path, monkeypatch):
    """Four cells of a `ddp` launch (accelerate launch, two gloo ranks): on one warm pool, and launched one by one.
    The second fails on every rank on its own, the fourth on rank 1 only. The pool's first three cells ran in the
    same two processes (the pool was reached: each cell rebuilt accelerate's state and found the process group
    alive; the failure on every rank kept the pool once the fence found the group whole); every rank's state, failure
    and result are the same both ways; the fourth cell tore the pool down, every process of it gone.

    One launch per cell: when every rank raises, torch's agent may stop the slower rank before its own error
    (stopped, not failed): a launched rank of that cell is failed with the pooled rank's failure, or stopped."""
    monkeypatch.setattr(pool, "_pools", type(pool._pools)())

    folders = []

    def run(launch, how: str) -> list:
        found = []
        for index, (function, value) in enumerate(CELLS):
            job = tmp_path / how / str(index) / "job"
            found.append(launch(f"{HERE}:{function}", job, 2, "ddp", "cpu", 180.0, {"job": str(job), "value": value}))
            if how == "pool" and index < ONE_RANK_RAISES:
                assert len(pool._pools) == 1, f"the pool did not stay warm after cell {index}"
                folders.extend(p.folder for p in pool._pools.values())
        return found

    pooled = run(pool.launch, "pool")
    assert not pool._pools, "the cell that failed on one rank left its pool warm"
    launched = run(launcher.launch, "launched")

    pids = [[o.result["pid"] for o in outcomes] for index, outcomes in enumerate(pooled[:ONE_RANK_RAISES]) if index != EVERY_RANK_RAISES]
    assert pids[0] == pids[1], f"the cell after the failure on every rank ran in other processes: {pids}"
    assert [o.state for o in pooled[EVERY_RANK_RAISES]] == [RankState.FAILED, RankState.FAILED]
    assert [o.state for o in pooled[ONE_RANK_RAISES]] == [RankState.PASSED, RankState.FAILED]
    alike = [index for index in range(len(CELLS)) if index != EVERY_RANK_RAISES]
    assert [comparable(pooled[index]) for index in alike] == [comparable(launched[index]) for index in alike]
    for pooled_rank, launched_rank in zip(comparable(pooled[EVERY_RANK_RAISES]), comparable(launched[EVERY_RANK_RAISES])):
        assert launched_rank == pooled_rank or launched_rank[1] == RankState.STOPPED, (pooled_rank, launched_rank)
    assert RankState.FAILED in [o.state for o in launched[EVERY_RANK_RAISES]]
    assert len(set(folders)) == 1, f"one pool ran the first three cells: {folders}"
    failed = tmp_path / "pool" / str(ONE_RANK_RAISES) / "job"
    assert (failed / "rank-1.log").exists() and (failed / "launcher.log").exists()
    assert not folders[0].exists() and no_process_of(folders[0])


def rank_reads_the_launch(job: str) -> dict:
    """The variables accelerate's launcher gives a rank (its FSDP and accelerate ones), as the rank's Accelerator reads
    them."""
    return {"environment": {name: value for name, value in os.environ.items() if name.startswith(("FSDP_", "ACCELERATE_"))},
            "pid": os.getpid()}


def test_engine_options_that_change_only_the_ranks_variables_run_on_the_engines_own_pool(tmp_path, monkeypatch):
    """An FSDP cell whose config sets another state dict type (`fsdp_state_dict_type`, as sharded_resume's cells do)
    runs on the warm pool of the engine's own file, between two cells without options, and its ranks read the
    variables a launch with the edited file gives them; the next cell reads the pool's own again. Two gloo ranks of
    `accelerate launch` with fixtures/distributed/fsdp1.yaml."""
    monkeypatch.setattr(pool, "_pools", type(pool._pools)())
    options = {"fsdp_state_dict_type": "FULL_STATE_DICT"}
    assert launcher.options_environment("fsdp1", options, 2, launcher.job_environment("cpu"), tmp_path) == {"FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}

    def run(launch, name: str, engine_options: dict | None) -> list:
        job = tmp_path / name / "job"
        return launch(f"{HERE}:rank_reads_the_launch", job, 2, "fsdp1", "cpu", 180.0, {"job": str(job)}, engine_options)

    pooled = [run(pool.launch, "first", None), run(pool.launch, "options", options), run(pool.launch, "after", None)]
    assert len(pool._pools) == 1, f"the cell with options started a pool of its own: {list(pool._pools)}"
    assert all(o.state == RankState.PASSED for outcomes in pooled for o in outcomes), pooled
    assert len({o.result["pid"] for outcomes in pooled for o in outcomes}) == 2, "the three cells did not run on one pool's two ranks"
    launched = run(launcher.launch, "launched", options)
    read = [[o.result["environment"] for o in outcomes] for outcomes in [*pooled, launched]]
    first, with_options, after, as_launched = read
    assert with_options == as_launched, "the pooled cell's ranks read other variables than a launch with the edited file gives"
    assert after == first and {r["FSDP_STATE_DICT_TYPE"] for r in first} == {"SHARDED_STATE_DICT"}, "the options outlived their cell"
    pool.close_all()


def test_the_pool_is_off_in_pytest_on_in_the_matrix_and_its_switch_is_checked(monkeypatch):
    from stackcheck.runner import lane

    monkeypatch.delenv(warm.POOL_ENV, raising=False)
    assert not warm.enabled()
    assert lane.rank_pools(default=True) == (True, {warm.POOL_ENV: "1"})  # the matrix commands' default
    assert lane.rank_pools(default=False) == (False, {warm.POOL_ENV: "0"})  # `stackcheck tests` (CI)
    monkeypatch.setenv(warm.POOL_ENV, "1")
    assert warm.enabled() and lane.rank_pools(default=False)[0]
    monkeypatch.setenv(warm.POOL_ENV, "0")
    assert not warm.enabled() and not lane.rank_pools(default=True)[0]
    monkeypatch.setenv(warm.POOL_ENV, "yes")
    with pytest.raises(pytest.UsageError, match="STACKCHECK_RANK_POOL='yes'"):
        warm.enabled()


def test_pools_choose_loadgroup_and_keep_the_order(monkeypatch):
    from stackcheck.runner import lane

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # as the matrix's own pytest sees it, not CI's workers

    assert lane.parallel_options([], workers=2, pools=True) == ["-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder"]
    assert lane.parallel_options([], workers=2) == ["-n", "2", "--dist", "load", "--maxschedchunk", "1"]
    assert lane.parallel_options(["-n", "0"], workers=2, pools=True) == []
