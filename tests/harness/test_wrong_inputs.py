"""Issue 24's wrong inputs, each through the real command (`python -m stackcheck ...` in a subprocess): one line
on stderr, exit code 2, no traceback, and nothing built first (no `+ command` line of an environment build)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stackcheck import REPO_ROOT

FAMILY_TEST = "tests/families/test_params4bit_kwargs.py::test_offload_hook_moves_loaded_param_to_meta"


def stackcheck(*argv: str, env: dict | None = None, cwd: Path = REPO_ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    """`env`: variables changed; stackcheck from this checkout wherever `cwd` is."""
    return subprocess.run([sys.executable, "-m", "stackcheck", *argv], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}, timeout=timeout)


def refused(*argv: str, **kwargs) -> str:
    """The one stderr line of a usage error, checked: exit 2, no traceback, nothing built or run before it."""
    run = stackcheck(*argv, **kwargs)
    assert run.returncode == 2, run
    assert run.stderr.startswith("stackcheck: ") and run.stderr.count("\n") == 1, run.stderr
    assert not [line for line in run.stdout.splitlines() if line.startswith("+ ")], run.stdout
    return run.stderr.strip()


@pytest.mark.parametrize("argv, option", [
    (["matrix", "--sets", "seed", "--results", "/proc/x.json"], "--results"),
    (["gate", "--with", "accelerate==1.14.0", "--output", "/proc/x"], "--output"),
    (["merge", str(REPO_ROOT / "README.md"), "--output", "/proc/x.json"], "--output"),
], ids=["matrix", "gate", "merge"])
def test_an_output_where_no_file_can_be_written(argv, option):
    # /proc takes no new file, even for root, whom every permission check lets through.
    assert refused(*argv) == f"stackcheck: {option}: cannot write in /proc (No such file or directory)"


def test_tests_with_two_sets():
    assert refused("tests", "--set", "seed,latest") == (
        "stackcheck: tests runs one set, not 'seed,latest' (the matrix takes several: --sets a,b)")


def test_wheelhouse_without_uv(tmp_path):
    line = refused("wheelhouse", "--sets", "seed", "--dest", str(tmp_path / "house"), env={"PATH": str(tmp_path)})
    assert line == "stackcheck: the wheelhouse needs uv on PATH (its resolver picks the target's versions): pip install uv"


def test_wheelhouse_with_a_binary_host_freeze(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_bytes(Path(sys.executable).resolve().read_bytes()[:4096])
    line = refused("wheelhouse", "--sets", "seed", "--dest", str(tmp_path / "house"), "--host-freeze", str(freeze))
    assert line == f"stackcheck: {freeze} is not text: expected the target's `pip list --format=freeze`"


def test_watch_with_an_empty_release_list(tmp_path):
    releases = tmp_path / "releases.json"
    releases.write_text(json.dumps({"transformers": []}))
    line = refused("watch", "--releases", str(releases), "--output", str(tmp_path / "watch"))
    assert line == (f"stackcheck: {releases} is not a stackcheck release list: "
                    "it is not an object of package: [release, ...], each list naming at least one release")


def test_doctor_with_a_program_that_prints_garbage(tmp_path):
    program = tmp_path / "python"
    program.write_text("#!/bin/sh\necho 'hello, world'\n")
    program.chmod(0o755)
    assert refused("doctor", "--python", str(program)) == (
        f"stackcheck: --python {program}: it printed no package report; name a Python interpreter")


def test_bisect_with_a_test_that_does_not_exist():
    line = refused("bisect", "accelerate", "--good", "1.15.0", "--bad", "1.13.0", "--test", FAMILY_TEST.replace("moves", "carries"))
    assert line == ("stackcheck: tests/families/test_params4bit_kwargs.py has no test test_offload_hook_carries_loaded_param_to_meta "
                    "(its tests: test_offload_hook_moves_loaded_param_to_meta, test_offload_hook_restores_weight_from_weights_map)")


@pytest.mark.parametrize("test_id", [FAMILY_TEST, FAMILY_TEST + "[cpu]", FAMILY_TEST + "[cpu-llama3]"], ids=["bare", "lane", "lane-arch"])
def test_bisect_and_repro_read_test_ids_alike(test_id, tmp_path):
    """One grammar: with or without the bracketed parameters (opaque), checked before anything is built. The
    run stops at the next usage error, which comes after the id's check: so the id passed it."""
    assert refused("bisect", "accelerate", "--good", "1.15.0", "--bad", "1.15.0", "--candidates", "1.15.0",
                   "--test", test_id) == "stackcheck: --good and --bad name the same candidate"
    assert refused("repro", "--sets", "seed,latest", "--test", test_id) == "stackcheck: --test runs on one set: name it with --sets SET"


@pytest.mark.parametrize("test_id", ["tests/families/test_params4bit_kwargs.py", "test_offload_hook_moves_loaded_param_to_meta[cpu]",
                                     FAMILY_TEST + "[]"])
def test_a_malformed_test_id_is_refused_by_both(test_id):
    from stackcheck.runner.lane import TEST_ID_FORM as form
    for argv in (["bisect", "accelerate", "--good", "1.15.0", "--bad", "1.13.0"], ["repro", "--sets", "seed"]):
        assert refused(*argv, "--test", test_id) == f"stackcheck: '{test_id}' is not a family test id: {form}"


def test_repro_names_its_own_set_option():
    assert refused("repro") == "stackcheck: name a test (--sets SET --test ID) or a results file (--from matrix.json [--sets A,B])"


def test_matrix_of_an_unknown_family():
    assert refused("matrix", "--sets", "seed", "--families", "zero3_lora,nope").startswith("stackcheck: unknown family 'nope' (families: ")


def test_the_same_package_pinned_twice():
    assert refused("matrix", "--sets", "seed", "--with", "peft==0.19.1", "--with", "peft==0.20.0") == (
        "stackcheck: --with pins peft 2 times (peft==0.19.1, peft==0.20.0): keep one")


def test_a_pin_with_one_equals_sign_says_which_syntaxes_exist():
    assert refused("matrix", "--sets", "seed", "--with", "transformers=5") == (
        f"stackcheck: bad pin 'transformers=5': NAME=PATH names a file or folder, and {REPO_ROOT / '5'} does not exist "
        "(a release is transformers==5); a pin is NAME==VERSION, NAME@git+URL[@REF] or NAME=PATH (a wheel, sdist or source tree)")


@pytest.mark.parametrize("command", [["matrix", "--sets", "seed"], ["gate"], ["bisect", "peft", "--good", "1", "--bad", "2", "--family", "merge_parity"]])
def test_no_index_without_find_links(command):
    assert refused(*command, "--no-index") == "stackcheck: --no-index installs only from --find-links folders: name one with --find-links DIR"


def test_find_links_that_is_no_folder(tmp_path):
    assert refused("matrix", "--sets", "seed", "--find-links", str(tmp_path / "wheels")) == f"stackcheck: --find-links {tmp_path / 'wheels'}: no such folder"


# scan builds the model with the libraries of the interpreter that runs it: the harness's set environment.
E2B = str(REPO_ROOT / "fixtures" / "gemma4-e2b")


def test_scan_with_a_max_memory_accelerate_cannot_read():
    assert refused("scan", E2B, "--max-memory", '{"0": "lots"}') == (
        "stackcheck: --max-memory: accelerate refuses it (`size` lots is not in a valid format. "
        "Use an integer for bytes, or a string with an unit (like '5.0GB').)")


def test_scan_with_an_unknown_quantization_key():
    line = refused("scan", E2B, "--quantization", '{"load_in_4bit": true, "bnb_4bit_quant_typ": "nf4"}')
    assert line.startswith("stackcheck: --quantization: BitsAndBytesConfig has no 'bnb_4bit_quant_typ' (it takes load_in_8bit, ")


def test_scan_with_a_quantization_file_that_is_missing(tmp_path):
    assert refused("scan", E2B, "--quantization", "seed_bnb.json", cwd=tmp_path) == "stackcheck: --quantization seed_bnb.json: no such file"


def test_scan_without_an_adapter_claims_nothing_about_one():
    run = stackcheck("scan", E2B)
    assert run.returncode == 0 and "\nno problems found in the model\n" in run.stdout, run  # the install's known bugs: doctor's


# Issue 29: tracebacks where one line belongs, through the real command.

def test_a_python_without_packaging_is_one_line():
    # -S leaves site-packages, and with them `packaging`, off the path; the standard library stays.
    run = subprocess.run([sys.executable, "-S", "-m", "stackcheck", "versions"], cwd=REPO_ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=60)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run
    assert run.stderr.startswith(f"stackcheck: needs the `packaging` package, which this Python ({sys.executable}) lacks: pip install packaging")


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """`doctor --json | head`: the pipe closes before doctor writes; no BrokenPipeError, the exit status SIGPIPE's."""
    process = subprocess.Popen([sys.executable, "-m", "stackcheck", "doctor", "--json", "--python", sys.executable], cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    process.stdout.close()  # the reader is gone before the report is written
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=60) == 141 and stderr == "", stderr


def test_ctrl_c_is_one_line_saying_what_was_kept(tmp_path):
    """SIGINT in the middle of a matrix run, after a cell was recorded (the set's pytest stands in)."""
    path = tmp_path / "matrix.json"
    # Python's own Ctrl-C handler, as a command started from a terminal has it: a process started from a test runner's
    # worker may inherit SIGINT ignored (a CI run read exit 1, the signal never raised), which says nothing of the command.
    code = f"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from pathlib import Path
from stackcheck import cli
from stackcheck.runner import envs
from stackcheck.core import results
from stackcheck.core.cell import Cell
envs.build = lambda *args, **kwargs: Path(sys.executable)
envs.versions_in = lambda *args: ""
def pytest_run(python, vset, targets, extra, path, *args, **kwargs):
    results.record_cells(path, [Cell(vset.name, "merge_parity", "t[cpu]", "cpu", "pass", seconds=1.0)])
    signal.raise_signal(signal.SIGINT)  # to this thread, as the terminal's Ctrl-C reaches the command
from stackcheck.commands import matrix
matrix.run_pytest = pytest_run
sys.exit(cli.main(["matrix", "--sets", "seed", "--families", "merge_parity", "--results", {str(path)!r}]))
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert run.returncode == 130 and run.stderr == f"stackcheck: interrupted: kept 1 finished cells in {path}\n", run
    assert json.loads(path.read_text())["cells"][0]["test"] == "t[cpu]"


@pytest.fixture
def broken_sets_toml(tmp_path) -> Path:
    """A copy of the package (and noxfile) whose sets.toml declares a set twice."""
    shutil.copytree(REPO_ROOT / "stackcheck", tmp_path / "stackcheck", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "noxfile.py", tmp_path / "noxfile.py")
    sets = tmp_path / "stackcheck" / "sets.toml"
    sets.write_text(sets.read_text() + '\n[sets.seed]\ntransformers = "5.6.2"\n')
    return tmp_path


def test_a_broken_sets_toml_is_one_line_in_every_command(broken_sets_toml):
    message = f"stackcheck: {broken_sets_toml / 'stackcheck' / 'sets.toml'} is not valid TOML: Cannot declare ('sets', 'seed') twice"
    for argv in (["versions"], ["versions", "--sets", "seed", "--with", "peft==0.20.0"]):
        line = refused(*argv, cwd=broken_sets_toml, env={"PYTHONPATH": str(broken_sets_toml)})
        assert line.startswith(message), line


def test_nox_lists_its_sessions_over_a_broken_sets_toml(broken_sets_toml):
    if not shutil.which("nox"):
        pytest.skip("no nox here")
    run = subprocess.run(["nox", "-l"], cwd=broken_sets_toml, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(broken_sets_toml)})
    assert run.returncode == 0 and "- matrix ->" in run.stdout and "Traceback" not in run.stderr, run
    assert "stackcheck: " in run.stderr and "no matrix_set sessions" in run.stderr


def test_scan_of_a_file_says_it_is_a_file():
    readme = REPO_ROOT / "README.md"
    assert refused("scan", str(readme)) == f"stackcheck: MODEL {readme} is a file; name a folder"


# Issue 47: the last silent inputs, and the rough edges.

def test_one_model_named_twice_in_arch():
    assert refused("matrix", "--sets", "seed", "--arch", "llama3,fixtures/architectures/llama3.json") == \
        "stackcheck: --arch llama3,fixtures/architectures/llama3.json: names the architecture llama3 more than once"


def test_a_copy_of_a_built_in_config_is_the_same_model(tmp_path):
    copy = tmp_path / "mine" / "config.json"
    copy.parent.mkdir()
    shutil.copy(REPO_ROOT / "fixtures" / "architectures" / "llama3.json", copy)
    assert refused("matrix", "--sets", "seed", "--arch", f"llama3,{copy}") == \
        f"stackcheck: --arch llama3,{copy}: fixtures/architectures/llama3.json and {copy} are the same model; name it once"


@pytest.mark.parametrize("key, value", [("hidden_size", -64), ("num_attention_heads", 0), ("num_hidden_layers", 0)])
def test_a_config_with_a_size_that_is_not_positive(tmp_path, key, value):
    config = json.loads((REPO_ROOT / "fixtures" / "architectures" / "llama3.json").read_text()) | {key: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert refused("matrix", "--sets", "seed", "--arch", str(path)) == \
        f"stackcheck: {path}: cannot be shrunk: {key} {value}: a size or count is a positive integer"


def test_a_pin_with_spaces_is_the_same_set():
    run = stackcheck("versions", "--sets", "seed", "--with", "peft==0.20.0 ", "--with", " Accelerate == 1.14.0")
    assert run.returncode == 0 and run.stdout.startswith("seed+peft==0.20.0+accelerate==1.14.0: "), run


def test_a_misspelt_option_is_named():
    assert refused("matrix", "--famlies", "merge_parity") == \
        "stackcheck: matrix: unrecognized arguments: --famlies; did you mean --families?"


def test_scan_takes_accelerates_device_map_strings(tmp_path):
    """`--device-map auto` as from_pretrained takes it: accelerate's map of this host, made on meta."""
    model = tmp_path / "llama"
    model.mkdir()
    shutil.copy(REPO_ROOT / "fixtures" / "architectures" / "llama3.json", model / "config.json")
    for device_map in ("auto", "cpu"):
        run = stackcheck("scan", str(model), "--device-map", device_map, timeout=600)
        assert run.returncode == 0 and "no problems found in the model and options" in run.stdout, run
