"""GRPO's weight sync pushes the merged weights W + dW and leaves the model as it was, sync after sync.

The journey step: RL fine-tuning with trl's GRPOTrainer and vLLM generation on a LoRA (or QLoRA) model. Before each
generation trl pushes the policy's weights to vLLM: PEFT's `merge_adapter`, the merged parameters read under vLLM's
names, `unmerge_adapter` (`VLLMGeneration._iter_named_params`). Training then goes on from the unmerged model, so
a merge or unmerge that does not give back what it took drifts the policy a little more at every sync.

Driven here: trl's own sync generator on the model, without a vLLM engine (the only missing piece is the receiver;
GRPOTrainer with use_vllm=False never syncs, so the trainer itself would not reach this code). The model is the
architecture's tiny base, bf16 or NF4 with double quant, with the adapter fixture loaded trainable (its LoRA B is
non-zero, as after training).

The property, over `SYNCS` syncs on every architecture:
- what is pushed for each LoRA layer's weight is W + dW: its change from W, projected on PEFT's own delta
  (`get_delta_weight`), keeps the delta (`PUSH_KEPT_BAND`; for NF4 the pushed codes are read with the quant state
  the layer held while they were pushed);
- the syncs give the weights back: after the last sync every LoRA layer's base weight is W again
  (`DRIFT_TOLERANCE` of the delta's norm, far above an fp32 merge's rounding and below one bf16 re-rounding). A drift
  of one sync compounds over the thousands of syncs of a GRPO run (measured over 20 here: see the constants). The
  logits' drift (a share of the adapter's effect on them) is reported beside it.

Bugs of this class: merge or unmerge dropping, doubling or re-rounding the delta (peft's 4-bit unmerge re-quantizes
W + dW - dW), adapters merged into the wrong layers, a sync that leaves the model merged. Upstream examples:
huggingface/trl#2698 and #3205 (GRPO + PEFT + vLLM weight sync), huggingface/peft#2321 (4-bit merge rounding).

Precondition proven: the base is NF4 with nested quant state (or bf16), the adapter changes the logits, and every
LoRA layer's weight is among the pushed tensors.

Tolerances (measured in docs/contract-trl-architectures.md): see the constants.
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
