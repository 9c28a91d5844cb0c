"""Issue 47: a real `python -m stackcheck matrix` (its pytest child and the child's two xdist workers, on the seed
set's environment) stopped mid-run by a signal sent to the command alone, as `kill`, `docker stop` and a CI job's
cancel send it, over a results file with earlier verdicts of the same set:

- SIGTERM, SIGHUP and SIGINT end the command with one line saying what was kept, and exit 128 + the signal; the
  child's process group (controller and workers) is gone when the command returns;
- SIGTERM followed by SIGKILL of the command (`timeout -k`) leaves no process of the run behind;
- either way no verdict recorded before is lost, the file is whole JSON, no cell reads `error` (cell lost), and the
  cells not reached are listed as not run, apart from the verdicts, only where no verdict was on record."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stackcheck import REPO_ROOT

FAMILIES = "params4bit_kwargs,merge_parity,int8_offload,meta_quant_state"  # 11 CPU cells on gemma4
EARLIER = "offload_hook or merge_into_4bit"  # the cells the earlier run records: 6 of them
WAIT = 900  # seconds: the machine that runs this has 2 cores, often shared


def matrix(results: Path, *pytest_args: str, **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "stackcheck", "matrix", "--sets", "seed", "--families", FAMILIES, "--arch", "gemma4",
               "--results", str(results), *(["--", *pytest_args] if pytest_args else [])]
    # Every signal at its default, as in a terminal's command: a test runner's worker may have SIGINT ignored, which a
    # process inherits (and stackcheck leaves a signal ignored where it was, as a shell's background job has it).
    return subprocess.Popen(command, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)],
                            **popen)


def on_disk(results: Path) -> dict:
    data = json.loads(results.read_text())  # whole JSON at every moment: every write is a rename
    return {"cells": {(c["lane"], c["test"]): c for c in data["cells"]},
            "not_run": {(c["lane"], c["test"]): c for c in data.get("not_run", [])}}


def controller_group(results: Path) -> int | None:
    """The process group of the run's pytest controller (its command line names the results file)."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"--stackcheck-results={results}" in (proc / "cmdline").read_text().replace("\0", " "):
                return os.getpgid(int(proc.name))
        except (OSError, ProcessLookupError):
            continue
    return None


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def earlier(tmp_path_factory) -> Path:
    """A results file with 6 verdicts of the seed set, from a real run that completed."""
    results = tmp_path_factory.mktemp("earlier") / "matrix.json"
    run = matrix(results, "-k", EARLIER)
    out, err = run.communicate(timeout=WAIT)
    assert run.returncode in (0, 1), (out[-3000:], err[-3000:])
    assert len(on_disk(results)["cells"]) == 6, out[-3000:]
    return results


def signalled_run(earlier: Path, tmp_path: Path, stop) -> tuple[subprocess.Popen, str, dict, dict, int]:
    """The 11 cells run over a copy of `earlier`; `stop(process)` once this run has recorded its first verdict."""
    results = tmp_path / "matrix.json"
    results.write_text(earlier.read_text())
    before = on_disk(results)
    runs = {c["run"] for c in before["cells"].values()}
    run = matrix(results)
    began, group = time.monotonic(), None
    while time.monotonic() - began < WAIT:
        group = group or controller_group(results)
        if group and any(c.get("run") not in runs for c in on_disk(results)["cells"].values()):
            break
        assert run.poll() is None, run.communicate()
        time.sleep(0.2)
    else:
        run.kill()
        pytest.fail("the run recorded no verdict in time")
    stop(run)
    _out, err = run.communicate(timeout=120)
    return run, err, before, on_disk(results), group


def check_nothing_lost(before: dict, after: dict, runs: set[str]) -> None:
    for key, cell in before["cells"].items():  # every earlier verdict is there, or this run's verdict of the cell
        assert key in after["cells"] and key not in after["not_run"], key
        assert after["cells"][key] == cell or after["cells"][key]["run"] not in runs, (cell, after["cells"][key])
    assert not [c for c in after["cells"].values() if (c["signature"] or "").startswith("cell lost")]
    assert all(c["verdict"] == "not_run" and key not in before["cells"] for key, c in after["not_run"].items())
    assert len(after["cells"]) + len(after["not_run"]) == 11


@pytest.mark.timeout(2 * WAIT)
@pytest.mark.parametrize("received, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_stops_the_run_and_keeps_every_verdict(earlier, tmp_path, received, code):
    run, err, before, after, group = signalled_run(earlier, tmp_path, lambda process: process.send_signal(received))
    results = tmp_path / "matrix.json"
    named = "" if received == signal.SIGINT else f" by {received.name}"
    last = err.strip().splitlines()[-1]
    assert run.returncode == code, err[-3000:]
    assert last == (f"stackcheck: interrupted{named}: kept {len(after['cells'])} finished cells"
                    + (f" ({len(after['not_run'])} not run)" if after["not_run"] else "") + f" in {results}"), err[-3000:]
    assert not group_alive(group), "the pytest child or one of its workers outlived the command"
    check_nothing_lost(before, after, {c["run"] for c in before["cells"].values()})
    assert after["not_run"], "the run ended before the signal: nothing was stopped"
    assert "Traceback" not in err.replace("KeyboardInterrupt", ""), err[-3000:]


@pytest.mark.timeout(2 * WAIT)
def test_sigkill_after_sigterm_leaves_the_file_whole_and_no_process_behind(earlier, tmp_path):
    """`timeout -k 1`: SIGTERM, then SIGKILL of the command before its child has finished stopping."""
    def stop(process):
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        process.send_signal(signal.SIGKILL)

    run, _err, before, after, group = signalled_run(earlier, tmp_path, stop)
    assert run.returncode == -signal.SIGKILL
    began = time.monotonic()
    while group_alive(group) and time.monotonic() - began < 10:
        time.sleep(0.1)
    assert not group_alive(group), "the pytest child or one of its workers outlived the command's SIGKILL"
    check_nothing_lost(before, on_disk(tmp_path / "matrix.json"), {c["run"] for c in before["cells"].values()})


def test_a_threads_child_stopped_by_a_signal_raises_there_too():
    """history's probes wait on their pytest children in threads; a stop signal interrupts every child, and a thread's
    `call` then raises too rather than return the cut-short child's code (the probe store kept such a probe, 22 of a
    release's 49 cells, as whole)."""
    import threading

    from stackcheck.runner import signals

    outcome: dict = {}
    started = threading.Event()

    def probe():
        try:
            started.set()
            # Ctrl-C's default in the child: an xdist worker ignores SIGINT, which a child would inherit.
            outcome["code"] = signals.call([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); time.sleep(60)"])
        except KeyboardInterrupt as exc:
            outcome["raised"] = exc

    thread = threading.Thread(target=probe)
    thread.start()
    started.wait()
    deadline = time.monotonic() + 30
    while not signals.LIVE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert signals.LIVE, "the thread's child never started"
    with pytest.raises(signals.Interrupted):
        signals._raise(signal.SIGTERM, None)
    thread.join(60)
    assert not thread.is_alive(), "the thread's child did not stop"
    assert "code" not in outcome, f"the thread's call returned {outcome.get('code')} for a child cut short"
    assert isinstance(outcome.get("raised"), signals.Interrupted) and outcome["raised"].signum == signal.SIGTERM
