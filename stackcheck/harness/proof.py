"""The proof vocabulary every family shares: a precondition not reached (`require`), an API the release under test
does not have yet (`require_api`), a measured value past its tolerance (`assert_within`), and the measures judged by
mechanism (`effect_kept`)."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util

import torch


class ScenarioNotReached(Exception):
    """The test could not prove its bug's precondition, so its outcome says nothing about the bug."""

    def __init__(self, what: str):
        super().__init__(f"scenario not reached: {what}")


def require(condition: object, what: str) -> None:
    if not condition:
        raise ScenarioNotReached(what)


class ApiAbsent(ScenarioNotReached):
    """The release under test has no API the family drives (it predates it): the verdict is `not_affected` with this
    reason, never an error. Raised only where the absence is proven (`require_api`)."""


def require_api(package: str, module: str, attribute: str | None = None, what: str = ""):
    """`module` (and its dotted `attribute`) of the installed `package`, or ApiAbsent where this release has none: the
    module is not in the release, or has no such attribute. A module that is there but fails to import is no absence:
    its error propagates and is judged as any failure."""
    try:
        release = f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        raise ApiAbsent(f"{package} is not installed, so it has no {module}{f' ({what})' if what else ''}") from None
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError as exc:  # a parent package of `module` is not in the release
        if not (exc.name and (module == exc.name or module.startswith(exc.name + "."))):
            raise
        found = False
    about = f" ({what})" if what else ""
    if not found:
        raise ApiAbsent(f"{release} has no {module}{about}: the release predates the API")
    target = importlib.import_module(module)
    for part in (attribute.split(".") if attribute else []):
        if not hasattr(target, part):
            raise ApiAbsent(f"{release} has no {module}.{attribute}{about}: the release predates the API")
        target = getattr(target, part)
    return target


class ToleranceExceeded(AssertionError):
    """A measured value past its tolerance. The ledger files it under a numeric known bug only when
    `measured` is finite and inside the band that bug was measured at.

    Where the value past the tolerance depends on the model's size or scale (a merge's logit error depends on how
    large the adapter is against the NF4 step), the test also names the quantity its bug's mechanism fixes
    (`judged_by`); that one is `measured`, and the ledger's band is over it."""

    def __init__(self, what: str, value: float, tolerance: float, judged_by: tuple[str, float] | None = None):
        self.measured = value if judged_by is None else judged_by[1]
        explained = "" if judged_by is None else f" ({judged_by[0]} {judged_by[1]:.4f})"
        super().__init__(f"{what} {value:.4f} > {tolerance}{explained}")


def assert_within(what: str, measured: float, tolerance: float, judged_by: tuple[str, float] | None = None) -> None:
    # Captured by pytest: shown for a failure, and for a pass with `-rP`, so passing margins can be reported too.
    explained = "" if judged_by is None else f"; {judged_by[0]} {judged_by[1]:.4f}"
    print(f"stackcheck measured: {what} {measured:.4f} (tolerance {tolerance}){explained}")
    if not measured <= tolerance:  # written so that NaN fails too
        raise ToleranceExceeded(what, measured, tolerance, judged_by)


def effect_kept(changed: torch.Tensor, reference: torch.Tensor, before: torch.Tensor) -> float:
    """How much of the change `before -> reference` the change `before -> changed` carries along its direction:
    1 when it is all there, 0 when none of it is. Error that is not along the change (noise) does not count."""
    effect, carried = (reference - before).float().flatten(), (changed - before).float().flatten()
    return (carried @ effect / (effect @ effect)).item()


def relative_error(measured: torch.Tensor, reference: torch.Tensor) -> float:
    """||measured - reference|| / ||reference||, in fp32."""
    measured, reference = measured.float(), reference.float()
    return ((measured - reference).norm() / reference.norm()).item()


def require_adapter_changes(with_adapter: torch.Tensor, without_adapter: torch.Tensor, where: str) -> None:
    require(not torch.allclose(with_adapter, without_adapter), f"the adapter does not change outputs of {where}")
