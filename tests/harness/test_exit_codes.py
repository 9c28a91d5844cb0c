"""One exit-code rule for every command (stackcheck.runner.exitcodes, docs/exit-codes.md), checked command by command.

The verdict commands run with their environments and pytest stood in for (the cells a run would record are
scripted), so each rule is shown in seconds; the real runs are in test_real_sets.py and test_cells.py."""

import sys
from pathlib import Path

import pytest

from stackcheck import cli
from stackcheck.commands import cross_release, matrix as matrix_command
from stackcheck.runner import envs, exitcodes, lane
from stackcheck.core import results, versions
from stackcheck.core.cell import Cell
from stackcheck.commands.triage import doctor
from tests.harness.test_doctor import SEED
from tests.harness.test_usage_errors import one_usage_line

LATEST = {**SEED, **{lib: pin.version for lib, pin in versions.load_sets()[0]["latest"].pins.items()}}
FAMILY = "params4bit_kwargs"
TEST = f"tests/families/test_{FAMILY}.py::test_offload_hook_moves_loaded_param_to_meta[cpu-gemma4]"


def test_the_docs_page_is_generated_from_the_rule():
    assert (Path(exitcodes.__file__).parents[2] / "docs" / "exit-codes.md").read_text() == exitcodes.markdown(), \
        "regenerate: python -m stackcheck.runner.exitcodes > docs/exit-codes.md"


def test_every_command_has_a_row():
    commands = set(cli._parser()._subparsers._group_actions[0].choices)
    assert commands == {c for r in exitcodes.COMMANDS for c in r.commands}


def test_pytests_codes_in_the_rules_terms():
    assert [exitcodes.from_pytest(code) for code in (0, 1, 2, 3, 4, 5, -11)] == [0, 1, 130, 3, 2, 2, 1]


# doctor: an install whose only bugs have no fix passes; one with a bug an upgrade leaves fails.

@pytest.mark.parametrize("installed, argv, code", [
    (LATEST, [], 0),  # 12-odd bugs of every version, none fixed in a release
    (SEED, [], 1),
    (LATEST, ["--fail-on", "known_bug"], 1),
    (SEED, ["--fail-on", "none"], 0),
])
def test_doctor(installed, argv, code, monkeypatch, capsys):
    monkeypatch.setattr(doctor, "versions_of", lambda python: dict(installed))
    assert doctor.diagnose(doctor.Ledger(), LATEST, "avx2") and not any(d.fixed_in_a_release for d in doctor.diagnose(doctor.Ledger(), LATEST, "avx2"))
    assert cli.main(["doctor", *argv]) == code
    err = capsys.readouterr().err
    assert (err.startswith("stackcheck: exit 1: ") and "docs/exit-codes.md" in err) if code else err == ""


def test_a_wrong_fail_on_is_one_line(capsys):
    assert "--fail-on 'fixable,'" in one_usage_line(cli.main(["doctor", "--fail-on", "fixable,"]), capsys)
    assert "expected outcomes among" in one_usage_line(cli.main(["matrix", "--fail-on", "regression"]), capsys)


# scan: "no problems found" is exit 0; the install's known bugs fail it only through --fail-on.

def test_scan_exits_0_when_it_finds_no_problem(tmp_path, capsys):
    (tmp_path / "config.json").write_text((Path(exitcodes.__file__).parents[2] / "fixtures" / "architectures" / "llama3.json").read_text())
    assert cli.main(["scan", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no problems found in the model" in out and "known bugs affect the installed versions" in out
    assert cli.main(["scan", str(tmp_path), "--fail-on", "known_bug"]) == 1


# matrix: exit 1 on the cells of this run that --fail-on names; nothing is run or recorded when a set cannot be built.

@pytest.fixture
def scripted(monkeypatch):
    """matrix with environments and pytest stood in for: `state["cells"]` are (verdict, bug) the run records,
    `state["code"]` is pytest's exit code; `state["built"]` lists the sets whose environment was asked for."""
    state = {"cells": [("pass", None)], "code": 0, "built": [], "runs": 0, "unimportable": {}}

    def build(vset, find_links=(), no_index=False, groups=()):
        state["built"].append(vset.name)
        if "9.9.9" in vset.name:
            raise envs.EnvBuildError("uv pip install: No solution found when resolving dependencies: Because there is no version of peft==9.9.9")
        return Path(sys.executable)

    def run_pytest(python, vset, targets, extra, results_path, baseline=None, env=None, run=None):
        state["runs"] += 1
        if state["code"] in (0, 1) and state["cells"] and results_path:
            cells = [Cell(vset.name, FAMILY, f"{TEST}-{i}", "cpu", verdict, "gemma4", bug=bug, run=run)
                     for i, (verdict, bug) in enumerate(state["cells"])]
            results.begin_run(results_path, vset.name, {"peft": "0.19.1"}, None, [c.replace(verdict="error") for c in cells])
            results.record_cells(results_path, cells)
        return state["code"]

    monkeypatch.setattr(envs, "build", build)
    monkeypatch.setattr(envs, "versions_in", lambda python, vset: "scripted")
    monkeypatch.setattr(envs, "import_problem", lambda python: state["unimportable"].get(state["built"][-1]))
    monkeypatch.setattr(matrix_command, "run_pytest", run_pytest)
    monkeypatch.setattr(cross_release, "plan", lambda *args: None)  # its own tests: test_cross_release
    return state


@pytest.mark.parametrize("cells, argv, code", [
    ([("pass", None), ("known_bug", "lora_on_offloaded_layer_meta")], [], 0),  # a known bug no release fixes
    ([("known_bug", "params4bit_kwargs")], [], 0),  # one an upgrade leaves: the set's expectation met
    ([("known_bug", "params4bit_kwargs")], ["--fail-on", "new_failure,error,fixed,fixable"], 1),
    ([("pass", None), ("new_failure", None)], [], 1),
    ([("new_failure", None)], ["--fail-on", "none"], 0),
    ([("error", None)], [], 1),
    ([("fixed", "params4bit_kwargs")], [], 1),
])
def test_matrix(cells, argv, code, scripted, tmp_path, capsys):
    scripted["cells"] = cells
    assert cli.main(["matrix", "--sets", "seed", "--families", FAMILY, "--results", str(tmp_path / "m.json"), *argv]) == code
    assert ("stackcheck: exit 1: " in capsys.readouterr().err) == bool(code)


def test_a_matrix_rerun_keeps_the_cells_it_did_not_run(scripted, tmp_path):
    """`matrix -- -k ...` re-checks some cells: the set's other cells stay (nothing is dropped before pytest runs)."""
    path = tmp_path / "m.json"
    scripted["cells"] = [("pass", None), ("known_bug", "params4bit_kwargs")]
    assert cli.main(["matrix", "--sets", "seed", "--families", FAMILY, "--results", str(path)]) == 0
    scripted["cells"] = [("new_failure", None)]  # the re-check of cell 0 only
    assert cli.main(["matrix", "--sets", "seed", "--families", FAMILY, "--results", str(path), "--", "-k", "x"]) == 1
    assert [c.verdict for c in results.load(path)["cells"]] == ["new_failure", "known_bug"]


@pytest.mark.parametrize("pytest_code, message", [(5, "the selection collected no test"), (4, "pytest refused the run")])
def test_a_matrix_run_pytest_refuses_or_that_selects_nothing_is_a_usage_error(pytest_code, message, scripted, tmp_path, capsys):
    scripted["code"] = pytest_code
    assert message in one_usage_line(cli.main(["matrix", "--sets", "seed", "--results", str(tmp_path / "m.json")]), capsys)


def test_a_set_that_cannot_be_built_is_exit_2_before_any_set_runs_and_records_nothing(scripted, tmp_path, capsys):
    path = tmp_path / "m.json"
    assert cli.main(["matrix", "--sets", "seed", "--families", FAMILY, "--results", str(path)]) == 0
    before = path.read_bytes()
    capsys.readouterr()
    line = one_usage_line(cli.main(["matrix", "--sets", "latest,seed", "--with", "peft==9.9.9", "--results", str(path)]), capsys)
    assert line.startswith("stackcheck: set latest+peft==9.9.9: environment not built, nothing was run or recorded: uv pip install: ")
    assert "no version of peft==9.9.9" in line
    assert scripted["runs"] == 1 and path.read_bytes() == before  # no phantom set in matrix.json or matrix.md


def test_an_unusable_set_is_one_line_its_cells_not_run_and_exit_4(scripted, tmp_path, capsys):
    """A set one of whose libraries does not import (envs.import_problem, tested on a real environment in test_envs)
    is named in one line and not run; the other set runs; exit 4 (exitcodes.UNUSABLE), 1 if a cell of the others fails."""
    path = tmp_path / "m.json"
    scripted["unimportable"] = {"seed+deepspeed==0.19.2": "deepspeed 0.19.2 does not import on Python 3.12 "
                                                          "(ModuleNotFoundError: No module named 'distutils')"}
    assert cli.main(["matrix", "--sets", "seed", "--with", "deepspeed==0.19.2", "--families", FAMILY, "--results", str(path)]) == 4
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("stackcheck: set seed+deepspeed==0.19.2 is unusable: deepspeed 0.19.2 does not import on Python 3.12 "
                      "(ModuleNotFoundError: No module named 'distutils'); its cells are not run")
    assert scripted["runs"] == 0 and not path.exists()
    scripted["unimportable"] = {"latest": "peft 0.17.1 does not import on Python 3.11 (ImportError: x)"}
    assert cli.main(["matrix", "--sets", "latest,seed", "--families", FAMILY, "--results", str(path)]) == 4
    assert scripted["runs"] == 1 and {c.set_name for c in results.load(path)["cells"]} == {"seed"}
    scripted["cells"] = [("new_failure", None)]
    assert cli.main(["matrix", "--sets", "latest,seed", "--families", FAMILY, "--results", str(path)]) == 1


def test_gpu_matrix_fails_when_no_gpu_cell_of_the_run_ran(scripted, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(envs, "cuda_device", lambda: "a scripted GPU")
    scripted["cells"] = [("pass", None)]  # the CPU lane only: every GPU cell missing
    assert cli.main(["gpu-matrix", "--sets", "seed", "--results", str(tmp_path / "m.json")]) == 1
    assert "every GPU cell was skipped or missing" in capsys.readouterr().err


# tests: pytest's own code, in the rule's terms.

@pytest.mark.parametrize("pytest_code, code", [(0, 0), (1, 1), (5, 2), (4, 2)])
def test_tests(pytest_code, code, scripted, capsys):
    scripted["code"] = pytest_code
    assert cli.main(["tests", "--", "-k", "anything"]) == code


# gate: both environments are built before either runs; 1 on a regression only.

@pytest.fixture
def gated(monkeypatch, scripted):
    verdicts = {}

    def run(vset, targets, results_path, *args, python=None, **kwargs):
        cell = Cell(vset.name, FAMILY, TEST, "cpu", verdicts[vset.name == "seed"], "gemma4")
        results.record_set(results_path, vset.name, {"peft": vset.pins["peft"].version})
        results.record_cells(results_path, [cell])
        return [cell]

    monkeypatch.setattr(lane, "run", run)
    return verdicts


@pytest.mark.parametrize("baseline, candidate, code", [("known_bug", "pass", 0), ("pass", "new_failure", 1), ("pass", "fixed", 0)])
def test_gate(baseline, candidate, code, gated, tmp_path):
    gated.update({True: baseline, False: candidate})
    assert cli.main(["gate", "--set", "seed", "--with", "peft==0.20.0", "--families", FAMILY, "--output", str(tmp_path)]) == code


def test_gate_builds_the_candidate_before_the_baseline_runs(gated, scripted, tmp_path, capsys):
    line = one_usage_line(cli.main(["gate", "--set", "seed", "--with", "peft==9.9.9", "--output", str(tmp_path)]), capsys)
    assert "set seed+peft==9.9.9: environment not built" in line
    assert scripted["built"] == ["seed", "seed+peft==9.9.9"] and not (tmp_path / "matrix.json").exists()


def test_bench_builds_every_set_before_it_measures(scripted, tmp_path, capsys):
    line = one_usage_line(cli.main(["bench", "--smoke", "--sets", "seed", "--with", "peft==9.9.9", "--results", str(tmp_path)]), capsys)
    assert "environment not built" in line and scripted["runs"] == 0


# What the installer said, in one line.

UV_NO_RELEASE = """  × No solution found when resolving dependencies:
  ╰─▶ Because there is no version of peft==9.9.9 and you require peft==9.9.9, we can conclude that your requirements are unsatisfiable.
"""
UV_GIT = """  × Failed to download and build `peft @ git+https://github.com/huggingface/peft@nope`
  ├─▶ Git operation failed
  ├─▶ failed to clone into: /root/.cache/uv/git-v2/db/81d1d349289b4c64
  ╰─▶ process didn't exit successfully: `/usr/bin/git fetch` (exit status: 128)
      --- stderr
      fatal: couldn't find remote ref refs/tags/nope
"""
PIP = """ERROR: Could not find a version that satisfies the requirement peft==9.9.9 (from versions: 0.1.0, 0.2.0)
ERROR: No matching distribution found for peft==9.9.9
"""


@pytest.mark.parametrize("output, reason", [
    (UV_NO_RELEASE, "No solution found when resolving dependencies: Because there is no version of peft==9.9.9 and you "
                    "require peft==9.9.9, we can conclude that your requirements are unsatisfiable."),
    (UV_GIT, "Failed to download and build `peft @ git+https://github.com/huggingface/peft@nope`: fatal: couldn't find remote ref refs/tags/nope"),
    (PIP, "No matching distribution found for peft==9.9.9"),
])
def test_the_installers_reason(output, reason):
    assert envs.failure_reason(output) == reason


# The commands that report without judging: versions, merge; and repro, whose rule is reproduction.

def test_versions_prints_a_pin_it_cannot_vouch_for_and_checks_it_on_request(tmp_path, capsys):
    assert cli.main(["versions", "--sets", "seed", "--with", "peft==9.9.9"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == ("seed+peft==9.9.9: transformers 5.6.2, peft 9.9.9, accelerate 1.13.0, bitsandbytes 0.49.2; "
                           "deepspeed 0.19.8, trl 1.16.0 (pyproject's extras)")
    assert "not checked against the package index: --check asks it" in err
    wheels = tmp_path / "wheels"
    wheels.mkdir()  # an offline index with nothing in it: the installer's own answer, no network
    line = one_usage_line(cli.main(["versions", "--sets", "seed", "--with", "peft==9.9.9", "--check", "--no-index",
                                    "--find-links", str(wheels)]), capsys)
    assert "peft==9.9.9" in line and ("No solution found" in line or "No matching distribution" in line), line


def test_merge_exits_0(tmp_path, capsys):
    path = tmp_path / "a.json"
    results.record_set(path, "seed", {"peft": "0.19.1"})
    results.record_cells(path, [Cell("seed", FAMILY, TEST, "cpu", "new_failure")])
    assert cli.main(["merge", str(path), "--output", str(tmp_path / "m.json")]) == 0  # merge judges nothing


def test_repro_exits_1_when_a_cell_is_not_reproduced(scripted, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("stackcheck.commands.triage.repro.gpu_host", lambda: False)
    path = tmp_path / "m.json"
    results.record_set(path, "seed", {"peft": "0.19.1"})
    results.record_cells(path, [Cell("seed", FAMILY, TEST.replace("[cpu-", "[gpu-"), "gpu", "known_bug", bug=FAMILY)])
    assert cli.main(["repro", "--from", str(path), "--output", str(tmp_path / "repro")]) == 1
    assert "0 of 1 cells reproduced" in capsys.readouterr().out


@pytest.mark.parametrize("command", [
    ["bisect", "accelerate", "--good", "1.15.0", "--bad", "1.13.0", "--family", FAMILY, "--candidates", "1.13.0,1.15.0"],
    ["history", "accelerate", "--from", "1.13.0", "--to", "1.15.0", "--candidates", "1.13.0,1.15.0", "--families", FAMILY],
])
def test_bisect_and_history_refuse_a_pin_the_index_lacks_before_any_probe(command, tmp_path, monkeypatch, capsys):
    """Every probe would be an `error` and the answer "untestable" (exit 1): the pin is the user's mistake (exit 2)."""
    monkeypatch.setattr(envs, "build", lambda *args, **kwargs: pytest.fail("built an environment"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    argv = [*command, "--with", "peft==9.9.9", "--no-index", "--find-links", str(wheels), "--store", str(tmp_path / "p.json"),
            "--output", str(tmp_path / "out.json")]
    assert one_usage_line(cli.main(argv), capsys).startswith("stackcheck: --with peft==9.9.9: ")
