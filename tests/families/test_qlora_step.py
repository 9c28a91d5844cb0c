"""A QLoRA training step does what users expect of it, on the seed's 4-bit base.

Symptom (seed 004: "PEFT training had an error"): training bugs mostly raise nothing; the run learns less, or
learns wrong. The user-level contract of QLoRA, checked on a few optimizer steps of one fixed batch, with
`prepare_model_for_kbit_training` and its defaults (gradient checkpointing on) and a LoRA config:
- the loss decreases;
- every LoRA parameter gets a finite, non-zero gradient (at the last step: LoRA's B starts at zero, so A's
  first gradient is zero by design);
- the frozen 4-bit base weights and their quant states (nested, with double quant) are bit-identical after
  the steps;
- the number of trainable parameters is what the config asks for: rank x (in + out) per targeted layer.

Run with torch's AdamW and with the QLoRA paper's paged 8-bit AdamW. On the CPU, bitsandbytes before 0.50.0 has
no optimizer kernels: the first step fails (bitsandbytes PR #1901 added them; paged falls back to non-paged).

Run on the language adapter's targets with text, and on the seed user's setup: the towers' inner `.linear` too,
with an image and an audio clip in the batch. There, PEFT's defaults checkpoint the vision encoder reentrantly
and its LoRA gets no gradient at all (14 of 14 tensors; every one with non-reentrant checkpointing or none):
our finding, `vision_tower_lora_reentrant_checkpointing`. On transformers < 5.11 the 4-bit audio tower crashes
first (`audio_tower_finfo_uint8`). On the split base, where accelerate offloads the towers, `get_peft_model`
puts their LoRA weights on the meta device: the forward silently adds uninitialized memory for the LoRA branch and the
backward fails (`lora_on_offloaded_layer_meta`, our finding; 20 of 96 LoRA tensors on meta: 14 in the vision tower, 6 in the audio tower).

Measured on the tiny model (CPU, seed and latest, language targets, AdamW lr 1e-2): the loss falls from 7.38 to
3.11 (seed) and 3.04 (latest) in 5 steps.

Precondition proven: the base is NF4 with nested quant state, and the optimizer really moved the LoRA weights.
"""

import re

import pytest
import torch

from stackcheck import scenario
from stackcheck.models import tiny

STEPS = 5


def frozen_state(model) -> dict[str, torch.Tensor]:
    """Copies of every frozen tensor of the base: parameters, and each 4-bit layer's quant state. Parameters an
    offload hook keeps on meta hold no data to compare (on the split base: unquantized tables and towers)."""
    state = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad and p.device.type != "meta"}
    for name, layer in scenario.linear4bit_modules(model).items():
        for index, tensor in enumerate(scenario.quant_state_tensors(layer.weight.quant_state)):
            state[f"{name}.quant_state.{index}"] = tensor.detach().clone()
    return state


def expected_trainable(base, target_modules: str, rank: int) -> int:
    return sum(rank * (m.in_features + m.out_features) for name, m in base.named_modules()
               if re.fullmatch(target_modules, name) and hasattr(m, "in_features"))


def require_optimizer_moved(trainable: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> None:
    scenario.require(any(not torch.equal(p, start[name]) for name, p in trainable.items()), "the optimizer moved no LoRA weight")


def paged_adamw_8bit(params, lr):
    import bitsandbytes as bnb

    return bnb.optim.PagedAdamW8bit(params, lr=lr)


# torch's AdamW, and the QLoRA paper's paged 8-bit AdamW (`optim="paged_adamw_8bit"` in transformers' Trainer).
OPTIMIZERS = {"torch_adamw": torch.optim.AdamW, "bnb_paged_adamw_8bit": paged_adamw_8bit}


def whole_base(offload_dir):
    return scenario.load_base()


# The base on one device, and split as the seed user split it: the towers in bf16, offloaded by accelerate
# (`scenario.towers_offloaded_base`: on the CPU in the GPU lane, on disk in the CPU lane).
BASES = {"whole": whole_base, "split": scenario.towers_offloaded_base}


# The language model's projections on text, and the seed user's setup: the towers' inner `.linear` too (the
# documented workaround for Gemma4ClippableLinear), on a batch with an image and an audio clip.
ADAPTERS = {"language": False, "inner_linear": True}


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
@pytest.mark.parametrize("base_name", BASES)
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_qlora_steps_learn_and_leave_the_4bit_base_untouched(adapter, base_name, optimizer_name, offload_dir):
    base = BASES[base_name](offload_dir)
    scenario.first_nested_linear4bit(base)
    config = tiny.lora_config(adapter)
    expected = expected_trainable(base, config.target_modules, config.r)
    model = scenario.qlora_model(base, adapter)
    before = frozen_state(model)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    start = {name: p.detach().clone() for name, p in trainable.items()}

    losses = scenario.train_steps(model, OPTIMIZERS[optimizer_name](list(trainable.values()), lr=1e-2), STEPS, ADAPTERS[adapter])

    require_optimizer_moved(trainable, start)
    assert losses[-1] < losses[0], f"the loss did not decrease over {STEPS} steps: {losses}"
    dead = [name for name, p in trainable.items() if p.grad is None or not torch.isfinite(p.grad).all() or not p.grad.any()]
    assert not dead, f"{len(dead)} of {len(trainable)} LoRA parameters got no finite non-zero gradient: {dead[:3]}"
    changed = [name for name, tensor in frozen_state(model).items() if not torch.equal(tensor, before[name])]
    assert not changed, f"training changed {len(changed)} frozen base tensors: {changed[:3]}"
    assert sum(p.numel() for p in trainable.values()) == expected
