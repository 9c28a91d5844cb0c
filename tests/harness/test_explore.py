"""Explore mode: the cells sampled beyond a pairwise cover are the same for a seed, never a cover's cell or an invalid
combination; shrinking moves a failing configuration's axes toward their first values while the failure stays, and
ends at a configuration no single move toward simpler values still fails in."""

import itertools
import subprocess
import sys

import pytest

from stackcheck import REPO_ROOT
from stackcheck.child import axes
from stackcheck.core import explore

AXES = {"arch": ["llama3", "qwen3moe"], "dora": ["dora.false", "dora.true"], "bias": ["bias.false", "bias.true"],
        "quant": ["nf4", "bf16"], "r": ["r.4", "r.16"], "dropout": ["dropout.0.0", "dropout.0.1"], "tokens": ["tokens.default", "tokens.three"]}
PAIRWISE = ["arch", "dora", "bias", "quant"]
INVALID = [{"dora": "dora.true", "bias": "bias.true"}]


def covered() -> list[tuple[str, ...]]:
    """The pairs' cells over the pairwise axes, the explore-only ones held at their first value (as child.axes does)."""
    held = tuple(AXES[name][0] for name in AXES if name not in PAIRWISE)
    return [cell + held for cell in axes.cover({name: AXES[name] for name in PAIRWISE}, invalid=INVALID)]


def test_a_seed_gives_the_same_cells_and_another_seed_others():
    first = explore.sample(AXES, covered(), 20, seed=7, invalid=INVALID, key="test_x")
    assert first == explore.sample(AXES, covered(), 20, seed=7, invalid=INVALID, key="test_x")
    assert first != explore.sample(AXES, covered(), 20, seed=8, invalid=INVALID, key="test_x")
    assert first != explore.sample(AXES, covered(), 20, seed=7, invalid=INVALID, key="test_y")


def test_explored_cells_are_distinct_never_the_covers_and_never_refused():
    cells = explore.sample(AXES, covered(), 40, seed=1, invalid=INVALID)
    assert len(cells) == len(set(cells)) == 40
    assert not set(cells) & set(covered())
    assert not [cell for cell in cells if explore.refused(dict(zip(AXES, cell)), INVALID)]


def test_a_space_smaller_than_asked_gives_every_cell_beyond_the_cover():
    small = {"a": ["a.0", "a.1"], "b": ["b.0", "b.1"]}
    cells = explore.sample(small, [("a.0", "b.0")], 100, seed=0, invalid=[{"a": "a.1", "b": "b.1"}])
    assert sorted(cells) == [("a.0", "b.1"), ("a.1", "b.0")]


def test_a_large_space_is_sampled_without_listing_it():
    large = {f"x{i}": [f"x{i}.{v}" for v in range(4)] for i in range(12)}  # 4 ** 12 = 16.8 million
    cells = explore.sample(large, [], 50, seed=3, invalid=[{"x0": "x0.1", "x1": "x1.1"}])
    assert len(set(cells)) == 50 and not [c for c in cells if c[0] == "x0.1" and c[1] == "x1.1"]
    assert cells == explore.sample(large, [], 50, seed=3, invalid=[{"x0": "x0.1", "x1": "x1.1"}])


def test_an_explored_id_names_its_configuration_and_no_pairs_id():
    cell = ("llama3", "dora.true", "bias.false", "nf4", "r.16", "dropout.0.1", "tokens.default")
    params = explore.cell_id(cell)
    assert params.endswith("-explored") and explore.parse_id(params, AXES) == cell
    assert explore.parse_id("llama3-dora.true-bias.false-nf4", AXES) is None  # a pair's id
    assert explore.parse_id(params.replace("r.16", "r.8"), AXES) is None  # a value the axis lacks


ORDER = {name: values for name, values in AXES.items()}


def test_shrinking_keeps_only_the_axes_the_failure_needs():
    # The failure needs DoRA and dropout; everything else moves back to its first value.
    start = dict(zip(AXES, ("qwen3moe", "dora.true", "bias.false", "bf16", "r.16", "dropout.0.1", "tokens.three")))
    asked = []

    def still_fails(config):
        asked.append(config)
        return config["dora"] == "dora.true" and config["dropout"] == "dropout.0.1"

    shrunk = explore.shrink(start, still_fails, ORDER, INVALID)
    assert shrunk.reproduced
    assert shrunk.config == {**{name: values[0] for name, values in AXES.items()}, "dora": "dora.true", "dropout": "dropout.0.1"}
    assert asked[0] == start  # the failure is run again before anything moves
    assert shrunk.asked == len(asked)


def test_a_failure_that_needs_two_axes_together_keeps_both_and_a_combination_that_fails_is_taken_at_once():
    start = dict(zip(AXES, ("qwen3moe", "dora.false", "bias.true", "bf16", "r.16", "dropout.0.1", "tokens.three")))
    # Fails on qwen3moe with r=16, whatever the rest: five axes move back at once, those two stay.
    shrunk = explore.shrink(start, lambda c: c["arch"] == "qwen3moe" and c["r"] == "r.16", ORDER, INVALID)
    assert {k: v for k, v in shrunk.config.items() if v != AXES[k][0]} == {"arch": "qwen3moe", "r": "r.16"}


def test_shrinking_never_asks_an_invalid_combination_and_stops_where_every_move_loses_the_failure():
    start = dict(zip(AXES, ("llama3", "dora.true", "bias.false", "nf4", "r.4", "dropout.0.0", "tokens.default")))
    # bias=true with dora=true is refused: never asked, though it is "simpler" for nothing here.
    seen = []
    shrunk = explore.shrink(start, lambda c: seen.append(c) or c["dora"] == "dora.true", ORDER, INVALID)
    assert shrunk.config == start
    assert not [c for c in seen if explore.refused(c, INVALID)]


def test_a_failure_that_does_not_come_back_is_not_shrunk():
    start = dict(zip(AXES, ("qwen3moe", "dora.true", "bias.false", "bf16", "r.16", "dropout.0.1", "tokens.three")))
    shrunk = explore.shrink(start, lambda c: False, ORDER)
    assert not shrunk.reproduced and shrunk.config == start and shrunk.asked == 1 + sum(AXES[k].index(v) for k, v in start.items())


def test_shrinking_with_more_than_two_values_moves_toward_the_first():
    order = {"init": ["true", "false", "gaussian", "pissa"], "r": ["r.4", "r.16"]}
    shrunk = explore.shrink({"init": "pissa", "r": "r.16"}, lambda c: c["init"] in ("gaussian", "pissa"), order)
    assert shrunk.config == {"init": "gaussian", "r": "r.4"}


def test_shrinks_driven_side_by_side_give_what_each_gives_alone():
    starts = [dict(zip(AXES, cell)) for cell in explore.sample(AXES, covered(), 6, seed=5, invalid=INVALID)]

    def fails(config):
        return config["quant"] == "bf16" or config["tokens"] == "tokens.three"

    alone = [explore.shrink(start, fails, ORDER, INVALID) for start in starts]
    rounds = []

    def answer(configs, askers):
        rounds.append(len(configs))
        return [fails(config) for config in configs]

    together = explore.drive([explore.shrink_steps(start, ORDER, INVALID) for start in starts], answer)
    assert together == alone
    assert len(rounds) <= max(shrunk.asked for shrunk in alone)  # one round serves every shrink


@pytest.mark.parametrize("signature, other, same", [
    ("AssertionError: 3 of 12 trainable tensors got no gradient @ tests/x.py:test_x",
     "AssertionError: 5 of 40 trainable tensors got no gradient @ tests/x.py:test_x", True),
    ("AssertionError: relative logit error 0.0312 > 0.01 @ tests/x.py:test_x",
     "AssertionError: relative logit error 1.5e-05 > 0.01 @ tests/x.py:test_x", True),
    ("ValueError: lora.ParamWrapper does not work with lora_dropout != 0. @ peft/tuners/lora/layer.py:__init__",
     "ValueError: lora.ParamWrapper does not work with use_dora=True. @ peft/tuners/lora/layer.py:__init__", False),
    ("ValueError: x @ a.py:f", "ValueError: x @ b.py:f", False),
    ("ValueError: x @ a.py:f", None, False),
])
def test_the_same_failure_is_the_same_signature_its_numbers_aside(signature, other, same):
    assert explore.same_failure(signature, other) is same


def test_a_configuration_outside_the_axes_is_refused():
    with pytest.raises(ValueError):
        explore.shrink({"arch": "gemma4"}, lambda c: True, {"arch": ["llama3"]})


def test_the_product_is_every_cell_once():
    # sample() over a space it can list, asked for all of it, gives the product less the cover and the refused.
    every = explore.sample(AXES, covered(), 10_000, seed=0, invalid=INVALID)
    product = [c for c in itertools.product(*AXES.values()) if not explore.refused(dict(zip(AXES, c)), INVALID)]
    assert sorted(every) == sorted(set(product) - set(covered()))


# --- the pytest child: explored cells beside the pairs -------------------------------------------------------------

CONFIGS = "tests/contract/adapt/test_adapter_configs.py"
TEST = f"{CONFIGS}::test_adapter_config_trains_saves_and_reloads"


def collected(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "--stackcheck-arch=llama3,qwen3moe", "--stackcheck-lanes=cpu", *args],
                         cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def test_explore_adds_cells_beside_the_pairs_and_a_named_explored_cell_is_collected():
    pairs = collected(CONFIGS)
    assert pairs and not [nodeid for nodeid in pairs if nodeid.endswith("-explored]")]
    explored = collected(CONFIGS, "--stackcheck-explore=5", "--stackcheck-seed=3")
    assert explored[:len(pairs)] == pairs  # the pairs' cells, ids and order, as without --stackcheck-explore
    new = explored[len(pairs):]
    assert len(new) == 5 and all(nodeid.endswith("-explored]") for nodeid in new)
    assert collected(CONFIGS, "--stackcheck-explore=5", "--stackcheck-seed=3") == explored  # another process, the same draw
    # A configuration the seed did not draw, named by its node id: collected alone (a shrink step, a reproducing line).
    named = (f"{TEST}[cpu-qwen3moe-use_dora.false-use_rslora.false-modules_to_save.default-lora_bias.false-nf4-r.16-lora_dropout.0.0-"
             "bias.none-ensure_weight_tying.false-trainable_token_indices.default-explored]")
    assert named not in new and collected(named) == [named]


def test_the_command_side_reads_a_pairs_cell_as_the_explored_configuration_it_equals():
    from stackcheck.commands import explore as explore_command
    from stackcheck.core.cell import Cell
    from stackcheck.core.versions import resolve

    order = {name: values for name, values in AXES.items()}
    config = dict(zip(AXES, ("qwen3moe", "dora.true", "bias.false", "bf16", "r.16", "dropout.0.0", "tokens.three")))
    record = {"seed": 1, "config": config, "axes": [[name, values] for name, values in order.items()], "pairwise": PAIRWISE,
              "invalid": INVALID}
    failing = Cell("latest", "x", f"tests/contract/p/test_x.py::test_x[cpu-{explore.cell_id(tuple(config.values()))}]", "cpu",
                   "new_failure", "qwen3moe", "ValueError: x @ a.py:f", extra={explore.EXPLORED_KEY: record})
    target = explore_command.Target.of(failing)
    assert target.node_id(config) == failing.test
    pair = Cell("latest", "x", "tests/contract/p/test_x.py::test_x[cpu-llama3-dora.false-bias.true-nf4]", "cpu", "pass", "llama3")
    held = {"r": "r.4", "dropout": "dropout.0.0", "tokens": "tokens.default"}
    assert target.as_explored(pair) == target.node_id({"arch": "llama3", "dora": "dora.false", "bias": "bias.true", "quant": "nf4", **held})
    assert target.as_explored(pair.replace(lane="gpu", test=pair.test.replace("[cpu", "[gpu"))) is None
    (vset,) = resolve(["latest"], ["peft==0.21.2"])
    line = explore_command.reproducing_line("matrix", vset, ["peft==0.21.2"], None, config, failing.test)
    assert line == ("python -m stackcheck matrix --sets latest --with peft==0.21.2 --arch qwen3moe -- "
                    f"'{failing.test}'")


def test_the_harness_spells_the_left_out_value_as_the_axis_model_does():
    from stackcheck.core import axis_model
    from stackcheck.harness import adapt, surfaces

    assert adapt.LEFT_OUT == axis_model.DEFAULT
    explored = surfaces.explore_axes("lora", "r", "lora_dropout")
    assert explored["r"] == {"r.4": axis_model.DEFAULT, "r.16": 16} and list(explored["lora_dropout"].values())[0] == axis_model.DEFAULT
