"""DOCSTRING"""

import pytest

from stackcheck import scenario

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


def assert_cached_decoding_matches(error: float, judged_by) -> None:
    scenario.assert_within("generate's cached logits diverge from a full forward: relative error", error, CACHE_TOLERANCE, judged_by)


@pytest.mark.axes(cache=CACHE, quantization=QUANTIZATION, adapter=ADAPTER)
def test_cached_decoding_matches_uncached(under_test, cache, quantization, adapter, prompt):
    model = model_under_test(under_test, quantization, adapter)
    kwargs = {"cache_implementation": cache} if cache else {}

    stepwise, full, used = scenario.cached_and_full_logits(model, prompt, NEW_TOKENS, **kwargs)

    require_cache(used, cache)
    assert_cached_decoding_matches(scenario.relative_error(full, stepwise), scenario.share_past_the_first(stepwise, full))
