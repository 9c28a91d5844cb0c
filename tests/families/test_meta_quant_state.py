"""`Tensor.item() cannot be called on meta tensors` in `QuantState.as_dict(packed=True)`.

Upstream: no issue or fix found (bitsandbytes 0.50.2, accelerate 1.15.0, peft 0.21.2 unchanged); thread
https://discuss.huggingface.co/t/cpu-offloading-error-scenario/175522.

Precondition proven: the module is a `Linear4bit` with nested quant state; after accelerate's offload its
quant state is on meta; after PEFT's redispatch 4-bit modules really sit on the offload device.

Symptom: docs/family-notes.md#meta_quant_state.
"""

from accelerate.utils import set_module_tensor_to_device

from stackcheck.harness import scenario


def test_state_dict_after_accelerate_offload_to_meta(under_test):
    name, module = scenario.first_nested_linear4bit(scenario.load_base(under_test))

    set_module_tensor_to_device(module, "weight", "meta")  # AlignDevicesHook.init_hook's own call
    scenario.require("meta" in scenario.quant_state_devices(module), f"{name}'s quant state stayed off meta")

    state = module.state_dict()  # what attach_execution_device_hook asks of every unhooked module

    assert any(key.endswith("quant_state.bitsandbytes__nf4") for key in state)


def test_peft_load_on_split_4bit_base_under_memory_pressure(under_test, offload_dir, prompt):
    """The seed's call, with the main device's budget cut so PEFT's redispatch must offload 4-bit layers.
    On the GPU lane the base is the seed's own split load, and the reference is the all-GPU run."""
    unsplit = scenario.peft_load(under_test, scenario.load_base(under_test), "language")
    reference = scenario.decode(unsplit, prompt)
    base = scenario.split_base(under_test, offload_dir / "base")
    # On a GPU the budget is fitted to the model PEFT maps (the PeftModel): fitted to the base, it can leave the GPU
    # nothing, and the whole model goes to the CPU without an offload (scenario.memory_pressure).
    pressure = scenario.memory_pressure(under_test, base, mapped=unsplit if under_test.device.type == "cuda" else None)
    del unsplit

    model = scenario.peft_load(under_test, base, "language", max_memory=pressure, offload_dir=str(offload_dir / "peft"))
    scenario.require_offloaded_linear4bit(model, scenario.offload_device(under_test.device))

    scenario.assert_decodes_alike(model, prompt, reference, "the redispatched model decodes otherwise")


def test_offloaded_4bit_layer_forward(under_test, offload_dir, prompt):
    """A 4-bit layer dispatched to the offload device must come back with its quant state at forward."""
    reference = scenario.decode(scenario.load_base(under_test), prompt)

    base = scenario.load_base(under_test)
    model = scenario.dispatch_with_offload(under_test, base, offload_dir, scenario.last_layer_4bit_block(base))
    scenario.require_offloaded_linear4bit(model, scenario.offload_device(under_test.device))

    scenario.assert_decodes_alike(model, prompt, reference, "the offloaded model decodes otherwise")
