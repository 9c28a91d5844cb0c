"""QLoRA trained through `transformers.Trainer` with `gradient_checkpointing=True`: the steps run and every LoRA
weight learns.

Precondition proven: the base is NF4 with nested quant state and frozen (no 4-bit weight requires grad), and
every decoder layer ran with checkpointing on during the steps (`gradient_checkpointing` set and in training
mode at its forward, which is what transformers' `GradientCheckpointingLayer` decides by).

Symptom, how users meet it, cells and measurements: docs/family-notes.md#trainer_checkpointing.
"""

import math

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.harness.trainer import one_device
from stackcheck.models import tiny

STEPS = 3

# Per cell: whether PEFT's `prepare_model_for_kbit_training` prepares the base, and the Trainer's
# `gradient_checkpointing_kwargs` (None: transformers' default).
RECIPES = {
    "kbit_prepared": (True, None),
    "peft_only": (False, None),
    "peft_only_reentrant": (False, {"use_reentrant": True}),
}


def training_dataset() -> list[dict[str, list[int]]]:
    """A tiny in-memory dataset: the fixed training sequence, its own labels, once per step."""
    ids = scenario.TRAINING_IDS[0]
    return [{"input_ids": ids, "labels": ids}] * STEPS


def require_frozen_4bit_base(model) -> None:
    scenario.first_nested_linear4bit(model)
    trainable = [name for name, layer in scenario.linear4bit_modules(model).items() if layer.weight.requires_grad]
    scenario.require(not trainable, f"{len(trainable)} 4-bit base weights require grad: {trainable[:3]}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_trainer_with_gradient_checkpointing_trains_every_lora_weight(under_test, recipe, tmp_path):
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    prepared, checkpointing_kwargs = RECIPES[recipe]
    base = scenario.load_base(under_test)
    if prepared:
        model = scenario.qlora_model(under_test, base)
    else:
        model = get_peft_model(base, tiny.lora_config(under_test.arch, "language"))
    require_frozen_4bit_base(model)
    # The text dataset reaches no tower: LoRA that PEFT's defaults put in an image model's tower (Gemma 3's SigLIP) is
    # left out, as no text batch can move it.
    lora = {name: p for name, p in model.named_parameters() if "lora_" in name and not any(t in name for t in ("vision_tower", "audio_tower"))}
    start = {name: p.detach().clone() for name, p in lora.items()}
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=1, logging_steps=1,
        gradient_checkpointing=True, gradient_checkpointing_kwargs=checkpointing_kwargs,
        save_strategy="no", report_to="none", use_cpu=under_test.device.type == "cpu",
    )
    one_device(args, under_test.device)  # the one-device user's Trainer, not nn.DataParallel over every GPU seen
    trainer = Trainer(model=model, args=args, train_dataset=training_dataset())
    seen = scenario.CheckpointingSeen(model)
    try:
        trainer.train()
    finally:  # a step that fails without checkpointing on says nothing about this bug
        seen.require_all()

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    still = [name for name, p in lora.items() if torch.equal(p.detach(), start[name])]
    print(f"stackcheck measured: {len(lora) - len(still)} of {len(lora)} LoRA tensors moved; losses {losses}")
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses), f"the Trainer's losses over {STEPS} steps: {losses}"
    assert not still, f"{len(still)} of {len(lora)} LoRA tensors did not move in {STEPS} Trainer steps with gradient checkpointing: {still[:3]}"
