"""How CI runs in parallel (docs/speed.md): the xdist options a run gets by default, the longest-first order, and the
locks that let workers share what they build."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stackcheck import REPO_ROOT
from stackcheck.child import schedule
from stackcheck.runner.lane import named_paths, parallel_options
from stackcheck.core.locking import folder_locked

PARALLEL = ["-n", "4", "--dist", "load", "--maxschedchunk", "1"]


@pytest.mark.parametrize("pytest_args, expected", [
    ([], PARALLEL),
    (["--durations=50", "-m", "not slow"], PARALLEL),
    (["-n", "2"], []),
    (["-n2"], []),
    (["--numprocesses=auto"], []),
    (["-p", "no:xdist"], []),
    (["--dist", "worksteal"], []),
    (["--pdb"], []),
    (["tests/harness/test_axes.py"], []),
    (["tests/families/test_tied_head.py::test_x", "-q"], []),
    (["-k", "tied_head"], []),
])
def test_a_run_gets_a_worker_per_core_unless_its_options_choose_or_name_tests(pytest_args, expected, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert parallel_options(pytest_args, workers=4) == expected


def test_one_core_or_an_xdist_worker_runs_in_one_process(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert parallel_options([], workers=1) == []
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # a harness test's own `matrix` run under CI's workers
    assert parallel_options([], workers=4) == []


def test_named_paths_are_the_checkouts_files_not_option_values():
    args = ["-k", "tests", "-m", "slow", "tests/harness", "tests/families/test_tied_head.py::test_x[cpu]", "nowhere.py", "-q"]
    assert named_paths(args) == ["tests/harness", "tests/families/test_tied_head.py::test_x[cpu]"]


def test_expected_seconds_fall_back_to_the_function_then_the_module():
    known = {"tests/a.py::test_long[x]": 10.0, "tests/a.py::test_long[y]": 20.0, "tests/a.py::test_short": 2.0}
    expected = schedule.expected_seconds(["tests/a.py::test_long[z]", "tests/a.py::test_new", "tests/b.py::test_b"], known)
    assert expected == {"tests/a.py::test_long[z]": 15.0, "tests/a.py::test_new": 32.0 / 3, "tests/b.py::test_b": 0.0}


def test_longest_first_is_stable_among_equals():
    items = [type("Item", (), {"nodeid": nodeid})() for nodeid in ("a", "b", "c", "d")]
    order = schedule.longest_first(items, {"a": 1.0, "b": 3.0, "c": 1.0, "d": 2.0})
    assert [item.nodeid for item in order] == ["b", "d", "a", "c"]


def test_the_tests_that_read_a_shared_result_go_after_the_one_that_builds_it():
    shares = pytest.mark.shares("run").mark

    def item(nodeid: str, shared: bool):
        return type("Item", (), {"nodeid": nodeid, "get_closest_marker": lambda self, name: shares if shared and name == "shares" else None})()

    items = [item("a", True), item("b", True), item("c", False), item("d", False), item("e", True)]
    order = schedule.longest_first(items, {"a": 20.0, "b": 25.0, "c": 1.0, "d": 10.0, "e": 30.0})
    assert [item.nodeid for item in order] == ["e", "d", "c", "b", "a"]


PROBE = '''
import os
import pathlib
import time

import pytest

OUT = pathlib.Path(os.environ["PROBE_OUT"])


@pytest.mark.parametrize("n", range(6))
def test_alone(n, worker_id):
    with (OUT / worker_id).open("a") as log:
        log.write(f"{n}\\n")
    time.sleep(0.6 if n == 5 else 0.1)
'''


def test_a_parallel_run_hands_out_the_longest_first(tmp_path):
    """Real xdist, two workers, over a probe module: each worker runs its tests in the order of the durations file
    (the longest first), and the durations a run records are each test's own."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    durations = tmp_path / "durations.json"
    seconds = {f"test_probe.py::test_alone[{n}]": float(n) for n in range(6)}
    durations.write_text(json.dumps({"seconds": seconds}))
    recorded = tmp_path / "recorded.json"
    # The scheduling plugin alone (not the families' plugin, which imports torch in each of the three processes).
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p stackcheck.child.schedule\n")
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
         *PARALLEL[:1], "2", *PARALLEL[2:], f"--stackcheck-durations={durations}", f"--stackcheck-record-durations={recorded}",
         str(tmp_path / "test_probe.py")],
        cwd=tmp_path, env=dict(os.environ, PROBE_OUT=str(out), PYTHONPATH=str(REPO_ROOT)), check=True, capture_output=True)
    by_worker = {path.name: [int(n) for n in path.read_text().split()] for path in out.glob("gw*")}
    assert sorted(n for started in by_worker.values() for n in started) == list(range(6))
    assert all(started == sorted(started, reverse=True) for started in by_worker.values()), by_worker  # each took the longest left
    kept = json.loads(recorded.read_text())["seconds"]  # the tests of half a second or more, by their own ids
    assert "test_probe.py::test_alone[5]" in kept and set(kept) <= set(seconds)


def test_a_checkpoint_asked_for_by_two_processes_at_once_is_built_once(tmp_path):
    """Two processes ask for one tiny checkpoint at once (two xdist workers, a job's two ranks): one builds it, the
    other waits under the cache folder's lock and finds it built."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from stackcheck.models import tiny

        def build(out):
            time.sleep(1.0)
            (out / "weights").write_text(sys.argv[1])

        tiny._build_once(Path({str(tmp_path / 'cache' / 'base')!r}), build)
        print([name for name, _ in tiny.BUILT])
    """)
    runs = [subprocess.Popen([sys.executable, "-c", code, str(n)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True) for n in range(2)]
    outputs = sorted(run.communicate()[0].strip() for run in runs)
    assert outputs == ["['base']", "[]"]
    assert (tmp_path / "cache" / "base" / "weights").read_text() in ("0", "1")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["base"]  # no scratch folder left behind


def test_a_folder_lock_excludes_another_process(tmp_path):
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\nexcept BlockingIOError:\n    print('held')")
    with folder_locked(tmp_path / "envs"):
        held = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "envs")], capture_output=True, text=True).stdout.strip()
    free = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "envs")], capture_output=True, text=True).stdout.strip()
    assert (held, free) == ("held", "free")


def test_the_durations_file_names_collected_tests():
    """The committed durations file is one this module reads, and most of what it names still exists (a test renamed
    since only loses its place in the order)."""
    known = schedule.measured(schedule.DURATIONS_FILE)
    assert known and all(seconds >= schedule.RECORD_FROM_SECONDS for seconds in known.values())
    modules = {nodeid.split("::", 1)[0] for nodeid in known}
    assert sum((REPO_ROOT / module).exists() for module in modules) >= 0.8 * len(modules)


def test_the_breakdown_names_the_floor_folders_and_longest_tests():
    seconds = {"tests/families/test_a.py::test_x[cpu]": 30.0, "tests/families/test_a.py::test_y": 10.0,
               "tests/harness/test_b.py::test_z": 20.0}
    text = schedule.breakdown(seconds, workers=2)
    assert text.startswith("3 tests over 0.5 s, 60 test-seconds; floor on 2 workers: 30 s")
    assert "     40 s  66.7%  tests/families" in text and "30.0 s  tests/families/test_a.py::test_x[cpu]" in text
    assert schedule.breakdown(seconds, workers=1).splitlines()[0].endswith("floor on 1 workers: 60 s")


def test_longest_first_makespan_is_the_classic_schedule():
    assert schedule.makespan([30.0, 10.0, 20.0], workers=2) == 30.0  # 30 | 20 + 10
    assert schedule.makespan([5.0, 5.0, 4.0, 3.0, 3.0], workers=2) == 11.0  # 5+4 | 5+3+3 (longest first is not always optimal)
    assert schedule.makespan([7.0], workers=4) == 7.0


def test_gpu_durations_come_from_a_results_files_gpu_cells(tmp_path):
    """The GPU lane's order comes from a GPU run's cells, the longest over its sets; the committed file is one the
    ordering reads, and it names GPU cells only."""
    cells = [{"test": "t.py::a[gpu-x]", "lane": "gpu", "seconds": 12.34, "set": "seed"},
             {"test": "t.py::a[gpu-x]", "lane": "gpu", "seconds": 20.0, "set": "latest"},
             {"test": "t.py::a[cpu-x]", "lane": "cpu", "seconds": 9.0, "set": "seed"},
             {"test": "t.py::b[gpu-x]", "lane": "gpu", "seconds": 0.1, "set": "seed"},
             {"test": "t.py::c[gpu-x]", "lane": "gpu", "seconds": None, "set": "seed"}]
    (tmp_path / "matrix.json").write_text(json.dumps({"cells": cells}))
    assert schedule.from_results(tmp_path / "matrix.json") == {"t.py::a[gpu-x]": 20.0}
    committed = schedule.measured(schedule.GPU_DURATIONS_FILE)
    assert committed and all("[gpu" in nodeid for nodeid in committed)


CPU_PROBE = '''
import subprocess
import sys
import time


def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_burns_in_its_process():
    burn(0.6)


def test_burns_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"], check=True)


def test_sleeps():
    time.sleep(0.6)
'''


def test_a_recorded_run_measures_each_tests_cpu_and_the_hosts(tmp_path):
    """Real xdist, two workers: each test's CPU seconds are its worker's and its waited-for children's (a fresh
    process's burn counts, a sleep does not), the host's busy core-seconds cover the run, and the breakdown prints
    the CPU floor."""
    (tmp_path / "test_cpu.py").write_text(CPU_PROBE)
    recorded = tmp_path / "recorded.json"
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -p stackcheck.child.schedule\n")
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
         "-n", "2", f"--stackcheck-record-durations={recorded}", str(tmp_path / "test_cpu.py")],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)), check=True, capture_output=True)
    cpu, host = schedule.measured_cpu(recorded)
    assert cpu["test_cpu.py::test_burns_in_its_process"] >= 0.5, cpu
    assert cpu["test_cpu.py::test_burns_in_a_child"] >= 0.5, cpu
    assert cpu["test_cpu.py::test_sleeps"] < 0.3, cpu
    if Path("/proc/stat").is_file():
        assert host["cores"] == os.cpu_count() and host["wall_seconds"] > 0 and host["busy_core_seconds"] >= 1.0, host
    text = schedule.breakdown(schedule.measured(recorded), workers=2, cpu=cpu, host=host)
    assert "core-seconds in the tests' processes and the children they waited for (3 tests)" in text, text


def test_the_breakdown_gives_the_floor_the_cores_set():
    text = schedule.breakdown({"t.py::a": 10.0}, workers=4, cpu={"t.py::a": 8.0, "t.py::b": 0.2},
                              host={"cores": 4, "wall_seconds": 20.0, "busy_core_seconds": 60.0})
    assert "CPU: 8 core-seconds in the tests' processes and the children they waited for (2 tests); shared out over 4 cores: 2 s" in text
    assert "host: 60 core-seconds busy over the run's 20 s on 4 cores (75%, every process on it); no run of this work on 4 cores ends before 15 s" in text
