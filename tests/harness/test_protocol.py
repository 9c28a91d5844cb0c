"""The boundary's vocabulary has one home: every STACKCHECK_* variable is declared in stackcheck/core/protocol.py's
registry (docs/variables.md is generated from it), and the package names no other."""

import ast
import re
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.core import protocol

PACKAGE = REPO_ROOT / "stackcheck"
NAME = re.compile(r"STACKCHECK_[A-Z0-9_]+")


def test_a_variable_is_declared_in_the_protocol_alone():
    declared = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(protocol.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                declared.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.value}")
    assert not declared, f"declare these in stackcheck/core/protocol.py (VARIABLES): {declared}"


def test_every_variable_the_package_mentions_is_registered():
    mentioned = {name for path in PACKAGE.rglob("*.py") for name in NAME.findall(path.read_text())}
    assert mentioned <= set(protocol.VARIABLES), sorted(mentioned - set(protocol.VARIABLES))
