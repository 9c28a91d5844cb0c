"""User mistakes end in one line on stderr, `stackcheck: <message>`, and exit code 2, never in a traceback,
and before any environment is built."""

import tomllib

from packaging.specifiers import SpecifierSet

from stackcheck import REPO_ROOT

def test_no_python_without_tomllib_is_claimed():
    claim = SpecifierSet(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    assert "3.10" not in claim and "3.11" in claim
