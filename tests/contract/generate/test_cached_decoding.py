"""Cached decoding equals uncached decoding: `generate`'s logits, computed step by step from its cache, equal one
forward of the same sequence without a cache (what uncached decoding computes at each step, on one sequence so
that a near-tie cannot fork the two), on every architecture, with the dynamic and the static cache
(`cache_implementation="static"`), on the bf16 and the 4-bit base, alone and through a PeftModel.

Precondition proven: `generate` returned the cache the cell asks for (a static one for `static`); the base is NF4
with nested quant state for the 4-bit cells; the adapter changes the outputs for the PeftModel cells.

The journey, upstream and tolerances: docs/family-notes.md#cached_decoding.
"""

import pytest

from stackcheck.harness import scenario
from stackcheck.harness.generate import decoded

CACHE_TOLERANCE = 0.01
NEW_TOKENS = 6  # prompt (8) + new tokens stays under the 16 query tokens where torch's CPU attention switches kernels
CACHE = {"dynamic": None, "static": "static"}
QUANTIZATION = {"bf16": False, "nf4": True}
ADAPTER = {"none": False, "lora": True}


def model_under_test(under_test, quantized: bool, adapter: bool):
    """The base (4-bit NF4 with double quant, or bf16), alone or through a PeftModel with the language adapter."""
    base = scenario.load_base(under_test, quantized=quantized)
    if quantized:
        scenario.first_nested_linear4bit(base)
    if not adapter:
        return base
    model = scenario.peft_load(under_test, base, "language")
    with model.disable_adapter():
        without = scenario.logits(model, scenario.prompt(under_test.device))
    scenario.require_adapter_changes(scenario.logits(model, scenario.prompt(under_test.device)), without, "the PeftModel")
    return model


def require_cache(cache, implementation) -> None:
    """The cache generate decoded from really is the one the cell asks for."""
    scenario.require(cache is not None, "generate returned no cache: it did not decode from one")
    if implementation == "static":
        scenario.require("Static" in type(cache).__name__, f"generate decoded from a {type(cache).__name__}, not a static cache")


def assert_cached_decoding_matches(error: float, judged_by, quantized: bool, tolerance: float = CACHE_TOLERANCE) -> None:
    scenario.assert_within(f"generate's cached logits diverge from a full forward ({scenario.base_kind(quantized)}): relative error", error,
                           tolerance, judged_by)


@pytest.mark.axes(cache=CACHE, quantization=QUANTIZATION, adapter=ADAPTER)
def test_cached_decoding_matches_uncached(under_test, cache, quantization, adapter, prompt):
    model = model_under_test(under_test, quantization, adapter)
    kwargs = {"cache_implementation": cache} if cache else {}

    stepwise, full, used, sequence = decoded(model, prompt, NEW_TOKENS, **kwargs)

    require_cache(used, cache)
    error = scenario.relative_error(full, stepwise)
    tolerance = CACHE_TOLERANCE
    if error > CACHE_TOLERANCE and not quantization:
        tolerance = bf16_rounding_bound(under_test, adapter, prompt, sequence, full, kwargs)
    assert_cached_decoding_matches(error, scenario.share_past_the_first(stepwise, full), quantization, tolerance)


def bf16_rounding_bound(under_test, adapter: bool, prompt, sequence, full, kwargs) -> float:
    """`scenario.bf16_rounding_bound` with a fresh fp32 model of the cell (generate keeps its static cache)."""
    fp32 = model_under_test(under_test, False, adapter).float()
    return scenario.bf16_rounding_bound(fp32, prompt, sequence, full, NEW_TOKENS, CACHE_TOLERANCE, **kwargs)
