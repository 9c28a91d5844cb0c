"""pytest plugin: every family test runs in two lanes, `[cpu]` and `[gpu]` (a `gpu` mark: the GPU lane only; `cpu`
or `gpus(n)` on a smaller host: skipped there, with the reason), and once per architecture where it uses the model
under test (`under_test`); a contract test's axes are its pairwise cells (stackcheck.child.axes). The fixtures the
families share: lane, device, arch, under_test, adapter_exchange, ranks. docs/architecture.md, "The pytest child"."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from stackcheck.child import axes, exchange, keys
from stackcheck.core.protocol import BASELINE_OPTION, RESULTS_OPTION
from stackcheck.core.results import family_of
from stackcheck.distributed.cells import Ranks
from stackcheck.models import architectures

if TYPE_CHECKING:
    from stackcheck.harness.scenario import UnderTest


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if family_of(metafunc.definition.nodeid) is None:
        return
    gpu_lane = pytest.param("gpu", marks=pytest.mark.gpu)
    lanes = [gpu_lane] if metafunc.definition.get_closest_marker("gpu") else ["cpu", gpu_lane]
    metafunc.parametrize("lane", lanes, indirect=True)
    if axes.parametrize(metafunc, metafunc.config.stash[keys.ARCHITECTURES]):  # a contract test's pairwise cells
        return
    if "under_test" in metafunc.fixturenames:
        archs = metafunc.config.stash[keys.ARCHITECTURES]
        metafunc.parametrize("arch", archs, ids=[arch.name for arch in archs], indirect=True)


def gpu_lane_skip_reason(node: pytest.Item, gpu_count: int) -> str | None:
    """Why a test cannot run in the GPU lane of a host where torch sees `gpu_count` GPUs, if it cannot."""
    if node.get_closest_marker("cpu"):
        return "GPU lane: the test is about a CPU code path"
    if gpu_count == 0:
        return "GPU lane: torch sees no CUDA device"
    if (needs := node.get_closest_marker("gpus")) and gpu_count < needs.args[0]:
        return f"GPU lane: needs {needs.args[0]} GPUs, torch sees {gpu_count}"
    return None


@pytest.fixture(autouse=True)
def lane(request: pytest.FixtureRequest):
    """The lane of a family test (`cpu` for everything else)."""
    import torch

    name = getattr(request, "param", "cpu")
    if name == "gpu" and (reason := gpu_lane_skip_reason(request.node, torch.cuda.device_count())):
        pytest.skip(reason)
    return name


@pytest.fixture
def device(lane: str):
    """The lane's device: CUDA device 0 in the GPU lane, the CPU in the CPU lane (on every host)."""
    from stackcheck.harness import scenario  # torch's: imported where tests run, never by an xdist controller (it starts the workers)

    return scenario.lane_device(lane)


@pytest.fixture
def arch(request: pytest.FixtureRequest) -> architectures.Architecture:
    """The architecture under test (a parameter of every family test that uses the model)."""
    return request.param


@pytest.fixture
def under_test(request: pytest.FixtureRequest, arch, device) -> UnderTest:
    """The model under test: the architecture on the lane's device. A test whose bug needs structures the
    architecture lacks (`needs` marks, module-level ones included) stops here as not applicable."""
    from stackcheck.harness.scenario import UnderTest

    subject = UnderTest(arch, device)
    for mark in request.node.iter_markers("needs"):
        subject.require_structures(mark.args)
    return subject


@pytest.fixture
def adapter_exchange(request: pytest.FixtureRequest, arch) -> exchange.AdapterExchange:
    """Where this set leaves the adapter it trains on `arch`, and finds its baseline's: beside the results
    file, one folder per architecture."""
    config = request.config
    path = config.getoption(RESULTS_OPTION)
    return exchange.AdapterExchange(exchange.folder_beside(Path(path)) / arch.name if path else None,
                                    config.stash[keys.SET].name, config.getoption(BASELINE_OPTION))


@pytest.fixture
def ranks(request: pytest.FixtureRequest, lane: str, tmp_path: Path) -> Ranks:
    """Launches the test's distributed job (stackcheck.distributed): `ranks("module:function", world_size,
    engine)`. Each rank's outcome goes into the cell; a rank that did not pass fails the test with all of them."""
    return Ranks(request.node, lane, tmp_path)
