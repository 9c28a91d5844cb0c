"""The adapter configurations users ship train, save every trained tensor, and reload to the trained outputs.

The user's journey, step 2: the adapter is more than plain LoRA. Configurations, by their names in PEFT, as an axis
covered by pairs with the architecture and the base's quantization (NF4 with `prepare_model_for_kbit_training`,
and bf16):
- `lora`: plain LoRA on the adapter fixture's targets;
- `modules_to_save=["lm_head", "embed_tokens"]`: the head and the input embeddings trained as full copies (on a
  model with tied embeddings PEFT handles the pair itself: whatever it does must still save and reload);
- `use_dora=True`: DoRA, on the 4-bit base too (its magnitude is computed from the dequantized weight);
- `use_rslora=True`: rsLoRA's scaling, alpha / sqrt(r).

Properties, after one AdamW step from a non-zero initialisation on the adapter fixture's targets in the first and
the last decoder layer (`scenario.train_adapter`; the ends of every tiny model's pattern of layer kinds):
- every trainable tensor of the configuration got a finite, non-zero gradient, and the trained adapter changes the
  outputs (against the same model with the adapter disabled);
- `save_pretrained` writes every trained tensor: the saved file holds an exact copy of each (found by value, so no
  naming convention of PEFT's is assumed; the head's and the embeddings' copies included);
- `PeftModel.from_pretrained` onto a fresh base, prepared as the trained one was, reproduces the trained model's
  logits.
The trained adapter is kept for the merge contract (`merge_effect` merges it rather than training it again).

Upstream: unsloth#9331 (the head and the embeddings named for training, silently left untrained), peft#2809 and
PR #2825 (Gemma 3's embedding scale not applied to trainable tokens), peft PR #2847 (DoRA on a 4-bit base broken
between releases), peft PR #3418 (device mismatch in DoRA's bitsandbytes dequantization), peft#2566 and
transformers#38927 (adapter keys missing after a model's refactor: the adapter silently absent on reload).

Precondition proven: the base is NF4 with nested quant state (or bf16 with no 4-bit layer); PEFT built what the
configuration asks for (a DoRA magnitude on every LoRA layer, rsLoRA's scaling, trainable copies of the head and
of the embeddings); the adapter changes the outputs before the round trip is judged.

Tolerance: the reloaded model's logits within 1% of the adapter's effect (||reloaded - trained|| / ||trained -
disabled||). Measured (CPU lane, seed and latest): the round trip is exact (0.0000) in every cell; the trained
adapter changes the logits by 0.65 to 1.42 of their norm (up to 3.4 with the head's copy trained); a save that
leaves out the head's copy fails the saved-tensor check (the guard test).
"""

import pytest

from stackcheck.harness import scenario

ROUND_TRIP_TOLERANCE = 0.01
QUANT = {"nf4": True, "bf16": False}


@pytest.mark.axes(config=scenario.ADAPTER_VARIANTS, quant=QUANT)
def test_adapter_config_trains_saves_and_reloads(under_test, config, quant, tmp_path, prompt):
    base = scenario.load_base(under_test, quantized=quant)
    if quant:
        scenario.first_nested_linear4bit(base)
    else:
        scenario.require(not scenario.linear4bit_modules(base), "the bf16 base is quantized")

    model = scenario.train_adapter(under_test, base, config, quant)

    scenario.require_variant_applied(model, config)
    trainable = scenario.trainable_tensors(model)
    dead = scenario.without_gradient(model)
    assert not dead, f"{len(dead)} of {len(trainable)} trainable tensors of the {config.name} adapter got no gradient: {dead[:3]}"
    trained = scenario.logits(model, prompt)
    with model.disable_adapter():
        disabled = scenario.logits(model, prompt)
    change = scenario.relative_error(trained, disabled)
    print(f"stackcheck measured: the trained {config.name} adapter changes the logits by {change:.4f}")
    assert change > 0, f"the trained {config.name} adapter does not change the outputs"

    model.save_pretrained(tmp_path / "adapter")
    scenario.remember_trained_adapter(under_test, config, quant, tmp_path / "adapter")  # the merge contract merges it
    missing = scenario.missing_from_saved(model, scenario.saved_adapter_tensors(tmp_path / "adapter"))
    assert not missing, f"the saved {config.name} adapter holds no copy of {len(missing)} of its {len(trainable)} trained tensors: {missing[:3]}"

    fresh = scenario.prepared_base(under_test, quant)
    reloaded = scenario.logits(scenario.peft_load(under_test, fresh, tmp_path / "adapter"), prompt)
    error = ((reloaded - trained).norm() / (trained - disabled).norm()).item()
    scenario.assert_within(f"the reloaded {config.name} adapter differs from the trained one: relative logit error (of its effect)",
                           error, ROUND_TRIP_TOLERANCE)
