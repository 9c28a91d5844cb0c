"""A reading of device memory is settled only once it stops falling (stackcheck.harness.memory.settled): the
allocator's count stood in for by a sequence of readings, CUDA's synchronize and the wait made no-ops (this machine
may have no GPU)."""

import pytest
import torch

from stackcheck.harness import memory


@pytest.fixture
def readings(monkeypatch):
    def install(values):
        values = list(values)
        taken = []

        def allocated(device):
            taken.append(values.pop(0))
            return taken[-1]

        monkeypatch.setattr(memory, "allocated", allocated)
        monkeypatch.setattr(memory.gc, "collect", lambda: 0)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(memory.time, "sleep", lambda seconds: None)
        return taken

    return install


def test_a_count_that_falls_is_read_again_until_it_holds(readings):
    taken = readings([1000 + 549888, 1000, 1000, 7])
    assert memory.settled(torch.device("cuda", 0)) == 1000
    assert taken == [1000 + 549888, 1000, 1000]


def test_a_steady_count_takes_two_readings_and_a_falling_one_stops_after_the_last_try(readings):
    taken = readings([5, 5, 9])
    assert memory.settled(torch.device("cuda", 0)) == 5 and taken == [5, 5]
    taken = readings(range(100, 0, -1))
    assert memory.settled(torch.device("cuda", 0)) == 100 - memory.QUIET_TRIES + 1
    assert len(taken) == memory.QUIET_TRIES
