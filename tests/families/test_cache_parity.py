"""Gemma 4's logits must not depend on the KV cache: `use_cache=False` against `use_cache=True`, and
`generate`'s step-by-step logits against one full forward.

Upstream: transformers#45242, fixed in 5.5.2 by PR #45312 ("Dissociate kv states sharing from the Cache");
5.5.0 is the first release with Gemma 4. bitsandbytes PR #1949 (fused 4-bit kernels, in 0.50).

Symptom, preconditions, tolerances and the judgement: docs/family-notes.md#cache_parity.
"""

import torch

from stackcheck.harness import scenario

CACHE_TOLERANCE = 0.01
NEW_TOKENS = 6  # prompt (8) + new tokens stays under the 16 query tokens where torch's CPU attention switches kernels


def adapted_model(under_test, quantized: bool):
    """The seed's inference setup: the base (4-bit NF4 with double quant, or the bf16 control) and the adapter."""
    base = scenario.load_base(under_test, quantized=quantized)
    if quantized:
        scenario.first_nested_linear4bit(base)
    if "kv_sharing" in under_test.structures:  # the layers transformers#45242 is in
        scenario.shared_kv_layers(base)
    return scenario.peft_load(under_test, base, "language")


def require_cache(output) -> None:
    scenario.require(output.past_key_values is not None, "the forward with use_cache=True returned no cache")


def assert_cache_parity(what: str, error: float, judged_by: tuple[str, float] | None = None, tolerance: float = CACHE_TOLERANCE) -> None:
    scenario.assert_within(f"{what}: relative error", error, tolerance, judged_by)


@scenario.QUANTIZATION
def test_forward_without_cache_matches_cached_forward(under_test, quantized, prompt):
    model = adapted_model(under_test, quantized)

    with torch.no_grad():
        cached = model(input_ids=prompt, use_cache=True)
        uncached = model(input_ids=prompt, use_cache=False).logits.float().cpu()

    require_cache(cached)
    assert_cache_parity("logits without a cache diverge from the cached forward",
                        scenario.relative_error(uncached, cached.logits.float().cpu()),
                        judged_by=scenario.share_past_the_first(uncached[0], cached.logits[0].float().cpu()))


@scenario.QUANTIZATION
@torch.no_grad()
def test_generate_cached_logits_match_full_forward(under_test, quantized, prompt):
    """`generate`'s logits, computed token by token from its cache, against one forward of the same sequence
    without a cache. Compared on one sequence, so a near-tie cannot flip it. A bf16 cell past CACHE_TOLERANCE is
    judged by bf16's rounding on its machine (`scenario.bf16_rounding_bound`, as cached_decoding judges its own)."""
    model = adapted_model(under_test, quantized)
    stepwise, full, _cache, sequence = scenario.decoded(model, prompt, NEW_TOKENS)
    error = scenario.relative_error(full, stepwise)
    tolerance = CACHE_TOLERANCE
    if error > CACHE_TOLERANCE and not quantized:
        tolerance = scenario.bf16_rounding_bound(adapted_model(under_test, False).float(), prompt, sequence, full, NEW_TOKENS, CACHE_TOLERANCE)
    assert_cache_parity(f"generate's cached logits diverge from a full forward ({scenario.base_kind(quantized)})", error,
                        judged_by=scenario.share_past_the_first(stepwise, full), tolerance=tolerance)
