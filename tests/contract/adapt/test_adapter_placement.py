"""The adapter's effect is present wherever the base lives.

The user's journey, step 2: `PeftModel.from_pretrained(base, adapter)` on a base that is not simply on one device.
Where the base lives changes PEFT's code path: a base whose `hf_device_map` names 'cpu' or 'disk' is
redispatched by PEFT (its hooks stripped, a new map computed, the adapter's weights loaded into an offload index
on disk); a base on a GPU other than the first takes the adapter's weights from wherever PEFT puts them. A
placement that drops the adapter on some layers, or on all of them, raises nothing: the model just answers as the
base would.

Placements (the base's own quantization is an axis, NF4 and bf16, covered by pairs with the architecture):
- `default`: `device_map="auto"` with the main device to fill; the base lands whole on it.
- `split`: the seed user's split (`scenario.split_base`): a module bitsandbytes leaves in bf16 offloaded, to the
  CPU (GPU lane) or to disk (CPU lane).
- `offloaded`: the last decoder layer, which the adapter targets, offloaded the same way (in bf16: transformers
  keeps offloaded modules of a 4-bit load unquantized).
- a non-zero GPU (`device_map={"": 1}`, GPU lane with two GPUs): the base on cuda:1.
PEFT gets the base's own map in its names for the split and offloaded bases (PEFT's documented way to keep a
placement; without it PEFT moves the modules back, which `peft_redispatch_placement` is about), so the forward
really runs offloaded.

Upstream: peft#2787 (open: `PeftModel.from_pretrained` with the base on cuda:1 gives the base's outputs), peft
PR #3468 (disk offloading matched the wrong keys). Met on the mixtures of experts: on an offloaded layer whose fused
experts carry LoRA (Qwen3-MoE's all-linear on peft >= 0.20), peft 0.21 raises at the forward
(`peft_param_lora_offloaded_autocast`) and peft 0.20.0 is silently wrong (the effect kept off by 0.517, or NaN).

Precondition proven: the reference adapter changes the outputs; the 4-bit base is NF4 with nested quant state;
the placement is what it says (whole on the main device, on cuda:1, or its modules on meta behind accelerate's
hooks, before and after PEFT's load); the offloaded layer carries LoRA layers.

Measure (judged by mechanism): the share of the adapter's effect kept (`scenario.effect_kept`: the placed model's
change from the reference base, projected on the change the adapter makes on the unsplit base, the same modules
kept in bf16). A dropped adapter keeps 0, one applied twice keeps 2. Tolerance: |1 - effect kept| <= 0.05.
Measured (CPU lane, seed and latest): 0.0000 in every cell PEFT loads (the placed model computes what the unsplit
one does, bit for bit); against the all-4-bit reference instead of the like-quantized one (the offloaded layer's
NF4 rounding as noise) it moves by 0.0005 (Llama 3) and 0.0024 (Gemma 4); the adapter left off on the offloaded
layer alone measures 0.4805 (Llama 3, the guard test), left off everywhere 1.0000.
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
