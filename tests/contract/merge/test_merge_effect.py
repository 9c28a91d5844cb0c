"""`merge_and_unload` keeps the adapter's effect, for every adapter configuration users ship.

Upstream: peft#2321 (a 4-bit merge's rounding, closed as inherent: the ledger's `merge_4bit_divergence`, which this
family meets in its NF4 cells and the ledger recognises by the effect kept), peft PR #3609 (DoRA's merge normed by
a weight that already held another adapter), peft#2809 (Gemma 3's embedding scale missing from trainable tokens).

The journey, preconditions and tolerances: docs/family-notes.md#merge_effect.
"""

import pytest

from stackcheck.harness import scenario

QUANT = {"nf4": True, "bf16": False}


@pytest.mark.axes(config=scenario.ADAPTER_VARIANTS, quant=QUANT)
def test_merge_keeps_the_adapters_effect(under_test, config, quant, prompt):
    adapter = scenario.trained_adapter(under_test, config, quant)  # the adapt contract's, when it ran in this process
    base = scenario.load_base(under_test, quantized=quant)
    if quant:
        scenario.first_nested_linear4bit(base)
    else:
        scenario.require(not scenario.linear4bit_modules(base), "the bf16 base is quantized")
    model = scenario.peft_load(under_test, base, adapter)
    scenario.require_variant_applied(model, config)
    adapter_logits = scenario.logits(model, prompt)
    with model.disable_adapter():
        base_logits = scenario.logits(model, prompt)
    scenario.require_adapter_changes(adapter_logits, base_logits, f"the base ({config.name})")

    merged = model.merge_and_unload()

    scenario.require(not scenario.lora_wrapped(merged), "merge_and_unload left LoRA layers in place")
    scenario.assert_merge_keeps_effect("4-bit" if quant else "bf16", scenario.logits(merged, prompt), adapter_logits, base_logits)
