"""The quantized model is the checkpoint, rounded: its weights are the bf16 checkpoint's values on the quantization's
grid, and its outputs are as far from the bf16 model's as that rounding explains.

Precondition proven: the reference is the checkpoint; the model holds bitsandbytes layers.

The property, the judgement and what it found: docs/family-notes.md#load_quantized_outputs.
"""

import pytest
import torch

from stackcheck.harness import scenario, surfaces

GRID_TOLERANCE = 1.25
LOGIT_TOLERANCE = 1.25
# BitsAndBytesConfig's fields, from the axis model: LLM.int8 or 4-bit (its data type and double quant), the compute
# dtype (the model is loaded in it too) and the skip list; the 4-bit fields held at their defaults under LLM.int8.
BNB = surfaces.model_axes("bnb_config", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype",
                          "llm_int8_skip_modules")

# Reference logits on the prompt, by (architecture, device, dtype, the routing followed): the same for every
# quantization of a model that routes alike; with the reference's own routing (its scores and what it followed).
_REFERENCE_LOGITS: dict[tuple, tuple] = {}

# A routing decision the model took otherwise than the fp32 checkpoint must be one that rounding can swap: the two
# sets of experts' scores differ, in the checkpoint, by at most what the rounding moves them, each score by at most
# the largest change that the explanation (the weights' and inputs' rounding, and the dtype's) makes to that router's
# scores, two scores in opposite directions: 2 by mechanism. Measured (CPU, seed and latest): 0.59 to 1.35 where
# Mixtral, Qwen3-MoE and Qwen3-Next route 1 to 4 of 16 or 32 decisions otherwise in 4-bit (gaps 0.0002 to 0.021);
# 0.63 for the tiny Qwen3-Next's near-tie (layer 0, token 2: 0.000089) broken the other way in int8; routers fed
# their input negated 17 to 4171 (tests/harness/test_guards_load.py).
ROUTING_TOLERANCE = 2.0


def reference_logits(under_test, dtype, prompt, follow: dict[str, torch.Tensor]) -> tuple[torch.Tensor, scenario.routing]:
    """The reference in `dtype` on the prompt, routed as `follow` (the model's routing) wherever its own choice differs."""
    key = (under_test.arch, str(under_test.device), dtype, tuple((name, tuple(chosen.flatten().tolist())) for name, chosen in follow.items()))
    if key not in _REFERENCE_LOGITS:
        reference = scenario.reference_model(under_test, dtype)
        with scenario.routing(reference, follow) as routed:
            _REFERENCE_LOGITS[key] = (scenario.logits(reference, prompt), routed)
    return _REFERENCE_LOGITS[key]


def routing_measured(model_routing, checkpoint, explanations) -> None:
    """Print how the model routed against the fp32 `checkpoint`, and hold each decision it took otherwise to a tie that
    the rounding `explanations` measure (their routings, computed along the model's) can break."""
    decisions = sum(chosen.shape[0] for chosen in model_routing.chosen.values())
    followed = {name: rows.nonzero().flatten().tolist() for name, rows in checkpoint.followed.items() if rows.any()}
    if not followed:
        print(f"stackcheck measured: routing: the model routes all {decisions} router decisions as the fp32 checkpoint")
        return
    ratios, where = [], []
    for name, tokens in followed.items():
        moved = max((routed.scores[name] - checkpoint.scores[name]).abs().max().item() for routed in explanations)
        for token, gap in zip(tokens, checkpoint.gaps[name].tolist()):
            ratios.append(gap / moved if moved > 0 else float("inf"))
            where.append(f"{name} token {token}: scores gap {gap:.6f}, rounding moves them up to {moved:.6f}")
    print(f"stackcheck measured: routing: the model routes {len(where)} of {decisions} router decisions otherwise than the "
          f"fp32 checkpoint ({'; '.join(where)}); every reference follows the model's routing")
    scenario.assert_within("largest scores gap of a routing decision the model took otherwise than the fp32 checkpoint, in "
                           "units of the largest change the rounding makes to that router's scores", max(ratios), ROUTING_TOLERANCE)


@pytest.mark.axes(**BNB)
@pytest.mark.axes_invalid(*surfaces.model_invalid("bnb_config", BNB))
def test_quantized_model_reproduces_the_checkpoint(under_test, load_in_8bit, bnb_4bit_quant_type, bnb_4bit_use_double_quant, bnb_4bit_compute_dtype,
                                                   llm_int8_skip_modules, prompt):
    quantization = scenario.Quantization.of(load_in_8bit, bnb_4bit_quant_type, bnb_4bit_use_double_quant, bnb_4bit_compute_dtype)
    quant, dtype = quantization.kind, quantization.dtype
    model = scenario.shared_quantized(under_test, quantization, scenario.skip_list(under_test, llm_int8_skip_modules))
    quantized = scenario.quantized_modules(model)
    scenario.require(quantized, "the model holds no bitsandbytes layer")
    reference = scenario.reference_model(under_test)
    layers = dict(reference.named_modules())

    errors = {name: scenario.grid_error(module, layers[name].weight, quantization) for name, module in quantized.items()}
    off = [name for name, error in errors.items() if not error <= GRID_TOLERANCE]
    straddling = sum(scenario.rows_span_blocks(quantized[name], quantization) for name in off) / len(off) if off else 0.0
    scenario.assert_within(f"{len(off)} quantized layers hold weights off the {quant} grid of the checkpoint ({scenario.by_kind(off)}): "
                           "worst error in half code steps", max(errors.values()), GRID_TOLERANCE,
                           judged_by=("of them with rows that are not whole blocks", straddling))

    expected = dict(reference.named_parameters())
    held = {f"{name}.weight" for name in quantized}
    differ = [name for name, param in model.named_parameters() if name not in held and (
        name not in expected or not torch.equal(param.detach(), expected[name].to(device=param.device, dtype=param.dtype)))]
    assert not differ, f"{len(differ)} weights bitsandbytes leaves unquantized differ from the checkpoint: {scenario.by_kind(differ)}"

    # Every reference computes along the routing the model took (`scenario.routing`): a mixture of experts' choice
    # at a near-tie is the rounding's, not the checkpoint's.
    with scenario.routing(model) as model_routing:
        logits = scenario.logits(model, prompt)
    follow = model_routing.chosen
    bf16, checkpoint_routing = reference_logits(under_test, torch.float32, prompt, follow)
    explanations = []
    dtype_error = 0.0
    if dtype != torch.float32:
        in_dtype, dtype_routing = reference_logits(under_test, dtype, prompt, follow)
        dtype_error = scenario.relative_error(in_dtype, bf16)
        explanations.append(dtype_routing)
    with torch.no_grad():
        for name, module in quantized.items():
            layers[name].weight.copy_(scenario.dequantized_weight(module))
    with scenario.routing(reference, follow) as rounded:
        rounding_error = scenario.relative_error(scenario.logits(reference, prompt), bf16)
    explanations.append(rounded)
    error = scenario.relative_error(logits, bf16)
    if not quantization.four_bit:
        # LLM.int8 rounds each layer's input to 8 bits as well: the rounding its path makes, measured on the device.
        weights_error = rounding_error
        with scenario.llm_int8_inputs(reference, {name: module.state.threshold for name, module in quantized.items()}), \
                scenario.routing(reference, follow) as rounded:
            rounding_error = scenario.relative_error(scenario.logits(reference, prompt), bf16)
        explanations.append(rounded)
        print(f"stackcheck measured: relative logit errors against the bf16 checkpoint: the model {error:.4f}; the checkpoint "
              f"with the int8 weights {weights_error:.4f}, and their inputs rounded as LLM.int8 rounds them {rounding_error:.4f}; "
              f"the dtype {dtype_error:.4f}")
    if follow:
        routing_measured(model_routing, checkpoint_routing, explanations)
    scenario.assert_within("relative logit error against the bf16 checkpoint, in units of what the weights' rounding and the "
                           "dtype explain", error / (rounding_error + dtype_error),
                           LOGIT_TOLERANCE, judged_by=("relative logit error", error))
