"""pytest plugin: the child's options, the run's state (ledger, lanes, architectures, versions, platform facts:
stackcheck.child.keys), and the xdist workers' share of the host: every worker sees every GPU, its own first
(`worker_gpus`), and keeps to its share of the CPU cores. Registers the recorder and the timing (stackcheck.child.recorder).
How a run is laid out: docs/architecture.md, "The pytest child"."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stackcheck.child import keys
from stackcheck.child.recorder import Recorder, Timing
from stackcheck.core import hostinfo, results
from stackcheck.core.ledger import Ledger, LedgerError
from stackcheck.core.protocol import ARCH_OPTION, BASELINE_OPTION, CROSS_RELEASE_OPTION, LANES_OPTION, RESULTS_OPTION, SET_OPTION, SET_RECORD_ENV, TIMING_OPTION
from stackcheck.core.versions import LIBRARIES, Pin, VersionSet, installed_versions
from stackcheck.models import architectures
from stackcheck.process import cuda_driver, gpu_wait, resume as resume_process, warm, warmer

WORKER_GPU_KEY = "stackcheck_cuda_visible_devices"  # in an xdist worker's workerinput
WORKER_THREADS_KEY = "stackcheck_cpu_threads"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stackcheck")
    group.addoption(SET_OPTION, default="local", help="name of the version set under test")
    group.addoption(RESULTS_OPTION, default=None, help="matrix.json to record each cell in")
    group.addoption(LANES_OPTION, default=",".join(results.LANES), help="comma-separated lanes to run (cpu, gpu)")
    group.addoption(ARCH_OPTION, default=None,
                    help="architectures under test: built-in names, comma-separated, or a config.json (default: every built-in one)")
    group.addoption(BASELINE_OPTION, default=None,
                    help=f"the set of this run whose trained adapter this set loads (stackcheck.child.exchange; needs {RESULTS_OPTION})")
    group.addoption(CROSS_RELEASE_OPTION, default=None,
                    help="the folder of the cross-release writer's exports, which this set's cross-release cells read "
                         "(stackcheck.commands.cross_release; without it they are skipped)")
    group.addoption(TIMING_OPTION, default=None,
                    help="JSON file to write the run's cost breakdown to: start-up, fixture build, tests, exit")


def visible_gpus() -> list[str]:
    """The GPUs this run may use: CUDA_VISIBLE_DEVICES when set, else every device the CUDA driver counts (as torch
    does, without importing it in the controller: stackcheck.process.cuda_driver)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [gpu.strip() for gpu in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()]
    return [str(index) for index in range(len(cuda_driver.device_names() or []))]


def worker_gpus(gpus: list[str], worker: int) -> str:
    """Worker `worker`'s CUDA_VISIBLE_DEVICES: every GPU of `gpus`, rotated so that the worker's own comes first.

    Not one GPU per worker: a cell that needs two GPUs (a `gpus(2)` test in the worker's process, a `ws2` job whose
    ranks inherit the list) would see one and read skipped. Not an exclusive lease either: no family's verdict
    depends on having a GPU to itself (the families compare numerics and each process's own allocator bytes, and the
    tiny models take megabytes), while the in-process `gpus(2)` tests need the GPUs in the worker's own process,
    which a lease handed to launched ranks cannot give."""
    first = worker % len(gpus)
    return ",".join(gpus[first:] + gpus[:first])


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: the controller calls it for each worker it starts
def pytest_configure_node(node) -> None:
    gpus = visible_gpus()
    if gpus:
        node.workerinput[WORKER_GPU_KEY] = worker_gpus(gpus, int(node.workerinput["workerid"].removeprefix("gw")))
    workers = getattr(node.config.option, "numprocesses", None)
    if "OMP_NUM_THREADS" not in os.environ and isinstance(workers, int) and workers > 1:
        # Each worker's share of the cores: with torch's default (every core) N workers spin against each
        # other (measured on the H100 host: docs/history-runs.md, "gpu-matrix on the H100").
        node.workerinput[WORKER_THREADS_KEY] = max(1, (os.cpu_count() or 1) // workers)


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", {})
    if WORKER_GPU_KEY in workerinput:
        os.environ["CUDA_VISIBLE_DEVICES"] = workerinput[WORKER_GPU_KEY]
    if workerinput:
        warmer.wait_for_torch()  # before a worker first imports torch: it reads the bytecode the warmer wrote
    if WORKER_THREADS_KEY in workerinput:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(workerinput[WORKER_THREADS_KEY])  # for what the worker starts
        torch.set_num_threads(workerinput[WORKER_THREADS_KEY])
        # inductor (transformers compiles the forward of a static cache's generate on CUDA) otherwise starts a pool of
        # one process per core in every worker that compiles, slower on a host many workers share (docs/speed.md,
        # session 16, "inductor compiles in the worker").
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(workerinput[WORKER_THREADS_KEY]))
    if int(workerinput.get("workercount", 1)) > 1:
        gpu_wait.for_a_shared_host()  # its GPUs' waits asleep, for the worker and what it starts (stackcheck.process.gpu_wait)
    try:
        config.stash[keys.LEDGER] = Ledger()
    except LedgerError as exc:
        raise pytest.UsageError(str(exc)) from None
    warm.enabled()  # STACKCHECK_RANK_POOL other than 0 or 1: pytest's usage error, before anything runs
    # The pool groups' mark (pool_group), pytest-xdist's, registered here too for a run without xdist (-p no:xdist).
    config.addinivalue_line("markers", "xdist_group(name): the tests run on one xdist worker under --dist loadgroup")
    config.addinivalue_line("markers", f"{resume_process.MARK}(resumes): the test resumes in a warm resume process where its "
                            "parameters make resumes(params) true (stackcheck.process.resume)")
    for family in config.stash[keys.LEDGER].families.values():
        config.addinivalue_line("markers", f"{family.id}: {family.title}")
    config.stash[keys.LANES] = [lane for lane in config.getoption(LANES_OPTION).split(",") if lane]
    if not set(config.stash[keys.LANES]) <= set(results.LANES):
        raise pytest.UsageError(f"{LANES_OPTION}: unknown lane in {config.stash[keys.LANES]} (lanes: {', '.join(results.LANES)})")
    try:
        config.stash[keys.ARCHITECTURES] = architectures.resolve(config.getoption(ARCH_OPTION))
    except architectures.ArchitectureError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[keys.ARCH_NAMES] = [arch.name for arch in config.stash[keys.ARCHITECTURES]]
    config.stash[keys.VERSIONS] = installed_versions()
    config.stash[keys.SET] = set_under_test(config)
    if config.getoption(TIMING_OPTION) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(Timing(Path(config.getoption(TIMING_OPTION))), "stackcheck-timing")
    path = config.getoption(RESULTS_OPTION)
    if path and not hasattr(config, "workerinput"):  # the xdist controller (or a plain run) owns the file
        # Nothing is written before collection finishes: a run that pytest refuses, or that collects nothing, changes nothing.
        recorder = Recorder(Path(path), config.stash[keys.SET].name, config.stash[keys.LANES], config.stash[keys.ARCH_NAMES],
                            config.stash[keys.VERSIONS], lambda: platform_of(config))
        config.pluginmanager.register(recorder, "stackcheck-recorder")
        read_platform_early(config)


def set_under_test(config: pytest.Config) -> VersionSet:
    """The set as the command side resolved it (protocol.SET_RECORD_ENV); in a plain pytest run, --stackcheck-set's
    name on what is installed."""
    record = os.environ.get(SET_RECORD_ENV)
    if record:
        return VersionSet.from_dict(json.loads(record))
    installed = config.stash[keys.VERSIONS]
    return VersionSet(config.getoption(SET_OPTION), {package: Pin(package, installed[package]) for package in LIBRARIES
                                                       if installed.get(package, "absent") != "absent"})


def platform_of(config: pytest.Config) -> dict[str, str]:
    """The run's platform facts (hostinfo.platform_facts), read once, when first asked for: they import bitsandbytes
    (4 to 6 s of CPU on this project's 2-core machine), which a process that neither records results nor reports
    them (an xdist worker, a `-q` run, a run of tests that never load a model) need not pay for."""
    if keys.PLATFORM not in config.stash:
        pending = config.stash.get(keys.PLATFORM_PENDING, None)
        config.stash[keys.PLATFORM] = pending.result() if pending is not None else hostinfo.platform_facts()
    return config.stash[keys.PLATFORM]


def read_platform_early(config: pytest.Config) -> None:
    """Start reading the platform facts in a thread of their own, in a process that will record them. An xdist
    controller records them once the first worker has collected; read only then (importing torch and bitsandbytes,
    CUDA's first call: seconds on a fresh machine), they waited for the workers' collection instead of overlapping it.
    Measured on one H100 (16 workers, docs/speed.md, session 18): the first tests started 5.4 to 7.1 s after the
    last worker had collected before (two fresh machines); after, 3.7 s on a fresh machine, 0.9 and 2.2 s with warm
    caches, and 5.1 and 5.9 s on the slowest machine of the session. The rest of that wait was found later: every
    worker's collection rebuilt the run's placeholders (`Recorder._start`). This project's 2-core machine: 1.4 s
    with 6 workers, bitsandbytes' fact cached beside the environment."""
    import threading
    from concurrent.futures import Future

    pending = config.stash[keys.PLATFORM_PENDING] = Future()

    def read() -> None:
        try:
            pending.set_result(hostinfo.platform_facts())
        except BaseException as exc:  # noqa: BLE001 - raised again where the facts are asked for
            pending.set_exception(exc)

    threading.Thread(target=read, name="stackcheck-platform", daemon=True).start()


def pytest_report_header(config: pytest.Config) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in config.stash[keys.VERSIONS].items())
    facts = ", ".join(f"{k} {v}" for k, v in platform_of(config).items())
    return [f"stackcheck set '{config.stash[keys.SET].name}': {versions}", f"stackcheck platform: {facts}"]
