"""Axes of a contract family, covered by pairs: every pair of values of two axes appears in some cell, the
architecture included, at a small fraction of the full product (`allpairspy`'s deterministic greedy cover, so
verdicts compare); `--stackcheck-exhaustive` runs the product instead. A test names its axes with
`@pytest.mark.axes(name={id: value, ...})`. A pytest plugin (pyproject's addopts) that runs in the pytest child.
How to use it: docs/internals.md, "child/axes.py".
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import pytest

from stackcheck.core.protocol import EXHAUSTIVE_OPTION
MARK = "axes"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("stackcheck").addoption(
        EXHAUSTIVE_OPTION, action="store_true", default=False,
        help="contract families: run the full product of their axes instead of a pairwise cover")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}(**axes): a contract test's axes, each a dict of value id -> value, covered by pairs")


def cover(axes: Mapping[str, list[str]], exhaustive: bool = False) -> list[tuple[str, ...]]:
    """The cells over `axes` (name -> value ids, in order): the full product, or a pairwise cover of it. An axis of
    one value joins every cell; fewer than two axes of several values are their own product."""
    names = list(axes)
    for name, values in axes.items():
        if not values:
            raise ValueError(f"axis '{name}' has no values")
        if len(set(values)) != len(values) or any("-" in value for value in values):
            raise ValueError(f"axis '{name}': value ids must be unique and free of '-': {values}")
    several = [name for name in names if len(axes[name]) > 1]
    if exhaustive or len(several) < 2:
        return [tuple(cell) for cell in itertools.product(*(axes[name] for name in names))]
    from allpairspy import AllPairs

    pairs = [dict(zip(several, cell)) for cell in AllPairs([axes[name] for name in several])]
    return [tuple(cell[name] if name in cell else axes[name][0] for name in names) for cell in pairs]


def uncovered_pairs(axes: Mapping[str, list[str]], cells: list[tuple[str, ...]]) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """The pairs of values (of two axes) that no cell holds: empty for a pairwise cover."""
    names = list(axes)
    missing = []
    for (i, a), (j, b) in itertools.combinations(enumerate(names), 2):
        seen = {(cell[i], cell[j]) for cell in cells}
        missing += [((a, x), (b, y)) for x in axes[a] for y in axes[b] if (x, y) not in seen]
    return missing


def axes_of(definition) -> dict[str, dict[str, object]] | None:
    mark = definition.get_closest_marker(MARK)
    return None if mark is None else {name: dict(values) for name, values in mark.kwargs.items()}


def parametrize(metafunc: pytest.Metafunc, archs: list) -> bool:
    """Parametrize a test marked with axes (and `arch` first where it uses the model under test) by the cover;
    False for a test without axes (the plugin parametrizes its architectures alone)."""
    axes = axes_of(metafunc.definition)
    if axes is None:
        return False
    ids = {name: list(values) for name, values in axes.items()}
    with_arch = "under_test" in metafunc.fixturenames
    if with_arch:
        by_name = {arch.name: arch for arch in archs}
        ids = {"arch": list(by_name), **ids}
    cells = cover(ids, metafunc.config.getoption(EXHAUSTIVE_OPTION))
    names = list(ids)
    params = []
    for cell in cells:
        values = [by_name[value] if name == "arch" else axes[name][value] for name, value in zip(names, cell)]
        params.append(pytest.param(*values, id="-".join(cell)))
    metafunc.parametrize(names, params, indirect=["arch"] if with_arch else [])
    return True
