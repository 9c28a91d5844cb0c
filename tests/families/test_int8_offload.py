"""The LLM.int8 (8-bit) twins of the 4-bit offload bugs: `Int8Params` rebuilt from a transformers 5 parameter,
and its statistics (`SCB`) lost when an offload hook detaches.

Precondition proven: the layers are bitsandbytes `Linear8bitLt` loaded by transformers, whose `Int8Params`
carry `_is_hf_initialized`; the offload hook really moved the weight to meta; PEFT's redispatch really
offloaded 8-bit layers.

Symptom, upstream and what is not tested: docs/family-notes.md#int8_offload.
"""

import bitsandbytes as bnb
import pytest
import torch
from accelerate import cpu_offload
from accelerate.hooks import remove_hook_from_submodules
from accelerate.utils import set_module_tensor_to_device

from stackcheck.harness import scenario


def int8_layers(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear8bitLt)}


def loaded_int8_layer(under_test, **load_kwargs):
    layers = int8_layers(scenario.load_base(under_test, quantization_config=scenario.int8_config(), **load_kwargs))
    scenario.require(layers, "the model has no bnb Linear8bitLt modules")
    name, module = next(iter(layers.items()))
    scenario.require(isinstance(module.weight, bnb.nn.Int8Params), f"{name}.weight is not Int8Params")
    scenario.require_hf_initialized(name, module.weight)
    return module


def layer_input(under_test, module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, module.in_features, generator=generator).to(torch.bfloat16).to(under_test.device)


def test_offload_hook_moves_loaded_int8_param_to_meta(under_test):
    scenario.assert_offload_hook_moves_weight_to_meta(loaded_int8_layer(under_test))


def test_offload_hook_restores_int8_weight_from_weights_map(under_test):
    """What `AlignDevicesHook.pre_forward` does for an offloaded 8-bit layer: set the stored weight back, with
    its statistics."""
    module = loaded_int8_layer(under_test)
    stored, statistics = module.weight.data.clone(), module.weight.SCB.clone()

    set_module_tensor_to_device(module, "weight", under_test.device, value=stored, fp16_statistics=statistics)

    assert isinstance(module.weight, bnb.nn.Int8Params)
    assert module.weight.device.type == under_test.device.type


@torch.no_grad()
def test_int8_layer_computes_the_same_after_its_offload_hook_detaches(under_test):
    module = loaded_int8_layer(under_test)
    x = layer_input(under_test, module)
    expected = module(x)

    cpu_offload(module, execution_device=under_test.device)
    scenario.require(module.weight.device.type == "meta", "the offload hook did not move the 8-bit weight to meta")
    remove_hook_from_submodules(module)

    assert module.weight.SCB is not None, "the offload hook's detach restored the int8 weight without its statistics (SCB)"
    torch.testing.assert_close(module(x), expected, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.needs("vision_tower", "audio_tower")  # the seed's split map sends the towers to the CPU
def test_int8_split_base_generates_after_peft_redispatch(under_test, offload_dir, prompt):
    """Seed 002's 8-bit load: the seed's split map with fp32 CPU offload, the adapter loaded under memory
    pressure, against the same adapter on the base loaded onto the GPU whole."""
    reference = scenario.peft_load(under_test, scenario.load_base(under_test, quantization_config=scenario.int8_config(), device_map={"": 0}), "language")
    reference_logits, reference_decode = scenario.logits(reference, prompt), scenario.decode(reference, prompt)
    del reference
    base = scenario.load_base(under_test, quantization_config=scenario.int8_config(fp32_cpu_offload=True),
                              device_map=scenario.SEED_SPLIT_DEVICE_MAP)
    scenario.require(int8_layers(base), "the split base has no bnb Linear8bitLt modules")

    model = scenario.peft_load(under_test, base, "language", max_memory=scenario.memory_pressure(under_test, base), offload_dir=str(offload_dir))

    offloaded = [name for name, m in int8_layers(model).items() if m.weight.device.type == "meta"]
    scenario.require(offloaded, "PEFT's redispatch kept every 8-bit layer on the GPU")
    torch.testing.assert_close(scenario.logits(model, prompt), reference_logits, rtol=0, atol=1e-2)
    scenario.assert_decodes_alike(model, prompt, reference_decode, "the redispatched 8-bit model decodes otherwise", beside_logits=True)
