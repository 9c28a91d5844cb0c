"""The garbage collection between tests (stackcheck.child.gc_freeze) walks everything only where a fixture wider than a
test's ended (and after the last test), not at every change of module: under xdist, longest first, a worker's next
test is nearly always of another module. And what such a fixture held in a reference cycle, frozen by then, is
still collected before the next test, as is what a test's own fixture held (not frozen as a survivor) and what a
test held when it collected everything itself (stackcheck.harness.memory.settled freezes it again). A nested pytest
run of three modules, their tests interleaved as a worker gets them, with the plugin and a count of its full
collections. Before a test marked `reads_device_memory`, everything is collected (stackcheck.child.gc_freeze says why)."""

import subprocess
import sys
import textwrap

from stackcheck import REPO_ROOT

CONFTEST = '''
import pytest
import stackcheck.child.gc_freeze as gc_freeze

FULL = []
_collect = gc_freeze.collect_everything


def counted():
    FULL.append(1)
    _collect()


gc_freeze.collect_everything = counted
gc_freeze._cuda_host = lambda: True  # a host with a CUDA device (faked: this machine may have none)
ORDER = {order}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: ORDER.index(item.nodeid))


def full_collections() -> int:
    return len(FULL)
'''


def conftest(order: list[str]) -> str:
    """The nested run's conftest: the plugin's full collections counted, the tests run in `order`."""
    return CONFTEST.format(order=repr(order))


INTERLEAVED = ["test_a.py::test_a1", "test_b.py::test_b1", "test_c.py::test_c1", "test_b.py::test_b2", "test_c.py::test_c2",
               "test_a.py::test_a2", "test_b.py::test_b3"]

MODULE_A = '''
import weakref

import pytest

HELD = {}


class Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture(scope="module")
def cycle():
    value = Cycle()
    HELD["cycle"] = weakref.ref(value)
    yield value


def test_a1(cycle):
    assert cycle.me is cycle


def test_a2(cycle):
    assert cycle.me is cycle
'''

MODULE_B = '''
import sys

import conftest


def test_b1():
    # test_a1's teardown ended the module fixture: one full collection, and its cycle is gone
    assert conftest.full_collections() == 1
    assert sys.modules["test_a"].HELD["cycle"]() is None, "the module fixture's reference cycle was not collected"


def test_b2():
    assert conftest.full_collections() == 1, "a change of module alone walked everything"
    assert sys.modules["test_c"].HELD["model"]() is None, "the last test's fixture was frozen, not collected"


def test_b3():
    # test_c2's own reading, the collection after it (it had frozen test_c2's objects), test_a2's module fixture
    assert conftest.full_collections() == 4
    assert sys.modules["test_c"].HELD["read"]() is None, "what a test held when it read memory stayed frozen after it"
    assert sys.modules["test_a"].HELD["cycle"]() is None
'''

MODULE_C = '''
import weakref

import pytest

import conftest

HELD = {}


class Cycle:
    def __init__(self):
        self.me = self


@pytest.fixture
def model():  # a test's own fixture, a cycle like a model's
    value = Cycle()
    HELD["model"] = weakref.ref(value)
    return value


def test_c1(model):
    assert conftest.full_collections() == 1, "a change of module alone walked everything"


def test_c2():
    # a reading of memory inside the test: everything collected, and what the test holds frozen again
    import stackcheck.child.gc_freeze as gc_freeze

    value = Cycle()
    HELD["read"] = weakref.ref(value)
    gc_freeze.collect_everything()
    assert conftest.full_collections() == 2
'''


def test_everything_is_walked_where_a_wider_fixture_ended_and_not_at_each_change_of_module(tmp_path):
    for name, text in (("conftest.py", conftest(INTERLEAVED)), ("test_a.py", MODULE_A), ("test_b.py", MODULE_B), ("test_c.py", MODULE_C)):
        (tmp_path / name).write_text(text)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "stackcheck.child.gc_freeze", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-p", "no:randomly", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0 and "7 passed" in run.stdout, textwrap.shorten(run.stdout + run.stderr, 3000)


MODULE_X = '''
import weakref

import conftest

HELD = {}


class Cycle:
    def __init__(self):
        self.me = self


def test_x1():
    HELD["alive"] = Cycle()  # survives the test: frozen after it
    HELD["cycle"] = weakref.ref(HELD["alive"])


def test_x2():
    del HELD["alive"]  # frozen garbage now: only a collection of everything reaches it
    assert conftest.full_collections() == 0


def test_x3():
    assert conftest.full_collections() == 1, "the test after one that reads memory walked everything"
'''

MODULE_Y = '''
import sys

import pytest

import conftest


@pytest.mark.reads_device_memory
def test_y1():
    assert conftest.full_collections() == 1, "the test before one that reads memory did not walk everything"
    assert sys.modules["test_x"].HELD["cycle"]() is None, "an earlier test's frozen garbage outlived the collection before a memory reading"
'''


def test_a_test_that_reads_device_memory_starts_after_everything_was_collected(tmp_path):
    order = ["test_x.py::test_x1", "test_x.py::test_x2", "test_y.py::test_y1", "test_x.py::test_x3"]
    for name, text in (("conftest.py", conftest(order)), ("test_x.py", MODULE_X), ("test_y.py", MODULE_Y)):
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    reads_device_memory: as stackcheck's\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "stackcheck.child.gc_freeze", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-p", "no:randomly", "-q", "--strict-markers"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0 and "4 passed" in run.stdout, textwrap.shorten(run.stdout + run.stderr, 3000)
