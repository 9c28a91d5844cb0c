"""User mistakes end in one line on stderr, `stackcheck: <message>`, and exit code 2, never in a traceback,
and before any environment is built."""

import tomllib

import pytest
from packaging.specifiers import SpecifierSet

from stackcheck import REPO_ROOT, cli

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
