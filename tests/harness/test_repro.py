"""`repro` cuts a standalone script out of a family test and checks it by running it: the script imports no
stackcheck code, runs from an empty folder, and fails with the cell's signature exactly when the ledger says
the installed versions have the bug."""

import ast
import sys
from pathlib import Path

import pytest

from stackcheck import cli
from stackcheck.core.cell import Cell
from stackcheck.commands.triage import repro, repro_script
from stackcheck.core.ledger import Ledger
from stackcheck.core.versions import default_set, installed_versions
from tests.harness.test_usage_errors import one_usage_line

CELL_TEST = "tests/families/test_params4bit_kwargs.py::test_offload_hook_moves_loaded_param_to_meta[cpu-gemma4]"
SIGNATURE = ("TypeError: Params4bit.__new__() got an unexpected keyword argument '_is_hf_initialized' "
             "@ accelerate/utils/modeling.py:set_module_tensor_to_device")


def test_the_script_imports_nothing_of_stackcheck():
    script = repro_script.build("qlora_step", "test_qlora_steps_learn_and_leave_the_4bit_base_untouched",
                                {"adapter": "'inner_linear'", "base_name": "'split'", "optimizer_name": "'torch_adamw'"},
                                ["offload_dir"], "cpu", '"""x"""')
    imported = [node for node in ast.walk(ast.parse(script)) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert not [n for n in imported if "stackcheck" in ast.unparse(n)]
    assert "def towers_offloaded_base(" in script and "scenario = SimpleNamespace(" in script


def test_a_fixture_the_script_cannot_stand_in_for_is_refused():
    with pytest.raises(repro_script.ReproUnsupported, match="adapter_exchange"):
        repro_script.build("adapter_round_trip", "test_adapter_trained_by_the_baseline_set_reloads", {}, ["prompt", "adapter_exchange"], "cpu", "")


def test_the_export_fails_with_the_cells_signature_only_where_the_bug_is(tmp_path):
    affected = Ledger().bugs["params4bit_kwargs"].affects(installed_versions())
    cell = Cell(default_set().name, "params4bit_kwargs", CELL_TEST, "cpu", "known_bug", "gemma4", SIGNATURE, "params4bit_kwargs")

    outcome = repro.export(cell, default_set(), Path(sys.executable), tmp_path, {"versions": installed_versions()}, Ledger())

    assert outcome.reproduced == affected, (outcome.folder / "check.txt").read_text()[-2000:]
    assert {p.name for p in outcome.folder.iterdir()} == {"repro.py", "issue.md", "environment.md", "check.txt"}
    issue = (outcome.folder / "issue.md").read_text()
    assert "https://github.com/huggingface/accelerate/pull/3976" in issue and "```python" in issue
    if affected:
        assert "raised in accelerate/utils/modeling.py:set_module_tensor_to_device" in issue
    # Nothing of this machine's paths: the export folder, the environment, the clone, the home (issue 47).
    assert not [path for path in (str(tmp_path), sys.prefix, str(repro.REPO_ROOT), str(Path.home())) if path in issue], issue


def test_an_issue_carries_no_path_of_the_machine(tmp_path):
    trace = (f'  File "{tmp_path}/latest/t/repro.py", line 3, in main\n'
             '  File "/work/x/.stackcheck/envs/latest/lib/python3.11/site-packages/torch/_tensor.py", line 623\n'
             f'  File "{repro.REPO_ROOT}/fixtures/a.json"')
    assert repro.portable(trace, tmp_path / "latest" / "t").splitlines() == [
        '  File "repro.py", line 3, in main', '  File "site-packages/torch/_tensor.py", line 623', '  File "stackcheck/fixtures/a.json"']


@pytest.mark.parametrize("argv, message", [
    (["--test", "tests/families/test_nope.py::test_x[cpu]"], "unknown family 'nope'"),
    (["--test", "test_x"], "is not a family test id"),
    (["--from", "/no/such/matrix.json"], "--from /no/such/matrix.json: no such file"),
    ([], "name a test (--sets SET --test ID)"),
])
def test_wrong_inputs_are_one_line(argv, message, capsys):
    assert message in one_usage_line(cli.main(["repro", *argv]), capsys)
