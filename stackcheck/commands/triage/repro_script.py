"""The standalone `repro.py` of one family test: its code and exactly the helpers it reaches, with no stackcheck import.

The script is cut from the sources the verdict came from, not written by hand (the test function, the definitions
it uses and the transitive closure of the helpers they call), with the tiny fixtures inline and the test's
parameters from pytest's own collection: so it calls the libraries exactly as the family test does. How it is cut:
docs/internals.md, "commands/triage/repro_script.py".
"""

from __future__ import annotations

import ast
import json
import pprint
import re
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.core.ledger import family_path

HELPER_MODULES = ("tiny", "architectures", "hostinfo", "scenario")  # in dependency order: each uses only those before it
# The tiny module's file and cache plumbing, replaced by inline fixtures and a temporary folder.
REPLACED = {
    "_fixture": '''def _fixture(name: str) -> dict:
    return json.loads(json.dumps(FIXTURES[name]))
''',
    "_cache_dir": '''def _cache_dir(model: str = "tiny-gemma4", fixtures=()) -> Path:
    return CACHE
''',
}
FIXTURE_VALUES = {
    "prompt": "prompt(DEVICE)",
    "device": "DEVICE",
    "arch": "ARCH",
    "under_test": "UnderTest(ARCH, DEVICE)",
    "offload_dir": "Path(tempfile.mkdtemp()) / 'offload'",
    "tmp_path": "Path(tempfile.mkdtemp())",
}
PRELUDE = '''import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"  # no network: every model is built from its config
'''


class ReproUnsupported(Exception):
    """The test cannot be cut into a standalone script (a fixture the script cannot stand in for)."""


# Where each helper module lives, by the name the families call it through. `scenario` is a facade over the
# harness's phase modules: its definitions are theirs, read in an order where each uses only those before it.
HARNESS_PHASES = ("proof", "subject", "generate", "load", "place", "adapt", "train", "trainer")
HELPER_PATHS = {"tiny": ("stackcheck/core/locking.py", "stackcheck/models/tiny.py"), "architectures": ("stackcheck/models/architectures.py",),
                "hostinfo": ("stackcheck/core/hostinfo.py",),
                "scenario": tuple(f"stackcheck/harness/{phase}.py" for phase in HARNESS_PHASES)}


def _module_paths(module: str) -> list[Path]:
    return [REPO_ROOT / path for path in HELPER_PATHS[module]]


class _Source:
    """One module's top-level definitions: name -> (node, source text), and its import statements. Several files
    read as one module (the harness's phases behind `scenario`) are joined, their `__future__` imports dropped."""

    def __init__(self, *paths: Path):
        self.text = "\n".join(re.sub(r"^from __future__ import .*$", "", path.read_text(), flags=re.MULTILINE) for path in paths)
        # A phase module's function-local import of another phase (a late import that avoids a cycle) names
        # definitions the joined module already has: it becomes a no-op, so the script imports nothing of stackcheck.
        self.text = re.sub(r"^(\s+)from stackcheck\.harness\.\w+ import (?:\([^)]*\)|.*)$", r"\1pass", self.text, flags=re.MULTILINE)
        self.tree = ast.parse(self.text)
        self.definitions: dict[str, ast.stmt] = {}
        self.imports: list[ast.Import | ast.ImportFrom] = []
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                self.definitions[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            self.definitions[name.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                self.definitions[node.target.id] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__":
                self.imports.append(node)

    def segment(self, node: ast.stmt, strip_decorators: bool = False) -> str:
        decorators = node.decorator_list if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else []
        start = node.lineno if strip_decorators or not decorators else decorators[0].lineno
        return "\n".join(self.text.splitlines()[start - 1 : node.end_lineno]) + "\n"


def _references(node: ast.AST, with_decorators: bool = True) -> tuple[set[str], set[tuple[str, str]]]:
    """Bare names a definition reads, and the `module.attr` pairs it reads (a test's pytest marks left out)."""
    names, attributes = set(), set()
    parts = [node] if with_decorators or not isinstance(node, ast.FunctionDef) else [node.args, *node.body]
    for child in (c for part in parts for c in ast.walk(part)):
        if isinstance(child, ast.Name):
            names.add(child.id)
        elif isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name):
            attributes.add((child.value.id, child.attr))
    return names, attributes


def _closure(sources: dict[str, _Source], roots: list[tuple[str, str]], test: str) -> list[tuple[str, str]]:
    """(module, name) of every definition reachable from `roots`, in the order they must be defined."""
    seen: set[tuple[str, str]] = set()
    pending = list(roots)
    while pending:
        module, name = pending.pop()
        if (module, name) in seen or name not in sources[module].definitions:
            continue
        seen.add((module, name))
        if name in REPLACED:
            continue
        names, attributes = _references(sources[module].definitions[name], with_decorators=(module, name) != ("family", test))
        pending += [(module, n) for n in names]
        pending += [(owner, attr) for owner, attr in attributes if owner in HELPER_MODULES]
    order = [*HELPER_MODULES, "family"]
    return sorted(seen, key=lambda item: (order.index(item[0]), sources[item[0]].definitions[item[1]].lineno))


def _unqualify(text: str) -> str:
    return re.sub(rf"\b(?:{'|'.join(HELPER_MODULES)})\.(?=\w)", "", text)


def build(family: str, test_name: str, params: dict[str, str], fixtures: list[str], lane: str, header: str,
          arch: dict | None = None) -> str:
    """repro.py for `test_name` of `family`; `params` maps each parameter to the repr of its value; `arch` is the
    architecture under test's fields (`Architecture`), written into the script as ARCH."""
    missing = [f for f in fixtures if f not in FIXTURE_VALUES]
    if missing:
        raise ReproUnsupported(f"{test_name} uses fixtures a standalone script cannot stand in for: {', '.join(missing)}")
    sources = {module: _Source(*_module_paths(module)) for module in HELPER_MODULES}
    sources["family"] = _Source(REPO_ROOT / family_path(family))
    if test_name not in sources["family"].definitions:
        raise ReproUnsupported(f"test_{family}.py has no function {test_name}")
    roots = [("family", test_name), ("scenario", "lane_device")] + [("scenario", "prompt")] * ("prompt" in fixtures)
    roots += [("architectures", "Architecture"), ("scenario", "UnderTest")] * (arch is not None)
    definitions = _closure(sources, roots, test_name)
    clashes = sorted({n for _m, n in definitions if sum(n == other for _o, other in definitions) > 1})
    if clashes:
        raise ReproUnsupported(f"names defined in more than one module: {', '.join(clashes)}")
    body = []
    emitted: set[int] = set()
    for module, name in definitions:
        if name in REPLACED:
            body.append(REPLACED[name])
            continue
        node = sources[module].definitions[name]
        if id(node) in emitted:  # one assignment can define several names
            continue
        emitted.add(id(node))
        text = sources[module].segment(node, strip_decorators=(module == "family" and name == test_name))
        # The helpers call each other by bare name; the test keeps `scenario.x`, so its own locals never shadow a helper.
        body.append(text if module == "family" else _unqualify(text))
    family_nodes = [sources["family"].definitions[n] for m, n in definitions if m == "family"]
    qualified = sorted({(owner, attr) for node in family_nodes for owner, attr in _references(node)[1] if owner in HELPER_MODULES})
    for owner in sorted({owner for owner, _attr in qualified}):
        members = ", ".join(f"{attr}={attr}" for o, attr in qualified if o == owner)
        body.insert(len(body) - len(family_nodes), f"{owner} = SimpleNamespace({members})  # stackcheck's {owner} helpers, as the test calls them\n")
    code = "\n\n".join(body)
    used, _attributes = _references(ast.parse(code))
    bound = {alias.asname or alias.name.split(".")[0] for node in ast.parse(PRELUDE).body
             if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
    imports = []
    for module in [*HELPER_MODULES, "family"]:
        for node in sources[module].imports:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stackcheck"):
                continue
            names = {alias.asname or alias.name.split(".")[0] for alias in node.names}
            if names & used and not names <= bound:
                imports.append(sources[module].segment(node))
                bound |= names
    uses_tiny = any(name == "_fixture" for _module, name in definitions)
    fixtures_data = {name: json.loads((REPO_ROOT / "fixtures" / name).read_text()) for name in ("tiny_gemma4.json", "adapters.json")}
    inline = (f"FIXTURES = {pprint.pformat(fixtures_data, width=110, sort_dicts=False)}\n"
              'CACHE = Path(tempfile.mkdtemp(prefix="repro-tiny-"))  # where the tiny checkpoints are built\n\n') if uses_tiny else ""
    arguments = [f"{p}={value}" for p, value in params.items()] + [f"{f}={FIXTURE_VALUES[f]}" for f in fixtures]
    arch_line = f"ARCH = Architecture(**{pprint.pformat(arch, width=110, sort_dicts=False)})\n" if arch else ""
    main = f'''DEVICE = lane_device({lane!r})
{arch_line}

def main():
    {test_name}({", ".join(arguments)})


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        traceback.print_exc()
        first_line = (str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)).strip().splitlines()
        print(f"REPRODUCED {{type(exc).__name__}}: {{first_line[0] if first_line else ''}}")
        sys.exit(1)
    print("NOT REPRODUCED: the test passed")
'''
    return "\n".join([header, "from __future__ import annotations\n", PRELUDE + "".join(imports), inline + code, "", main])
