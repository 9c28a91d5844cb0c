"""No cell vanishes and no setup failure reads as a bug: real pytest runs of family modules in a copy of this
checkout that holds a module which does not import and one whose test kills its worker, and a run of a real
family test over a fixture that cannot be built."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from stackcheck import REPO_ROOT
from stackcheck.models import tiny

BROKEN_MODULE = "import transformers.no_such_module\n\ndef test_never_collected():\n    pass\n"
CRASHING_MODULE = textwrap.dedent("""
    import os

    def test_kills_its_worker():
        os._exit(3)

    def test_passes():
        pass
""")
EXTRA_LEDGER = textwrap.dedent("""
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
    ledger = root / "stackcheck" / "ledger.toml"
    ledger.write_text(ledger.read_text() + EXTRA_LEDGER)
    return root


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


def test_a_killed_run_leaves_its_unfinished_cells_as_errors(checkout, tmp_path):
    results = tmp_path / "matrix.json"
    run_pytest(checkout, "--stackcheck-lanes=cpu", f"--stackcheck-results={results}", "tests/families/test_worker_crash.py")
    cells = cells_of(results)
    assert [c["verdict"] for c in cells.values()] == ["error", "error"]
    assert all(c["signature"].startswith("cell lost") for c in cells.values())


def test_a_family_module_without_a_ledger_entry_is_a_usage_error(checkout):
    ledger = checkout / "stackcheck" / "ledger.toml"
    ledger.write_text(ledger.read_text().replace(EXTRA_LEDGER, ""))
    run = run_pytest(checkout, "tests/families/test_seed_scenario.py")
    assert run.returncode == 4 and "INTERNALERROR" not in run.stdout + run.stderr
    assert "no entry for family module(s) test_import_fails.py, test_worker_crash.py" in run.stderr


def test_a_fixture_that_cannot_be_built_is_an_error_not_a_new_failure(tmp_path):
    fixtures = tmp_path / "fixtures"
    shutil.copytree(tiny.FIXTURES_DIR, fixtures)
    config = json.loads((fixtures / "tiny_gemma4.json").read_text())
    config["text_config"]["layer_types"] = ["no_such_attention"] * config["text_config"]["num_hidden_layers"]
    (fixtures / "tiny_gemma4.json").write_text(json.dumps(config))
    results = tmp_path / "matrix.json"
    run_pytest(REPO_ROOT, f"--stackcheck-results={results}", "--stackcheck-lanes=cpu", "--stackcheck-arch=gemma4",
               "tests/families/test_merge_parity.py::test_merge_into_bf16_base_reproduces_adapter_outputs",
               env={"STACKCHECK_FIXTURES": str(fixtures)})
    (cell,) = cells_of(results).values()
    assert (cell["verdict"], cell["note"]) == ("error", "setup broke"), cell
    assert "FixtureError" in cell["signature"]
