"""No cell vanishes and no setup failure reads as a bug: real pytest runs of family modules in a copy of this
checkout that holds a module which does not import and one whose test kills its worker, and a run of a real
family test over a fixture that cannot be built."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from stackcheck import REPO_ROOT
from stackcheck.core.ledger import Ledger
from stackcheck.core.locking import folder_locked, run_folder
from stackcheck.models import tiny
from stackcheck.core.versions import installed_versions

BROKEN_MODULE = "import transformers.no_such_module\n\ndef test_never_collected():\n    pass\n"
CRASHING_MODULE = textwrap.dedent("""
    import os

    def test_kills_its_worker():
        os._exit(3)

    def test_passes():
        pass
""")
QUICK_MODULE = textwrap.dedent("""
    import os

    import pytest


    def test_stops_when_told():
        if os.environ.get("QUICK_STOP"):
            raise KeyboardInterrupt  # as Ctrl-C does, before the other cells of the run


    @pytest.mark.parametrize("n", ["one", "two"])
    def test_counts(n):
        assert os.environ.get("QUICK_FAIL") != n, f"told to fail {n}\\nthe child's output: line two"
""")
EXTRA_LEDGER = textwrap.dedent("""
    [families.quick]
    title = "cells that pass or fail on request"
    bugs = []

    [families.import_fails]
    title = "a module that does not import"
    bugs = []

    [families.worker_crash]
    title = "a test that kills its worker"
    bugs = []
""")


def run_pytest(root, *args, env=None):
    env = dict(os.environ, STACKCHECK_CACHE=str(tiny.cache_root()), **(env or {}))  # the checkout's tiny checkpoints
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors", *args],
                          cwd=root, env=env, capture_output=True, text=True)


def cells_of(results):
    return {c["test"]: c for c in json.loads(results.read_text())["cells"]}


@pytest.fixture
def checkout(tmp_path):
    """This checkout's code, ledger and family modules, plus the two broken families."""
    root = tmp_path / "checkout"
    shutil.copytree(REPO_ROOT, root, ignore=shutil.ignore_patterns(".git", ".stackcheck", ".cache", ".nox", "results", "docs", "wheelhouse", ".whl", "__pycache__"))
    (root / "tests" / "families" / "test_import_fails.py").write_text(BROKEN_MODULE)
    (root / "tests" / "families" / "test_worker_crash.py").write_text(CRASHING_MODULE)
    (root / "tests" / "families" / "test_quick.py").write_text(QUICK_MODULE)
    ledger = root / "stackcheck" / "ledger.toml"
    ledger.write_text(ledger.read_text() + EXTRA_LEDGER)
    return root


@pytest.mark.timeout(900)  # two xdist workers and their controller: 4 min 10 s on 2 cores under a load of 11 to 15
def test_crashed_worker_and_unimportable_module_leave_error_cells(checkout, tmp_path):
    results = tmp_path / "matrix.json"
    run = run_pytest(checkout, "-n", "2", "--stackcheck-lanes=cpu", "--stackcheck-arch=gemma4", f"--stackcheck-results={results}",
                     "tests/families/test_import_fails.py", "tests/families/test_worker_crash.py",
                     "tests/families/test_seed_scenario.py")
    cells = cells_of(results)
    assert cells["tests/families/test_import_fails.py[cpu]"]["verdict"] == "error", run.stdout
    assert "does not import" in cells["tests/families/test_import_fails.py[cpu]"]["signature"]
    crashed = cells["tests/families/test_worker_crash.py::test_kills_its_worker[cpu]"]
    assert crashed["verdict"] == "error" and crashed["signature"].startswith("cell lost"), crashed
    assert cells["tests/families/test_worker_crash.py::test_passes[cpu]"]["verdict"] == "pass"
    assert cells["tests/families/test_seed_scenario.py::test_seed_device_map_names_existing_modules[cpu-gemma4]"]["verdict"] == "known_bug"


def test_a_killed_run_loses_no_verdict_and_leaves_its_other_cells_not_run(checkout, tmp_path):
    """A process that dies in a test (no xdist to report it) leaves the file as its last write left it: the verdict
    recorded before of a cell it did not reach stays, and a cell without one reads not run, apart from the verdicts."""
    results = tmp_path / "matrix.json"
    module = "tests/families/test_worker_crash.py"
    run_pytest(checkout, "--stackcheck-lanes=cpu", f"--stackcheck-results={results}", module, "-k", "passes", env={"STACKCHECK_RUN": "r1"})
    run_pytest(checkout, "--stackcheck-lanes=cpu", f"--stackcheck-results={results}", module, env={"STACKCHECK_RUN": "r2"})
    data = json.loads(results.read_text())
    assert [(c["test"], c["verdict"], c["run"]) for c in data["cells"]] == [(f"{module}::test_passes[cpu]", "pass", "r1")]
    assert [(c["test"], c["verdict"], c["run"]) for c in data["not_run"]] == [(f"{module}::test_kills_its_worker[cpu]", "not_run", "r2")]


def test_a_family_module_without_a_ledger_entry_is_a_usage_error(checkout):
    ledger = checkout / "stackcheck" / "ledger.toml"
    ledger.write_text(ledger.read_text().replace(EXTRA_LEDGER, ""))
    run = run_pytest(checkout, "tests/families/test_seed_scenario.py")
    assert run.returncode == 4 and "INTERNALERROR" not in run.stdout + run.stderr
    assert "no entry for family module(s) test_import_fails.py, test_quick.py, test_worker_crash.py" in run.stderr


MERGE_PARITY = "tests/families/test_merge_parity.py::test_merge_into_bf16_base_reproduces_adapter_outputs"


@pytest.fixture(scope="module")
def merge_parity_cells(tmp_path_factory) -> tuple[dict, str]:
    """One real run of a family test on two architectures, whose cells the two tests below read: Gemma 4 over a copy
    of the fixtures whose Gemma 4 config cannot be built, Qwen3-MoE over its own config, copied as it is (so its
    tiny checkpoint cache still hits). Once per test run, shared on disk by this run's xdist workers."""
    shared = run_folder(tmp_path_factory, "merge-parity-cells")
    out = shared / "matrix.json"
    with folder_locked(shared):
        if not out.exists():
            work = Path(tempfile.mkdtemp(dir=shared))
            fixtures = work / "fixtures"
            shutil.copytree(tiny.FIXTURES_DIR, fixtures)
            config = json.loads((fixtures / "tiny_gemma4.json").read_text())
            config["text_config"]["layer_types"] = ["no_such_attention"] * config["text_config"]["num_hidden_layers"]
            (fixtures / "tiny_gemma4.json").write_text(json.dumps(config))
            run = run_pytest(REPO_ROOT, f"--stackcheck-results={work / 'matrix.json'}", "--stackcheck-lanes=cpu",
                             "--stackcheck-arch=gemma4,qwen3moe", MERGE_PARITY, env={"STACKCHECK_FIXTURES": str(fixtures)})
            (work / "stdout.txt").write_text(run.stdout)
            os.replace(work / "stdout.txt", shared / "stdout.txt")
            os.replace(work / "matrix.json", out)  # only a run that finished is shared
        return cells_of(out), (shared / "stdout.txt").read_text()


@pytest.mark.shares("merge-parity-cells")
def test_a_fixture_that_cannot_be_built_is_an_error_not_a_new_failure(merge_parity_cells):
    cells, _ = merge_parity_cells
    cell = cells[f"{MERGE_PARITY}[cpu-gemma4]"]
    assert (cell["verdict"], cell["note"]) == ("error", "setup broke"), cell
    assert "FixtureError" in cell["signature"]


@pytest.mark.shares("merge-parity-cells")
def test_a_fixture_that_meets_a_known_bug_is_that_known_bug(merge_parity_cells):
    """Qwen3-MoE's default adapter is all-linear (PEFT has no default targets for qwen3_moe). Where PEFT 0.19 turns
    that string into a set of its characters (peft_moe_all_linear_charset), building the adapter fixture fails with
    the bug's own signature: the ledger judges it as it judges a test, and the cell is the known bug, not `error`."""
    cells, stdout = merge_parity_cells
    cell = cells[f"{MERGE_PARITY}[cpu-qwen3moe]"]
    if not Ledger().bugs["peft_moe_all_linear_charset"].affects(installed_versions()):
        pytest.skip(f"these versions do not have peft_moe_all_linear_charset: the fixture builds ({cell['verdict']})")
    assert (cell["verdict"], cell["bug"]) == ("known_bug", "peft_moe_all_linear_charset"), stdout[-3000:]
    assert cell["note"].startswith("in the test's setup: FixtureError: fixture adapter-language cannot be built"), cell
    assert cell["signature"].endswith("@ peft/tuners/tuners_utils.py:inject_adapter"), cell


@pytest.mark.timeout(900)  # four pytest runs: on 2 cores under a load of 15, one run took 100 s, nearly all start-up
def test_a_rerun_replaces_only_what_it_ran_and_an_empty_or_stopped_one_loses_nothing(checkout, tmp_path):
    """The matrix's pytest runs into one results file: a `-k` re-check replaces its own cells and keeps the others;
    a `-k` that selects nothing changes nothing (not a byte); a run stopped by Ctrl-C before its cells ran leaves the
    cells it had as they were."""
    results = tmp_path / "matrix.json"

    def run(*args, **env):
        return run_pytest(checkout, "--stackcheck-lanes=cpu", "--stackcheck-set=seed", f"--stackcheck-results={results}",
                          "tests/families/test_quick.py", *args, env={"STACKCHECK_RUN": env.pop("run", "r"), **env})

    def verdicts():
        return {c["test"].split("::")[1]: (c["verdict"], c.get("run")) for c in json.loads(results.read_text())["cells"]}

    assert run(run="r1").returncode == 0
    first = verdicts()
    assert first == {"test_stops_when_told[cpu]": ("pass", "r1"), "test_counts[cpu-one]": ("pass", "r1"),
                     "test_counts[cpu-two]": ("pass", "r1")}
    assert run("-k", "two", run="r2", QUICK_FAIL="two").returncode == 1
    checked = dict(first, **{"test_counts[cpu-two]": ("new_failure", "r2")})
    assert verdicts() == checked
    failed = cells_of(results)["tests/families/test_quick.py::test_counts[cpu-two]"]
    assert failed["signature"].startswith("AssertionError: told to fail two @ ")  # the first line; the rest is kept apart
    assert failed["detail"].startswith("the child's output: line two"), failed
    on_disk = results.read_bytes(), results.with_suffix(".md").read_bytes()
    assert run("-k", "no_such_test", run="r3").returncode == 5
    assert (results.read_bytes(), results.with_suffix(".md").read_bytes()) == on_disk
    assert run(run="r5", QUICK_STOP="1").returncode == 2  # pytest's "interrupted"
    assert verdicts() == checked
