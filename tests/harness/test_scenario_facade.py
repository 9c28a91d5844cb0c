"""The facade `stackcheck.harness.scenario` re-exports every phase module of `stackcheck/harness/` with `import *`: a name
two phase modules define would silently resolve to the last one imported (a family calling the other's helper gets
the wrong function). Each public name of the facade's modules has one home."""

import ast
from pathlib import Path

import stackcheck.harness.scenario

HARNESS = Path(stackcheck.harness.scenario.__file__).parent


def _facade_modules() -> list[str]:
    tree = ast.parse(Path(stackcheck.harness.scenario.__file__).read_text())
    return [node.module.rsplit(".", 1)[-1] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module.startswith("stackcheck.harness.")]


def _public_names(module: str) -> set[str]:
    names = set()
    for node in ast.parse((HARNESS / f"{module}.py").read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return {name for name in names if not name.startswith("_")}


def test_no_two_facade_modules_define_the_same_public_name():
    modules = _facade_modules()
    assert len(modules) >= 5, modules
    homes: dict[str, list[str]] = {}
    for module in modules:
        for name in _public_names(module):
            homes.setdefault(name, []).append(module)
    clashes = {name: where for name, where in homes.items() if len(where) > 1}
    assert not clashes, f"names defined in more than one module behind stackcheck.harness.scenario: {clashes}"
