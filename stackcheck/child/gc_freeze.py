"""pytest plugin (on by default from pyproject's addopts; `-p no:stackcheck.child.gc_freeze` turns it off, and with it
the collection between tests): the garbage collection between tests, cheap, after the libraries' process-wide state
is reset (stackcheck.process.isolation). Every test ends with a collection, so nothing a test left in cycles reaches
the next; what survives is frozen out of the collector's reach (`gc.freeze`), so each collection walks only what was
made since; everything is collected where a wider fixture ended, at the run's end, and before a test marked
`reads_device_memory`. Why each rule: docs/internals.md, "child/gc_freeze.py"; what it saved: docs/speed.md.
"""

from __future__ import annotations

import gc
import sys

import pytest

from stackcheck.process.isolation import reset_libraries


# Whether a full collection froze again what the running test holds (a reading of memory inside a test): its model
# and the rest are then frozen, and only another full collection frees them once the test is over.
_REFROZE = {"inside_a_test": False}


def collect_everything() -> None:
    """A full collection that reaches frozen objects too, frozen again after (only where something was)."""
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
        _REFROZE["inside_a_test"] = True


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


# Set when a fixture wider than a function's is finalized, cleared by the collection of everything.
WIDER_FIXTURE_ENDED = pytest.StashKey[bool]()
# The mark (registered in pyproject.toml) of a test that reads the CUDA allocator's counts: the test before it ends
# with everything collected.
MEMORY_MARK = "reads_device_memory"


def pytest_fixture_post_finalizer(fixturedef, request) -> None:
    if fixturedef.scope != "function":
        request.node.session.stash[WIDER_FIXTURE_ENDED] = True


def _cuda_host() -> bool:
    torch = sys.modules.get("torch")  # a process that never imported torch allocated nothing on a GPU
    return torch is not None and torch.cuda.is_available()


def _empty_cuda_cache() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _end_of_test(full: bool) -> None:
    """What every test ends with: the libraries' process-wide state reset (what the test left there becomes garbage
    here), then a collection of everything (`full`) or of what was made since the last freeze, the survivors frozen,
    and CUDA's cache emptied."""
    reset_libraries()
    if full:
        collect_everything()
    else:
        gc.collect()
        gc.freeze()
    _REFROZE["inside_a_test"] = False
    _empty_cuda_cache()


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # After the test's teardown (every fixture it finalizes, those of its module too where the next test is elsewhere)
    # and after pytest has let go of its fixtures' values (item.funcargs, released once the teardown hooks have run):
    # what they held in cycles is garbage now, not frozen as a survivor.
    result = yield
    full = (nextitem is None or item.session.stash.get(WIDER_FIXTURE_ENDED, False) or _REFROZE["inside_a_test"]
            or (nextitem.get_closest_marker(MEMORY_MARK) is not None and _cuda_host()))
    item.session.stash[WIDER_FIXTURE_ENDED] = False
    _end_of_test(full)
    return result
