"""The axis model: every setting users touch in the stack's configuration APIs, classified as data
(stackcheck/axes.toml) as an axis with its values or as no axis with the reason. Both sides read it: the pytest child
introspects the installed releases (stackcheck.harness.surfaces) and takes families' axes from it; docgen writes
docs/axes.md from it and the recorded snapshot of each set's fields (docs/axes-fields.json). Needs no library:
classification, checks and the page are pure. The rules and how the page stays current: docs/axes.md.
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from stackcheck import REPO_ROOT

AXES_FILE = REPO_ROOT / "stackcheck" / "axes.toml"
SNAPSHOTS = REPO_ROOT / "docs" / "axes-fields.json"
HOWS = ("auto", "dataclass", "signature", "signature+kwargs", "enum")
DEFAULT = "<default>"  # an axis value meaning: leave the field out, the library's default applies
# refused: the config class raises; refused_on_wrap: the library raises when it wraps a model with the config (PEFT's
# get_peft_model), as its own source says (the `why`); cut: left out for the cell budget.
CONSTRAINT_KINDS = ("refused", "refused_on_wrap", "cut")
NO_4BIT_PATH, OPTIM_VALUE = "no_4bit_path", "optim_value"  # reasons whose truth the snapshot can tell  # the library refuses the combination / left out for the cell budget


class AxisModelError(ValueError):
    """axes.toml does not hold together: one line, naming the key."""


@dataclass(frozen=True)
class Surface:
    id: str
    title: str
    section: str
    why: str
    classes: tuple[str, ...] = ()
    how: str = "auto"
    minus: str | None = None
    declared: tuple[str, ...] | None = None  # a surface of no class: its fields named here (ways to move a model)


@dataclass(frozen=True)
class Rule:
    index: int
    on: tuple[str, ...]
    fields: tuple[str, ...]  # names or fnmatch patterns
    values: dict | None = None  # an axis: value id -> value (DEFAULT: left out)
    reason: str | None = None  # not an axis: a key of [reasons]
    note: str = ""
    thresholds: tuple[str, ...] = ()

    @property
    def is_axis(self) -> bool:
        return self.values is not None

    def matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.fields)


@dataclass(frozen=True)
class Constraint:
    on: str
    when: dict  # field -> value id: the combination
    kind: str
    why: str


@dataclass
class Classification:
    assigned: dict[str, Rule] = field(default_factory=dict)
    unclassified: list[str] = field(default_factory=list)
    ambiguous: dict[str, list[Rule]] = field(default_factory=dict)


def value_id(value) -> str:
    """The cell id of a listed axis value: `true`, `4`, `0.1`, `nf4`; `-` is pytest's separator, so never in an id."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return re.sub(r"[^A-Za-z0-9_.]", "_", text.replace("-", "m")) if text else "empty"


@dataclass
class AxisModel:
    reasons: dict[str, str]
    surfaces: dict[str, Surface]
    rules: list[Rule]
    thresholds: dict[str, dict]
    constraints: list[Constraint]
    peft_out: dict[str, str]

    def rules_on(self, surface: str) -> list[Rule]:
        return [rule for rule in self.rules if surface in rule.on]

    def classify(self, surface: str, names: list[str]) -> Classification:
        """Each field of `surface` to the one rule that covers it; the fields no rule covers, and those two do."""
        result = Classification()
        rules = self.rules_on(surface)
        for name in names:
            hits = [rule for rule in rules if rule.matches(name)]
            if len(hits) == 1:
                result.assigned[name] = hits[0]
            elif not hits:
                result.unclassified.append(name)
            else:
                result.ambiguous[name] = hits
        return result

    def axis(self, surface: str, name: str) -> dict:
        """An axis's values (id -> value), as the families take them; KeyError where `name` is not an axis."""
        hits = [rule.values for rule in self.rules_on(surface) if rule.matches(name) and rule.values is not None]
        if len(hits) != 1:
            raise KeyError(f"{surface}.{name} is not one axis of the model ({len(hits)} axis rules match)")
        return dict(hits[0])

    def constraints_on(self, surface: str) -> list[Constraint]:
        return [c for c in self.constraints if c.on == surface]


def _values(raw, where: str) -> dict:
    if isinstance(raw, list):
        values = {value_id(value): value for value in raw}
        if len(values) != len(raw):
            raise AxisModelError(f"{where}: two values give the same id: {raw}")
    elif isinstance(raw, dict):
        values = dict(raw)
    else:
        raise AxisModelError(f"{where}: values must be a list or a table of id = value")
    if not values:
        raise AxisModelError(f"{where}: an axis needs at least one value")
    bad = [key for key in values if not re.fullmatch(r"[A-Za-z0-9_.]+", key)]
    if bad:
        raise AxisModelError(f"{where}: value ids must be letters, digits, '_' or '.': {bad}")
    return values


def parse(data: dict, where: str = "axes.toml") -> AxisModel:
    unknown = set(data) - {"reasons", "surfaces", "rules", "thresholds", "invalid", "peft_methods_out"}
    if unknown:
        raise AxisModelError(f"{where}: unknown top-level keys {sorted(unknown)}")
    reasons = dict(data.get("reasons", {}))
    surfaces = {}
    for sid, raw in data.get("surfaces", {}).items():
        extra = set(raw) - {"title", "section", "why", "classes", "how", "minus", "declared"}
        if extra:
            raise AxisModelError(f"{where}: surfaces.{sid}: unknown keys {sorted(extra)}")
        if ("classes" in raw) == ("declared" in raw):
            raise AxisModelError(f"{where}: surfaces.{sid}: give either `classes` (introspected) or `declared` (named here)")
        if raw.get("how", "auto") not in HOWS:
            raise AxisModelError(f"{where}: surfaces.{sid}.how must be one of {HOWS}")
        surfaces[sid] = Surface(sid, raw["title"], raw.get("section", "other"), raw.get("why", ""), tuple(raw.get("classes", ())),
                                raw.get("how", "auto"), raw.get("minus"),
                                tuple(raw["declared"]) if "declared" in raw else None)
    thresholds = dict(data.get("thresholds", {}))
    rules = []
    for index, raw in enumerate(data.get("rules", [])):
        at = f"{where}: rules[{index}] ({raw.get('fields')})"
        extra = set(raw) - {"on", "fields", "values", "reason", "note", "thresholds"}
        if extra:
            raise AxisModelError(f"{at}: unknown keys {sorted(extra)}")
        on = (raw["on"],) if isinstance(raw.get("on"), str) else tuple(raw.get("on", ()))
        if not on or any(s not in surfaces for s in on):
            raise AxisModelError(f"{at}: `on` must name surfaces of [surfaces]: {on}")
        if not raw.get("fields"):
            raise AxisModelError(f"{at}: no `fields`")
        if ("values" in raw) == ("reason" in raw):
            raise AxisModelError(f"{at}: a rule is an axis (`values`) or not one (`reason`), never both or neither")
        if "reason" in raw and raw["reason"] not in reasons:
            raise AxisModelError(f"{at}: reason '{raw['reason']}' is not a key of [reasons]")
        named = tuple(raw.get("thresholds", ()))
        if any(t not in thresholds for t in named):
            raise AxisModelError(f"{at}: thresholds {named} not all in [thresholds]")
        values = _values(raw["values"], at) if "values" in raw else None
        rules.append(Rule(index, on, tuple(raw["fields"]), values, raw.get("reason"), raw.get("note", ""), named))
    constraints = []
    for index, raw in enumerate(data.get("invalid", [])):
        at = f"{where}: invalid[{index}]"
        if raw.get("on") not in surfaces or not raw.get("when") or raw.get("kind") not in CONSTRAINT_KINDS or not raw.get("why"):
            raise AxisModelError(f"{at}: needs `on` (a surface), `when` (field = value id), `kind` {CONSTRAINT_KINDS} and `why`")
        constraints.append(Constraint(raw["on"], dict(raw["when"]), raw["kind"], raw["why"]))
    for tid, raw in thresholds.items():
        if not {"library", "default", "switch", "tiny"} <= set(raw):
            raise AxisModelError(f"{where}: thresholds.{tid} needs library, default, switch and tiny")
    peft_out = dict(data.get("peft_methods_out", {}))
    bad = sorted(method for method, reason in peft_out.items() if reason not in reasons)
    if bad:
        raise AxisModelError(f"{where}: peft_methods_out: {bad} name no key of [reasons]")
    model = AxisModel(reasons, surfaces, rules, thresholds, constraints, peft_out)
    for c in model.constraints:
        for name, vid in c.when.items():
            try:
                ids = model.axis(c.on, name)
            except KeyError as exc:
                raise AxisModelError(f"{where}: invalid on {c.on}: {exc.args[0]}") from None
            if vid not in ids:
                raise AxisModelError(f"{where}: invalid on {c.on}: '{vid}' is no value of {name} ({sorted(ids)})")
    return model


def load(path: Path = AXES_FILE) -> AxisModel:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise AxisModelError(f"{path.name}: {exc}") from None
    return parse(data, path.name)


# --- snapshots: each set's fields, recorded in its environment ---------------------------------------------------


def snapshots(path: Path = SNAPSHOTS) -> dict[str, dict]:
    return json.loads(path.read_text()) if path.is_file() else {}


def record_snapshot(set_name: str, snapshot: dict, path: Path = SNAPSHOTS) -> None:
    data = snapshots(path)
    data[set_name] = snapshot
    path.write_text(json.dumps(dict(sorted(data.items())), indent=1, sort_keys=True) + "\n")


def problems(model: AxisModel, snapshot: dict) -> list[str]:
    """Every field of a snapshot that no rule or two rules classify, and every PEFT adapter config with a 4-bit
    layer that is neither a surface nor out with a reason: one line each, empty when the model covers the release."""
    lines = []
    for sid, names in snapshot["surfaces"].items():
        if sid not in model.surfaces:
            continue
        found = model.classify(sid, names)
        lines += [f"{sid}.{name}: unclassified (add a rule to stackcheck/axes.toml)" for name in found.unclassified]
        lines += [f"{sid}.{name}: classified by {len(rules)} rules ({', '.join(str(r.fields) for r in rules)})"
                  for name, rules in found.ambiguous.items()]
    surfaced = {target.rpartition(".")[2].rpartition(":")[2] for s in model.surfaces.values() for target in s.classes}
    for method in snapshot.get("peft_methods", {}):
        if method not in surfaced and method not in model.peft_out:
            lines.append(f"peft.{method}: neither a surface nor in [peft_methods_out] with a reason")
        elif snapshot["peft_methods"][method] and model.peft_out.get(method) == NO_4BIT_PATH:
            lines.append(f"peft.{method}: out as {NO_4BIT_PATH}, but this release has a 4-bit path for it: classify it again")
    optim_values = {str(v) for v in model.axis("training_args", "optim").values()}
    named = {n for n, rule in model.classify("optim_names", snapshot["surfaces"].get("optim_names", [])).assigned.items()
             if rule.reason == OPTIM_VALUE}
    if "optim_names" in snapshot["surfaces"] and named != optim_values:
        lines.append(f"optim_names: the names classified {OPTIM_VALUE} {sorted(named)} are not the optim axis's values {sorted(optim_values)}")
    return lines


# --- the page -------------------------------------------------------------------------------------------------


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _show(value) -> str:
    return "(default)" if value == DEFAULT else json.dumps(value) if not isinstance(value, str) else value


def _values_text(values: dict) -> str:
    listed = all(value_id(value) == vid for vid, value in values.items())
    if listed:
        return ", ".join(f"`{_show(value)}`" for value in values.values())
    return ", ".join(f"`{vid}` = `{_show(value)}`" for vid, value in values.items())


def _versions(snapshot: dict) -> str:
    return ", ".join(f"{name} {version}" for name, version in snapshot["versions"].items())


def page(model: AxisModel, recorded: dict[str, dict], generated: str) -> str:
    sets = list(recorded)
    lines = [generated, "", "# The axis model", "",
             "Every setting a QLoRA user touches in the stack's configuration APIs, read from the installed releases "
             "and classified: an **axis** (a setting whose values change numerics, placement or serialization, with the "
             "values families cover) or **not an axis** (with the reason). The classification is data, one rule per group "
             "of fields: `stackcheck/axes.toml`. The fields are read from the libraries themselves "
             "(`stackcheck/harness/surfaces.py`: dataclass fields, signatures, the names `from_pretrained` pops from "
             "`**kwargs`), so a field a new release adds is unclassified until a rule covers it, and "
             "`tests/harness/test_axis_model.py` fails in that release's environment until then.", "",
             "**How this page stays current.** Introspection needs the libraries, the page does not: each set's fields are "
             "recorded in its own environment (`.stackcheck/envs/<set>/bin/python -m stackcheck.harness.surfaces --record "
             "<set>` writes `docs/axes-fields.json`), and this page is generated from that snapshot and axes.toml by "
             "`python -m stackcheck docs` in any Python. In the pytest child, the harness test compares the live "
             "fields with the snapshot of the set whose versions are installed (a stale snapshot fails) and classifies the "
             "live fields (an unclassified field fails, on any release); tests/harness/test_docs.py keeps this page "
             "equal to what the generator writes.", "",
             "Recorded from:", ""]
    lines += [f"- `{name}`: {_versions(snapshot)}" for name, snapshot in recorded.items()]
    lines += ["", "## Summary", "",
              "Fields per surface in each recorded set, and how the union of them is classified.", "",
              f"| surface | what | {' | '.join(f'fields ({s})' for s in sets)} | axes | not axes | unclassified |",
              f"|---|---|{'---|' * len(sets)}---|---|---|"]
    union: dict[str, list[str]] = {}
    for sid in model.surfaces:
        names: list[str] = []
        for snapshot in recorded.values():
            names += [n for n in snapshot["surfaces"].get(sid, []) if n not in names]
        union[sid] = names
    totals = [0, 0, 0]
    for sid, surface in model.surfaces.items():
        found = model.classify(sid, union[sid])
        axes = sum(1 for rule in found.assigned.values() if rule.is_axis)
        counts = [axes, len(found.assigned) - axes, len(found.unclassified) + len(found.ambiguous)]
        totals = [t + c for t, c in zip(totals, counts)]
        per_set = " | ".join(str(len(snap["surfaces"].get(sid, []))) for snap in recorded.values())
        lines.append(f"| [`{sid}`](#{sid}) | {_cell(surface.title)} | {per_set} | {counts[0]} | {counts[1]} | {counts[2]} |")
    lines.append(f"| all | | {' | '.join('' for _ in sets)} | {totals[0]} | {totals[1]} | {totals[2]} |")

    section = None
    for sid, surface in model.surfaces.items():
        if surface.section != section:
            section = surface.section
            lines += ["", f"## {section}"]
        source = ", ".join(f"`{c}`" for c in surface.classes) if surface.classes else "declared in axes.toml (no class to read)"
        minus = f"; less the fields of `{surface.minus}`" if surface.minus else ""
        lines += ["", f"### {sid}", "", f"{surface.title}. {surface.why}".strip(), "", f"Read from {source}{minus}.", ""]
        found = model.classify(sid, union[sid])
        absent = {name: [s for s in sets if name not in recorded[s]["surfaces"].get(sid, [])] for name in union[sid]}

        def where(name: str, absent: dict[str, list[str]] = absent) -> str:
            return f" (not in {', '.join(absent[name])})" if absent[name] else ""

        lines += ["| field(s) | axis: values, or why not | note |", "|---|---|---|"]
        for rule in model.rules_on(sid):
            names = [name for name, r in found.assigned.items() if r is rule]
            named_absent = [p for p in rule.fields if len(rule.on) == 1 and not any(ch in p for ch in "*?[") and p not in union[sid]]
            shown = ", ".join(f"`{n}`{where(n)}" for n in names) or "(none in these releases)"
            if named_absent:
                shown += f"; named but absent from every recorded release: {', '.join(f'`{n}`' for n in named_absent)}"
            what = f"**axis**: {_values_text(rule.values)}" if rule.values is not None else f"not an axis: {rule.reason}"
            note = rule.note + "".join(f" Threshold: [{t}](#threshold-{t})." for t in rule.thresholds)
            lines.append(f"| {_cell(shown)} | {_cell(what)} | {_cell(note)} |")
        for name in found.unclassified:
            lines.append(f"| `{name}`{where(name)} | **unclassified** | |")
        for name, rules in found.ambiguous.items():
            lines.append(f"| `{name}` | **classified twice** ({len(rules)} rules) | |")
        constraints = model.constraints_on(sid)
        if constraints:
            lines += ["", "Combinations never made a cell:", ""]
            lines += [f"- {', '.join(f'`{k}={v}`' for k, v in c.when.items())} ({c.kind}): {_cell(c.why)}" for c in constraints]

    lines += ["", "## Defaults that switch behaviour by size", "",
              "A family that meets one of these exercises both sides of it (the tiny models sit on one side by default: "
              "the `tiny` column says which, and how a family reaches the other).", "",
              "| threshold | library | where | default | what switches | the tiny models |", "|---|---|---|---|---|---|"]
    for tid, t in model.thresholds.items():
        applies = "".join(f" ({lib} {spec})" for lib, spec in t.get("applies", {}).items())
        lines.append(f"| <a id=\"threshold-{tid}\"></a>`{tid}` | {t['library']}{applies} | {_cell(t.get('where', ''))} | "
                     f"{_cell(t['default'])} | {_cell(t['switch'])} | {_cell(t['tiny'])} |")

    methods: dict[str, list[str]] = {}
    for name, snapshot in recorded.items():
        for method, bnb in snapshot.get("peft_methods", {}).items():
            methods.setdefault(method, []).append(f"{name}: {'yes' if bnb else 'no'}")
    surfaced = {c.rpartition(".")[2].rpartition(":")[2]: s.id for s in model.surfaces.values() for c in s.classes}
    lines += ["", "## PEFT's adapter methods", "",
              "Every adapter config PEFT exports, whether its tuner has a bitsandbytes layer (a `bnb` module beside it: "
              "PEFT's own 4-bit path), and whether it is a surface of the model or why not.", "",
              "| config | 4-bit layer | in the model |", "|---|---|---|"]
    for method, where_bnb in sorted(methods.items()):
        inside = f"surface [`{surfaced[method]}`](#{surfaced[method]})" if method in surfaced else model.peft_out.get(method, "**unclassified**")
        lines.append(f"| `{method}` | {', '.join(where_bnb)} | {_cell(inside)} |")

    lines += ["", "## Reasons a field is not an axis", ""]
    lines += [f"- `{key}`: {_cell(text)}" for key, text in model.reasons.items()]
    return "\n".join(lines) + "\n"
