"""The pytest side of the distributed lane: a family test's `ranks` fixture (stackcheck.plugin) launches its job
through `Ranks`, and `WORLD_SIZES` parametrizes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from stackcheck.distributed import launcher
from stackcheck.distributed.outcome import RankOutcome, raise_unless_passed

# The GPU lane runs world sizes 1 and 2 (NCCL), 2 skipped with the count on a host with one GPU; the CPU lane
# runs CPU_WORLD_SIZE ranks over gloo, and reads world size 1 as skipped.
CPU_WORLD_SIZE = 2
WORLD_SIZES = pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.gpus(2))], ids=["ws1", "ws2"])
# A job of the tiny models takes 25 s on 2 shared cores (two ranks of 12 s each); a rank that takes this long hangs.
DEFAULT_TIMEOUT = 180.0


class Ranks:
    """Launches one job for a cell, and leaves every rank's outcome on the test item for the plugin to record."""

    def __init__(self, node: pytest.Item, lane: str, workdir: Path):
        self.node, self.lane, self.workdir = node, lane, workdir

    def __call__(self, target: str, world_size: int, engine: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                 gpu_only: str | None = None, **kwargs) -> list[RankOutcome]:
        """Run `target` (MODULE:FUNCTION of the test's module, called with `kwargs` on every rank); raise
        RanksFailed unless every rank passed. Returns the outcomes (with what each rank's function returned).
        `gpu_only`: why the cell has no gloo variant (a visible skip in the CPU lane): CI's 2 cores pay about 30 s
        for each two-rank job, so a contract cell runs there only where its CPU variant reproduces something."""
        if self.lane == "cpu" and world_size != CPU_WORLD_SIZE:
            pytest.skip(f"CPU lane: the gloo variant runs {CPU_WORLD_SIZE} ranks")
        if self.lane == "cpu" and gpu_only:
            pytest.skip(f"CPU lane: GPU lane only ({gpu_only})")
        outcomes = launcher.launch(target, self.workdir / "job", world_size, engine, self.lane, timeout, kwargs)
        self.node.stackcheck_ranks = outcomes
        raise_unless_passed(outcomes)
        return outcomes
