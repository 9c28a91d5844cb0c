"""The adapter configurations users ship train, save every trained tensor, and reload to the trained outputs.

Precondition proven: the base is NF4 with nested quant state (or bf16 with no 4-bit layer); PEFT built what the
configuration asks for (a DoRA magnitude on every LoRA layer, rsLoRA's scaling, trainable copies of the head and
of the embeddings, a bias on every lora_B); the adapter changes the outputs before the round trip is judged.

The journey, properties, upstream and tolerances: docs/family-notes.md#adapter_configs.
"""

import pytest

from stackcheck.harness import scenario, surfaces

ROUND_TRIP_TOLERANCE = 0.01
QUANT = {"nf4": True, "bf16": False}
LORA = surfaces.model_axes("lora", "use_dora", "use_rslora", "modules_to_save", "lora_bias")
# Explore mode's further axes (--explore): the pairs hold each at its first value, the field left out, which is the
# adapter fixture's and LoraConfig's (rank 4, no dropout, no bias trained, no tying asked, no trainable tokens).
EXPLORED = surfaces.explore_axes("lora", "r", "lora_dropout", "bias", "ensure_weight_tying", "trainable_token_indices")


@pytest.mark.axes(**LORA, quant=QUANT)
@pytest.mark.axes_explore(**EXPLORED)
@pytest.mark.axes_invalid(*surfaces.model_invalid("lora", {**LORA, **EXPLORED}))
def test_adapter_config_trains_saves_and_reloads(under_test, use_dora, use_rslora, modules_to_save, lora_bias, quant, r, lora_dropout, bias,
                                                 ensure_weight_tying, trainable_token_indices, tmp_path, prompt):
    config = scenario.AdapterVariant.of(use_dora=use_dora, use_rslora=use_rslora, modules_to_save=modules_to_save, lora_bias=lora_bias, r=r,
                                        lora_dropout=lora_dropout, bias=bias, ensure_weight_tying=ensure_weight_tying,
                                        trainable_token_indices=trainable_token_indices)
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
