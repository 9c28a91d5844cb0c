"""The repeat tests taken out unless --stackcheck-bench-repeat asks for them; the distributed case's records
(test_bench_distributed.py) added to the bench JSON."""

import pytest

DISTRIBUTED = pytest.StashKey[list]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The repeat tests run only when --stackcheck-bench-repeat asks for two measurements or more; left
    unparametrized otherwise, they are taken out here rather than shown as empty-parameter skips."""
    if config.getoption("--stackcheck-bench-repeat") >= 2:
        return
    repeats = [item for item in items if getattr(item, "originalname", "").endswith("_repeat")]
    if repeats:
        config.hook.pytest_deselected(items=repeats)
        items[:] = [item for item in items if item not in repeats]


@pytest.fixture
def record_distributed(request: pytest.FixtureRequest):
    """Keeps one cell of the distributed case (stackcheck.bench.distributed.measure) for the bench JSON."""
    return request.config.stash.setdefault(DISTRIBUTED, []).append


@pytest.hookimpl(optionalhook=True, trylast=True)
def pytest_benchmark_update_json(config: pytest.Config, benchmarks, output_json: dict) -> None:
    """`stackcheck.distributed` beside the block stackcheck.bench.plugin writes (trylast: after it). pytest-benchmark
    writes no JSON at all when no benchmark of its own ran, so a run of the distributed case alone records nothing."""
    output_json.setdefault("stackcheck", {})["distributed"] = config.stash.get(DISTRIBUTED, [])
