"""The distributed training case (stackcheck.bench.distributed): QLoRA steps under FSDP2 and DeepSpeed ZeRO-3 at
world sizes 1 and 2, launched as users launch them, every rank's tokens/s of the job, peak VRAM and sharding
arithmetic recorded under `stackcheck.distributed` in the bench JSON (not pytest-benchmark entries: the ranks time
their steps, not this process). A world size the host cannot run is recorded as not measured, with the reason,
and skipped; a job that fails is recorded with its ranks' failures, and fails. In smoke mode the tiny size only, FSDP2 (uint8) and ZeRO-3: on the CPU two ranks over gloo, as CI runs it.
"""

import pytest

from stackcheck.bench import distributed
from stackcheck.child.bench import bench_sizes

pytestmark = pytest.mark.benchmark


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    smoke = metafunc.config.getoption("--stackcheck-bench-smoke")
    cells = [pytest.param(size, engine, world_size, id=f"{size}-{engine}-ws{world_size}",
                          marks=pytest.mark.timeout(distributed.TIMEOUTS[size] + distributed.BUILD_SECONDS))
             for size in distributed.sizes(bench_sizes(metafunc.config), smoke)
             for engine in (distributed.SMOKE_ENGINES if smoke else distributed.ENGINES) for world_size in distributed.WORLD_SIZES]
    metafunc.parametrize(("size", "engine", "world_size"), cells)


def test_distributed_training(size, engine, world_size, bench_device, record_distributed, request, tmp_path):
    smoke = request.config.getoption("--stackcheck-bench-smoke")
    record = distributed.measure(size, engine, world_size, smoke, bench_device, tmp_path)
    record_distributed(record)  # a failed job too: the report names its failure
    if record.get("failed"):
        pytest.fail(record["not_measured"], pytrace=False)
    if "not_measured" in record:
        pytest.skip(f"not measured: {record['not_measured']}")
