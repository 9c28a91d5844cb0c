"""Reentrant gradient checkpointing silently drops the gradient Gemma 4's KV-shared layers send back to the
layers whose K/V they reuse.

Upstream: no transformers or PEFT report found; the mechanism came with transformers PR #45312 (KV sharing
dissociated from the cache, 5.5.2), whose reviewer noted "ig we have to disable GC for model" (not done, not in
5.23.0). unsloth-zoo PR #813 forces non-reentrant for it (measured there on transformers 5.12.1).

Symptom, how users meet it, preconditions and tolerances: docs/family-notes.md#checkpointing_kv_sharing.
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.models import tiny

GRADIENT_TOLERANCE = 0.01
TOWERS = ("vision_tower", "audio_tower")


def lora_model(under_test, quantized: bool, prepare=lambda base: base):
    """The base, `prepare`d, with the language adapter's targets and non-zero LoRA weights (the same on every
    call), in training mode."""
    from peft import get_peft_model

    base = scenario.load_base(under_test, quantized=quantized)
    if "kv_sharing" in under_test.structures:  # the layers whose gradient the bug drops
        scenario.shared_kv_layers(base)
    base = prepare(base)
    torch.manual_seed(tiny.SEED + 1)
    model = get_peft_model(base, tiny.lora_config(under_test.arch, "language", init_lora_weights=False))
    model.train()
    return model


def lora_gradients(under_test, model) -> dict[str, torch.Tensor]:
    """The LoRA gradients of one forward and backward of the fixed batch."""
    model.zero_grad()
    model(**scenario.training_batch(under_test.device, model.config)).loss.backward()
    return {name: torch.zeros_like(p, dtype=torch.float) if p.grad is None else p.grad.detach().float().clone()
            for name, p in model.named_parameters() if "lora_" in name}


def attention_runs(model, run) -> int:
    """How often the attention of decoder layer 0 ran during `run` (the layer's own hooks sit outside
    transformers' checkpoint wrapper, so they see the first pass only). The layer's one attention, whatever its
    kind (`scenario.layer_attention`): Qwen3-Next's layer 0 holds a `linear_attn`, no `self_attn`."""
    layers = scenario.decoder_layers(model)
    calls = []
    handle = scenario.layer_attention(layers[0]).register_forward_hook(lambda *args: calls.append(1))
    try:
        run()
    finally:
        handle.remove()
    return len(calls)


def assert_gradients_match(reference: dict[str, torch.Tensor], measured: dict[str, torch.Tensor]) -> None:
    errors = {name: scenario.relative_error(measured[name], g) for name, g in reference.items()}
    wrong = [name for name, error in errors.items() if not error <= GRADIENT_TOLERANCE]
    worst = max(errors.values())
    scenario.assert_within(f"LoRA gradients with checkpointing diverge from those without ({len(wrong)} of "
                           f"{len(errors)} tensors): worst relative error", worst, GRADIENT_TOLERANCE)


def checkpointed_gradients(under_test, model) -> dict[str, torch.Tensor]:
    gradients = {}
    runs = attention_runs(model, lambda: gradients.update(lora_gradients(under_test, model)))
    scenario.require(runs == 2, f"decoder layer 0's attention ran {runs} time(s) in a forward and backward: checkpointing did not recompute it")
    return gradients


def reference_gradients(under_test, model) -> dict[str, torch.Tensor]:
    """The LoRA gradients without checkpointing, of the LoRA tensors the text batch reaches: an adapter that also sits
    in an image model's tower (PEFT's defaults on Gemma 3 with its SigLIP tower) gets none there from text."""
    reference = {name: g for name, g in lora_gradients(under_test, model).items() if not any(tower in name for tower in TOWERS)}
    dead = [name for name, g in reference.items() if not g.any()]
    scenario.require(not dead, f"{len(dead)} LoRA tensors get no gradient even without checkpointing")
    return reference


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_lora_gradients_with_checkpointing_match_without(under_test, use_reentrant):
    """transformers' `gradient_checkpointing_enable`, with `use_reentrant` chosen explicitly; reentrant needs
    inputs that require grad, so `enable_input_require_grads` as PEFT's docs show."""
    model = lora_model(under_test, quantized=False)
    reference = reference_gradients(under_test, model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.enable_input_require_grads()

    assert_gradients_match(reference, checkpointed_gradients(under_test, model))


def test_kbit_training_defaults_keep_lora_gradients(under_test):
    """The QLoRA path: `prepare_model_for_kbit_training` with its defaults on the 4-bit base, against the same
    preparation without checkpointing."""
    from peft import prepare_model_for_kbit_training

    reference_model = lora_model(under_test, True, lambda base: prepare_model_for_kbit_training(base, use_gradient_checkpointing=False))
    scenario.first_nested_linear4bit(reference_model)
    reference = reference_gradients(under_test, reference_model)
    del reference_model

    model = lora_model(under_test, True, prepare_model_for_kbit_training)

    assert_gradients_match(reference, checkpointed_gradients(under_test, model))
