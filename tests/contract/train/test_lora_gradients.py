"""Contract, train: the gradient of a QLoRA step reaches every LoRA tensor, and it is the gradient checkpointing does
not change, under each checkpointing mode, in bf16 and in fp16.

The journey, the property, the bugs it catches, axes, preconditions and tolerances:
docs/family-notes.md#lora_gradients.
"""

import pytest
import torch

from stackcheck.harness import scenario

GRADIENT_TOLERANCE = 0.01
# The base's quantization: NF4 (double quant), and LLM.int8, whose layers keep their int8 codes and row scales (CB, SCB)
# through the checkpointed recomputation too (bitsandbytes#1927).
QUANT = {"nf4": "nf4", "int8": "int8"}
LEARNING_RATE = 1e-2
# How often the GradScaler may halve its scale before a backward gives finite gradients (65536 down to 1).
MAX_SCALER_RETRIES = 17


def measured_backward(model, mixed: scenario.MixedPrecision, optimizer, batch) -> tuple[dict, int]:
    """The user's backward: scaled in fp16, retried at a halved scale while the gradients are not finite (the scaler
    skips those steps, so the weights do not change). The unscaled LoRA gradients, and how often the last decoder
    layer's attention ran in the forward and backward that gave them (2 where checkpointing recomputed it)."""
    lora = scenario.lora_reached_by_text(model)
    attention = scenario.decoder_layers(model)[-1].self_attn
    for _ in range(MAX_SCALER_RETRIES):
        optimizer.zero_grad()
        runs = scenario.forward_runs(attention, lambda: mixed.backward(mixed.loss(model, batch)))
        mixed.unscale(optimizer)
        grads = scenario.gradient_copies(lora)
        if mixed.scaler is None or all(g is None or torch.isfinite(g).all() for g in grads.values()):
            return grads, runs
        mixed.step(optimizer)  # skipped by the scaler: the weights stay, the scale halves
    raise AssertionError(f"fp16 gradients were not finite at any of {MAX_SCALER_RETRIES} loss scales: the GradScaler skipped every step")


def reference_gradients(model, mixed: scenario.MixedPrecision, batch) -> dict[str, torch.Tensor | None]:
    """The LoRA gradients of the same weights and batch with checkpointing off (at the measured loss scale), through
    `torch.autograd.grad`, which leaves the measured `.grad` for the step."""
    lora = scenario.lora_reached_by_text(model)
    model.gradient_checkpointing_disable()
    scale = mixed.scale
    grads = torch.autograd.grad(mixed.loss(model, batch) * scale, list(lora.values()), allow_unused=True)
    return {name: None if g is None else g.float() / scale for name, g in zip(lora, grads)}


def assert_checkpointing_keeps_gradients(reference: dict, measured: dict) -> None:
    # Without checkpointing every LoRA tensor a text batch reaches gets a gradient too (the towers' by design do not).
    dead = [name for name in scenario.grads_missing(reference) if not any(tower in name for tower in ("vision_tower", "audio_tower"))]
    assert not dead, f"{len(dead)} of {len(reference)} LoRA tensors got no finite non-zero gradient: {dead[:3]}"
    reference = {name: g for name, g in reference.items() if g is not None}
    errors = {name: scenario.relative_error(measured[name], g) for name, g in reference.items()}
    wrong = [name for name, error in errors.items() if not error <= GRADIENT_TOLERANCE]
    scenario.assert_within(f"LoRA gradients with checkpointing diverge from those without ({len(wrong)} of "
                           f"{len(errors)} tensors): worst relative error", max(errors.values()), GRADIENT_TOLERANCE)


@pytest.mark.axes(checkpointing={name: name for name in scenario.CHECKPOINTING}, precision=scenario.PRECISIONS, quant=QUANT)
def test_every_lora_tensor_gets_the_gradient_and_learns(under_test, checkpointing, precision, quant):
    use_reentrant = scenario.CHECKPOINTING[checkpointing]
    base = scenario.load_base_in(under_test, precision, quant)
    if quant == "int8":
        int8 = scenario.quantized_modules(base)
        faults = {name: scenario.quant_state_faults(m, scenario.Quantization("int8", dtype=precision)) for name, m in int8.items()}
        scenario.require(int8 and not any(faults.values()), f"the int8 base holds no Linear8bitLt with int8 codes and row scales: {faults}")
    else:
        scenario.first_nested_linear4bit(base)
    model = scenario.kbit_lora_model(under_test, base, use_reentrant, init_lora_weights=False)
    half = scenario.half_precision_parameters(model)
    scenario.require(not half, f"prepare_model_for_kbit_training left {len(half)} parameters in half precision: {half[:3]}")
    lora = scenario.lora_reached_by_text(model)
    scenario.require(lora, "get_peft_model added no LoRA tensor")
    frozen = scenario.frozen_state(model)
    start = {name: p.detach().clone() for name, p in lora.items()}
    mixed = scenario.MixedPrecision(under_test.device, precision)
    optimizer = torch.optim.AdamW(lora.values(), lr=LEARNING_RATE, weight_decay=0.0)
    batch = scenario.training_batch(under_test.device, model.config)

    seen = scenario.CheckpointingSeen(model)
    try:
        grads, runs = measured_backward(model, mixed, optimizer, batch)
    finally:  # checkpointing as asked, whatever the backward did
        seen.require_none() if use_reentrant is None else seen.require_all()

    # A text batch reaches no tower: LoRA that PEFT's defaults put in an image model's tower (Gemma 3's SigLIP) gets
    # no gradient by design, as in qlora_step (measured on gemma3mm, H200: 12 of 96 tensors, all in the vision tower).
    dead = [name for name in scenario.grads_missing(grads) if not any(tower in name for tower in ("vision_tower", "audio_tower"))]
    print(f"stackcheck measured: {len(lora) - len(dead)} of {len(lora)} LoRA tensors got a finite non-zero gradient "
          f"(loss scale {mixed.scale}; the last layer's attention ran {runs} time(s))")
    assert not dead, f"{len(dead)} of {len(lora)} LoRA tensors got no finite non-zero gradient: {dead[:3]}"
    if use_reentrant is not None:
        assert_checkpointing_keeps_gradients(reference_gradients(model, mixed, batch), grads)
    assert mixed.step(optimizer), "the optimizer step was skipped although every gradient was finite"
    still = [name for name, p in lora.items() if torch.equal(p.detach(), start[name])]
    assert not still, f"{len(still)} of {len(lora)} LoRA tensors did not move in a step: {still[:3]}"
    touched = scenario.tensors_changed(frozen, scenario.frozen_state(model))
    assert not touched, f"a training step changed {len(touched)} frozen base tensors: {touched[:3]}"
