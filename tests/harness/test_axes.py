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


def test_invalid_combinations_are_never_cells_and_every_other_pair_is_covered():
    axes_ = {"arch": ["a", "b", "c"], "dora": ["f", "t"], "bias": ["f", "t"], "rslora": ["f", "t"]}
    invalid = [{"dora": "t", "bias": "t"}]
    for exhaustive in (False, True):
        cells = axes.cover(axes_, exhaustive, invalid)
        assert not [cell for cell in cells if cell[1] == "t" and cell[2] == "t"]
        assert not axes.uncovered_pairs(axes_, cells, invalid)
    assert len(axes.cover(axes_, True, invalid)) == 3 * 2 * 2 * 2 - 3 * 2
    with pytest.raises(ValueError):
        axes.cover(axes_, invalid=[{"dora": "maybe"}])


def test_a_family_takes_its_axes_and_refusals_from_the_model():
    from stackcheck.harness import surfaces

    lora = surfaces.model_axes("lora", "use_dora", "lora_bias", "modules_to_save")
    assert lora["use_dora"] == {"use_dora.false": False, "use_dora.true": True}
    assert {"use_dora": "use_dora.true", "lora_bias": "lora_bias.true"} in surfaces.model_invalid("lora", lora)
    ids = {name: list(values) for name, values in lora.items()}
    cells = axes.cover(ids, invalid=surfaces.model_invalid("lora", lora))
    assert not axes.uncovered_pairs(ids, cells, surfaces.model_invalid("lora", lora))


def test_the_load_contract_builds_every_skip_list_it_covers():
    """Each value of llm_int8_skip_modules the model does not cut is a list harness.load builds (`SKIPS`)."""
    from stackcheck.core import explore
    from stackcheck.harness import load, surfaces

    bnb = surfaces.model_axes("bnb_config", "llm_int8_skip_modules")
    cuts = surfaces.model_invalid("bnb_config", bnb)
    covered = [value for vid, value in bnb["llm_int8_skip_modules"].items() if not explore.refused({"llm_int8_skip_modules": vid}, cuts)]
    assert len(covered) == 4 and all(value in load.SKIPS for value in covered), covered


def test_the_auto_placement_contract_builds_every_budget_it_covers():
    """Each value of from_pretrained's max_memory the model does not cut is a budget harness.load builds (`AUTO_BUDGETS`)."""
    from stackcheck.core import explore
    from stackcheck.harness import load, surfaces

    budgets = surfaces.model_axes("from_pretrained", "max_memory")
    cuts = surfaces.model_invalid("from_pretrained", budgets)
    covered = [value for vid, value in budgets["max_memory"].items() if not explore.refused({"max_memory": vid}, cuts)]
    assert covered == list(load.AUTO_BUDGETS), covered
