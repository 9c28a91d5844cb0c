"""pytest plugin (`-p stackcheck.child.gc_freeze`, on by default from pyproject's addopts; `-p no:stackcheck.child.gc_freeze`
turns it off, and with it the collection between tests): the garbage collection between tests, cheap, after the
libraries' process-wide state is reset (stackcheck.process.isolation).

Every test ends with a garbage collection (and CUDA's cache emptied), so that what a test left in reference cycles
(a model, its CUDA tensors, a library's weakly referenced registration) is gone before the next one starts. A full
collection walks every tracked object, and torch, transformers, peft and bitsandbytes make hundreds of
thousands at import, many of them lazily, inside the first tests of a family. So what lives on is frozen out of the
collector's reach (`gc.freeze`):
- after collection: what import and collection made (the CPU lane's teardowns on one set fell from 8.9 s to
  0.3 s, docs/history-runs.md);
- after each test's collection: what survived it (the modules its first model imported, caches, module-scoped
  fixtures). The next test's collection walks only what was made since: measured on 450 cells of three family
  modules, 0.09 to 0.18 s per collection before (45 s of a 107 s run, the objects lazily imported in the first tests
  never frozen), 0.000 s after (docs/speed.md);
- an object that survived one test and dies later in a cycle (a module-scoped fixture's model) is frozen by then,
  so some tests end with a collection of everything (`collect_everything`): a test whose teardown finalized a fixture
  wider than the function's (module, class, package or session scope), a test that collected everything itself (what
  it held was frozen again), the run's last, and the test before one marked `reads_device_memory` (`MEMORY_MARK`:
  device_memory's cells, which count the CUDA allocator's bytes). The collection runs once pytest has let go of the
  test's fixtures' values, so what they held in cycles is garbage then, not a frozen survivor. Under xdist, longest
  first, a worker's next test is nearly always of another module, and a collection at each change of module walked
  everything after nearly every test (0.1 s each: 68 of a worker's 69 seconds over 689 skipped cells on this
  project's 2-core machine; `matrix` for seed and latest fell from 312 s to 234 s, every verdict the same; on one
  H100 a set's workers spent 1404 CPU-seconds in tests with it and 965 without, on a slower machine, docs/speed.md).
- Before a test that reads the allocator (on a host with a CUDA device), everything is collected and CUDA's cache
  emptied, so that its readings start where every earlier test's garbage, frozen or not, is gone (its own readings
  then collect only what it made: stackcheck.harness.memory.settled). Sessions 16 and 17 ran GPU hosts with a
  collection of everything at each change of module instead, because device_memory read memory freed during a 4-bit
  load (150 to 558 KiB, 1 to 6 cells a set) when the collection between tests walked less and every reading
  collected everything itself (what freed it is not found: docs/speed.md, session 17). With this flow, in 9
  whole-set runs on one H100 (486 device_memory cells, session 18) no device_memory cell failed, and its workers
  spent 24 to 51 CPU-seconds a set, against 212 and 251 in session 17's last run.
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
