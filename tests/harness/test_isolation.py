"""A cell starts as a fresh process would, as far as the libraries' process-wide state goes (stackcheck.isolation):
accelerate's state that one test built is gone before the next, and garbage collection between tests still frees a
test's cycles. A nested pytest run of two tests in one process, with the plugin that does both."""

import subprocess
import sys
import textwrap

from stackcheck import REPO_ROOT

TESTS = '''
import gc, weakref

HELD = {}


class Cycle:
    def __init__(self):
        self.me = self


def test_builds_accelerate_state_and_a_cycle():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    Accelerator(cpu=True)
    assert AcceleratorState._shared_state, "no state was built"
    HELD["cycle"] = weakref.ref(Cycle())


def test_finds_neither():
    from accelerate.state import AcceleratorState, PartialState

    assert AcceleratorState._shared_state == {} and PartialState._shared_state == {}
    assert HELD["cycle"]() is None, "the first test's reference cycle was not collected"
'''


def test_the_next_test_finds_no_accelerate_state_and_no_garbage_of_the_last(tmp_path):
    (tmp_path / "test_two.py").write_text(TESTS)
    run = subprocess.run([sys.executable, "-m", "pytest", "test_two.py", "-p", "stackcheck.gc_freeze", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0 and "2 passed" in run.stdout, textwrap.shorten(run.stdout + run.stderr, 3000)
