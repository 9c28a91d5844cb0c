"""A cell keeps what its verdict was judged from, and is judged again from it under another ledger or range: a
ledger change re-runs nothing (the probe store), and the same evidence gives the live verdict."""

from stackcheck.child import evidence
from stackcheck.core.cell import Cell
from stackcheck.core.ledger import ERROR, FIXED, KNOWN_BUG, NEW_FAILURE, NOT_AFFECTED, PASS, Failure, Ledger

TEST = "test_offload_hook_moves_loaded_param_to_meta[cpu]"
SEED = {"transformers": "5.6.2", "peft": "0.19.1", "accelerate": "1.13.0", "bitsandbytes": "0.49.2"}
RAISED = Failure("TypeError", ("TypeError", "Exception", "BaseException"),
                 "Params4bit.__new__() got an unexpected keyword argument '_is_hf_initialized'",
                 ("tests/families/test_params4bit_kwargs.py:test_offload_hook_moves_loaded_param_to_meta",
                  "accelerate/utils/modeling.py:set_module_tensor_to_device"))


def cell(found: dict) -> Cell:
    return Cell("seed", "params4bit_kwargs", f"tests/families/test_params4bit_kwargs.py::{TEST}", "cpu", "pass", evidence=found)


def test_a_stored_failure_is_judged_again_as_the_live_plugin_judges_it():
    ledger = Ledger()
    live = ledger.judge("params4bit_kwargs", TEST, SEED, RAISED, None)
    again = evidence.rejudge(cell(evidence.of_test(RAISED)), ledger, SEED)
    assert live.verdict == KNOWN_BUG and (again.verdict, again.bug, again.signature) == (str(live.verdict), live.bug, live.signature)
    # The same evidence on a release outside the bug's range: the range decides, not the stored verdict.
    moved = evidence.rejudge(cell(evidence.of_test(RAISED)), ledger, dict(SEED, accelerate="1.14.0"))
    assert moved.verdict == str(NEW_FAILURE) and "outside its affected range" in moved.note


def test_a_pass_is_fixed_where_the_ledger_expects_the_bug_and_a_pass_outside_it():
    ledger = Ledger()
    assert evidence.rejudge(cell(evidence.of_test(None)), ledger, SEED).verdict == str(FIXED)
    assert evidence.rejudge(cell(evidence.of_test(None)), ledger, dict(SEED, accelerate="1.14.0")).verdict == str(PASS)


def test_a_broken_setup_is_a_known_bug_or_an_error_never_a_new_failure():
    ledger = Ledger()
    outer = Failure("FixtureError", ("FixtureError", "Exception"), "fixture cannot be built", ("tests/x.py:fixture",))
    known = evidence.rejudge(cell(evidence.of_setup(RAISED, outer)), ledger, SEED)
    assert known.verdict == str(KNOWN_BUG) and known.note.startswith("in the test's setup: FixtureError")
    other = evidence.rejudge(cell(evidence.of_setup(RAISED, outer)), ledger, dict(SEED, accelerate="1.14.0"))
    assert other.verdict == str(ERROR) and other.note == "setup broke" and other.signature.startswith("FixtureError")


def test_an_api_the_release_lacks_stays_not_affected_and_a_skip_keeps_its_verdict():
    absent = Failure("ApiAbsent", ("ApiAbsent", "ScenarioNotReached", "AssertionError"), "scenario not reached: no such API",
                     ("tests/x.py:test",), not_reached=True, api_absent=True)
    assert evidence.rejudge(cell(evidence.of_test(absent)), Ledger(), SEED).verdict == str(NOT_AFFECTED)
    skipped = Cell("seed", "params4bit_kwargs", "t::x[gpu]", "gpu", "skipped", note="no GPU")
    assert evidence.rejudge(skipped, Ledger(), SEED) is skipped


def test_evidence_survives_the_cell_round_trip():
    found = cell(evidence.of_test(RAISED))
    assert Cell.from_dict(found.to_dict()) == found and found.to_dict()["evidence"]["test"]["message"] == RAISED.message


def test_a_scenario_a_known_bug_keeps_from_being_reached_reads_that_bug_inside_its_range_alone():
    test = "test_peft_load_on_split_4bit_base_under_memory_pressure[cpu-qwen3moe]"
    stopped = Failure("ScenarioNotReached", ("ScenarioNotReached", "Exception", "BaseException"),
                      "scenario not reached: the dispatch kept every Linear4bit on the main device ({'a': 'cpu'})",
                      ("tests/families/test_meta_quant_state.py:test_peft_load_on_split_4bit_base_under_memory_pressure",
                       "stackcheck/harness/place.py:require_offloaded_linear4bit", "stackcheck/harness/proof.py:require"), not_reached=True)
    ledger = Ledger()
    inside = ledger.judge("meta_quant_state", test, dict(SEED, peft="0.18.1"), stopped, "qwen3_moe")
    assert (inside.verdict, inside.bug) == (KNOWN_BUG, "peft_0_18_redispatch_keeps_moe_4bit_on_main")
    assert ledger.judge("meta_quant_state", test, dict(SEED, peft="0.19.0"), stopped, "qwen3_moe").verdict == ERROR
    assert ledger.judge("meta_quant_state", test, dict(SEED, peft="0.18.1"), stopped, "llama").verdict == ERROR


def test_a_distributed_jobs_evidence_is_plain_data_and_judged_again_the_same():
    from stackcheck.distributed.outcome import RankOutcome, RankState, judge_ranks

    outcomes = [RankOutcome(0, RankState.FAILED, RAISED), RankOutcome(1, RankState.STOPPED)]
    found = evidence.of_ranks(outcomes)
    assert found["ranks"][0]["state"] == "failed" and isinstance(found["ranks"][0]["failure"]["exception_mro"], list)
    ledger = Ledger()
    live, _ = judge_ranks(outcomes, lambda failure: ledger.judge("params4bit_kwargs", TEST, SEED, failure, None))
    again = evidence.rejudge(cell(found), ledger, SEED)
    assert (again.verdict, again.bug) == (str(live.verdict), live.bug) == (str(KNOWN_BUG), "params4bit_kwargs")
