"""trl's SFT, DPO and GRPO trainers each run a QLoRA step in the precision the user asked for (bf16 or fp16): every LoRA
tensor gets a gradient and moves, the loss is finite, and the 4-bit base stays bit-identical.

Each trainer is driven through the installed trl release's own API (0.24.0, the oldest release usable with
transformers 5, to 1.16.0): `peft_config` on an NF4 base loaded in the run's precision, GRPO with its in-process
`generate()` (no vLLM, no server). A release without the trainer reads `not_affected`; below 0.29.0 DPO and GRPO
meet the ledger's trl bugs on transformers 5.

Precondition proven: the base is NF4 with nested quant state, the trainer put LoRA on 4-bit layers, the steps ran
(and at least two were taken: fp16's scaler may skip one), and every training forward of a LoRA layer ran under
autocast in the precision asked. On the CPU lane fp16 is `skipped` where accelerate runs it without autocast.

The journey, how each release is driven, the property and tolerances: docs/family-notes.md#trl_step.
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.harness import trainers

STEPS = 3
TAKEN = 2  # steps the optimizer must take: PEFT's zero lora_B gives lora_A its first gradient at the second
# The axes' order decides how allpairspy's greedy cover shares the precisions out over the 27 (architecture, trainer)
# pairs of the default run: in this order 18 cells are bf16 (SFT 4, GRPO 6, DPO 8), all of which the CPU lane runs, and
# 9 fp16 (SFT 5, GRPO 3, DPO 1), which only the GPU lane can (see require_mixed_precision).
TRAINERS = {"grpo": "grpo", "sft": "sft", "dpo": "dpo"}
PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16}


def lora_on_4bit(model) -> dict[str, torch.nn.Module]:
    """The LoRA layers of `model` whose base layer is a 4-bit one, by name."""
    from peft.tuners.lora import LoraLayer

    quantized = set(scenario.linear4bit_modules(model).values())
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer) and m.get_base_layer() in quantized}


def require_mixed_precision(trainer, dtype: torch.dtype, device: torch.device) -> None:
    """The trainer asked accelerate for the run's mixed precision; where accelerate runs fp16 on the CPU without
    autocast or a loss scaler (its `native_amp` off), the lane has no fp16 step to check: skipped, with the reason."""
    import accelerate

    asked = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    accelerator = trainer.accelerator
    scenario.require(accelerator.mixed_precision == asked, f"the trainer's accelerator runs mixed precision "
                     f"{accelerator.mixed_precision!r}, not the {asked!r} its config asked for")
    if device.type == "cpu" and not accelerator.native_amp:
        pytest.skip(f"CPU lane: accelerate {accelerate.__version__} runs {asked} mixed precision on the CPU without autocast "
                    "or a loss scaler (Accelerator.native_amp is False), so the CPU has no such step; the GPU lane runs it")
    scenario.require(accelerator.native_amp, f"accelerate runs {asked} on {device.type} without autocast (native_amp is False)")
    if asked == "fp16" and device.type == "cuda":
        scenario.require(accelerator.scaler is not None, "accelerate runs fp16 on the GPU without a loss scaler")


@pytest.mark.axes(trainer=TRAINERS, precision=PRECISIONS)
def test_a_qlora_step_trains_the_adapter_in_the_precision_asked(under_test, trainer, precision, tmp_path):
    kind, asked = trainer, {dtype: name for name, dtype in PRECISIONS.items()}[precision]
    trainers.require_trainer(kind)
    base = scenario.load_base_in(under_test, precision)
    scenario.first_nested_linear4bit(base)
    trainer = trainers.qlora_trainer(kind, under_test, base, precision, tmp_path / "run", STEPS)
    require_mixed_precision(trainer, precision, under_test.device)
    model = trainer.model
    layers = lora_on_4bit(model)
    scenario.require(layers, f"{type(trainer).__name__} put no LoRA on a 4-bit layer")
    lora = scenario.lora_reached_by_text(model)
    frozen, start = scenario.frozen_state(model), {name: p.detach().clone() for name, p in lora.items()}
    seen = trainers.StepsSeen(trainer, layers)

    try:
        trainer.train()
    finally:
        seen.remove()

    losses = trainers.trained_losses(trainer)
    scenario.require(trainer.state.global_step == STEPS and len(losses) == STEPS,
                     f"{kind} ran {trainer.state.global_step} steps and logged {len(losses)} losses, not {STEPS}")
    scenario.require(seen.taken >= TAKEN, f"the optimizer took {seen.taken} of {STEPS} {kind} steps (skipped: {seen.skipped}), not {TAKEN}")
    scenario.require(seen.forwards, f"no {kind} training forward ran a LoRA layer on a 4-bit weight")
    autocast = sorted({(on, str(dtype)) for on, dtype, _lora, _base in seen.forwards})
    scenario.require(autocast == [(True, str(precision))], f"{kind}'s training forwards ran under autocast {autocast}, not {precision}")
    computed = sorted({(str(lora_dtype), str(base_dtype)) for _on, _dtype, lora_dtype, base_dtype in seen.forwards})
    lora_dtypes = sorted({str(p.dtype) for p in lora.values()})
    print(f"stackcheck measured: {kind} {asked}: losses {[round(x, 4) for x in losses]}; steps skipped {seen.skipped}; "
          f"LoRA weights {lora_dtypes}; LoRA and 4-bit base outputs {computed}; {len(seen.forwards)} LoRA forwards")
    scenario.require(all(lora_dtype == str(precision) for lora_dtype, _base in computed),
                     f"{kind}'s LoRA layers computed in {computed} under {precision} autocast")

    assert all(torch.isfinite(torch.tensor(losses))), f"{kind} {asked} loss is not finite: {losses}"
    last = seen.grads[-1]
    dead = scenario.grads_missing({name: last[name] for name in lora})
    assert not dead, f"{len(dead)} of {len(lora)} LoRA tensors got no finite non-zero gradient at {kind}'s last {asked} step: {dead[:3]}"
    still = [name for name, p in lora.items() if torch.equal(p.detach(), start[name])]
    assert not still, f"{len(still)} of {len(lora)} LoRA tensors did not move in {STEPS} {kind} {asked} steps: {still[:3]}"
    touched = scenario.tensors_changed(frozen, scenario.frozen_state(model))
    assert not touched, f"{STEPS} {kind} {asked} steps changed {len(touched)} frozen base tensors: {touched[:3]}"
