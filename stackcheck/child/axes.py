"""Axes of a contract family, covered by pairs: every pair of values of two axes appears in some cell, the
architecture included, at a small fraction of the full product (`allpairspy`'s deterministic greedy cover, so
verdicts compare); `--stackcheck-exhaustive` runs the product instead. A test names its axes with
`@pytest.mark.axes(name={id: value, ...})` and the combinations never made a cell with
`@pytest.mark.axes_invalid({axis: id, ...}, ...)`. A pytest plugin (pyproject's addopts) that runs in the pytest
child. How to use it: docs/internals.md, "child/axes.py".
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import pytest

from stackcheck.core.protocol import EXHAUSTIVE_OPTION
MARK = "axes"
INVALID_MARK = "axes_invalid"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("stackcheck").addoption(
        EXHAUSTIVE_OPTION, action="store_true", default=False,
        help="contract families: run the full product of their axes instead of a pairwise cover")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}(**axes): a contract test's axes, each a dict of value id -> value, covered by pairs")
    config.addinivalue_line("markers", f"{INVALID_MARK}(*combinations): combinations of axis value ids never made a cell")


def _refused(cell: Mapping[str, str], invalid) -> bool:
    """Whether `cell` (axis -> value id, possibly partial) holds every value of one invalid combination."""
    return any(all(name in cell and cell[name] == vid for name, vid in combo.items()) for combo in invalid)


def cover(axes: Mapping[str, list[str]], exhaustive: bool = False, invalid=()) -> list[tuple[str, ...]]:
    """The cells over `axes` (name -> value ids, in order): the full product, or a pairwise cover of it, never a
    cell holding an `invalid` combination (dicts of axis -> value id). An axis of one value joins every cell; fewer
    than two axes of several values are their own product."""
    names = list(axes)
    for name, values in axes.items():
        if not values:
            raise ValueError(f"axis '{name}' has no values")
        if len(set(values)) != len(values) or any("-" in value for value in values):
            raise ValueError(f"axis '{name}': value ids must be unique and free of '-': {values}")
    several = [name for name in names if len(axes[name]) > 1]
    for combo in invalid:
        unknown = {name: vid for name, vid in combo.items() if name not in axes or vid not in axes[name]}
        if unknown:
            raise ValueError(f"invalid combination {combo}: {unknown} names no axis value")
    if exhaustive or len(several) < 2:
        cells = [dict(zip(names, cell)) for cell in itertools.product(*(axes[name] for name in names))]
    else:
        from allpairspy import AllPairs

        def allowed(row: list[str]) -> bool:
            return not _refused(dict(zip(several, row)), invalid)

        pairs = [dict(zip(several, cell)) for cell in AllPairs([axes[name] for name in several], filter_func=allowed)]
        cells = [{name: cell.get(name, axes[name][0]) for name in names} for cell in pairs]
        # allpairspy's greedy cover can miss a valid pair where a filter refuses some: one more cell for each
        impossible = set()
        while missing := [p for p in uncovered_pairs(axes, [tuple(c[n] for n in names) for c in cells], invalid) if p not in impossible]:
            (a, x), (b, y) = missing[0]
            rest = [n for n in names if n not in (a, b)]
            fills = ({a: x, b: y, **dict(zip(rest, values))} for values in itertools.product(*(axes[n] for n in rest)))
            cell = next((cell for cell in fills if not _refused(cell, invalid)), None)
            if cell is None:
                impossible.add(missing[0])
            else:
                cells.append({n: cell[n] for n in names})
    return [tuple(cell[name] for name in names) for cell in cells if not _refused(cell, invalid)]


def uncovered_pairs(axes: Mapping[str, list[str]], cells: list[tuple[str, ...]], invalid=()) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """The pairs of values (of two axes) that no cell holds, less the pairs that are an invalid combination
    themselves: empty for a pairwise cover."""
    names = list(axes)
    missing = []
    for (i, a), (j, b) in itertools.combinations(enumerate(names), 2):
        seen = {(cell[i], cell[j]) for cell in cells}
        missing += [((a, x), (b, y)) for x in axes[a] for y in axes[b]
                    if (x, y) not in seen and not _refused({a: x, b: y}, [c for c in invalid if len(c) <= 2])]
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
    marks = [mark for mark in metafunc.definition.iter_markers(INVALID_MARK)]
    invalid = [combo for mark in marks for combo in mark.args]
    cells = cover(ids, metafunc.config.getoption(EXHAUSTIVE_OPTION), invalid)
    names = list(ids)
    params = []
    for cell in cells:
        values = [by_name[value] if name == "arch" else axes[name][value] for name, value in zip(names, cell)]
        params.append(pytest.param(*values, id="-".join(cell)))
    metafunc.parametrize(names, params, indirect=["arch"] if with_arch else [])
    return True
