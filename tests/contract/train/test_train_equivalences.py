"""Training equivalences a QLoRA user relies on without checking: switches that must change the cost of a step,
never its result.

Properties, on every architecture:
- **Gradient checkpointing changes memory, not gradients.** One step with checkpointing on (reentrant and
  non-reentrant) gives the loss and every LoRA gradient of the same step with it off, on a 4-bit and a bf16 base.
  Catches a recompute that differs from the first forward: state a hook sets on the first pass only
  (peft#2826, fixed by PR #2860: activated LoRA's offsets), a quantized layer whose state breaks on recompute
  (bitsandbytes#1927: INT8 and checkpointing), frozen inputs that cut the graph (transformers#42489, which
  `trainer_checkpointing` names).
- **Gradient accumulation changes batching, not the update.** Through `transformers.Trainer`, two micro-batches
  of one sequence with `gradient_accumulation_steps=2` update the adapter as one batch of both does, when the
  sequences hold different numbers of label tokens (where a per-micro-batch mean differs from the batch's:
  transformers#34191's accumulation loss, and DeepSpeed PR #7967 and #7981, which dropped micro-steps).
- **The loss the Trainer reports is the model's.** The logged loss of that first step equals the cross entropy
  recomputed from the logits of the model before the step, over every label token of the batch (unsloth#5037: a
  loss reported at a seventh of its value after an update).
- **The adapter has the dtype asked for.** `get_peft_model(..., autocast_adapter_dtype=False)` leaves the LoRA
  weights in the base's compute dtype, and the default casts them to float32 (peft#2889, fixed by PR #2893: the
  flag was ignored on a 4-bit base).

Precondition proven: the 4-bit base is NF4 with nested quant state (bf16 cells: no 4-bit layer), the checkpointed
step really ran every decoder layer under checkpointing, the adapter really changes the loss's gradient (some LoRA
gradient is non-zero), and the two sequences' label-token counts differ.

Tolerances, judged by mechanism. A checkpointed step recomputes the same operations on the same inputs: measured
bit-identical on the CPU (0.0 relative difference, every architecture, seed and latest); the bound 1e-3 leaves room
for a GPU's kernel choice and is far below what a different recompute gives (order 1). Accumulation and one batch
add the same per-token terms in another order: measured below 1e-6 relative on the LoRA update (SGD, so the update
is the gradient); a per-micro-batch mean is off by the ratio of the token counts (11 to 4 label tokens: 0.37 relative
on the tiny Gemma 4, whose model class tells the Trainer not to count label tokens, `accepts_loss_kwargs = False`). A
failure reports whether the Trainer counted the batch's label tokens (1 or 0): the mechanism the ledger tells bugs
apart by. The other order is not the only difference on a GPU: the micro-batches are smaller matrices, for which the
GPU picks other matrix-product kernels (tiles, split reductions in bf16), so the same sums round otherwise. The cell
measures that on its device (`trainer.batching_floor`: one batch against two micro-batches by hand, no Trainer, the
right denominator) and allows twice it where that exceeds 1e-3. Measured on the CPU (seed): the floor 8.6e-8 to
1.2e-7, the Trainer's accumulation 6.3e-7 to 2.3e-6 (tiny Llama 3, Gemma 3, Phi-4). On two H100s (torch 2.11, before
this floor), the Trainer's accumulation was off by 0.0017 to 0.0043 on Gemma 3, Phi-4 and Qwen3-Next with the label
tokens counted (at most 1.1 times bf16's epsilon, 2^-8 = 0.0039) and 0.0245 on multimodal Gemma 3 (latest): the floor
tells the kernels from the Trainer there (docs/contract-gpu-run.md).
The reported loss against the recomputed one: bf16 logits summed in another order, measured below 1e-3 relative
(transformers 5.23.0); a failure also reports the ratio of the two, which a denominator's mechanism fixes: counting
the label tokens before the shift (16 here, against the 15 that the loss sums) gives 15/16 = 0.9375 exactly, on
every architecture (`trainer_num_items_unshifted`, transformers PR #46204).
"""

import math

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.harness import trainer

CHECKPOINTING = {"reentrant": True, "non_reentrant": False}
BASES = {"nf4": True, "bf16": False}
GRADIENT_TOLERANCE = 1e-3
ACCUMULATION_TOLERANCE = 1e-3
LOSS_TOLERANCE = 1e-2
BATCHING_FLOOR_FACTOR = 2


def accumulation_tolerance(floor: float) -> float:
    """ACCUMULATION_TOLERANCE, or BATCHING_FLOOR_FACTOR times what the batch's shape alone does to the gradient on
    this device (`trainer.batching_floor`, by hand) where that is more, rounded up to 4 decimals."""
    return max(ACCUMULATION_TOLERANCE, math.ceil(BATCHING_FLOOR_FACTOR * floor * 1e4) / 1e4)


@pytest.mark.axes(checkpointing=CHECKPOINTING, base=BASES)
def test_a_checkpointed_step_equals_the_plain_step(under_test, checkpointing, base):
    plain = trainer.lora_gradients(under_test, quantized=base, checkpointing=None)
    checkpointed = trainer.lora_gradients(under_test, quantized=base, checkpointing=checkpointing)
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
