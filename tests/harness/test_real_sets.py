"""gate, bisect and merge end to end on real sets: real environments (libraries from the package index,
which CI reaches) running real family tests on the CPU lane. Each run keeps to one family so CI stays
fast; the environments are reused across runs."""

import json

import pytest

from stackcheck import REPO_ROOT, cli
from stackcheck.runner import envs
from stackcheck.core import results

pytestmark = pytest.mark.slow
# First transformers release where the seed's attn_implementation="sdpa" no longer loads, as bisected
# with the rest of `seed` pinned (5.19.0 loads).
FIRST_SDPA_BREAK = "5.20.0"
ONE_TEST = "tests/families/test_params4bit_kwargs.py::test_offload_hook_moves_loaded_param_to_meta"


@pytest.fixture(autouse=True)
def harness_envs(monkeypatch):
    # Apart from .stackcheck/envs, so nothing here can rebuild the environment running these tests.
    monkeypatch.setattr(envs, "ENVS_DIR", REPO_ROOT / ".stackcheck" / "harness-envs")


def test_gate_passes_a_bump_that_only_fixes_a_family(tmp_path, monkeypatch):
    step_summary = tmp_path / "step-summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step_summary))
    argv = ["gate", "--set", "seed", "--with", "accelerate==1.14.0", "--families", "params4bit_kwargs", "--arch", "gemma4"]
    assert cli.main([*argv, "--output", str(tmp_path / "gate")]) == 0
    summary = step_summary.read_text()
    assert "## stackcheck gate: PASS" in summary and "fixed families: params4bit_kwargs [gemma4]" in summary
    assert "accelerate 1.13.0 → 1.14.0" in summary


def test_gate_fails_a_bump_that_breaks_a_family(tmp_path):
    argv = ["gate", "--set", "seed", "--with", f"transformers=={FIRST_SDPA_BREAK}", "--families", "sdpa_multimodal_load", "--arch", "gemma4"]
    assert cli.main([*argv, "--output", str(tmp_path / "gate")]) == 1
    summary = (tmp_path / "gate" / "summary.md").read_text()
    assert "## stackcheck gate: FAIL" in summary and "regressions: families/sdpa_multimodal_load [gemma4]" in summary
    assert "| families | sdpa_multimodal_load [gemma4] | pass | known_bug (sdpa_audio_tower) | **regression** |" in summary


def test_bisect_finds_the_accelerate_release_that_fixes_params4bit_kwargs(tmp_path):
    output = tmp_path / "bisect.json"
    argv = ["bisect", "accelerate", "--good", "1.15.0", "--bad", "1.13.0", "--test", ONE_TEST,
            "--candidates", "1.13.0,1.14.0,1.15.0", "--output", str(output), "--store", str(tmp_path / "probes.json")]
    assert cli.main(argv) == 0
    record = json.loads(output.read_text())
    assert (record["status"], record["direction"], record["answer"]["first"]) == ("answered", "first fixed in", "1.14.0")
    assert [(p["candidate"], p["side"]) for p in record["probes"]] == [
        ("1.15.0", "good"), ("1.13.0", "bad"), ("1.15.0", "good"), ("1.14.0", "good"), ("1.14.0", "good")
    ]
    assert "_is_hf_initialized" in record["probes"][1]["cells"][0]["signature"]


def without_seconds(data: dict) -> dict:
    """Only the measured seconds, and the id of the run that recorded a cell, differ between two runs of the same cells."""
    return dict(data, cells=[c.replace(seconds=0.0, run=None) for c in data["cells"]])


def test_merging_two_separately_run_sets_gives_the_report_of_running_both_together(tmp_path):
    # --families: each run collects that family's module only, not every family's (9 s of collection a run).
    one_test = ["--families", "params4bit_kwargs", "--", "-p", "no:cacheprovider", "-m", "params4bit_kwargs and not gpu",
                "-k", ONE_TEST.split("::")[1]]
    together = tmp_path / "together" / "matrix.json"
    assert cli.main(["matrix", "--sets", "seed,latest", "--results", str(together), "--arch", "gemma4", *one_test]) == 0
    jobs = [tmp_path / name / "matrix.json" for name in ("seed", "latest")]
    for name, job in zip(("seed", "latest"), jobs):
        assert cli.main(["matrix", "--sets", name, "--results", str(job), "--arch", "gemma4", *one_test]) == 0
    merged = results.merge_files(jobs, tmp_path / "merged" / "matrix.json")
    expected = results.load(together)
    assert [(c.set_name, c.test) for c in merged["cells"]] == [("latest", f"{ONE_TEST}[cpu-gemma4]"), ("seed", f"{ONE_TEST}[cpu-gemma4]")]
    # Only the measured seconds differ between two runs of the same cells.
    assert without_seconds(merged) == without_seconds(expected)
    assert results.render_markdown(without_seconds(merged)) == results.render_markdown(without_seconds(expected))
