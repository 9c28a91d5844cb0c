"""Axes of a contract family, covered by pairs: every pair of values of two axes appears in some cell, the
architecture included, at a small fraction of the full product (`allpairspy`'s deterministic greedy cover, so
verdicts compare); `--stackcheck-exhaustive` runs the product instead. A test names its axes with
`@pytest.mark.axes(name={id: value, ...})` and the combinations never made a cell with
`@pytest.mark.axes_invalid({axis: id, ...}, ...)`. Explore mode (`--stackcheck-explore N --stackcheck-seed S`) adds N
cells per test sampled beyond the cover (stackcheck.core.explore), over those axes and the ones
`@pytest.mark.axes_explore(...)` names (the pairs hold each at its first value); a node id of an explored cell on the
command line is collected whether sampled or not. A pytest plugin (pyproject's addopts) that runs in the pytest child.
How to use it: docs/internals.md, "child/axes.py".
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path

import pytest

from stackcheck.core import explore
from stackcheck.core.protocol import EXHAUSTIVE_OPTION, EXPLORE_OPTION, SEED_OPTION

MARK = "axes"
INVALID_MARK = "axes_invalid"
EXPLORE_MARK = "axes_explore"  # axes only explore mode varies: the pairs hold each at its first value
EXPLORED_MARK = "explored"  # on an explored cell: what the recorder keeps of it (`explored_record`)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stackcheck")
    group.addoption(EXHAUSTIVE_OPTION, action="store_true", default=False,
                    help="contract families: run the full product of their axes instead of a pairwise cover")
    group.addoption(EXPLORE_OPTION, type=int, default=0, metavar="N",
                    help="contract families: also N configurations of each test's axes beyond its pairwise cover, sampled "
                         f"from {SEED_OPTION} (their cell ids end in -{explore.EXPLORED})")
    group.addoption(SEED_OPTION, type=int, default=0, metavar="S", help=f"the seed {EXPLORE_OPTION} samples from (default 0)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARK}(**axes): a contract test's axes, each a dict of value id -> value, covered by pairs")
    config.addinivalue_line("markers", f"{INVALID_MARK}(*combinations): combinations of axis value ids never made a cell")
    config.addinivalue_line("markers", f"{EXPLORE_MARK}(**axes): axes only {EXPLORE_OPTION} varies; the pairs hold each at its first value")
    config.addinivalue_line("markers", f"{EXPLORED_MARK}(record): a cell {EXPLORE_OPTION} sampled (or the command line named)")
    if config.getoption(EXPLORE_OPTION) < 0:
        raise pytest.UsageError(f"{EXPLORE_OPTION} takes a count of configurations, 0 or more: not {config.getoption(EXPLORE_OPTION)}")


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
            return not explore.refused(dict(zip(several, row)), invalid)

        pairs = [dict(zip(several, cell)) for cell in AllPairs([axes[name] for name in several], filter_func=allowed)]
        cells = [{name: cell.get(name, axes[name][0]) for name in names} for cell in pairs]
        # allpairspy's greedy cover can miss a valid pair where a filter refuses some: one more cell for each
        impossible = set()
        while missing := [p for p in uncovered_pairs(axes, [tuple(c[n] for n in names) for c in cells], invalid) if p not in impossible]:
            (a, x), (b, y) = missing[0]
            rest = [n for n in names if n not in (a, b)]
            fills = ({a: x, b: y, **dict(zip(rest, values))} for values in itertools.product(*(axes[n] for n in rest)))
            cell = next((cell for cell in fills if not explore.refused(cell, invalid)), None)
            if cell is None:
                impossible.add(missing[0])
            else:
                cells.append({n: cell[n] for n in names})
    return [tuple(cell[name] for name in names) for cell in cells if not explore.refused(cell, invalid)]


def uncovered_pairs(axes: Mapping[str, list[str]], cells: list[tuple[str, ...]], invalid=()) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """The pairs of values (of two axes) that no cell holds, less the pairs that are an invalid combination
    themselves: empty for a pairwise cover."""
    names = list(axes)
    missing = []
    for (i, a), (j, b) in itertools.combinations(enumerate(names), 2):
        seen = {(cell[i], cell[j]) for cell in cells}
        missing += [((a, x), (b, y)) for x in axes[a] for y in axes[b]
                    if (x, y) not in seen and not explore.refused({a: x, b: y}, [c for c in invalid if len(c) <= 2])]
    return missing


def axes_of(definition, mark: str = MARK) -> dict[str, dict[str, object]] | None:
    found = definition.get_closest_marker(mark)
    return None if found is None else {name: dict(values) for name, values in found.kwargs.items()}


def parametrize(metafunc: pytest.Metafunc, archs: list) -> bool:
    """Parametrize a test marked with axes (and `arch` first where it uses the model under test) by the cover, and
    in explore mode by the cells sampled beyond it; False for a test without axes (the plugin parametrizes its
    architectures alone)."""
    axes = axes_of(metafunc.definition)
    if axes is None:
        return False
    beyond = axes_of(metafunc.definition, EXPLORE_MARK) or {}
    if set(beyond) & set(axes):
        raise ValueError(f"{metafunc.definition.name}: {sorted(set(beyond) & set(axes))} are axes of both {MARK} and {EXPLORE_MARK}")
    ids = {name: list(values) for name, values in axes.items()}
    with_arch = "under_test" in metafunc.fixturenames
    by_name = {arch.name: arch for arch in archs}
    if with_arch:
        ids = {"arch": list(by_name), **ids}
    every = {**ids, **{name: list(values) for name, values in beyond.items()}}
    marks = [mark for mark in metafunc.definition.iter_markers(INVALID_MARK)]
    invalid = [combo for mark in marks for combo in mark.args]
    for combo in invalid:
        if any(name not in every or vid not in every[name] for name, vid in combo.items()):
            raise ValueError(f"invalid combination {combo} names no axis value of {metafunc.definition.name}")
    cells = cover(ids, metafunc.config.getoption(EXHAUSTIVE_OPTION), [combo for combo in invalid if set(combo) <= set(ids)])
    held = tuple(every[name][0] for name in beyond)  # the pairs' value of each axis only explore varies
    names = list(every)

    def values(cell: tuple[str, ...]) -> list:
        return [by_name[vid] if name == "arch" else {**axes, **beyond}[name][vid] for name, vid in zip(names, cell)]

    params = [pytest.param(*values(cell + held), id="-".join(cell)) for cell in cells]
    count, seed = metafunc.config.getoption(EXPLORE_OPTION), metafunc.config.getoption(SEED_OPTION)
    key = metafunc.definition.nodeid.partition("[")[0]
    sampled = explore.sample(every, [cell + held for cell in cells], count, seed, invalid, key) if count else []
    requested = [cell for cell in _requested(metafunc, every) if cell not in sampled and not explore.refused(dict(zip(names, cell)), invalid)]
    for cell in sampled + requested:
        record = {"seed": seed if cell in sampled else None, "config": dict(zip(names, cell)),
                  "axes": [[name, values] for name, values in every.items()], "pairwise": list(ids), "invalid": invalid}
        params.append(pytest.param(*values(cell), id=explore.cell_id(cell), marks=getattr(pytest.mark, EXPLORED_MARK)(record=record)))
    metafunc.parametrize(names, params, indirect=["arch"] if with_arch else [])
    return True


def _requested(metafunc: pytest.Metafunc, axes: Mapping[str, list[str]]) -> list[tuple[str, ...]]:
    """The explored cells of this test that the command line names by node id (`path::test[lane-...-explored]`): a
    shrink step, or the line that reproduces a shrunk configuration, runs one that was not sampled."""
    found: list[tuple[str, ...]] = []
    here = Path(metafunc.definition.path).resolve()
    for arg in metafunc.config.args:
        path, _, rest = str(arg).partition("::")
        name, _, params = rest.partition("[")
        if name != metafunc.definition.originalname or not params.endswith("]"):
            continue
        if (Path(metafunc.config.invocation_params.dir) / path).resolve() != here:
            continue
        cell = explore.parse_id(params[:-1].partition("-")[2], axes)  # the lane first
        if cell is not None and cell not in found:
            found.append(cell)
    return found


def explored_record(item: pytest.Item) -> dict | None:
    """What an explored cell's record in matrix.json keeps of it (`explore.EXPLORED_KEY`): the seed it was sampled from
    (None: the command line named it), its configuration (axis -> value id), the axes in order, each `[name, value ids]`
    (its first value is the pairs'; a list, as matrix.json sorts the keys of a dict), the axes of the pairs' ids, and
    the invalid combinations; None for any other cell."""
    mark = item.get_closest_marker(EXPLORED_MARK)
    return None if mark is None else mark.kwargs["record"]
