"""The serialize phase's fixtures: the base-checkpoint exchange (stackcheck.child.exchange), beside the results file, one
folder per architecture, as the plugin's `adapter_exchange` is for adapters; and the cross-release writer's, in the
machine's cache (stackcheck.commands.cross_release)."""

from pathlib import Path

import pytest

from stackcheck.child import exchange
from stackcheck.core.protocol import CROSS_RELEASE_OPTION
from stackcheck.core.versions import cross_release_writer
from stackcheck.models import architectures


@pytest.fixture
def base_exchange(request: pytest.FixtureRequest, arch) -> exchange.BaseExchange:
    """Where this set leaves the quantized checkpoints it saves on `arch`, and finds its baseline's."""
    config = request.config
    path = config.getoption("--stackcheck-results")
    return exchange.BaseExchange(exchange.folder_beside(Path(path), "base") / arch.name if path else None,
                                 config.getoption("--stackcheck-set"), config.getoption("--stackcheck-baseline"))


@pytest.fixture
def writer_exchange(request: pytest.FixtureRequest, arch) -> exchange.BaseExchange:
    """Where this set finds the quantized checkpoints the cross-release writer (sets.toml's `cross_release`, transformers
    4) saved on `arch`: in the folder the command names, or nowhere (the cells are skipped; a configuration of the
    user's is never written)."""
    config = request.config
    folder, writer = config.getoption(CROSS_RELEASE_OPTION), cross_release_writer()
    if architectures.builtin().get(arch.name) != arch:
        folder = None  # the writer writes the built-in architectures alone (a configuration of the user's: none)
    return exchange.BaseExchange(exchange.folder_beside(Path(folder) / "matrix.json", "base") / arch.name if folder and writer else None,
                                 config.getoption("--stackcheck-set"), writer.name if writer else None)
