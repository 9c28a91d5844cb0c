"""The axis model covers the installed releases (issue 46): every field the libraries' configuration APIs have here is
classified by exactly one rule of stackcheck/axes.toml, the recorded fields of this set are current, the size
thresholds hold as recorded, and the combinations declared refused are refused by the library. Runs in the set's
environment (it introspects the libraries); docs/axes.md says how the page stays current."""

import inspect

import pytest

from stackcheck.core import axis_model
from stackcheck.harness import surfaces


@pytest.fixture(scope="module")
def model():
    return axis_model.load()


@pytest.fixture(scope="module")
def live(model):
    return {**surfaces.introspect(model), "peft_methods": surfaces.peft_methods()}


def test_every_field_of_the_installed_releases_is_classified_once(model, live):
    counts = {sid: len(names) for sid, names in live["surfaces"].items()}
    assert all(counts[sid] > 0 for sid in model.surfaces), f"a surface read no field: {counts}"  # the introspection ran
    problems = axis_model.problems(model, live)
    assert not problems, "the axis model does not cover the installed releases:\n" + "\n".join(problems)


def test_the_recorded_fields_of_this_set_are_current(live):
    recorded = {name: snap for name, snap in axis_model.snapshots().items() if snap["versions"] == live["versions"]}
    if not recorded:
        pytest.skip(f"no set recorded in docs/axes-fields.json has these versions ({live['versions']})")
    for name, snapshot in recorded.items():
        assert snapshot == live, (f"docs/axes-fields.json's {name} is not what these releases have: run "
                                  f"`python -m stackcheck.harness.surfaces --record {name}` here, then docgen")


def test_the_thresholds_hold_in_the_installed_release(model):
    from packaging.specifiers import SpecifierSet

    versions = surfaces.installed_versions()
    checked = 0
    for tid, threshold in model.thresholds.items():
        here = all(versions[lib] in SpecifierSet(spec) for lib, spec in threshold.get("applies", {}).items())
        if not here:
            where, text = threshold["check_source"]
            assert text not in surfaces.source_of(where), f"{tid}: `{text}` is in {where} again: widen `applies`"
            checked += 1
            continue
        if "check_default" in threshold:
            spec, recorded = threshold["check_default"]
            default = surfaces.live_default(spec)
            assert default == recorded, f"{tid}: {spec} defaults to {default!r} here, recorded {recorded!r}"
            checked += 1
        if "check_source" in threshold:
            where, text = threshold["check_source"]
            assert text in surfaces.source_of(where), f"{tid}: `{text}` is no longer in {where}: the threshold moved"
            checked += 1
    assert checked >= len(model.thresholds), "a threshold has nothing checked against the release"


def test_refused_combinations_are_refused_by_the_library(model):
    refused = [c for c in model.constraints if c.kind == "refused"]
    assert refused
    for constraint in refused:
        surface = model.surfaces[constraint.on]
        make = surfaces.resolve(surface.classes[0])
        kwargs = {name: model.axis(constraint.on, name)[vid] for name, vid in constraint.when.items()}
        with pytest.raises((ValueError, TypeError)):
            make(**kwargs)
        # each field alone is accepted: the refusal is the combination's
        for name, value in kwargs.items():
            make(**{name: value})


def test_from_pretrained_reads_its_placement_arguments_from_kwargs():
    from transformers import PreTrainedModel

    popped = surfaces.popped_kwargs(PreTrainedModel.from_pretrained)
    assert {"device_map", "max_memory", "offload_folder", "offload_buffers", "quantization_config"} <= set(popped)
    assert "device_map" not in inspect.signature(PreTrainedModel.from_pretrained).parameters


def test_a_field_no_rule_covers_is_reported(model, live):
    snapshot = {**live, "surfaces": {**live["surfaces"], "lora": [*live["surfaces"]["lora"], "use_brand_new_thing"]}}
    assert axis_model.problems(model, snapshot) == ["lora.use_brand_new_thing: unclassified (add a rule to stackcheck/axes.toml)"]


def test_a_field_two_rules_cover_is_reported(model, live):
    data = {"reasons": {"r": "why"}, "surfaces": {"s": {"title": "t", "declared": ["a_x", "b"]}},
            "rules": [{"on": "s", "fields": ["a_*"], "reason": "r"}, {"on": "s", "fields": ["a_x", "b"], "values": [1, 2]}]}
    found = axis_model.parse(data).classify("s", ["a_x", "b", "c"])
    assert list(found.ambiguous) == ["a_x"] and found.unclassified == ["c"] and found.assigned["b"].values == {"1": 1, "2": 2}


@pytest.mark.parametrize("broken, says", [
    ({"rules": [{"on": "s", "fields": ["a"], "reason": "nope"}]}, "not a key of [reasons]"),
    ({"rules": [{"on": "s", "fields": ["a"], "reason": "r", "values": [1]}]}, "never both or neither"),
    ({"rules": [{"on": "t", "fields": ["a"], "reason": "r"}]}, "must name surfaces"),
    ({"rules": [{"on": "s", "fields": ["a"], "values": {"a-b": 1}}]}, "value ids"),
    ({"invalid": [{"on": "s", "when": {"a": "3"}, "kind": "refused", "why": "w"}],
      "rules": [{"on": "s", "fields": ["a"], "values": [1, 2]}]}, "no value of a"),
])
def test_a_broken_model_is_one_line_naming_the_key(broken, says):
    data = {"reasons": {"r": "why"}, "surfaces": {"s": {"title": "t", "declared": ["a"]}}, **broken}
    with pytest.raises(axis_model.AxisModelError, match=None) as raised:
        axis_model.parse(data)
    assert says in str(raised.value) and "\n" not in str(raised.value)
