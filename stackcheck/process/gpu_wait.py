"""How a process of a run waits for its GPU: asleep, not spinning a core.

CUDA's default, for a process with one context on a host with more cores than contexts, is to spin: a thread that
waits for the GPU (a synchronize, a copy to the host, an allocator's event) keeps its core busy until the GPU is done.
`gpu-matrix` runs one xdist worker per core, and their ranks and fresh processes, all waiting on one or two GPUs: the
cores they spin on are taken from the others, and on one H100 the run is bound by the CPU (docs/speed.md).

So where several workers share a host's cores (pytest-xdist with more than one worker), each worker sets its devices'
primary contexts to block (CU_CTX_SCHED_BLOCKING_SYNC) before anything in it creates them, and says so in
`WAIT_VARIABLE` for what it starts: a rank and the trainer_resume family's fresh process call `follow_the_worker`.
Only how the waiting thread waits changes: the kernels, streams, allocator and every value read are the same. On one
H100 (latest): a thread that synchronizes after each of 20 kernels of 25 ms spent 0.51 CPU-seconds spinning, 0.01
blocking; the GPU lane of seven one-process families (352 cells, 16 workers) cost its workers 463 CPU-seconds spinning
and 373 blocking; every family, both lanes (2631 cells), gave the same verdicts blocking as spinning (docs/speed.md,
session 17).

`STACKCHECK_GPU_WAIT=spin` keeps CUDA's default. A host without the CUDA driver, or without a visible device, is
left as it is.
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
