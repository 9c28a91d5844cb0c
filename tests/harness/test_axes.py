"""The contract families' axes: a pairwise cover holds every pair, is the same on every run, and is far smaller
than the product; `--stackcheck-exhaustive` gives the product."""

import itertools

import pytest

from stackcheck.child import axes

AXES = {"arch": ["gemma4", "llama3", "qwen3", "phi4", "mixtral", "qwen3moe", "gemma3"],
        "quant": ["nf4", "fp4", "nf4_dq", "int8"], "dtype": ["bf16", "fp16"], "adapter": ["plain", "dora", "rslora", "mts"]}


def test_a_pairwise_cover_holds_every_pair_and_is_small():
    cells = axes.cover(AXES)
    assert not axes.uncovered_pairs(AXES, cells)
    product = len(list(itertools.product(*AXES.values())))
    assert len(cells) <= product / 5, (len(cells), product)


def test_the_cover_is_the_same_on_every_run():
    assert axes.cover(AXES) == axes.cover({name: list(values) for name, values in AXES.items()})


def test_exhaustive_is_the_product_and_single_valued_axes_join_every_cell():
    assert len(axes.cover(AXES, exhaustive=True)) == 7 * 4 * 2 * 4
    cells = axes.cover({"arch": ["a", "b"], "quant": ["nf4"], "dtype": ["bf16", "fp16"]})
    assert sorted(cells) == sorted(itertools.product(["a", "b"], ["nf4"], ["bf16", "fp16"]))


@pytest.mark.parametrize("bad", [{"quant": []}, {"quant": ["nf4", "nf4"]}, {"quant": ["nf-4"]}])
def test_an_axis_that_cannot_name_its_cells_fails_loudly(bad):
    with pytest.raises(ValueError):
        axes.cover({"arch": ["a"], **bad})
