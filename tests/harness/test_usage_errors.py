"""User mistakes end in one line on stderr, `stackcheck: <message>`, and exit code 2, never in a traceback,
and before any environment is built; path options are absolute from the start; an environment that cannot
report its versions counts as unbuildable. Fast: no network, no environment."""

import dataclasses
import functools
import importlib.metadata
import json
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from stackcheck import REPO_ROOT, cli
from stackcheck.commands import setup as setup_command
from stackcheck.commands import matrix as matrix_command
from stackcheck.runner import envs, lane, wheelhouse
from stackcheck.core import ledger, versions
from stackcheck.core.cell import Cell
from stackcheck.core.versions import UsageError, resolve

PATH_OPTIONS = [
    (["matrix", "--results", "out/m.json"], "results", "out/m.json"),
    (["gpu-matrix", "--results", "out/m.json"], "results", "out/m.json"),
    (["bench", "--results", "out/bench"], "results", "out/bench"),
    (["wheelhouse", "--dest", "house", "--host-freeze", "freeze.txt"], "dest", "house"),
    (["wheelhouse", "--host-freeze", "freeze.txt"], "host_freeze", "freeze.txt"),
    (["gate", "--output", "out/gate"], "output", "out/gate"),
    (["merge", "a.json", "--output", "out/m.json"], "output", "out/m.json"),
    (["bisect", "peft", "--good", "1", "--bad", "2", "--family", "f", "--output", "b.json"], "output", "b.json"),
    (["bisect", "peft", "--good", "1", "--bad", "2", "--family", "f", "--git", "clone"], "git", "clone"),
]


@pytest.mark.parametrize("argv, dest, given", PATH_OPTIONS, ids=[f"{argv[0]} {dest}" for argv, dest, _ in PATH_OPTIONS])
def test_path_options_are_absolute_against_the_callers_directory(argv, dest, given, tmp_path, monkeypatch):
    # pytest runs from the repository root: a relative path left as it is would land in two places.
    monkeypatch.chdir(tmp_path)
    path = getattr(cli._parser().parse_args(argv), dest)
    assert path.is_absolute() and path == tmp_path.resolve() / given


def test_merge_inputs_are_absolute_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli._parser().parse_args(["merge", "a.json", "b/c.json"]).inputs == [tmp_path.resolve() / "a.json", tmp_path.resolve() / "b/c.json"]


def test_no_python_without_tomllib_is_claimed():
    claim = SpecifierSet(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    assert "3.10" not in claim and "3.11" in claim


def one_usage_line(code: int, capsys) -> str:
    """The one stderr line of a usage error (exit 2, no traceback)."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("stackcheck: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


VERSIONS = {"python": "3.11.7", "torch": "2.13.0", "transformers": "5.6.2", "peft": "0.19.1", "accelerate": "1.13.0", "bitsandbytes": "0.49.2"}
CELL = {"set": "seed", "family": "merge_parity", "test": "t[cpu]", "lane": "cpu", "verdict": "pass", "signature": None, "bug": None, "seconds": 1.0}


def matrix_json(tmp_path, **changes) -> Path:
    path = tmp_path / "job" / "matrix.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"sets": {"seed": VERSIONS}, "cells": [CELL]} | changes))
    return path


MALFORMED = {
    "a cell without a verdict": ({"cells": [{k: v for k, v in CELL.items() if k != "verdict"}]}, "cell 0 has no verdict"),
    "sets as a list": ({"sets": ["seed"]}, "`sets` is not an object"),
    "a set's versions as a list": ({"sets": {"seed": ["2.13.0"]}}, "set 'seed' is not an object of version strings"),
    "cells as an object": ({"cells": {"0": CELL}}, "`cells` is not a list"),
    "a cell as a list": ({"cells": [list(CELL.values())]}, "cell 0 is not an object"),
    "seconds as text": ({"cells": [dict(CELL, seconds="1.0")]}, "seconds a number"),
    "an unknown verdict": ({"cells": [dict(CELL, verdict="ok")]}, "unknown verdict 'ok'"),
}


@pytest.mark.parametrize("changes, message", MALFORMED.values(), ids=MALFORMED)
def test_merge_of_a_malformed_matrix_json_names_the_file(changes, message, tmp_path, capsys):
    path = matrix_json(tmp_path, **changes)
    output = tmp_path / "merged.json"
    line = one_usage_line(cli.main(["merge", str(path), "--output", str(output)]), capsys)
    assert line.startswith(f"stackcheck: {path} is not a stackcheck matrix.json: ") and message in line
    assert not output.exists()


def test_merge_of_a_file_that_is_not_json(tmp_path, capsys):
    path = tmp_path / "matrix.json"
    path.write_text("{not json")
    assert one_usage_line(cli.main(["merge", str(path), "--output", str(tmp_path / "m.json")]), capsys).startswith(f"stackcheck: cannot read {path}: ")


def test_merge_output_that_is_a_folder(tmp_path, capsys):
    line = one_usage_line(cli.main(["merge", str(matrix_json(tmp_path)), "--output", str(tmp_path)]), capsys)
    assert line == f"stackcheck: --output {tmp_path} is a folder; name the file to write"


@pytest.fixture
def no_environments(monkeypatch):
    """A usage error must show before any set's environment is built (minutes, in a real run)."""
    def refuse(*args, **kwargs):
        raise AssertionError("an environment was built before the usage error")

    monkeypatch.setattr(envs, "build", refuse)


def test_gate_output_that_is_a_file(tmp_path, capsys, no_environments):
    output = tmp_path / "gate.txt"
    output.write_text("")
    line = one_usage_line(cli.main(["gate", "--with", "accelerate==1.14.0", "--output", str(output)]), capsys)
    assert line == f"stackcheck: --output {output} is a file; name a folder"


def bench_entry(**info) -> dict:
    return {"stats": {"median": 0.5, "iqr": 0.01},
            "extra_info": {"size": "tiny", "case": "bf16", "phase": "decode", "tokens": 8, "parameters": 100,
                           "weights": {"expected": {"cpu": 200}, "stored": {"cpu": 210}}, "memory": {}} | info}


CORRUPT_BENCH = {
    "not JSON": ("{", "cannot read"),
    "a list": ("[]", "is not a stackcheck bench JSON: it has no `benchmarks` list"),
    "an entry without stats": (json.dumps({"benchmarks": [{"extra_info": bench_entry()["extra_info"]}]}), "benchmark 0 has no `stats`"),
    "tokens as text": (json.dumps({"benchmarks": [bench_entry(tokens="8")]}), "benchmark 0: its median (> 0), iqr and tokens"),
    "weights without stored": (json.dumps({"benchmarks": [bench_entry(weights={"expected": {}})]}), "benchmark 0: its `memory`, or its `weights`"),
    "stackcheck as a list": (json.dumps({"benchmarks": [], "stackcheck": []}), "`stackcheck`, or its `versions` or `bandwidth`, is not an object"),
    "not_measured without reasons": (json.dumps({"benchmarks": [], "stackcheck": {"not_measured": [{"size": "tiny"}]}}), "`stackcheck.not_measured`"),
}


@pytest.mark.parametrize("text, message", CORRUPT_BENCH.values(), ids=CORRUPT_BENCH)
def test_bench_render_only_over_a_corrupt_json_names_the_file(text, message, tmp_path, capsys, no_environments):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "seed.json").write_text(text)
    line = one_usage_line(cli.main(["bench", "--sets", "seed", "--render-only", "--results", str(tmp_path / "bench")]), capsys)
    assert line.startswith("stackcheck: ") and str(tmp_path / "bench" / "seed.json") in line and message in line, line


def test_bench_render_only_reads_a_well_formed_json(tmp_path, capsys):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "seed.json").write_text(json.dumps({"benchmarks": [bench_entry()], "stackcheck": {"device": "cpu", "mode": "smoke"}}))
    assert cli.main(["bench", "--sets", "seed", "--render-only", "--results", str(tmp_path / "bench")]) == 0
    assert "| tiny/bf16 |" in (tmp_path / "bench.md").read_text()


def test_a_host_freeze_line_with_an_invalid_version_is_named(tmp_path, capsys):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("torch==2.13.0\nfoo==1.0-custom\n")
    message = f"{freeze}, line 2: 'foo==1.0-custom': '1.0-custom' is not a valid version"
    with pytest.raises(UsageError) as raised:
        wheelhouse.read_freeze(freeze)
    assert str(raised.value) == message
    dest = tmp_path / "house"
    line = one_usage_line(cli.main(["wheelhouse", "--sets", "seed", "--dest", str(dest), "--host-freeze", str(freeze)]), capsys)
    assert line == f"stackcheck: {message}" and not dest.exists()  # refused before any download


@pytest.mark.parametrize("command", ["matrix", "gpu-matrix"])
def test_matrix_results_that_is_a_folder(command, tmp_path, capsys, no_environments):
    line = one_usage_line(cli.main([command, "--sets", "seed", "--results", str(tmp_path)]), capsys)
    assert line == f"stackcheck: --results {tmp_path} is a folder; name the file to write"


@pytest.mark.parametrize("command", ["matrix", "gpu-matrix", "tests"])
def test_a_rank_pool_switch_other_than_0_or_1_is_one_line(command, tmp_path, capsys, monkeypatch, no_environments):
    monkeypatch.setenv("STACKCHECK_RANK_POOL", "yes")
    line = one_usage_line(cli.main([command, "--sets", "seed", *(["--results", str(tmp_path / "m.json")] if command != "tests" else [])]), capsys)
    assert line == ("stackcheck: STACKCHECK_RANK_POOL='yes': 1 runs the two-rank cells on warm rank pools and trainer_resume's "
                    "resumes on a warm process, 0 starts a new process for each")


@pytest.mark.parametrize("argv, message", [
    (["--explore", "0"], "--explore 0: explore samples N configurations beyond the pairs, N at least 1"),
    (["--explore", "-3"], "--explore -3: explore samples N configurations beyond the pairs, N at least 1"),
    (["--explore", "many"], "--explore: invalid int value: 'many'"),
    (["--seed", "7"], "--seed S is the seed of --explore N: name --explore too"),
    (["--explore", "5", "--seed", "-1"], "--seed -1: a seed is 0 or more"),
])
def test_an_explore_count_or_seed_that_cannot_be_is_one_line(argv, message, tmp_path, capsys, no_environments):
    line = one_usage_line(cli.main(["matrix", "--sets", "seed", "--results", str(tmp_path / "m.json"), *argv]), capsys)
    assert line.startswith("stackcheck: ") and message in line, line


@pytest.mark.parametrize("text, message", [("{", "cannot read"), ('{"sets": [], "cells": []}', "`sets` is not an object")],
                         ids=["not JSON", "sets as a list"])
def test_matrix_over_corrupt_results_fails_before_any_build(text, message, tmp_path, capsys, no_environments):
    path = tmp_path / "matrix.json"
    path.write_text(text)
    line = one_usage_line(cli.main(["matrix", "--sets", "seed", "--results", str(path)]), capsys)
    assert str(path) in line and message in line, line


@pytest.fixture
def python_without_torch(tmp_path) -> Path:
    """An environment's python whose torch does not import, as a broken `--with torch==X` pin leaves it."""
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
                      "echo \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    python.chmod(0o755)
    return python


def test_an_environment_that_cannot_report_its_versions_is_unbuildable(python_without_torch):
    (seed,) = resolve(["seed"])
    with pytest.raises(envs.EnvBuildError) as raised:
        envs.versions_in(python_without_torch, seed)
    assert str(raised.value) == (f"the environment of set seed ({python_without_torch}) cannot report its versions: "
                                 "ModuleNotFoundError: No module named 'torch'")


def test_the_tests_command_on_such_an_environment_fails_in_one_line(python_without_torch, monkeypatch, capsys):
    monkeypatch.setattr(envs, "build", lambda *args, **kwargs: python_without_torch)
    line = one_usage_line(cli.main(["tests", "--set", "seed"]), capsys)
    assert line.startswith("stackcheck: set seed: environment not built, nothing was run or recorded: the environment of set seed (")
    assert line.endswith("No module named 'torch'")


def test_the_matrix_records_nothing_of_such_a_set(python_without_torch, tmp_path, monkeypatch, capsys):
    """No phantom set: an environment that cannot be built is a usage error before any set runs, not error cells."""
    monkeypatch.setattr(envs, "build", lambda *args, **kwargs: python_without_torch)
    path = tmp_path / "matrix.json"
    line = one_usage_line(cli.main(["matrix", "--sets", "seed", "--results", str(path)]), capsys)
    assert line.startswith("stackcheck: set seed: environment not built") and line.endswith("No module named 'torch'")
    assert not path.exists() and not path.with_suffix(".md").exists()


def test_refresh_latest_without_a_latest_set(tmp_path, monkeypatch, capsys):
    sets_file = tmp_path / "sets.toml"
    sets_file.write_text('default = "seed"\n\n[sets.seed]\ntransformers = "5.6.2"\n')
    monkeypatch.setattr(versions, "index_versions", lambda package: pytest.fail("asked the package index"))
    with pytest.raises(UsageError, match=r"has no \[sets.latest\] table to refresh"):
        versions.refresh_latest(sets_file)
    monkeypatch.setattr(setup_command, "newest_latest", functools.partial(versions.refresh_latest, sets_file))
    line = one_usage_line(cli.main(["refresh-latest"]), capsys)
    assert line == f"stackcheck: {sets_file} has no [sets.latest] table to refresh"


WRONG_KIND = [
    (["bench", "--sets", "seed", "--smoke", "--results"], "file", "--results {} is a file; name a folder"),
    (["wheelhouse", "--sets", "seed", "--dest"], "file", "--dest {} is a file; name a folder"),
    (["bisect", "accelerate", "--good", "1.15.0", "--bad", "1.13.0", "--family", "params4bit_kwargs", "--output"], "folder",
     "--output {} is a folder; name the file to write"),
]


@pytest.mark.parametrize("argv, kind, message", WRONG_KIND, ids=[f"{argv[0]} {argv[-1]}" for argv, _, _ in WRONG_KIND])
def test_a_path_option_of_the_wrong_kind_fails_before_any_build(argv, kind, message, tmp_path, capsys, no_environments):
    path = tmp_path / "given"
    if kind == "folder":
        path.mkdir()
    else:
        path.write_text("")
    assert one_usage_line(cli.main([*argv, str(path)]), capsys) == "stackcheck: " + message.format(path)


@pytest.mark.parametrize("command", [["matrix", "--sets", "seed"], ["gate", "--with", "accelerate==1.14.0"]])
def test_a_family_module_without_a_ledger_entry_fails_before_any_build(command, tmp_path, capsys, monkeypatch, no_environments):
    monkeypatch.setattr(lane, "family_modules", lambda: [*ledger.family_modules(), "new_family"])
    code = cli.main([*command, *(["--results", str(tmp_path / "out.json")] if command[0] == "matrix" else ["--output", str(tmp_path / "out")])])
    assert "no entry for family module(s) test_new_family.py" in one_usage_line(code, capsys)


# Issue 29: the rules every option follows (stackcheck.runner.inputs), one test per wrong input, each in-process.

EMPTY_VALUES = [
    (["matrix", "--sets", ""], "--sets '': an empty value names nothing"),
    (["matrix", "--sets", "  "], "--sets '  ': an empty value names nothing"),
    (["matrix", "--sets", "seed,"], "--sets 'seed,' has an empty item"),
    (["matrix", "--sets", ",seed"], "--sets ',seed' has an empty item"),
    (["matrix", "--sets", "seed, ,latest"], "--sets 'seed, ,latest' has an empty item"),
    (["matrix", "--sets", ","], "--sets ',' names nothing"),
    (["versions", "--sets", ""], "--sets '': an empty value names nothing"),
    (["matrix", "--families", ""], "--families '': an empty value names nothing"),
    (["matrix", "--families", "merge_parity,"], "--families 'merge_parity,' has an empty item"),
    (["matrix", "--arch", ""], "--arch '': an empty value names nothing"),
    (["matrix", "--arch", "llama3,,qwen3"], "--arch 'llama3,,qwen3' has an empty item"),
    (["matrix", "--results", ""], "--results '': an empty value names nothing"),
    (["matrix", "--with", ""], "--with '': an empty value names nothing"),
    (["matrix", "--with", " "], "--with ' ': an empty value names nothing"),
    (["matrix", "--find-links", ""], "--find-links '': an empty value names nothing"),
    (["tests", "--set", ""], "--set '': an empty value names nothing"),
    (["gate", "--candidate", ""], "--candidate '': an empty value names nothing"),
    (["gate", "--output", " "], "--output ' ': an empty value names nothing"),
    (["bench", "--baseline", ""], "--baseline '': an empty value names nothing"),
    (["doctor", "--python", ""], "--python '': an empty value names nothing"),
    (["doctor", "--arch", ""], "--arch '': an empty value names nothing"),
    (["repro", "--from", "m.json", "--sets", ""], "--sets '': an empty value names nothing"),
    (["repro", "--test", ""], "--test '': an empty value names nothing"),
    (["bisect", "accelerate", "--good", "1.13.0", "--bad", "1.15.0", "--family", "x", "--candidates", "1.13.0,,1.15.0"],
     "--candidates '1.13.0,,1.15.0' has an empty item"),
    (["bisect", "", "--good", "1", "--bad", "2", "--family", "x"], "PACKAGE '': an empty value names nothing"),
    (["history", "peft", "--families", ""], "--families '': an empty value names nothing"),
    (["watch", "--sets", ""], "--sets '': an empty value names nothing"),
    (["scan", ""], "MODEL '': an empty value names nothing"),
    (["scan", "fixtures/gemma4-e2b", ""], "ADAPTER '': an empty value names nothing"),
    (["merge", ""], "INPUTS '': an empty value names nothing"),
    (["wheelhouse", "--platform", ""], "--platform '': an empty value names nothing"),
    (["wheelhouse", "--cuda", ""], "--cuda '': an empty value names nothing"),
]


@pytest.mark.parametrize("argv, message", EMPTY_VALUES, ids=[" ".join(argv) for argv, _ in EMPTY_VALUES])
def test_an_empty_value_or_item_never_means_everything(argv, message, capsys, no_environments):
    assert one_usage_line(cli.main(argv), capsys).startswith(f"stackcheck: {message}")


@pytest.mark.parametrize("command", ["matrix", "gpu-matrix", "versions", "wheelhouse", "bench", "repro"])
def test_a_list_option_given_twice_adds_its_items(command):
    args = cli._parser().parse_args([command, "--sets", "seed", "--sets", "latest"])
    assert args.sets == "seed,latest"
    assert cli._parser().parse_args([command, "--set", "seed", "--sets", "latest"]).sets == "seed,latest"  # the old spelling


def test_the_matrix_runs_every_set_given_by_repeated_options(capsys):
    assert cli.main(["versions", "--sets", "seed", "--sets", "latest"]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == ["seed", "latest"]


@pytest.mark.parametrize("argv, message", [
    (["matrix", "--sets", "seed", "--sets", "seed"], "--sets names seed more than once"),
    (["matrix", "--sets", "seed,latest,seed"], "--sets names seed more than once"),
    (["matrix", "--families", "merge_parity", "--families", "merge_parity"], "--families names merge_parity more than once"),
    (["matrix", "--arch", "llama3,llama3"], "--arch names llama3 more than once"),
    (["tests", "--set", "seed", "--set", "latest"], "tests runs one set: --set names seed and latest; keep one"),
    (["gate", "--sets", "seed", "--set", "latest"], "gate runs one set: --set names seed and latest; keep one"),
    (["matrix", "--results", "a.json", "--results", "b.json"], "--results given twice"),
    (["bench", "--baseline", "seed", "--baseline", "latest"], "--baseline given twice ('seed' and 'latest'): keep one"),
    (["doctor", "--arch", "llama3", "--arch", "qwen3"], "--arch given twice ('llama3' and 'qwen3'): keep one"),
])
def test_a_repeated_name_or_option_is_refused_not_dropped(argv, message, capsys, no_environments):
    assert message in one_usage_line(cli.main(argv), capsys)


@pytest.mark.parametrize("command", ["matrix", "gpu-matrix", "tests", "versions", "wheelhouse", "bench", "bisect", "history",
                                     "watch", "gate", "repro"])
def test_every_command_takes_sets_and_the_old_set(command):
    """One spelling everywhere, `--sets`; `--set`, which the commands of one set used to take, still works."""
    required = {"bisect": ["peft", "--good", "1", "--bad", "2", "--family", "f"], "history": ["peft"]}.get(command, [])
    for spelling in ("--sets", "--set"):
        assert cli._parser().parse_args([command, *required, spelling, "seed"]).sets == "seed"
    assert "--sets" in cli._parser()._subparsers._group_actions[0].choices[command].format_help()


@pytest.mark.parametrize("argv, message", [
    (["matrix", "--sets", "seed", "-k", "merge"], "matrix: unrecognized arguments: -k (pytest's own options go after `--`"),
    (["matrix", "--bogus"], "matrix: unrecognized arguments: --bogus"),
    (["bench", "--size", "huge"], "bench: argument --size: invalid choice: 'huge'"),
    (["history", "peft", "--jobs", "two"], "history: argument --jobs: invalid int value: 'two'"),
    (["bisect", "peft"], "bisect: the following arguments are required: --good, --bad"),
    (["nope"], "argument command: invalid choice: 'nope'"),
])
def test_argparse_errors_are_one_line_too(argv, message, capsys):
    assert message in one_usage_line(cli.main(argv), capsys)


PINS = {
    "peft>=0.20": "bad pin 'peft>=0.20': a pin names one release, peft==VERSION, not a range or an exclusion (peft==0.20 pins that release)",
    "peft~=0.20": "bad pin 'peft~=0.20': a pin names one release, peft==VERSION, not a range or an exclusion (peft==0.20 pins that release)",
    "peft!=0.20": "bad pin 'peft!=0.20': a pin names one release, peft==VERSION, not a range or an exclusion",
    "peft<1": "bad pin 'peft<1': a pin names one release, peft==VERSION, not a range or an exclusion",
    "peft": f"bad pin 'peft': expected {versions.PIN_HELP}, e.g. peft==VERSION",
    "peft==": f"bad pin 'peft==': expected {versions.PIN_HELP}, e.g. peft==0.19.1",
    "pfet==0.20.0": "bad pin 'pfet==0.20.0': unknown package 'pfet'",
    "pfet>=0.20.0": "bad pin 'pfet>=0.20.0': unknown package 'pfet'",
    "peft==0.20 beta": "bad pin 'peft==0.20 beta': '0.20 beta' is not a valid version",
}


@pytest.mark.parametrize("token, message", PINS.items(), ids=PINS)
def test_a_pin_that_is_no_pin_says_what_a_pin_is(token, message, capsys, no_environments):
    assert one_usage_line(cli.main(["matrix", "--sets", "seed", "--with", token]), capsys).startswith(f"stackcheck: {message}")


def test_a_pin_with_spaces_around_its_parts_is_the_pin():
    assert versions.parse_pin(" peft == 0.20.0 ") == versions.Pin("peft", version="0.20.0")


SETS_FILES = {
    "syntax error": ('default = "seed"\n[sets.seed\n', "is not valid TOML: Expected ']'"),
    "duplicate table": ('default = "seed"\n[sets.seed]\npeft = "0.19.1"\n[sets.seed]\n', "is not valid TOML: Cannot declare ('sets', 'seed') twice"),
    "unknown default": ('default = "sed"\n[sets.seed]\n' + SEED_PINS, "default = 'sed' names no set (its sets: seed)") if (
        SEED_PINS := 'transformers = "5.6.2"\npeft = "0.19.1"\naccelerate = "1.13.0"\nbitsandbytes = "0.49.2"\n') else None,
    "no default": ('[sets.seed]\n' + SEED_PINS, "default = None names no set"),
    "misspelt package": ('default = "seed"\n[sets.seed]\n' + SEED_PINS + 'tranformers = "5.6.2"\n', "[sets.seed]: unknown key(s) tranformers"),
    "a version as a number": ('default = "seed"\n[sets.seed]\n' + SEED_PINS.replace('"0.19.1"', "0.19"), "[sets.seed]: peft must be a string"),
    "a version that is none": ('default = "seed"\n[sets.seed]\n' + SEED_PINS.replace("0.19.1", "latest"), "[sets.seed]: bad pin 'peft==latest'"),
    "a set that is no table": ('default = "seed"\nsets = {seed = "5.6.2"}\n', "[sets.seed] is not a table of pins"),
    "no sets": ('default = "seed"\n', "has no [sets.NAME] table"),
}


@pytest.mark.parametrize("text, message", SETS_FILES.values(), ids=SETS_FILES)
def test_a_broken_sets_toml_is_one_line(text, message, tmp_path, monkeypatch, capsys):
    path = tmp_path / "sets.toml"
    path.write_text(text)
    with pytest.raises(UsageError) as raised:
        versions.load_sets(path)
    assert str(raised.value).startswith(str(path)) and message in str(raised.value), raised.value
    monkeypatch.setattr(versions.load_sets, "__defaults__", (path,))
    assert message in one_usage_line(cli.main(["versions"]), capsys)


def test_find_links_that_is_a_file_says_so(capsys, no_environments):
    readme = REPO_ROOT / "README.md"
    assert one_usage_line(cli.main(["matrix", "--sets", "seed", "--find-links", str(readme)]), capsys) == (
        f"stackcheck: --find-links {readme} is a file; name a folder")


def test_bench_without_a_gpu_names_its_cpu_mode(monkeypatch, tmp_path, capsys, no_environments):
    monkeypatch.setattr(envs, "cuda_device", lambda: (_ for _ in ()).throw(UsageError("no GPU: torch 2.13.0 on this host sees no CUDA device")))
    line = one_usage_line(cli.main(["bench", "--sets", "seed", "--results", str(tmp_path / "bench")]), capsys)
    assert line == "stackcheck: no GPU: torch 2.13.0 on this host sees no CUDA device: `bench --smoke` runs on the CPU"
    line = one_usage_line(cli.main(["gate", "--with", "accelerate==1.14.0", "--bench", "tiny", "--output", str(tmp_path / "g")]), capsys)
    assert line.endswith(": `gate --bench smoke` runs on the CPU")


def test_refresh_latest_says_what_it_pinned(tmp_path, monkeypatch, capsys):
    sets_file = tmp_path / "sets.toml"
    sets_file.write_text((REPO_ROOT / "stackcheck" / "sets.toml").read_text())
    newest = {"transformers": "9.0.0", "peft": versions.load_sets()[0]["latest"].pins["peft"].version, "accelerate": "9.1.0", "bitsandbytes": "9.2.0"}
    monkeypatch.setattr(versions, "index_versions", lambda package: [versions.Version(newest[package])])
    monkeypatch.setattr(setup_command, "newest_latest", functools.partial(versions.refresh_latest, sets_file))
    monkeypatch.setattr(setup_command, "load_sets", functools.partial(versions.load_sets, sets_file))
    was = versions.load_sets()[0]["latest"].pins
    assert cli.main(["refresh-latest"]) == 0
    assert capsys.readouterr().out == (f"latest: transformers 9.0.0 (was {was['transformers']}), peft {newest['peft']}, "
                                       f"accelerate 9.1.0 (was {was['accelerate']}), bitsandbytes 9.2.0 (was {was['bitsandbytes']})\n")


def test_ctrl_c_says_what_was_kept_and_where(tmp_path, monkeypatch, capsys):
    """The run stops in its second set's pytest, after the first set's cells were recorded."""
    results_path = tmp_path / "matrix.json"
    monkeypatch.setattr(envs, "build", lambda *args, **kwargs: Path("python"))
    monkeypatch.setattr(envs, "versions_in", lambda python, vset: "")

    def pytest_run(python, vset, targets, extra, path, *args, **kwargs):
        if vset.name == "latest":
            raise KeyboardInterrupt
        cli.results.record_cells(path, [Cell.from_dict(dict(CELL, set=vset.name, test=f"t{index}[cpu]")) for index in range(3)])
        return 0

    monkeypatch.setattr(matrix_command, "run_pytest", pytest_run)
    assert cli.main(["matrix", "--sets", "seed,latest", "--families", "merge_parity", "--results", str(results_path)]) == 130
    assert capsys.readouterr().err == f"stackcheck: interrupted: kept 3 finished cells in {results_path}\n"


def test_ctrl_c_before_anything_was_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(envs, "build", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
    assert cli.main(["matrix", "--sets", "seed", "--results", str(tmp_path / "matrix.json")]) == 130
    assert capsys.readouterr().err == "stackcheck: interrupted: nothing was recorded yet\n"


LLAMA = json.loads((REPO_ROOT / "fixtures" / "architectures" / "llama3.json").read_text())


def snapshot(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("case, message", [
    ("no sizes", "cannot be shrunk: it does not state hidden_size, intermediate_size, num_attention_heads, vocab_size"),
    ("no width", "cannot be shrunk: it does not state hidden_size (as integers), so transformers' full-size default would be built"),
    ("folder without config", "is a folder without a config.json"),
    ("same folder twice", "names the architecture my_llama more than once"),
    ("builtin twice", "--arch names llama3 more than once"),
])
def test_arch_inputs_that_cannot_run_are_one_line_before_any_build(case, message, tmp_path, capsys, no_environments):
    spec = {
        "no sizes": lambda: str(snapshot(tmp_path, "tiny", {"model_type": "llama"}) / "config.json"),
        "no width": lambda: str(snapshot(tmp_path, "narrow", {k: v for k, v in LLAMA.items() if k != "hidden_size"})),
        "folder without config": lambda: str((tmp_path / "empty").mkdir() or tmp_path / "empty"),
        "same folder twice": lambda: f"{snapshot(tmp_path, 'My-Llama', LLAMA)},{tmp_path / 'My-Llama' / 'config.json'}",
        "builtin twice": lambda: "llama3, llama3",
    }[case]()
    assert message in one_usage_line(cli.main(["matrix", "--sets", "seed", "--arch", spec, "--results", str(tmp_path / "m.json")]), capsys)


def test_arch_takes_a_snapshot_folder_as_its_config(tmp_path):
    folder = snapshot(tmp_path, "My-Llama", LLAMA)
    (arch,) = cli.architectures.resolve(str(folder))
    assert arch.name == "my_llama" and arch.source == str(folder / "config.json")
    assert lane.arch_options(str(folder)) == [f"--stackcheck-arch={folder / 'config.json'}"]


def test_an_unknown_model_type_stops_before_pytest_where_the_host_has_no_transformers(tmp_path, monkeypatch, capsys):
    """The host cannot tell (no transformers), so the set's environment is asked, before its pytest starts."""
    folder = snapshot(tmp_path, "lama", LLAMA | {"model_type": "lama"})
    real_find_spec = lane.importlib.util.find_spec
    monkeypatch.setattr(lane.importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real_find_spec(name, *a))
    monkeypatch.setattr(envs, "build", lambda *args, **kwargs: Path(sys.executable))  # this harness's environment
    monkeypatch.setattr(envs, "versions_in", lambda python, vset: "")
    monkeypatch.setattr(lane.subprocess, "call", lambda *args, **kwargs: pytest.fail("pytest ran"))
    code = cli.main(["matrix", "--sets", "seed", "--arch", str(folder), "--results", str(tmp_path / "m.json")])
    version = importlib.metadata.version("transformers")
    assert one_usage_line(code, capsys) == (f"stackcheck: --arch {folder / 'config.json'}: model_type 'lama' is not one transformers "
                                            f"{version} (set seed) can build; did you mean 'llama'?")


@pytest.fixture
def llama_folder(tmp_path) -> Path:
    """A model folder as a user has one: Llama 3.2 1B's config (built on meta by scan: no weights)."""
    return snapshot(tmp_path, "Llama-3.2-1B", LLAMA)


def adapter_folder(tmp_path: Path, config: dict, weights: bool = False) -> Path:
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"} | config))
    if weights:
        (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_scan_of_an_adapter_without_weights_is_a_problem(llama_folder, tmp_path, capsys):
    adapter = adapter_folder(tmp_path, {"target_modules": ["q_proj", "v_proj"]})
    assert cli.main(["scan", str(llama_folder), str(adapter)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("== scan: building llama from ")  # it says what it does while it works
    assert (f"adapter_weights_missing:\n  - {adapter} has no adapter_model.safetensors or adapter_model.bin: "
            "PeftModel.from_pretrained cannot load it") in out
    assert "no problems found" not in out
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    cli.main(["scan", str(llama_folder), str(adapter)])
    assert "adapter_weights_missing" not in capsys.readouterr().out


@pytest.mark.parametrize("case, message", [
    ("quant type nf5", "--quantization: bitsandbytes refuses it (RuntimeError: quant_type must be nf4 or fp4, got nf5)"),
    ("compute dtype float17", "--quantization: not a BitsAndBytesConfig (module 'torch' has no attribute 'float17')"),
    ("target_modules 42", "/adapter/adapter_config.json: PEFT cannot use it (TypeError: "),
    ("an adapter config that is a list", "/adapter/adapter_config.json: not a adapter_config.json (a JSON object)"),
    ("a huge config with quantization", "/config.json: transformers cannot build the model on meta (RuntimeError: Storage size calculation overflowed"),
    ("MODEL that is a file", "MODEL {model}/config.json is a file; name a folder"),
    ("a quantization file that is a folder", "--quantization {tmp}/q.json is a folder; name a file"),
    ("--python that is a folder", "--python {tmp} is a folder; name a Python interpreter"),
])
def test_scan_inputs_that_are_wrong_are_one_line(case, message, llama_folder, tmp_path, capsys):
    model, extra = llama_folder, []
    if case == "quant type nf5":
        extra = ["--quantization", '{"load_in_4bit": true, "bnb_4bit_quant_type": "nf5"}']
    elif case == "compute dtype float17":
        extra = ["--quantization", '{"load_in_4bit": true, "bnb_4bit_compute_dtype": "float17"}']
    elif case == "target_modules 42":
        extra = [str(adapter_folder(tmp_path, {"target_modules": 42}, weights=True))]
    elif case == "an adapter config that is a list":
        (tmp_path / "adapter").mkdir()
        (tmp_path / "adapter" / "adapter_config.json").write_text("[]")
        extra = [str(tmp_path / "adapter")]
    elif case == "a huge config with quantization":
        model = snapshot(tmp_path, "huge", LLAMA | {"vocab_size": 10**12, "hidden_size": 10**9})
        extra = ["--quantization", '{"load_in_4bit": true}']
    elif case == "MODEL that is a file":
        model = llama_folder / "config.json"
    elif case == "a quantization file that is a folder":
        (tmp_path / "q.json").mkdir()
        extra = ["--quantization", str(tmp_path / "q.json")]
    elif case == "--python that is a folder":
        extra = ["--python", str(tmp_path)]
    line = one_usage_line(cli.main(["scan", str(model), *extra, "--json"]), capsys)
    assert message.format(model=llama_folder, tmp=tmp_path) in line, line


class Built(BaseException):
    """Raised by a stand-in for envs.build: the set a command would have built, and nothing after it (a BaseException:
    cli.main turns any Exception into exit 3, an internal error)."""


def test_repro_reproduces_on_the_pinned_version(tmp_path, monkeypatch, capsys):
    def build(vset, *args, **kwargs):
        raise Built(vset)

    monkeypatch.setattr(envs, "build", build)
    test_id = "tests/families/test_params4bit_kwargs.py::test_offload_hook_moves_loaded_param_to_meta"
    with pytest.raises(Built) as built:
        cli.main(["repro", "--sets", "seed", "--with", "accelerate==1.14.0", "--test", test_id, "--output", str(tmp_path)])
    (vset,) = built.value.args
    assert vset.name == "seed+accelerate==1.14.0" and str(vset.pins["accelerate"]) == "1.14.0"
    assert "== repro: set seed+accelerate==1.14.0: its environment" in capsys.readouterr().out


def test_repro_from_a_results_file_refuses_a_pin_it_would_not_reproduce_on(tmp_path, capsys, no_environments):
    line = one_usage_line(cli.main(["repro", "--from", str(matrix_json(tmp_path)), "--with", "accelerate==1.14.0"]), capsys)
    assert line.startswith("stackcheck: --with pins the set of --test; a results file's cells are reproduced on the pins they were recorded with")


def test_repro_names_the_architecture_it_builds():
    from stackcheck.models import architectures
    from stackcheck.commands.triage import repro

    llama = dataclasses.asdict(architectures.builtin()["llama3"])
    assert repro.model_built("FIXTURES = {}", llama) == (": it builds a tiny random LlamaForCausalLM (`llama3`, shrunk from "
                                                         "fixtures/architectures/llama3.json) from its config, no network")
    assert "Gemma4ForConditionalGeneration" in repro.model_built("FIXTURES = {}", dataclasses.asdict(architectures.builtin()["gemma4"]))
    assert repro.model_built("FIXTURES = {}", None) == ": it builds a tiny random Gemma 4 from its config, no network"


@pytest.mark.parametrize("argv, message", [
    (["matrix", "--sets", "seed", "--results", "out/matrix.md"], "--results {tmp}/out/matrix.md: name a .json file (its .md is written beside it)"),
    (["merge", str(REPO_ROOT / "README.md"), "--output", "merged"], "--output {tmp}/merged: name a .json file"),
    (["bisect", "peft", "--good", "1", "--bad", "2", "--family", "merge_parity", "--store", "probes"], "--store {tmp}/probes: name a .json file"),
    (["wheelhouse", "--sets", "seed", "--python-version", "twelve"], "--python-version twelve: name the target's Python as MAJOR.MINOR"),
    (["wheelhouse", "--sets", "seed", "--cuda", "13.0"], "--cuda 13.0: name the CUDA build as bitsandbytes' binaries do, e.g. 130"),
])
def test_a_value_of_the_wrong_form_is_named(argv, message, tmp_path, monkeypatch, capsys, no_environments):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(wheelhouse, "require_uv", lambda: None)
    assert message.format(tmp=tmp_path) in one_usage_line(cli.main(argv), capsys)


def test_find_links_are_made_absolute_for_the_installers(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    monkeypatch.chdir(tmp_path)

    def build(vset, find_links, *args, **kwargs):
        raise Built(find_links)

    monkeypatch.setattr(envs, "build", build)
    with pytest.raises(Built) as built:
        cli.main(["matrix", "--sets", "seed", "--find-links", "wheels", "--find-links", "https://example.org/simple", "--results", "m.json"])
    assert built.value.args[0] == [str(tmp_path / "wheels"), "https://example.org/simple"]
