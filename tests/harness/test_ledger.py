"""Verdicts from the ledger, driven by real exceptions raised and caught here."""

import pytest

from stackcheck.ledger import ERROR, FIXED, KNOWN_BUG, NEW_FAILURE, PASS, Failure, Ledger

SEED = {"transformers": "5.6.2", "peft": "0.19.1", "accelerate": "1.13.0", "bitsandbytes": "0.49.2"}
LATEST = {"transformers": "5.23.0", "peft": "0.21.2", "accelerate": "1.15.0", "bitsandbytes": "0.50.2"}


def failure(exc: BaseException, frames: tuple[str, ...]) -> Failure:
    caught = Failure.from_exception(exc)
    return Failure(caught.exception_type, caught.exception_mro, caught.message, frames)


KV_FRAME = ("transformers/models/gemma4/modeling_gemma4.py:forward",)
TEST = "test_generate_after_peft_redispatch_matches_undispatched[cpu-bf16]"


@pytest.fixture(scope="module")
def ledger():
    return Ledger()


def test_every_family_has_bugs_with_links_and_signatures(ledger):
    assert set(ledger.families) >= {
        "meta_quant_state", "params4bit_kwargs", "shared_kv_redispatch", "clippable_linear_targeting", "merge_parity"
    }
    for family in ledger.families.values():
        for bug, _patterns in family.bugs:
            assert bug.links and bug.signature.exception and bug.signature.frame


def test_known_signature_is_known_bug(ledger):
    verdict = ledger.judge("shared_kv_redispatch", TEST, SEED, failure(KeyError(22), KV_FRAME))
    assert (verdict.verdict, verdict.bug) == (KNOWN_BUG, "shared_kv_redispatch")


def test_same_family_new_key_is_a_new_failure_not_the_known_one(ledger):
    verdict = ledger.judge("shared_kv_redispatch", TEST, SEED, failure(KeyError("sliding_attention"), KV_FRAME))
    assert verdict.verdict == NEW_FAILURE
    assert verdict.bug == "shared_kv_redispatch" and "new signature" in verdict.note


def test_unknown_exception_is_a_new_failure(ledger):
    verdict = ledger.judge("shared_kv_redispatch", TEST, SEED, failure(IndexError("x"), KV_FRAME))
    assert (verdict.verdict, verdict.bug) == (NEW_FAILURE, None)


def test_pass_where_the_ledger_says_affected_is_fixed(ledger):
    assert ledger.judge("shared_kv_redispatch", TEST, SEED, None).verdict == FIXED
    assert ledger.judge("shared_kv_redispatch", TEST, LATEST, None).verdict == PASS


def test_blocking_bug_applies_only_to_the_tests_the_ledger_names(ledger):
    nf4 = TEST.replace("bf16", "nf4")
    # bf16 never touches bitsandbytes, so on latest it passes; the nf4 variant is expected to hit meta_quant_state
    assert ledger.judge("shared_kv_redispatch", TEST, LATEST, None).verdict == PASS
    assert ledger.judge("shared_kv_redispatch", nf4, LATEST, None).verdict == FIXED


def test_params4bit_fix_in_either_library_counts(ledger):
    test = "test_offload_hook_moves_loaded_param_to_meta"
    assert ledger.judge("params4bit_kwargs", test, SEED, None).verdict == FIXED
    assert ledger.judge("params4bit_kwargs", test, dict(SEED, accelerate="1.14.0"), None).verdict == PASS
    assert ledger.judge("params4bit_kwargs", test, dict(SEED, bitsandbytes="0.50.0"), None).verdict == PASS


def test_scenario_not_reached_is_never_a_pass():
    from stackcheck.scenario import ScenarioNotReached

    assert ERROR == "error"
    assert str(ScenarioNotReached("no hooks")) == "scenario not reached: no hooks"
