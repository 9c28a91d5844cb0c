"""The model under test: an architecture on the lane's device (the `under_test` fixture)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import torch

from stackcheck.models import architectures, tiny
from stackcheck.models.architectures import Architecture
from stackcheck.models.tiny import NotApplicable


@dataclass(frozen=True)
class UnderTest:
    """The model under test: an architecture, on the lane's device (the CPU lane stays on the CPU even on a
    GPU host, so its verdicts mean the same on every machine)."""

    arch: Architecture
    device: torch.device

    @cached_property
    def structures(self) -> frozenset[str]:
        found = architectures.structures(tiny.tiny_config(self.arch))
        if self.arch.declared is not None and found != self.arch.declared:
            raise tiny.FixtureError(f"the tiny {self.arch.name} has the structures {sorted(found)}, its config declares {sorted(self.arch.declared)}")
        return found

    def require_structures(self, needed: Iterable[str]) -> None:
        """A test whose bug lives in structures this architecture lacks cannot exist on it: not applicable."""
        missing = sorted(set(needed) - self.structures)
        if missing:
            raise NotApplicable(f"{self.arch.name} has no {', '.join(missing)}")

    def __str__(self) -> str:
        return f"{self.arch.name} on {self.device}"


def seed_model(device: torch.device) -> UnderTest:
    """The seed user's model, the tiny Gemma 4, on `device`: what the benchmarks and the harness's own tests use."""
    return UnderTest(architectures.builtin()[architectures.SEED_ARCHITECTURE], device)


def lane_device(lane: str) -> torch.device:
    return torch.device("cuda", 0) if lane == "gpu" else torch.device("cpu")
