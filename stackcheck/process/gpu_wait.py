"""How a process of a run waits for its GPU: asleep, not spinning a core.

CUDA spins a core while a thread waits for the GPU, and `gpu-matrix`'s many workers and ranks share a host's cores,
so where several xdist workers share them each sets its devices' primary contexts to block
(CU_CTX_SCHED_BLOCKING_SYNC) before it creates them, and what it starts follows (`follow_the_worker`). Only how the
thread waits changes. `STACKCHECK_GPU_WAIT=spin` keeps CUDA's default. Why and what it measured: docs/internals.md,
"process/gpu_wait.py"; docs/speed.md, session 17.
"""

from __future__ import annotations

import os

from stackcheck.core.protocol import GPU_WAIT_ENV
from stackcheck.process import cuda_driver

WAIT_VARIABLE = GPU_WAIT_ENV
BLOCK, SPIN = "block", "spin"
CU_CTX_SCHED_BLOCKING_SYNC = 0x04


def block_waits() -> int:
    """Every visible device's primary context blocks when a thread waits for it. How many devices it set: 0 without a
    driver or a device, or where the driver refused."""
    cuda = cuda_driver.load()
    return sum(cuda.cuDevicePrimaryCtxSetFlags_v2(device, CU_CTX_SCHED_BLOCKING_SYNC) == cuda_driver.SUCCESS
               for device in cuda_driver.devices(cuda) or [])


def for_a_shared_host() -> int:
    """An xdist worker among several: block, unless the user asked for CUDA's spinning, and have what the worker
    starts do the same. Call it after CUDA_VISIBLE_DEVICES is final and before torch initialises CUDA."""
    if os.environ.get(WAIT_VARIABLE) == SPIN:
        return 0
    os.environ[WAIT_VARIABLE] = BLOCK
    return block_waits()


def follow_the_worker() -> int:
    """A process a worker started (a rank, a fresh process): wait as the worker does."""
    return block_waits() if os.environ.get(WAIT_VARIABLE) == BLOCK else 0
