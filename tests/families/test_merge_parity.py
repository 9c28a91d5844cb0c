"""`merge_and_unload()` into a 4-bit base does not reproduce the adapter-loaded outputs.

Symptom (seed 002): direct merge into a bnb NF4 base gives outputs that match neither the adapter nor the
base, while a fresh bf16 base + the same adapter + merge restores parity. `dequantize()` followed by
`merge_and_unload()` fails with `AttributeError: 'Parameter' object has no attribute 'quant_state'`.

Upstream: peft#2321 (closed: rounding in 4-bit merges is inherent), the seed thread for the dequantize path.

Preconditions, tolerances and the judgement: docs/family-notes.md#merge_parity.
"""
from stackcheck.harness import scenario

RELATIVE_TOLERANCE = scenario.MERGE_TOLERANCE  # 0.10, shared with the merge contract (tests/contract/merge)


def adapter_outputs(under_test, quantized: bool, prompt, on_4bit_layers_only: bool = False):
    """The base, the language adapter on it (on its 4-bit layers only where asked: `scenario.peft_load_on_4bit_layers`),
    the logits of both and the adapter's greedy decode."""
    base = scenario.load_base(under_test, quantized=quantized)
    if quantized:
        scenario.first_nested_linear4bit(base)
    else:
        scenario.require(not scenario.linear4bit_modules(base), "the bf16 control base is quantized")
    base_logits = scenario.logits(base, prompt)
    model = scenario.peft_load_on_4bit_layers(under_test, base) if on_4bit_layers_only else scenario.peft_load(under_test, base, "language")
    adapter_logits = scenario.logits(model, prompt)
    scenario.require_adapter_changes(adapter_logits, base_logits, "the language model")
    return model, base_logits, adapter_logits, scenario.decode(model, prompt)


def merged_and_kept(model):
    """`merge_and_unload()`, and the share of the adapter's weight change the merged weights carry
    (`scenario.weight_change_kept`, over every LoRA layer of a linear weight)."""
    start, deltas = scenario.lora_base_weights(model), scenario.lora_deltas(model)
    scenario.require(bool(start), "no LoRA layer of a linear weight to merge")
    merged = model.merge_and_unload()
    return merged, scenario.weight_change_kept(merged, start, deltas)


def assert_merge_parity(label, merged, weight_kept, prompt, base_logits, adapter_logits, adapter_decode):
    merged_logits = scenario.logits(merged, prompt)
    error, kept = scenario.merge_divergence(merged_logits, adapter_logits, base_logits)
    print(f"stackcheck measured: {label} merge: of the adapter's effect on the logits kept {kept:.4f}")
    scenario.assert_within(f"{label} merge diverges: relative logit error", error, RELATIVE_TOLERANCE,
                           judged_by=("of the adapter's weight change kept", weight_kept))
    scenario.assert_decodes_alike(merged, prompt, adapter_decode, f"{label} merge diverges from the adapter", beside_logits=True)


def test_merge_into_4bit_base_reproduces_adapter_outputs(under_test, prompt):
    """A merge into 4-bit layers: the adapter's targets that bitsandbytes left in bf16 (a mixture of experts' router
    gates and fused experts, which a merge changes exactly) are not loaded, so every LoRA layer merged re-quantizes."""
    model, base_logits, adapter_logits, adapter_decode = adapter_outputs(under_test, True, prompt, on_4bit_layers_only=True)
    not_4bit = scenario.lora_on_unquantized_weights(model)
    scenario.require(not not_4bit, f"the adapter also sits on weights left in bf16 ({not_4bit[:1]}): a merge into them is exact")
    merged, weight_kept = merged_and_kept(model)
    assert_merge_parity("4-bit", merged, weight_kept, prompt, base_logits, adapter_logits, adapter_decode)


def test_merge_into_bf16_base_reproduces_adapter_outputs(under_test, prompt):
    """The control: a failure here is a new_failure, since the seed's bf16 merge restores parity."""
    model, base_logits, adapter_logits, adapter_decode = adapter_outputs(under_test, False, prompt)
    merged, weight_kept = merged_and_kept(model)
    assert_merge_parity("bf16", merged, weight_kept, prompt, base_logits, adapter_logits, adapter_decode)


def test_dequantize_then_merge_reproduces_adapter_outputs(under_test, prompt):
    model, base_logits, adapter_logits, adapter_decode = adapter_outputs(under_test, True, prompt)
    model.dequantize()
    scenario.require(not scenario.linear4bit_modules(model), "dequantize() left bnb Linear4bit modules in place")
    merged, weight_kept = merged_and_kept(model)
    assert_merge_parity("dequantized", merged, weight_kept, prompt, base_logits, adapter_logits, adapter_decode)
