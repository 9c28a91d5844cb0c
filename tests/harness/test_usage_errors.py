"""User mistakes end in one line on stderr, `stackcheck: <message>`, and exit code 2, never in a traceback,
and before any environment is built; path options are absolute from the start; an environment that cannot
report its versions counts as unbuildable. Fast: no network, no environment."""

import functools
import json
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from stackcheck import REPO_ROOT, cli, envs, lane, ledger, versions, wheelhouse
from stackcheck.versions import UsageError, resolve

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
    assert line.startswith("stackcheck: the environment of set seed (") and line.endswith("No module named 'torch'")


def test_the_matrix_records_such_a_set_as_unbuildable(python_without_torch, tmp_path, monkeypatch):
    monkeypatch.setattr(envs, "build", lambda *args, **kwargs: python_without_torch)
    path = tmp_path / "matrix.json"
    assert cli.main(["matrix", "--sets", "seed", "--results", str(path)]) == 1
    cells = json.loads(path.read_text())["cells"]
    assert cells and all(c["set"] == "seed" and c["verdict"] == "error" for c in cells)
    assert all(c["signature"].startswith("environment not built: the environment of set seed") for c in cells)


def test_refresh_latest_without_a_latest_set(tmp_path, monkeypatch, capsys):
    sets_file = tmp_path / "sets.toml"
    sets_file.write_text('default = "seed"\n\n[sets.seed]\ntransformers = "5.6.2"\n')
    monkeypatch.setattr(versions, "index_versions", lambda package: pytest.fail("asked the package index"))
    with pytest.raises(UsageError, match=r"has no \[sets.latest\] table to refresh"):
        versions.refresh_latest(sets_file)
    monkeypatch.setattr(cli, "refresh_latest", functools.partial(versions.refresh_latest, sets_file))
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
    code = cli.main([*command, "--results" if command[0] == "matrix" else "--output", str(tmp_path / "out")])
    assert "no entry for family module(s) test_new_family.py" in one_usage_line(code, capsys)
