"""GRPO's weight sync pushes the merged weights W + dW and leaves the model as it was, sync after sync.

Precondition proven: the base is NF4 with nested quant state (or bf16), the adapter changes the logits, and every
LoRA layer's weight is among the pushed tensors.

The journey, how it is driven, the property, the bugs it catches and tolerances:
docs/family-notes.md#grpo_weight_sync.
"""

import torch

from stackcheck.harness import scenario
from stackcheck.harness import trainers
from stackcheck.models import tiny

SYNCS = 3
PUSH_KEPT_BAND = (0.8, 1.2)
# A sync gives back what it took: after it the weights are W again. An fp32 merge and unmerge leaves ~1e-7 of the
# delta's norm (trl#6688's control: flat over 1000 cycles); every cycle of a bf16 one re-rounds W (0.0024 to 0.006 of
# the delta after one sync, compounding: 2.6 to 7.4 times that after 20), an NF4 one re-quantizes it (0.10 to 0.41
# after one, 4.3 to 5.0 times that after 20). Measured on the tiny models, CPU, seed and latest.
DRIFT_TOLERANCE = 1e-3


def dense(layer, state=None, data=None) -> torch.Tensor:
    """A LoRA layer's base weight in fp32: dequantized when it is 4-bit (with `state`/`data` when given)."""
    import bitsandbytes as bnb

    weight = layer.get_base_layer().weight
    if isinstance(weight, bnb.nn.Params4bit):
        return bnb.functional.dequantize_4bit(weight.data if data is None else data, state or weight.quant_state).float()
    return (weight if data is None else data).detach().float()


@scenario.QUANTIZATION
def test_grpo_weight_sync_pushes_w_plus_dw_and_unmerges_back(under_test, prompt, quantized):
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    trainers.require_trl_sync()
    base = scenario.load_base(under_test, quantized=quantized)
    if quantized:
        scenario.first_nested_linear4bit(base)
    model = PeftModel.from_pretrained(base, tiny.adapter_checkpoint(under_test.arch, "language"), is_trainable=True)
    layers = {trainers.vllm_name(name): m for name, m in model.named_modules()
              if isinstance(m, LoraLayer) and "default" in m.lora_A and hasattr(m.get_base_layer(), "weight")}
    scenario.require(layers, "the adapter wraps no linear layer")
    model.eval()
    before = scenario.logits(model, prompt)
    with model.disable_adapter():
        base_logits = scenario.logits(model, prompt)
    scenario.require_adapter_changes(before, base_logits, "the model")
    weights = {name: dense(layer) for name, layer in layers.items()}
    deltas = {name: layer.get_delta_weight("default").float() for name, layer in layers.items()}

    kept, drift = {}, {}
    for sync in range(SYNCS):
        pushed, states = trainers.vllm_sync(model, keep=set(layers) if sync == 0 else set())
        if sync == 0:
            missing = sorted(set(layers) - set(pushed))
            scenario.require(not missing, f"the sync pushed no weight for {len(missing)} LoRA layers: {missing[:2]}")
            for name, layer in layers.items():
                merged = dense(layer, states.get(name), pushed[name])
                kept[name] = scenario.effect_kept(merged, weights[name] + deltas[name], weights[name])
        if sync in (0, SYNCS - 1):
            drift[sync] = max(((dense(layer) - weights[name]).norm() / deltas[name].norm()).item() for name, layer in layers.items())
    after = scenario.logits(model, prompt)

    low, high = min(kept.values()), max(kept.values())
    logit_drift = ((after - before).norm() / (before - base_logits).norm()).item()
    print(f"stackcheck measured: delta kept in the pushed weights {low:.4f} to {high:.4f}; weight drift after 1 sync "
          f"{drift[0]:.4f}, after {SYNCS} {drift[SYNCS - 1]:.4f} (of the delta's norm); logit drift after {SYNCS} "
          f"{logit_drift:.4f} (of the adapter's effect)")
    outside = {name: round(value, 4) for name, value in kept.items() if not PUSH_KEPT_BAND[0] <= value <= PUSH_KEPT_BAND[1]}
    assert not outside, f"the synced weights are not W + dW: the delta kept is outside {PUSH_KEPT_BAND} for {len(outside)} layers: {list(outside.items())[:3]}"
    scenario.assert_within(f"GRPO weight syncs do not give the weights back: drift from W after {SYNCS} syncs, of the delta's norm",
                           drift[SYNCS - 1], DRIFT_TOLERANCE)
