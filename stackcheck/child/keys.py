"""What the child's plugins keep on pytest's objects, as typed StashKeys in one place (pytest's Stash): the run's
ledger, lanes, architectures, versions and platform facts on the config; a distributed cell's rank records on its
item. The keys a distributed cell sets itself (its ranks, its pool group) are stackcheck.distributed.cells'."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from stackcheck.core.ledger import Ledger
from stackcheck.core.versions import VersionSet
from stackcheck.distributed.cells import POOL_GROUP, RANKS  # noqa: F401 - the item's keys that the distributed lane sets
from stackcheck.models.architectures import Architecture

CELL_KEY = "stackcheck_cell"  # the report's user property that carries a cell (plain data: xdist sends it)
SET = pytest.StashKey[VersionSet]()  # the set under test: the runner's record, or --stackcheck-set's name on the installed versions
LEDGER = pytest.StashKey[Ledger]()
LANES = pytest.StashKey[list]()  # the lanes the run holds (--stackcheck-lanes)
ARCHITECTURES = pytest.StashKey[list[Architecture]]()  # the architectures under test (--stackcheck-arch)
ARCH_NAMES = pytest.StashKey[list]()
VERSIONS = pytest.StashKey[dict]()  # the installed versions of the stack: what the ledger judges against
PLATFORM = pytest.StashKey[dict]()  # hostinfo.platform_facts, read once (setup.platform_of)
PLATFORM_PENDING = pytest.StashKey[Future]()  # the facts being read in a thread (setup.read_platform_early)
RANK_RECORDS = pytest.StashKey[list]()  # a distributed cell's ranks, each judged as a test of its own
