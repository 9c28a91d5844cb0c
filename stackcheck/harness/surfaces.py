"""The configuration surface of the installed releases, read from the libraries themselves: each surface of the axis
model (stackcheck/axes.toml) names classes or functions, and this lists their fields (dataclass fields, else the
signature's parameters; for `from_pretrained` also the names it pops from `**kwargs`; for an enum its values). A field
a new release adds then reaches `stackcheck.core.axis_model`'s classification unclassified, and
tests/harness/test_axis_model.py fails until axes.toml classifies it. How the page stays current: docs/axes.md.

Runs in a set's environment (it imports the libraries). `python -m stackcheck.harness.surfaces --record SET` writes
this environment's fields to docs/axes-fields.json, the snapshot docs/axes.md is generated from.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import importlib.metadata
import inspect
import importlib.util
import json
import textwrap

from stackcheck.core import axis_model

LIBRARIES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "deepspeed", "trl")
# Parameters that are the object or the call's plumbing, never a setting.
PLUMBING = {"self", "cls", "params", "args", "kwargs", "model_args"}


def resolve(target: str):
    """`module:Qual.name` -> the object."""
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def popped_kwargs(function) -> list[str]:
    """The names `function` reads from its `**kwargs` (`kwargs.pop("x", ...)`, `kwargs.get("x")`), in order."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    names = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("pop", "get")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "kwargs"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.append(node.args[0].value)
    return list(dict.fromkeys(names))


def fields_of(obj, how: str = "auto") -> list[str]:
    """The settings of one class or function, by `how`: `dataclass`, `signature`, `signature+kwargs`, `enum`, or
    `auto` (an enum's values, a dataclass's fields, else the signature of the class's `__init__` or the function)."""
    if how == "enum" or (how == "auto" and isinstance(obj, type) and issubclass(obj, enum.Enum)):
        return [str(member.value) for member in obj]
    if how == "dataclass" or (how == "auto" and dataclasses.is_dataclass(obj) and len(dataclasses.fields(obj)) > 1):
        return [field.name for field in dataclasses.fields(obj)]
    function = obj.__init__ if isinstance(obj, type) else obj
    names = [name for name, p in inspect.signature(function).parameters.items()
             if name not in PLUMBING and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if how == "signature+kwargs":
        names += [name for name in popped_kwargs(function) if name not in names]
    return names


def surface_fields(surface: axis_model.Surface) -> list[str]:
    """Every field of a surface in this environment: the union over its classes, less its base's fields."""
    if surface.declared is not None:
        return list(surface.declared)
    names: list[str] = []
    for target in surface.classes:
        names += [name for name in fields_of(resolve(target), surface.how) if name not in names]
    if surface.minus:
        base = set(fields_of(resolve(surface.minus)))
        names = [name for name in names if name not in base]
    return names


def installed_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def introspect(model: axis_model.AxisModel | None = None) -> dict:
    """This environment's snapshot: the libraries' versions and every surface's fields."""
    model = model or axis_model.load()
    return {"versions": installed_versions(),
            "surfaces": {surface.id: surface_fields(surface) for surface in model.surfaces.values()}}


def peft_methods() -> dict[str, bool]:
    """Every adapter config PEFT exports (a PeftConfig subclass) -> whether its tuner has a 4-bit path: a `bnb` module
    in its tuner package (PEFT's bitsandbytes layers), or code that resolves a quantized base layer through PEFT's
    generic quantization backend (`resolve_quantization_backend`, which replaced some `bnb` modules in PEFT 0.21)."""
    from pathlib import Path

    import peft

    methods = {}
    for name in sorted(dir(peft)):
        obj = getattr(peft, name)
        if isinstance(obj, type) and issubclass(obj, peft.PeftConfig) and obj.__module__.startswith("peft.tuners."):
            folder = Path(importlib.import_module(obj.__module__).__file__).parent
            methods[name] = (folder / "bnb.py").is_file() or any(
                "resolve_quantization_backend" in path.read_text() for path in folder.glob("*.py"))
    return methods


def live_default(spec: str):
    """`module:Qual.name(param)` -> the default of that parameter in the installed release."""
    target, _, param = spec.rstrip(")").partition("(")
    obj = resolve(target)
    function = obj.__init__ if isinstance(obj, type) else obj
    return inspect.signature(function).parameters[param].default


def source_of(spec: str) -> str:
    return inspect.getsource(resolve(spec))


# --- a family's axes, taken from the model ----------------------------------------------------------------------


def cell_id(name: str, value_id: str) -> str:
    """A model axis value's id in a cell: `use_dora.true`, so a cell reads without the axis order at hand (`.`, not
    `=`: pytest's `-k` takes it)."""
    return f"{name}.{value_id}"


def model_axes(surface: str, *names: str, model: axis_model.AxisModel | None = None) -> dict[str, dict]:
    """Axes of `surface` by field name, for `@pytest.mark.axes(**...)`: each field -> {cell id: value}, the values as
    axes.toml lists them (`axis_model.DEFAULT`: leave the field out)."""
    model = model or axis_model.load()
    return {name: {cell_id(name, vid): value for vid, value in model.axis(surface, name).items()} for name in names}


def model_invalid(surface: str, axes: dict[str, dict], model: axis_model.AxisModel | None = None) -> list[dict[str, str]]:
    """The model's invalid combinations on `surface` among `axes` (refused by the library, or cut), as
    `@pytest.mark.axes_invalid(*...)` takes them."""
    model = model or axis_model.load()
    return [{name: cell_id(name, vid) for name, vid in c.when.items()}
            for c in model.constraints_on(surface) if set(c.when) <= set(axes)]


def explore_axes(surface: str, *names: str, model: axis_model.AxisModel | None = None) -> dict[str, dict]:
    """Axes of `surface` for `@pytest.mark.axes_explore` (axes only explore mode varies): as `model_axes`, but each
    axis's first value is `axis_model.DEFAULT`, the field left out. The pairs hold such an axis at its first value, so
    their configuration is what it was without the axis; that value must be what leaving the field out gives (the
    library's default, or the adapter fixture's)."""
    axes = model_axes(surface, *names, model=model)
    return {name: {vid: axis_model.DEFAULT if i == 0 else value for i, (vid, value) in enumerate(values.items())}
            for name, values in axes.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stackcheck.harness.surfaces", description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", metavar="SET", help="write this environment's fields to docs/axes-fields.json under SET")
    args = parser.parse_args(argv)
    snapshot = {**introspect(), "peft_methods": peft_methods()}
    if args.record:
        axis_model.record_snapshot(args.record, snapshot)
        print(f"recorded {args.record} in {axis_model.SNAPSHOTS.relative_to(axis_model.REPO_ROOT)}")
    else:
        print(json.dumps(snapshot, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
