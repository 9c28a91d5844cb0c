"""Repeated `merge_adapter()` / `unmerge_adapter()` cycles leave the base where one cycle leaves it.

The user's journey, step 5, as RL trainers run it: to hand the current policy to a generation engine, TRL's GRPO
(and others) merge the LoRA into the base, read the weights, and unmerge, at every weight sync. PEFT merges in
place, in the base weight's own format: `W + dW` rounded to bf16 (or re-quantized to NF4), then `- dW` rounded
again. If that rounding does not cancel, every sync moves the frozen base a little, and the drift compounds over
a run: the model being trained is no longer base + adapter.

Property: after twenty cycles the base weight under the LoRA layer is no further from where it started than one
cycle can leave it: one merge's rounding and one unmerge's, i.e. at most twice one merge's rounding
(||W_merged - (W + dW)|| over ||dW||, in fp32; NF4 weights dequantized). The adapter is a LoRA on the first module
the adapter fixture targets in the first decoder layer (`scenario.one_layer_adapter`): a 4-bit merge and unmerge
re-quantize every merged layer, about a tenth of a second each on the CPU, so Gemma 4's 42 layers would take
minutes; the drift is a per-layer mechanism.

Upstream: trl#6688 (open: bf16 merge/unmerge drift compounds, 1000 cycles; fp32 flat), peft PR #3166 (the
maintainers' answer: rounding in merge/unmerge "can never be avoided"), peft#2501 (merge_adapter on a 4-bit base
in GRPO's weight sync).

Precondition proven: the base is NF4 with nested quant state (or bf16 with no 4-bit layer); the adapter changes the
outputs and adds a non-zero delta; every LoRA layer really is merged after `merge_adapter()` and unmerged after
`unmerge_adapter()`.

Measured (CPU lane, seed and latest; the base's drift after 20 cycles, in one merge's rounding): bf16 9.84 (Llama
3, Qwen3, Phi-4: the tiny dense models start from the same random weights), 9.62 (Gemma 3), 9.30 (Mixtral,
Qwen3-MoE), 3.17 (Gemma 4); NF4 4.93, 3.96 to 4.06, 3.55, 8.94 to 9.11 in the same order: every cell fails
(`merge_unmerge_drift`). With the fixture's whole adapter on Llama 3, one cycle leaves the base 1.3 merge roundings
away, ten 4.9, twenty 9.4 (bf16; NF4 1.05, 1.7, 3.6): the drift grows with the cycles. Judged by mechanism: the ratio says whether the rounding accumulates; a
PEFT that restored the unmerged weight measures 0 and passes (the guard test), an unmerge that left a tenth of the
delta behind measures above 40, beyond what rounding can do (a new failure).
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
