"""A mixture of experts loaded with `load_in_4bit` keeps its experts in bf16, and nothing warns.

Upstream: bitsandbytes#1849 (open), bitsandbytes PR #1965 and transformers PR #39859 (both unmerged).

Precondition proven: the tiny model really has fused experts (3-D parameters, one matrix per expert) and the load
really quantized its other linear layers (bnb Linear4bit with a nested quant state).

Symptom: docs/family-notes.md#quantized_experts.
"""

import pytest

from stackcheck.harness import scenario
from stackcheck.models import footprint

pytestmark = pytest.mark.needs("experts")

BYTES_TOLERANCE = 0.02


def quantized_moe(under_test):
    """The MoE base loaded in 4-bit as the seed user loads it, proven to have fused experts and 4-bit layers."""
    model = scenario.load_base(under_test, quantized=True)
    scenario.first_nested_linear4bit(model)
    experts = footprint.fused_experts(model)
    scenario.require(experts, f"the tiny {under_test.arch.name} has no fused 3-D expert parameters (one matrix per expert)")
    return model, experts


def skip_modules(model) -> list[str]:
    """The user's llm_int8_skip_modules and transformers' defaults, as the quantizer applied them."""
    return list(model.hf_quantizer.modules_to_not_convert or [])


def stored_data_bytes(param) -> int:
    """The bytes a weight holds that the arithmetic counts: its storage, and a 4-bit weight's absmax."""
    state = getattr(param, "quant_state", None)
    if state is None:
        return param.nbytes
    return param.nbytes + state.absmax.nbytes + (state.state2.absmax.nbytes if state.nested else 0)


def arithmetic_bytes(name: str, param, meant_for_4bit: dict) -> int:
    """What the weight should take: NF4 where the config asks for 4-bit, its dtype's size elsewhere."""
    state = getattr(param, "quant_state", None)
    if state is not None:
        return footprint.nf4_bytes(state.shape.numel(), state.blocksize, state.nested)
    if name in meant_for_4bit:
        return footprint.nf4_bytes(param.numel())
    return param.nbytes


def test_every_weight_meant_for_4bit_is_4bit(under_test):
    model, experts = quantized_moe(under_test)
    unquantized = [name for name, p in footprint.meant_for_4bit(model, skip_modules(model)).items() if not hasattr(p, "quant_state")]
    others = [name for name in unquantized if name not in experts]
    assert not others, f"{len(others)} weights meant for 4-bit are not 4-bit: {', '.join(others[:4])}"
    assert not unquantized, f"{len(unquantized)} fused expert parameters stay in {next(iter(experts.values())).dtype} under load_in_4bit: {', '.join(unquantized[:2])}"


def test_weight_bytes_match_the_nf4_arithmetic(under_test):
    model, experts = quantized_moe(under_test)
    meant = footprint.meant_for_4bit(model, skip_modules(model))
    stored = sum(stored_data_bytes(p) for p in model.parameters())
    expected = sum(arithmetic_bytes(name, p, meant) for name, p in model.named_parameters())
    excess_in_experts = sum(stored_data_bytes(p) - arithmetic_bytes(name, p, meant) for name, p in experts.items())
    excess = stored - expected
    scenario.assert_within("the 4-bit model's weights take more than the NF4 arithmetic: relative excess", excess / expected,
                           BYTES_TOLERANCE, judged_by=("of the excess in fused experts left in 16 bits:", excess_in_experts / excess if excess else 0.0))
