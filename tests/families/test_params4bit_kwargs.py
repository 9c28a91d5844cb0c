"""`Params4bit.__new__() got an unexpected keyword argument '_is_hf_initialized'`.

Upstream: accelerate#3976 (fixed in 1.14.0), bitsandbytes#1900 (fixed in 0.50.0), transformers#43872
(the Int8Params twin).

Precondition proven: the module is a bnb `Linear4bit` loaded by transformers, with nested (double-quant)
quant state, and its `Params4bit` carries `_is_hf_initialized`.

Symptom: docs/family-notes.md#params4bit_kwargs.
"""

import bitsandbytes as bnb
from accelerate.utils import set_module_tensor_to_device

from stackcheck.harness import scenario


def loaded_param4bit_module(under_test):
    name, module = scenario.first_nested_linear4bit(scenario.load_base(under_test))
    scenario.require_hf_initialized(name, module.weight)
    return module


def test_offload_hook_moves_loaded_param_to_meta(under_test):
    scenario.assert_offload_hook_moves_weight_to_meta(loaded_param4bit_module(under_test))


def test_offload_hook_restores_weight_from_weights_map(under_test):
    """What `AlignDevicesHook.pre_forward` does for an offloaded layer: set the stored weight back."""
    module = loaded_param4bit_module(under_test)
    stored = module.weight.data.clone()

    set_module_tensor_to_device(module, "weight", under_test.device, value=stored)

    assert isinstance(module.weight, bnb.nn.Params4bit)
    assert module.weight.quant_state is not None
    assert module.weight.device.type == under_test.device.type
