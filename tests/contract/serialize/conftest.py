"""The serialize phase's fixture: the base-checkpoint exchange (stackcheck.child.exchange), beside the results file, one
folder per architecture, as the plugin's `adapter_exchange` is for adapters."""

from pathlib import Path

import pytest

from stackcheck.child import exchange


@pytest.fixture
def base_exchange(request: pytest.FixtureRequest, arch) -> exchange.BaseExchange:
    """Where this set leaves the quantized checkpoints it saves on `arch`, and finds its baseline's."""
    config = request.config
    path = config.getoption("--stackcheck-results")
    return exchange.BaseExchange(exchange.folder_beside(Path(path), "base") / arch.name if path else None,
                                 config.getoption("--stackcheck-set"), config.getoption("--stackcheck-baseline"))
