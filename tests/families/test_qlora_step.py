"""A QLoRA training step does what users expect of it, on the seed's 4-bit base.

Precondition proven: the base is NF4 with nested quant state, and the optimizer really moved the LoRA weights.

Symptom, how it is run and measurements: docs/family-notes.md#qlora_step.
"""

import re

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.models import tiny

STEPS = 5


def targeted(base, target_modules: str | list[str]) -> dict[str, torch.nn.Module]:
    """The linear layers of `base` that LoRA targets mean, read as PEFT documents them: a regular expression
    matching the whole name, names matching a module's trailing dotted part, or every linear layer but the
    output head ("all-linear")."""
    linears = {name: m for name, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    if target_modules == "all-linear":
        head = base.get_output_embeddings()
        return {name: m for name, m in linears.items() if m is not head}
    if isinstance(target_modules, str):
        return {name: m for name, m in linears.items() if re.fullmatch(target_modules, name)}
    return {name: m for name, m in linears.items() if name.rpartition(".")[2] in target_modules}


def expected_trainable(base, target_modules: str | list[str], rank: int) -> int:
    return sum(rank * (m.in_features + m.out_features) for m in targeted(base, target_modules).values())


def on_a_linear_layer(model, parameter_name: str) -> bool:
    """Whether a LoRA parameter belongs to a linear layer's adapter, not to one PEFT puts on a fused-expert
    parameter (`ParamWrapper`, which PEFT's "all-linear" reaches on mixture-of-experts models)."""
    layer = model.get_submodule(parameter_name.split(".lora_", 1)[0])
    return isinstance(getattr(layer, "base_layer", None), torch.nn.Linear)


def require_optimizer_moved(trainable: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> None:
    scenario.require(any(not torch.equal(p, start[name]) for name, p in trainable.items()), "the optimizer moved no LoRA weight")


def paged_adamw_8bit(params, lr):
    import bitsandbytes as bnb

    return bnb.optim.PagedAdamW8bit(params, lr=lr)


# torch's AdamW, and the QLoRA paper's paged 8-bit AdamW (`optim="paged_adamw_8bit"` in transformers' Trainer).
OPTIMIZERS = {"torch_adamw": torch.optim.AdamW, "bnb_paged_adamw_8bit": paged_adamw_8bit}


def whole_base(under_test, offload_dir):
    return scenario.load_base(under_test)


# The base on one device, and split as the seed user split it: the towers in bf16, offloaded by accelerate
# (`scenario.towers_offloaded_base`: on the CPU in the GPU lane, on disk in the CPU lane).
BASES = {"whole": whole_base, "split": scenario.towers_offloaded_base}


# The language model's projections on text (Gemma 4's seed targets; elsewhere PEFT's default targets for the
# model type), "all-linear" (not defined for Gemma 4, whose seed user targets by hand), and the seed user's setup:
# the towers' inner `.linear` too (the documented workaround for Gemma4ClippableLinear), on a batch with an image
# and an audio clip. The value: whether the batch is multimodal.
ADAPTERS = {"language": False, "all_linear": False, "inner_linear": True}


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
@pytest.mark.parametrize("base_name", BASES)
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_qlora_steps_learn_and_leave_the_4bit_base_untouched(under_test, adapter, base_name, optimizer_name, offload_dir):
    base = BASES[base_name](under_test, offload_dir)
    scenario.first_nested_linear4bit(base)
    config = tiny.lora_config(under_test.arch, adapter)
    expected = expected_trainable(base, config.target_modules, config.r)
    model = scenario.qlora_model(under_test, base, adapter)
    before = scenario.frozen_state(model)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    start = {name: p.detach().clone() for name, p in trainable.items()}

    losses = scenario.train_steps(under_test, model, OPTIMIZERS[optimizer_name](list(trainable.values()), lr=1e-2), STEPS, ADAPTERS[adapter])

    require_optimizer_moved(trainable, start)
    assert losses[-1] < losses[0], f"the loss did not decrease over {STEPS} steps: {losses}"
    # A text batch reaches no tower: LoRA that PEFT's defaults put in an image model's tower (Gemma 3's SigLIP) is left
    # out of the gradient check unless the batch is multimodal.
    reached = {name: p for name, p in trainable.items()
               if ADAPTERS[adapter] or not any(tower in name for tower in ("vision_tower", "audio_tower"))}
    dead = [name for name, p in reached.items() if p.grad is None or not torch.isfinite(p.grad).all() or not p.grad.any()]
    assert not dead, f"{len(dead)} of {len(reached)} LoRA parameters got no finite non-zero gradient: {dead[:3]}"
    changed = scenario.tensors_changed(before, scenario.frozen_state(model))
    assert not changed, f"training changed {len(changed)} frozen base tensors: {changed[:3]}"
    on_linears = sum(p.numel() for name, p in trainable.items() if on_a_linear_layer(model, name))
    print(f"stackcheck measured: {sum(p.numel() for p in trainable.values()) - on_linears} trainable LoRA parameters on "
          f"PEFT's parameter targets (fused experts), beside {on_linears} on linear layers")
    assert on_linears == expected, f"LoRA on the targeted linear layers has {on_linears} trainable parameters, the config asks for {expected}"
