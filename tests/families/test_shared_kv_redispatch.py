"""`KeyError` on `shared_kv_states[self.kv_shared_layer_index]` after PEFT redispatches Gemma 4.

Symptom (seed 001/000): `PeftModel.from_pretrained(base, ..., device_map=...)` on a dispatched Gemma 4,
then `generate` -> `Gemma4TextAttention.forward` -> `KeyError: 22` (E4B; 13 on E2B). PEFT's
`load_adapter` calls `dispatch_model` without `skip_keys`, so accelerate's `send_to_device` rebuilds the
`shared_kv_states` dict at every hooked layer and the reusing layer never sees its source layer's entry.
transformers 5.8-5.22 key the dict by layer type, so the same bug reads `KeyError: 'sliding_attention'`:
a new signature of this family.

Upstream: transformers#45347 (fixed transformers' own dispatch only), #45663 (FSDP2 twin), #47290 /
5.23.0 `KVSharingDict` with an in-place `.to()`.

Precondition proven: the model has KV-shared layers; after the redispatch its decoder layers carry
accelerate hooks and the `shared_kv_states` dict really crosses a hooked layer during the forward.
"""

import pytest
import torch

from stackcheck import scenario


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "nf4"])
def test_generate_after_peft_redispatch_matches_undispatched(quantized, offload_dir, prompt):
    undispatched = scenario.peft_load(scenario.load_base(quantized=quantized), "language")
    reference_logits, reference_tokens = scenario.logits(undispatched, prompt), scenario.greedy(undispatched, prompt)
    base = scenario.split_dispatch(scenario.load_base(quantized=quantized), offload_dir / "base")

    model = scenario.peft_load(
        base, "language", max_memory=scenario.memory_pressure(base), offload_dir=str(offload_dir / "peft")
    )
    layers, shared = scenario.shared_kv_layers(model)
    scenario.require(all(hasattr(layer, "_hf_hook") for layer in layers), "PEFT's redispatch left decoder layers unhooked")
    crossings = []
    shared[0].register_forward_pre_hook(
        lambda module, args, kwargs: crossings.append("shared_kv_states" in kwargs), with_kwargs=True
    )

    logits = scenario.logits(model, prompt)
    scenario.require(any(crossings), "no shared_kv_states kwarg reached a hooked KV-shared layer")

    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=1e-2)
    assert scenario.greedy(model, prompt) == reference_tokens
