"""pytest-xdist within one machine: on a GPU host every worker sees every GPU, its own first (so a cell that needs
two GPUs gets them under xdist); without GPUs the workers are left as they are. Real xdist runs over a probe test
that reports what its worker sees."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from stackcheck import REPO_ROOT
from stackcheck.core.locking import folder_locked, run_folder
from stackcheck.child.lanes import gpu_lane_skip_reason
from stackcheck.child.setup import visible_gpus, worker_gpus

PROBE = """
import os
import pathlib


def test_report_visible_gpus(worker_id):
    pathlib.Path(os.environ["PROBE_OUT"], worker_id).write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))


def test_report_cpu_threads(worker_id):
    import torch

    pathlib.Path(os.environ["PROBE_OUT"], worker_id + "-threads").write_text(str(torch.get_num_threads()))
"""


def seen_by_workers(tmp_path, cuda_visible_devices: str | None) -> dict[str, str]:
    (tmp_path / "test_probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")}
    env.update({"PROBE_OUT": str(out)}, **({"CUDA_VISIBLE_DEVICES": cuda_visible_devices} if cuda_visible_devices is not None else {}))
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "each", "-p", "no:cacheprovider", "-c", str(REPO_ROOT / "pyproject.toml"),
         "--rootdir", str(REPO_ROOT), str(tmp_path / "test_probe.py")],
        cwd=REPO_ROOT, env=env, check=True, capture_output=True,
    )
    return {worker.name: worker.read_text() for worker in out.iterdir()}


def gpus_seen(seen: dict[str, str]) -> dict[str, str]:
    return {worker: value for worker, value in seen.items() if not worker.endswith("-threads")}


@pytest.fixture(scope="module")
def seen_without_gpus(tmp_path_factory) -> dict[str, str]:
    """One real xdist run with CUDA_VISIBLE_DEVICES unset, which both the threads and the GPUs tests below read: once
    per test run, shared on disk by this run's xdist workers."""
    shared = run_folder(tmp_path_factory, "xdist-without-gpus")
    out = shared / "seen.json"
    with folder_locked(shared):
        if not out.exists():
            seen = seen_by_workers(Path(tempfile.mkdtemp(dir=shared)), None)
            (shared / "seen.tmp").write_text(json.dumps(seen))
            os.replace(shared / "seen.tmp", out)  # only a run that finished is shared
        return json.loads(out.read_text())


@pytest.mark.shares("xdist-without-gpus")
def test_each_worker_keeps_to_its_share_of_the_cores(seen_without_gpus):
    seen = seen_without_gpus
    share = str(max(1, (os.cpu_count() or 1) // 2))
    assert (seen["gw0-threads"], seen["gw1-threads"]) == (share, share)


def test_each_worker_sees_every_visible_gpu_its_own_first(tmp_path):
    assert gpus_seen(seen_by_workers(tmp_path, "3,5")) == {"gw0": "3,5", "gw1": "5,3"}


@pytest.mark.parametrize("host_gpus", [1, 2, 4])
def test_eight_workers_spread_over_the_gpus_and_keep_every_gpu(host_gpus):
    """`-n 8` on a host of 1, 2 or 4 GPUs: each worker's first GPU (where one-GPU cells run) takes turns, and every
    worker sees the host's every GPU, so no two-GPU cell (a `gpus(2)` test, a `ws2` job) reads skipped for the count."""
    gpus = [str(index) for index in range(host_gpus)]
    views = [worker_gpus(gpus, worker).split(",") for worker in range(8)]
    assert [view[0] for view in views] == [gpus[worker % host_gpus] for worker in range(8)]
    assert all(sorted(view) == gpus for view in views)
    two_gpu_cell = pytest.mark.gpus(2).mark
    node = type("Node", (), {"get_closest_marker": lambda self, name: two_gpu_cell if name == "gpus" else None})()
    skipped = {gpu_lane_skip_reason(node, len(view)) for view in views}
    assert skipped == ({None} if host_gpus >= 2 else {"GPU lane: needs 2 GPUs, torch sees 1"})


@pytest.mark.shares("xdist-without-gpus")
def test_without_gpus_workers_are_left_alone(seen_without_gpus, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if visible_gpus():
        pytest.skip("this host has GPUs")
    assert gpus_seen(seen_without_gpus) == {"gw0": "unset", "gw1": "unset"}


GROUPED_PROBE = """
import os
import pathlib

import pytest


def report(worker_id, name):
    pathlib.Path(os.environ["PROBE_OUT"], name).write_text(worker_id)


@pytest.mark.xdist_group("ranks-fsdp2-ws2-cpu")
@pytest.mark.parametrize("index", range(4))
def test_fsdp2(worker_id, index):
    report(worker_id, f"fsdp2-{index}")


@pytest.mark.xdist_group("ranks-zero3-ws2-cpu")
@pytest.mark.parametrize("index", range(4))
def test_zero3(worker_id, index):
    report(worker_id, f"zero3-{index}")


@pytest.mark.parametrize("index", range(6))
def test_alone(worker_id, index):
    report(worker_id, f"alone-{index}")
"""


def test_loadgroup_keeps_each_pool_group_on_one_worker(tmp_path):
    """What the matrix runs with pools (stackcheck.runner.lane.parallel_options): `--dist loadgroup --no-loadscope-reorder`.
    pytest-xdist 3.8's own grouping is lost under pytest 9 (stackcheck.child.schedule); stackcheck's scheduler keeps it:
    every test of a group on one worker (without it, xdist hands them out one by one)."""
    (tmp_path / "test_grouped.py").write_text(GROUPED_PROBE)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "PYTEST_XDIST_WORKER")}
    env.update(PROBE_OUT=str(out))
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder", "-p", "no:cacheprovider",
         "-c", str(REPO_ROOT / "pyproject.toml"), "--rootdir", str(REPO_ROOT), str(tmp_path / "test_grouped.py")],
        cwd=REPO_ROOT, env=env, check=True, capture_output=True,
    )
    ran = {path.name: path.read_text() for path in out.iterdir()}
    assert len(ran) == 14
    workers = {group: {worker for name, worker in ran.items() if name.startswith(group)} for group in ("fsdp2", "zero3")}
    assert all(len(seen) == 1 for seen in workers.values()), workers
