"""The repeat tests taken out unless --stackcheck-bench-repeat asks for them; the distributed case's records
(test_bench_distributed.py) added to the bench JSON, which is written even when they are all the run measured."""

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
    """`stackcheck.distributed` beside the block stackcheck.child.bench writes (trylast: after it). pytest-benchmark
    writes no JSON at all when no benchmark of its own ran, so a run of the distributed case alone records nothing."""
    output_json.setdefault("stackcheck", {})["distributed"] = config.stash.get(DISTRIBUTED, [])


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the bench JSON where pytest-benchmark wrote none because no benchmark of its own ran (`-k` selecting the
    distributed case alone): its own hooks build the JSON, with an empty `benchmarks` list beside the distributed
    cells, so that `stackcheck bench` finds the set's results. pytest-benchmark's own sessionfinish wraps this one
    and has already decided by then."""
    benchmarks = getattr(session.config, "_benchmarksession", None)
    cells = session.config.stash.get(DISTRIBUTED, [])
    if benchmarks is None or not benchmarks.json or benchmarks.benchmarks or not cells:
        return
    hook = session.config.hook
    commit_info = hook.pytest_benchmark_generate_commit_info(config=session.config)
    hook.pytest_benchmark_update_commit_info(config=session.config, commit_info=commit_info)
    output_json = hook.pytest_benchmark_generate_json(config=session.config, benchmarks=[], include_data=True,
                                                      machine_info=benchmarks.get_machine_info(), commit_info=commit_info)
    hook.pytest_benchmark_update_json(config=session.config, benchmarks=[], output_json=output_json)
    benchmarks.save_json(output_json)
