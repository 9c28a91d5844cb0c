"""Progress of a long run: one line per unit (set, probe) for CI logs, and a live line in a terminal, written by
the unit's pytest process (stackcheck.child.progress) in place of pytest's per-test letters."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from stackcheck import REPO_ROOT
from stackcheck.core.progress import ENV, Progress, line


def test_one_line_per_unit_with_cells_done_of_the_total_and_an_eta(capsys, monkeypatch):
    clock = iter([0.0, 120.0, 240.0])
    monkeypatch.setattr("stackcheck.core.progress.time.monotonic", lambda: next(clock))
    tracker = Progress("matrix", 2, "set")
    tracker.finished("seed", 47)
    tracker.finished("latest", 47)
    assert capsys.readouterr().out.splitlines() == [
        "== progress: set seed done, 47 cells; matrix: 47 of ~94 cells, 1 of 2 sets done, 2 min in, ETA 2 min",
        "== progress: set latest done, 47 cells; matrix: 94 of 94 cells, 2 of 2 sets done, 4 min in, done",
    ]


def test_the_live_line_counts_the_running_unit():
    assert line("history", "probe", 31, 10, 470, 47, 20, 600.0) == (
        "history: 490 of ~1457 cells, 10 of 31 probes done, 10 min in, ETA 20 min")


@pytest.mark.skipif(not shutil.which("script"), reason="needs util-linux `script` for a terminal")
def test_in_a_terminal_the_unit_keeps_one_live_line(tmp_path):
    (tmp_path / "test_cells.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(3))\ndef test_cell(i):\n    assert i != 1\n")
    state = json.loads(Progress("gate", 2, "set").env()[ENV]) | {"units_done": 1, "finished_cells": 3}
    command = f"{sys.executable} -m pytest -q -p no:cacheprovider -p stackcheck.child.progress test_cells.py"
    run = subprocess.run(["script", "-qec", command, "/dev/null"], cwd=tmp_path, capture_output=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), **{ENV: json.dumps(state)}))
    terminal = run.stdout.decode()  # bytes: text mode would turn the carriage returns into newlines
    assert "\rgate: 6 of ~6 cells, 1 of 2 sets done" in terminal, terminal
    assert "1 failed" in terminal and "F." not in terminal  # the live line, not the letters
    quiet = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "stackcheck.child.progress",
                            "test_cells.py"], cwd=tmp_path, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), **{ENV: json.dumps(state)}))
    assert ".F." in quiet.stdout and "gate:" not in quiet.stdout  # a CI log keeps pytest's letters
