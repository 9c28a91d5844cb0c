"""The garbage collection between tests (stackcheck.gc_freeze) walks everything only where a fixture wider than a
test's ended (and after the last test), not at every change of module: under xdist, longest first, a worker's next
test is nearly always of another module. And what such a fixture held in a reference cycle, frozen by then, is
still collected before the next test, as is what a test's own fixture held (not frozen as a survivor) and what a
test held when it collected everything itself (stackcheck.harness.memory.settled freezes it again). A nested pytest
run of three modules, their tests interleaved as a worker gets them, with the plugin and a count of its full
collections. A host with a CUDA device keeps the collection at each change of module (stackcheck.gc_freeze says
why)."""

import subprocess
import sys
import textwrap

from stackcheck import REPO_ROOT

CONFTEST = '''
import pytest
import stackcheck.gc_freeze as gc_freeze

FULL = []
_collect = gc_freeze.collect_everything


def counted():
    FULL.append(1)
    _collect()


gc_freeze.collect_everything = counted
{host}
ORDER = {order}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: ORDER.index(item.nodeid))


def full_collections() -> int:
    return len(FULL)
'''


def conftest(order: list[str], cuda_host: bool = False) -> str:
    """The nested run's conftest: the plugin's full collections counted, the tests run in `order`, on a host with a
    CUDA device where `cuda_host` (faked: this machine may have none)."""
    host = "gc_freeze._cuda_host = lambda: True  # a host with a CUDA device" if cuda_host else ""
    return CONFTEST.format(host=host, order=repr(order))


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
    import stackcheck.gc_freeze as gc_freeze

    value = Cycle()
    HELD["read"] = weakref.ref(value)
    gc_freeze.collect_everything()
    assert conftest.full_collections() == 2
'''


def test_everything_is_walked_where_a_wider_fixture_ended_and_not_at_each_change_of_module(tmp_path):
    for name, text in (("conftest.py", conftest(INTERLEAVED)), ("test_a.py", MODULE_A), ("test_b.py", MODULE_B), ("test_c.py", MODULE_C)):
        (tmp_path / name).write_text(text)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "stackcheck.gc_freeze", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-p", "no:randomly", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0 and "7 passed" in run.stdout, textwrap.shorten(run.stdout + run.stderr, 3000)


MODULE_X = '''
import conftest


def test_x1():
    assert conftest.full_collections() == 0


def test_x2():
    # the teardowns of test_x1 and test_y1, each the last of a run of its module's tests
    assert conftest.full_collections() == 2
'''

MODULE_Y = '''
import conftest


def test_y1():
    assert conftest.full_collections() == 1
'''


def test_a_cuda_host_walks_everything_at_each_change_of_module(tmp_path):
    for name, text in (("conftest.py", conftest(["test_x.py::test_x1", "test_y.py::test_y1", "test_x.py::test_x2"], cuda_host=True)), ("test_x.py", MODULE_X), ("test_y.py", MODULE_Y)):
        (tmp_path / name).write_text(text)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "stackcheck.gc_freeze", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-p", "no:randomly", "-q"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0 and "3 passed" in run.stdout, textwrap.shorten(run.stdout + run.stderr, 3000)
