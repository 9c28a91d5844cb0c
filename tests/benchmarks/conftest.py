"""The benchmarks' lane, and the repeat tests taken out unless --stackcheck-bench-repeat asks for them."""

import pytest

from stackcheck import scenario


@pytest.fixture(autouse=True)
def lane(bench_device):
    """Overrides stackcheck.plugin's `lane` (the CPU for everything but a family test): a benchmark's lane is
    its device, so the scenario helpers that build on `scenario.main_device()`, such as the training batch
    of `scenario.train_steps`, build where the case runs."""
    name = "gpu" if bench_device.type == "cuda" else "cpu"
    scenario.use_lane(name)
    yield name
    scenario.use_lane("cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The repeat tests run only when --stackcheck-bench-repeat asks for two measurements or more; left
    unparametrized otherwise, they are taken out here rather than shown as empty-parameter skips."""
    if config.getoption("--stackcheck-bench-repeat") >= 2:
        return
    repeats = [item for item in items if getattr(item, "originalname", "").endswith("_repeat")]
    if repeats:
        config.hook.pytest_deselected(items=repeats)
        items[:] = [item for item in items if item not in repeats]
