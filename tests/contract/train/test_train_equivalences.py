"""Training equivalences a QLoRA user relies on without checking: switches that must change the cost of a step,
never its result.

Precondition proven: the 4-bit base is NF4 with nested quant state (bf16 cells: no 4-bit layer), the checkpointed
step really ran every decoder layer under checkpointing, the adapter really changes the loss's gradient (some LoRA
gradient is non-zero), and the two sequences' label-token counts differ.

Properties and tolerances: docs/family-notes.md#train_equivalences.
"""

import math

import pytest
import torch

from stackcheck.harness import scenario, surfaces
from stackcheck.harness import trainer

# TrainingArguments' checkpointing kwargs, from the axis model: left out (the libraries' default), reentrant or not.
CHECKPOINTING = surfaces.model_axes("training_args", "gradient_checkpointing_kwargs")
BASES = {"nf4": True, "bf16": False}
GRADIENT_TOLERANCE = 1e-3
ACCUMULATION_TOLERANCE = 1e-3
LOSS_TOLERANCE = 1e-2
BATCHING_FLOOR_FACTOR = 2


def accumulation_tolerance(floor: float) -> float:
    """ACCUMULATION_TOLERANCE, or BATCHING_FLOOR_FACTOR times what the batch's shape alone does to the gradient on
    this device (`trainer.batching_floor`, by hand) where that is more, rounded up to 4 decimals."""
    return max(ACCUMULATION_TOLERANCE, math.ceil(BATCHING_FLOOR_FACTOR * floor * 1e4) / 1e4)


@pytest.mark.axes(**CHECKPOINTING, base=BASES)
@pytest.mark.axes_invalid(*surfaces.model_invalid("training_args", CHECKPOINTING))
def test_a_checkpointed_step_equals_the_plain_step(under_test, gradient_checkpointing_kwargs, base):
    plain = trainer.lora_gradients(under_test, quantized=base, checkpointing=None)
    checkpointed = trainer.lora_gradients(under_test, quantized=base, checkpointing=gradient_checkpointing_kwargs)
    scenario.require(checkpointed.all_layers_checkpointed, "not every decoder layer ran under gradient checkpointing")
    scenario.require(any(g.any() for g in plain.gradients.values()), "no LoRA tensor got a non-zero gradient")
    scenario.require(plain.gradients.keys() == checkpointed.gradients.keys(), "the two models hold different LoRA tensors")
    loss_error = abs(checkpointed.loss - plain.loss) / abs(plain.loss)
    gradient_error = max(scenario.relative_error(checkpointed.gradients[name], g) if g.any() else
                         float(checkpointed.gradients[name].abs().max()) for name, g in plain.gradients.items())
    scenario.assert_within("a checkpointed step differs from the plain step: relative loss difference", loss_error, GRADIENT_TOLERANCE)
    scenario.assert_within("a checkpointed step differs from the plain step: largest relative LoRA gradient difference",
                           gradient_error, GRADIENT_TOLERANCE)


def test_accumulated_micro_batches_update_as_one_batch(under_test, tmp_path):
    one_batch = trainer.trainer_first_step(under_test, tmp_path / "one", batch_size=2, accumulation=1)
    accumulated = trainer.trainer_first_step(under_test, tmp_path / "accumulated", batch_size=1, accumulation=2)
    scenario.require(one_batch.label_tokens[0] != one_batch.label_tokens[1], "the two sequences hold as many label tokens")
    scenario.require(any(d.any() for d in one_batch.updates.values()), "the step moved no LoRA tensor")
    error = max(scenario.relative_error(accumulated.updates[name], d) for name, d in one_batch.updates.items() if d.any())
    floor = trainer.batching_floor(under_test)
    print(f"stackcheck measured: accumulation against one batch {error:.3g}; the same by hand (the batch's shape alone) {floor:.3g}")
    scenario.assert_within("gradient accumulation updates the adapter unlike one batch: largest relative LoRA update difference",
                           error, accumulation_tolerance(floor),
                           judged_by=("label tokens counted by the Trainer", float(accumulated.counted_label_tokens)))
    for label, run in (("one batch", one_batch), ("accumulated", accumulated)):
        reported = abs(run.reported_loss - run.recomputed_loss) / run.recomputed_loss
        scenario.assert_within(f"the Trainer reports another loss than the model's ({label}): relative difference", reported, LOSS_TOLERANCE,
                               judged_by=("reported over recomputed", run.reported_loss / run.recomputed_loss))


@pytest.mark.axes(autocast={"default": True, "off": False})
def test_the_adapter_has_the_dtype_asked_for(under_test, autocast):
    from peft import get_peft_model

    from stackcheck.models import tiny

    base = scenario.load_base(under_test)
    _name, layer = scenario.first_nested_linear4bit(base)
    model = get_peft_model(base, tiny.lora_config(under_test.arch, "language"), autocast_adapter_dtype=autocast)
    lora = {name: p.dtype for name, p in model.named_parameters() if "lora_" in name}
    scenario.require(lora, "get_peft_model added no LoRA tensor")
    expected = torch.float32 if autocast else layer.compute_dtype
    wrong = sorted({str(dtype) for dtype in lora.values() if dtype != expected})
    assert not wrong, f"autocast_adapter_dtype={autocast}: LoRA tensors in {wrong}, expected {expected}"
