"""The gate's comparison: a pure function over two results dicts, so each rule is shown on small data
here; test_real_sets.py runs the gate itself on real sets."""

import pytest

from stackcheck import cli
from stackcheck.commands import gate
from stackcheck.core.cell import Cell

SEED = {"python": "3.11.7", "torch": "2.13.0", "transformers": "5.6.2", "peft": "0.19.1", "accelerate": "1.13.0", "bitsandbytes": "0.49.2"}


def run(name, versions, *cells):
    """A one-set results dict; each cell is (family, verdict, bug)."""
    return {
        "sets": {name: versions},
        "cells": [Cell(name, family, f"tests/families/test_{family}.py::t{i}", "cpu", verdict, bug=bug,
                       signature=f"{verdict} sig" if verdict != "pass" else None, seconds=1.0)
                  for i, (family, verdict, bug) in enumerate(cells)],
    }


def statuses(findings):
    return {f.subject: f.status for f in findings}


def test_a_family_that_only_gets_fixed_is_an_improvement():
    baseline = run("seed", SEED, ("params4bit_kwargs", "known_bug", "params4bit_kwargs"), ("merge_parity", "known_bug", "m"))
    candidate = run("seed+a", dict(SEED, accelerate="1.14.0"), ("params4bit_kwargs", "pass", None), ("merge_parity", "known_bug", "m"))
    findings = gate.compare(baseline, candidate)
    assert statuses(findings) == {"params4bit_kwargs": gate.IMPROVEMENT, "merge_parity": gate.SAME}
    summary = gate.render_summary(baseline, candidate, findings)
    assert "## stackcheck gate: PASS" in summary and "fixed families: params4bit_kwargs" in summary
    assert "accelerate 1.13.0 → 1.14.0" in summary


@pytest.mark.parametrize(
    "before, after",
    [
        (("pass", None), ("known_bug", "sdpa_audio_tower")),  # passed on the baseline, no longer passes
        (("known_bug", "x"), ("new_failure", None)),  # a new failure, whatever the baseline had
        (("new_failure", None), ("new_failure", None)),
        (("pass", None), ("error", None)),  # the scenario was not reached: nothing is known
    ],
)
def test_regressions(before, after):
    findings = gate.compare(run("b", SEED, ("sdpa_multimodal_load", *before)), run("c", SEED, ("sdpa_multimodal_load", *after)))
    assert statuses(findings) == {"sdpa_multimodal_load": gate.REGRESSION}
    assert "## stackcheck gate: FAIL" in gate.render_summary(run("b", SEED), run("c", SEED), findings)


def test_a_family_the_candidate_did_not_run_is_a_regression():
    findings = gate.compare(run("b", SEED, ("merge_parity", "pass", None)), run("c", SEED))
    assert [(f.subject, f.candidate, f.status) for f in findings] == [("merge_parity", "not run", gate.REGRESSION)]


def test_another_known_bug_in_a_failing_family_is_a_change_not_a_regression():
    findings = gate.compare(run("b", SEED, ("meta_quant_state", "known_bug", "params4bit_kwargs")),
                            run("c", SEED, ("meta_quant_state", "known_bug", "meta_quant_state")))
    assert statuses(findings) == {"meta_quant_state": gate.CHANGE}


def test_a_pass_the_ledger_did_not_expect_still_counts_as_passing():
    findings = gate.compare(run("b", SEED, ("params4bit_kwargs", "known_bug", "p")), run("c", SEED, ("params4bit_kwargs", "fixed", "p")))
    assert statuses(findings) == {"params4bit_kwargs": gate.IMPROVEMENT}


def test_a_candidate_equal_to_the_baseline_is_a_usage_error(capsys):
    assert cli.main(["gate", "--set", "seed"]) == 2
    assert capsys.readouterr().err.strip() == (
        "stackcheck: the candidate is the baseline: bump a library with --with PIN or name --candidate SET"
    )


def test_cells_not_run_are_no_error_for_the_gate(tmp_path):
    """A candidate run stopped before some cells: the gate reads its verdicts; the cells it did not reach count as
    nothing (a family none of whose cells ran is "not run", as before), never as `error` (issue 47)."""
    from stackcheck.core import results

    path = tmp_path / "matrix.json"
    results.record_set(path, "c", SEED)
    results.record_cells(path, [Cell("c", "merge_parity", "tests/families/test_merge_parity.py::t0", "cpu", "pass")])
    results.begin_run(path, "c", SEED, None, [Cell.not_run("c", family, f"tests/families/test_{family}.py::t1[cpu]", [])
                                              for family in ("merge_parity", "qlora_step")])
    candidate = gate.one_set(results.load(path), "c")
    findings = gate.compare(run("b", SEED, ("merge_parity", "pass", None), ("qlora_step", "pass", None)), candidate)
    assert [(f.subject, f.candidate, f.status) for f in findings] == [
        ("merge_parity", "pass", gate.SAME), ("qlora_step", "not run", gate.REGRESSION)]
