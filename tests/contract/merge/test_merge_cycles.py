"""Repeated `merge_adapter()` / `unmerge_adapter()` cycles leave the base where one cycle leaves it.

Upstream: trl#6688 (open: bf16 merge/unmerge drift compounds, 1000 cycles; fp32 flat), peft PR #3166 (the
maintainers' answer: rounding in merge/unmerge "can never be avoided"), peft#2501 (merge_adapter on a 4-bit base
in GRPO's weight sync).

The journey, the property, preconditions and measurements: docs/family-notes.md#merge_cycles.
"""

import math

import pytest

from stackcheck.harness import scenario

CYCLES = 20
# One merge's rounding and one unmerge's: the furthest a single cycle can leave the base.
TOLERANCE = 2

QUANT = {"nf4": True, "bf16": False}


@pytest.mark.axes(quant=QUANT)
def test_merge_unmerge_cycles_do_not_drift(under_test, quant, prompt):
    base = scenario.load_base(under_test, quantized=quant)
    if quant:
        scenario.first_nested_linear4bit(base)
    else:
        scenario.require(not scenario.linear4bit_modules(base), "the bf16 base is quantized")
    model = scenario.one_layer_adapter(under_test, base)
    adapter_logits = scenario.logits(model, prompt)
    with model.disable_adapter():
        base_logits = scenario.logits(model, prompt)
    scenario.require_adapter_changes(adapter_logits, base_logits, "the base")
    start, delta = scenario.lora_base_weights(model), scenario.lora_deltas(model)
    scenario.require(start and any(d.any() for d in delta.values()), "the adapter adds no delta to a linear weight")

    model.merge_adapter()
    scenario.require(scenario.merged_state(model) == {True}, "merge_adapter() left LoRA layers unmerged")
    rounding = scenario.weight_distance(scenario.lora_base_weights(model), {n: start[n] + delta[n] for n in start}, delta)
    model.unmerge_adapter()
    for _ in range(CYCLES - 1):
        model.merge_adapter()
        model.unmerge_adapter()
    scenario.require(scenario.merged_state(model) == {False}, "unmerge_adapter() left LoRA layers merged")

    drift = scenario.weight_distance(scenario.lora_base_weights(model), start, delta)
    after = scenario.logits(model, prompt)
    print(f"stackcheck measured: one merge's rounding {rounding:.4f} of the delta; the base's drift after {CYCLES} cycles "
          f"{drift:.4f}; the adapter's logits moved by {scenario.relative_error(after, adapter_logits):.4f}")
    ratio = drift / rounding if rounding else (0.0 if drift == 0 else math.inf)
    scenario.assert_within(f"{CYCLES} merge/unmerge cycles drift: the base's distance from its start, in one merge's rounding", ratio, TOLERANCE)
