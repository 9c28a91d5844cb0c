"""pytest plugin for the benchmarks, loaded from pyproject's addopts beside stackcheck.child.plugin: the bench
options, the rule that benchmarks run only when `-m` names them, the session's device and measured copy
bandwidth, and the `stackcheck` block it adds to pytest-benchmark's JSON.
"""

from __future__ import annotations

import pytest

from stackcheck.child import keys
from stackcheck.core.protocol import BENCH_REPEAT_OPTION, BENCH_SIZE_OPTION, BENCH_SMOKE_OPTION

BANDWIDTH = pytest.StashKey[dict]()
NOT_MEASURED = pytest.StashKey[list]()


def record_not_measured(config: pytest.Config, size: str, case: str, phase: str, reason: str) -> None:
    """A benchmark that could not be measured faithfully: the JSON says which and why, the report shows it."""
    config.stash.setdefault(NOT_MEASURED, []).append({"size": size, "case": case, "phase": phase, "reason": reason})


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stackcheck bench")
    group.addoption(BENCH_SIZE_OPTION, choices=("tiny", "realistic", "all"), default="tiny",
                    help="model size to benchmark (default: tiny)")
    group.addoption(BENCH_SMOKE_OPTION, action="store_true",
                    help="few tokens and rounds; runs on the CPU (one thread) when there is no GPU")
    group.addoption(BENCH_REPEAT_OPTION, type=int, default=0, metavar="N",
                    help="measure the 4-bit (nf4_dq) decode N more times in each mode, for its coefficient of variation")


def bench_sizes(config: pytest.Config) -> list[str]:
    size = config.getoption(BENCH_SIZE_OPTION)
    return ["tiny", "realistic"] if size == "all" else [size]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Benchmarks take minutes on a GPU: a run whose -m expression does not name `benchmark` (the plain
    test run, `-m gpu`, `-m "not gpu"`) leaves them out."""
    if "benchmark" in (config.option.markexpr or ""):
        return
    benchmarks = [item for item in items if item.get_closest_marker("benchmark")]
    if benchmarks:
        config.hook.pytest_deselected(items=benchmarks)
        items[:] = [item for item in items if not item.get_closest_marker("benchmark")]


@pytest.fixture(scope="session")
def bench_device(request: pytest.FixtureRequest):
    """The GPU, or in smoke mode without one the CPU, with the copy bandwidth measured on it once."""
    import torch

    from stackcheck.core import hostinfo
    from stackcheck.child.setup import platform_of

    from stackcheck.bench import harness as bench

    device = bench.bench_device()
    if device.type == "cpu":
        if not request.config.getoption(BENCH_SMOKE_OPTION):
            pytest.skip("the full bench needs a CUDA GPU; --stackcheck-bench-smoke runs the short CPU version")
        # On a shared 2-core CI machine, OpenMP's spin-waiting turns any other busy process into 10-30x
        # swings of the timings; one thread keeps the smoke run's numbers steady enough to compare.
        torch.set_num_threads(1)
    request.config.stash[BANDWIDTH] = {
        "measured_bytes_per_s": bench.copy_bandwidth(device),
        "spec_bytes_per_s": bench.spec_bandwidth(hostinfo.device_name(platform_of(request.config))),
        "method": "device-to-device copy, bytes read + written, median of 10",
    }
    return device


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_json(config: pytest.Config, benchmarks, output_json: dict) -> None:
    import torch

    from stackcheck.core import hostinfo
    from stackcheck.child.setup import platform_of

    from stackcheck.bench import harness as bench
    from stackcheck.core.versions import installed_versions

    output_json["stackcheck"] = {
        "set": config.stash[keys.SET].name,
        "versions": installed_versions(),
        "device": hostinfo.device_name(platform_of(config)),
        "platform": platform_of(config),
        "mode": "smoke" if config.getoption(BENCH_SMOKE_OPTION) else "full",
        "sizes": bench_sizes(config),
        "bandwidth": config.stash.get(BANDWIDTH, None),
        "cpu_threads": torch.get_num_threads(),
        "synthetic_slowdown": bench.synthetic_slowdown(),
        "not_measured": config.stash.get(NOT_MEASURED, []),
    }
