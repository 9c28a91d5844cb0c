"""`KeyError` on `shared_kv_states[self.kv_shared_layer_index]` after PEFT redispatches Gemma 4.

Upstream: transformers#45347 (fixed transformers' own dispatch only), #45663 (FSDP2 twin), #47290 /
5.23.0 `KVSharingDict` with an in-place `.to()`.

Precondition proven: the model has KV-shared layers; after the redispatch its decoder layers carry
accelerate hooks and the `shared_kv_states` dict really crosses a hooked layer during the forward.

Symptom: docs/family-notes.md#shared_kv_redispatch.
"""

import pytest
import torch

from stackcheck.harness import scenario

pytestmark = pytest.mark.needs("kv_sharing")


def assert_redispatched_generation_matches_undispatched(under_test, quantized, prompt, offload_dir, redispatch_options) -> None:
    """`redispatch_options(base)` gives the PEFT load kwargs that make it redispatch the split base."""
    undispatched = scenario.peft_load(under_test, scenario.load_base(under_test, quantized=quantized), "language")
    reference_logits, reference_decode = scenario.logits(undispatched, prompt), scenario.decode(undispatched, prompt)
    del undispatched
    base = scenario.split_base(under_test, offload_dir / "base", quantized=quantized)

    model = scenario.peft_load(under_test, base, "language", offload_dir=str(offload_dir / "peft"), **redispatch_options(base))
    layers, shared = scenario.shared_kv_layers(model)
    scenario.require(all(hasattr(layer, "_hf_hook") for layer in layers), "PEFT's redispatch left decoder layers unhooked")
    crossings = []
    shared[0].register_forward_pre_hook(
        lambda module, args, kwargs: crossings.append("shared_kv_states" in kwargs), with_kwargs=True
    )

    logits = scenario.logits(model, prompt)
    scenario.require(any(crossings), "no shared_kv_states kwarg reached a hooked KV-shared layer")

    torch.testing.assert_close(logits, reference_logits, rtol=0, atol=1e-2)
    scenario.assert_decodes_alike(model, prompt, reference_decode, "the redispatched model decodes otherwise", beside_logits=True)


@scenario.QUANTIZATION
def test_generate_after_peft_redispatch_matches_undispatched(under_test, quantized, offload_dir, prompt):
    assert_redispatched_generation_matches_undispatched(
        under_test, quantized, prompt, offload_dir, lambda base: {"max_memory": scenario.memory_pressure(under_test, base)}
    )


@pytest.mark.gpu
@scenario.QUANTIZATION
def test_generate_after_peft_load_with_base_device_map_matches_all_gpu(under_test, quantized, offload_dir, prompt):
    """Seed 001's variant: the base's own device map handed to PEFT, no memory pressure."""
    assert_redispatched_generation_matches_undispatched(
        under_test,
        quantized, prompt, offload_dir, lambda base: {"device_map": base.hf_device_map}
    )
