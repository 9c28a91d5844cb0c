"""The bytecode warmer (stackcheck.process.warmer): a run of many xdist workers starts one process that imports the set's
libraries into the bytecode cache, and each worker waits for its torch before importing torch itself."""

import os
import subprocess
import sys
import time
from pathlib import Path

from stackcheck.runner import envs, lane
from stackcheck.process import warmer as warm
from stackcheck.core.protocol import WARMING_ENV


def test_how_many_workers_a_run_starts():
    assert lane.xdist_workers(["-q", "-n", "16", "--dist", "load"]) == 16
    assert lane.xdist_workers(["-n4"]) == lane.xdist_workers(["--numprocesses=4"]) == lane.xdist_workers(["--numprocesses", "4"]) == 4
    assert lane.xdist_workers(["-n", "auto"]) == lane.xdist_workers(["-q"]) == 0


def test_the_workers_wait_for_the_warmers_first_library_and_read_what_it_wrote(monkeypatch, tmp_path):
    environ = envs.bytecode_cache(dict(os.environ, PYTHONPYCACHEPREFIX=str(tmp_path)))
    assert warm.start(Path(sys.executable), warm.FROM_WORKERS - 1, environ) is None and WARMING_ENV not in environ
    monkeypatch.setattr(warm, "IMPORTS", ("no_such_library", "stackcheck.process.cuda_driver", "stackcheck.process.gpu_wait"))
    monkeypatch.setattr(warm, "FIRST", "stackcheck.process.cuda_driver")
    warmer = warm.start(Path(sys.executable), warm.FROM_WORKERS, environ)
    assert warm.wait_for_torch(environ) < warm.WAIT_SECONDS
    assert list(tmp_path.rglob("cuda_driver*.pyc")), "a worker would go on before the warmer wrote its first library"
    assert warmer.wait(timeout=60) == 0  # a library it cannot import is skipped
    assert list(tmp_path.rglob("gpu_wait*.pyc")), "the warmer wrote no bytecode for what it imported after the first"
    marker = Path(environ[WARMING_ENV].rpartition(os.pathsep)[0])
    warm.stop(warmer, environ)
    assert WARMING_ENV not in environ and not marker.parent.exists()


def test_no_worker_waits_for_a_warmer_that_ended_without_its_marker(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])  # ended, and not reaped yet by its parent (this test)
    time.sleep(0.5)
    began = time.monotonic()
    assert warm.wait_for_torch({WARMING_ENV: f"{tmp_path / 'never'}{os.pathsep}{ended.pid}"}) < warm.WAIT_SECONDS
    assert time.monotonic() - began < 5
    ended.wait()
    assert warm.wait_for_torch({}) == 0.0
