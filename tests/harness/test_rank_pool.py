"""The warm rank pool (stackcheck.distributed.pool, STACKCHECK_RANK_POOL=1) gives the outcomes one launch per cell
gives: the same cells, tiny rank functions over gloo on two CPU ranks, run on one pool and launched one by one."""

import os
import time
from pathlib import Path

import pytest

from stackcheck.distributed import launcher, pool
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
