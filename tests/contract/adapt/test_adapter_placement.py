"""The adapter's effect is present wherever the base lives.

Precondition proven: the reference adapter changes the outputs; the 4-bit base is NF4 with nested quant state;
the placement is what it says (whole on the main device, on cuda:1, or its modules on meta behind accelerate's
hooks, before and after PEFT's load); the offloaded layer carries LoRA layers.

The journey and upstream: docs/family-notes.md#adapter_placement.
"""

import pytest

from stackcheck.harness import scenario

TOLERANCE = 0.05

QUANT = {"nf4": True, "bf16": False}
PLACEMENTS = {"default": scenario.placed_on_default_device, "split": scenario.placed_split,
              "offloaded": scenario.placed_offloaded}

# (architecture, device, quantized, modules kept in bf16) -> (the base's logits, the adapter's) on the unsplit base.
_REFERENCES: dict[tuple, tuple] = {}


def reference(under_test, quantized: bool, skip_modules: tuple[str, ...], prompt):
    key = (under_test.arch.name, str(under_test.device), quantized, skip_modules)
    if key not in _REFERENCES:
        base = scenario.reference_base(under_test, quantized, skip_modules)
        if quantized:
            scenario.first_nested_linear4bit(base)
        base_logits = scenario.logits(base, prompt)
        adapter_logits = scenario.logits(scenario.peft_load(under_test, base, "language"), prompt)
        _REFERENCES[key] = (base_logits, adapter_logits)
    base_logits, adapter_logits = _REFERENCES[key]
    scenario.require_adapter_changes(adapter_logits, base_logits, "the unsplit base")
    return base_logits, adapter_logits


def assert_effect_kept(under_test, placement_name: str, placed: scenario.Placement, quantized: bool, prompt):
    base_logits, adapter_logits = reference(under_test, quantized, placed.skip_modules, prompt)

    model = scenario.peft_load(under_test, placed.base, "language", **placed.peft_kwargs)

    still = scenario.offloaded_modules(model, placed.offloaded)
    scenario.require(still == placed.offloaded, f"PEFT's load brought {sorted(set(placed.offloaded) - set(still))} back from offload")
    for name in placed.offloaded:
        on_it = [layer for layer in scenario.lora_wrapped(model) if f".{name}." in f"{layer}."]
        scenario.require(on_it or placement_name == "split", f"the adapter has no LoRA layer in the offloaded {name}")
    placed_logits = scenario.logits(model, scenario.prompt(placed.device))
    kept = scenario.effect_kept(placed_logits, adapter_logits, base_logits)
    scenario.assert_within(f"the adapter's effect on the {placement_name} base: |1 - effect kept|", abs(1 - kept), TOLERANCE)


@pytest.mark.axes(placement=PLACEMENTS, quant=QUANT)
def test_adapter_effect_wherever_the_base_lives(under_test, placement, quant, offload_dir, prompt):
    placed = placement(under_test, quant, offload_dir)
    name = next(key for key, value in PLACEMENTS.items() if value is placement)
    assert_effect_kept(under_test, name, placed, quant, prompt)


@pytest.mark.gpu
@pytest.mark.gpus(2)
@pytest.mark.axes(quant=QUANT)
def test_adapter_effect_on_a_non_zero_gpu(under_test, quant, prompt):
    """peft#2787: the base on cuda:1, the reference on cuda:0 (the same kind of GPU, the same kernels)."""
    assert_effect_kept(under_test, "cuda:1", scenario.placed_on_gpu(under_test, quant, 1), quant, prompt)
