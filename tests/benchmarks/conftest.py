"""The repeat tests taken out unless --stackcheck-bench-repeat asks for them."""

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The repeat tests run only when --stackcheck-bench-repeat asks for two measurements or more; left
    unparametrized otherwise, they are taken out here rather than shown as empty-parameter skips."""
    if config.getoption("--stackcheck-bench-repeat") >= 2:
        return
    repeats = [item for item in items if getattr(item, "originalname", "").endswith("_repeat")]
    if repeats:
        config.hook.pytest_deselected(items=repeats)
        items[:] = [item for item in items if item not in repeats]
