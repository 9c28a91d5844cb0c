"""transformers' own `device_map="auto"` with `max_memory`: a quantized model that fits the budget is not spilled, and
a placement under a budget keeps to it.

The property, upstream, axes and tolerances: docs/family-notes.md#load_auto_device_map.
"""

import gc

import pytest
import torch

from stackcheck.harness import scenario, surfaces

# From the axis model: LLM.int8 or 4-bit (the QLoRA recipe's NF4 with double quant), and max_memory as a multiple of
# the quantized footprint on the main device (scenario.AUTO_BUDGETS: 1.5 fits, 0.9 is tight).
AXES = {**surfaces.model_axes("bnb_config", "load_in_8bit"), **surfaces.model_axes("from_pretrained", "max_memory")}
QUANTIZATIONS = {False: scenario.Quantization("nf4", True, torch.bfloat16), True: scenario.Quantization("int8", False, torch.bfloat16)}
LOGIT_TOLERANCE = 1e-3


@pytest.mark.axes(**AXES)
@pytest.mark.axes_invalid(*surfaces.model_invalid("bnb_config", AXES), *surfaces.model_invalid("from_pretrained", AXES))
def test_auto_device_map_honours_max_memory(under_test, load_in_8bit, max_memory, offload_dir, prompt):
    quant, budget = QUANTIZATIONS[load_in_8bit], scenario.AUTO_BUDGETS[max_memory]
    whole = scenario.shared_quantized(under_test, quant)
    footprint = scenario.model_bytes(whole)
    allowed = int(footprint * budget)
    main = scenario.device_key(under_test.device)
    model, device_map = scenario.auto_placed(under_test, quant, allowed, offload_dir)
    elsewhere = {name: device for name, device in device_map.items() if device != main}

    if budget >= 1:  # the model fits
        bf16 = scenario.bf16_bytes(under_test)
        print(f"stackcheck measured: footprint {footprint} B, budget {allowed} B, bf16 size {bf16} B "
              f"({'a map sized in bf16 would spill it' if allowed < bf16 else 'the budget holds it in bf16 too'})")
        on_meta = [name for name, p in model.named_parameters() if p.device.type == "meta"]
        spilled = [f"{name or 'the whole model'} on {device}" for name, device in elsewhere.items()] or [scenario.by_kind(on_meta) + " on meta"]
        assert not elsewhere and not on_meta, (f"device_map='auto' spills a model that fits max_memory ({budget}x its footprint) "
                                               f"off {main}: {', '.join(spilled[:4])}")
        return

    placed = scenario.bytes_on(model, device_map, main)
    scenario.assert_within(f"device_map='auto' places more on {main} than max_memory allows: bytes placed / budget", placed / allowed, 1.0)
    scenario.require(len(elsewhere) < len(device_map), f"transformers placed nothing on {main} ({device_map})")
    placed_logits = scenario.logits(model, prompt)
    reference = same_weights(under_test, quant, same_layers_quantized(under_test, quant, model, whole), model)
    error = scenario.relative_error(placed_logits, scenario.logits(reference, prompt))
    scenario.assert_within("the placed model's logits against the model on one device: relative error", error, LOGIT_TOLERANCE)

    # The same call again once the first model is released, as a loop that reloads it does: the same map.
    del model
    gc.collect()
    if under_test.device.type == "cuda":
        unused = torch.cuda.memory_reserved(under_test.device) - torch.cuda.memory_allocated(under_test.device)
        scenario.require(unused > 0, "no reserved-but-unused CUDA memory is left by the first placement")
        print(f"stackcheck measured: {unused} B reserved but unused on {main} before the second call")
    _, again = scenario.auto_placed(under_test, quant, allowed, offload_dir / "again")
    moved = sorted(name for name in set(device_map) | set(again) if device_map.get(name) != again.get(name))
    assert not moved, ("device_map='auto' with the same model and max_memory gives another map on the second call: "
                       + ", ".join(f"{name or 'the whole model'} {device_map.get(name)} -> {again.get(name)}" for name in moved[:4]))

def same_layers_quantized(under_test, quant, placed, whole):
    """The model on one device with the layers the placed model holds unquantized left unquantized too: with
    `llm_int8_enable_fp32_cpu_offload`, transformers' bitsandbytes quantizers add every module a device map given as
    a dict sends to the CPU or disk to `modules_to_not_convert` (by design: those weights stay in the model's dtype).
    With `device_map="auto"` they do not: transformers 5.23.0 prepares the model for quantization (`preprocess_model`)
    before it infers the map, so the quantizer sees the string "auto" and every layer is quantized wherever the map
    puts it (CPU lane, latest, tiny multimodal Gemma 3 under the tight budget: 48 of 48 layers, as on one device).
    Then this is `whole`, and `same_weights` is what tells the rounding from the placement."""
    import bitsandbytes as bnb

    quantized = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    unquantized = sorted(name for name, m in placed.named_modules() if isinstance(m, torch.nn.Linear) and not isinstance(m, quantized))
    if set(scenario.quantized_modules(placed)) == set(scenario.quantized_modules(whole)):
        return whole
    reference = scenario.shared_quantized(under_test, quant, skip_modules=unquantized)
    scenario.require(set(scenario.quantized_modules(reference)) == set(scenario.quantized_modules(placed)),
                     "the reference on one device does not quantize the placed model's layers")
    return reference


CODE_STEPS, SCALE_TOLERANCE = 1, 1e-6


def same_weights(under_test, quant, reference, placed):
    """`reference` (the model on one device), or, where the placed model's offloaded LLM.int8 layers hold other codes
    than it, a fresh load of it holding the placed model's codes and scales in those layers: the same weights through
    the same kernels, so that what is left is the placement's.

    Why the codes can differ: transformers quantizes each weight where the map puts it (its Bnb8bitQuantize converts
    on the weight's device). Mapped to the CPU, a weight is quantized by bitsandbytes' torch implementation on the
    CPU; on the main device by its CUDA kernel (`kInt8VectorQuant`, a fast approximate division). Both round
    127 * x / absmax(row) to the nearest code, and may part where that lands on a half step, which bf16 weights hit
    often. Such codes are the checkpoint's rounding too (within half a step, as load_quantized_outputs judges), so
    they are held to one step apart and equal scales (the row's absmax, exact on both); a layer mis-restored by an
    offload hook (scales lost or another row's, stale codes) is off by far more. On one H100 (2026-11-27, latest) both
    tight int8 GPU cells pass (seed's are known_bug `int8params_kwargs`); a tight int8 cell prints what it found."""
    states = scenario.offloaded_int8_states(placed)
    if not states:
        import bitsandbytes as bnb

        waiting = [name for name, m in placed.named_modules() if isinstance(m, bnb.nn.Linear8bitLt) and m.weight.device.type == "meta"]
        if waiting:
            print(f"stackcheck measured: {len(waiting)} offloaded LLM.int8 layers, none behind its own offload hook ({scenario.by_kind(waiting)})")
        return reference
    ours = {name: scenario.int8_state(module) for name, module in scenario.quantized_modules(reference).items() if name in states}
    scenario.require(set(ours) == set(states), "the model on one device has no LLM.int8 layer for some offloaded ones")
    steps = max((codes.int() - ours[name][0].cpu().int()).abs().max().item() for name, (codes, *_rest) in states.items())
    differing = sum((codes != ours[name][0].cpu()).sum().item() for name, (codes, *_rest) in states.items())
    total = sum(codes.numel() for codes, *_rest in states.values())
    scale_error = max(((scales - ours[name][1].cpu().float()).abs() / ours[name][1].cpu().float().clamp(min=1e-12)).max().item()
                      for name, (_codes, scales, _stored) in states.items())
    stored = sorted({str(stored).removeprefix("torch.") for *_rest, stored in states.values()})
    print(f"stackcheck measured: {len(states)} offloaded LLM.int8 layers (weights map holds {', '.join(stored)}): {differing} of {total} "
          f"codes differ from the model on one device, by at most {steps} step(s); scales' largest relative difference {scale_error:.2e}")
    scenario.assert_within("the offloaded LLM.int8 layers' codes against the model on one device: largest difference in code steps", steps, CODE_STEPS)
    scenario.assert_within("the offloaded LLM.int8 layers' scales against the model on one device: largest relative difference", scale_error, SCALE_TOLERANCE)
    if not differing:
        return reference
    skip = sorted(name for name, m in reference.named_modules() if isinstance(m, torch.nn.Linear) and name not in scenario.quantized_modules(reference))
    fresh = scenario.load_quantized(under_test, quant, skip_modules=skip if reference is not scenario.shared_quantized(under_test, quant) else None)
    scenario.set_int8_states(fresh, states)
    return fresh
