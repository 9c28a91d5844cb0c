"""Each precondition guard fires when its precondition is broken on purpose, so no family test can pass
without reaching its bug's scenario."""

import json
import os
import subprocess
import sys

import pytest
import torch

from stackcheck import REPO_ROOT, scenario, tiny
from stackcheck.scenario import ScenarioNotReached


def test_linear4bit_guard_fires_on_a_bf16_model():
    with pytest.raises(ScenarioNotReached, match="no bnb Linear4bit"):
        scenario.first_nested_linear4bit(scenario.load_base(quantized=False))


def test_nested_quant_state_guard_fires_without_double_quant():
    with pytest.raises(ScenarioNotReached, match="no nested"):
        scenario.first_nested_linear4bit(scenario.load_base(double_quant=False))


def test_hf_initialized_guard_fires_on_a_param_transformers_never_loaded():
    import bitsandbytes as bnb

    with pytest.raises(ScenarioNotReached, match="_is_hf_initialized"):
        scenario.require_hf_initialized("w", bnb.nn.Params4bit(torch.zeros(4, 4)))


def test_offload_guard_fires_when_nothing_4bit_was_offloaded(tmp_path):
    with pytest.raises(ScenarioNotReached, match="never dispatched"):
        scenario.require_offloaded_linear4bit(scenario.load_base(), "disk")
    # The split base offloads only the unquantized embedding table: like a big GPU, no pressure.
    split = scenario.split_base(tmp_path)
    with pytest.raises(ScenarioNotReached, match="kept every Linear4bit on the main device"):
        scenario.require_offloaded_linear4bit(split, scenario.offload_device(scenario.main_device()))


def test_adapter_effect_guard_fires_when_outputs_do_not_change():
    logits = torch.randn(1, 4, 8)
    with pytest.raises(ScenarioNotReached, match="does not change"):
        scenario.require_adapter_changes(logits, logits.clone(), "the language model")


def test_broken_fixture_makes_family_tests_error_not_pass(tmp_path):
    """Rebuild the tiny model with no shared-KV layers and no clipped linears, then run the real family
    tests: they must end as `error` (scenario not reached), never as `pass`."""
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    config = json.loads((tiny.FIXTURES_DIR / "tiny_gemma4.json").read_text())
    config["text_config"]["num_kv_shared_layers"] = 0
    config["vision_config"]["use_clipped_linears"] = False  # the wrapper stays; its clamp buffers go
    (fixtures / "tiny_gemma4.json").write_text(json.dumps(config))
    adapters = json.loads((tiny.FIXTURES_DIR / "adapters.json").read_text())
    adapters["inner_linear"]["target_modules"] = adapters["language"]["target_modules"]  # towers untouched
    (fixtures / "adapters.json").write_text(json.dumps(adapters))
    results = tmp_path / "matrix.json"
    env = dict(os.environ, STACKCHECK_FIXTURES=str(fixtures), STACKCHECK_CACHE=str(tmp_path / "cache"))
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--stackcheck-results={results}",
         "tests/families/test_shared_kv_redispatch.py::test_generate_after_peft_redispatch_matches_undispatched[cpu-bf16]",
         "tests/families/test_clippable_linear_targeting.py::test_inner_linear_targets_change_tower_and_language_outputs[cpu]"],
        cwd=REPO_ROOT, env=env, capture_output=True, check=False,
    )
    cells = json.loads(results.read_text())["cells"]
    assert len(cells) == 2
    for cell in cells:
        assert cell["verdict"] == "error", cell
        assert "scenario not reached" in cell["signature"]


def test_dequantize_guard_sees_the_4bit_layers_it_must_remove():
    model = scenario.peft_load(scenario.load_base(), "language")
    assert scenario.linear4bit_modules(model), "a 4-bit PEFT model must show bnb Linear4bit modules to the guard"
