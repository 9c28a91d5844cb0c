"""Each precondition guard fires when its precondition is broken on purpose, so no family test can pass
without reaching its bug's scenario."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from stackcheck import REPO_ROOT
from stackcheck.child import lanes as plugin
from stackcheck.harness import scenario
from stackcheck.harness import place
from stackcheck.models import tiny
from stackcheck.harness.scenario import ScenarioNotReached

GEMMA4 = scenario.seed_model(torch.device("cpu"))


def test_linear4bit_guard_fires_on_a_bf16_model():
    with pytest.raises(ScenarioNotReached, match="no bnb Linear4bit"):
        scenario.first_nested_linear4bit(scenario.load_base(GEMMA4, quantized=False))


def test_nested_quant_state_guard_fires_without_double_quant():
    with pytest.raises(ScenarioNotReached, match="no nested"):
        scenario.first_nested_linear4bit(scenario.load_base(GEMMA4, double_quant=False))


def test_hf_initialized_guard_fires_on_a_param_transformers_never_loaded():
    import bitsandbytes as bnb

    with pytest.raises(ScenarioNotReached, match="_is_hf_initialized"):
        scenario.require_hf_initialized("w", bnb.nn.Params4bit(torch.zeros(4, 4)))


def test_offload_guard_fires_when_nothing_4bit_was_offloaded(tmp_path):
    with pytest.raises(ScenarioNotReached, match="never dispatched"):
        scenario.require_offloaded_linear4bit(scenario.load_base(GEMMA4), "disk")
    # The split base offloads only the unquantized embedding table: like a big GPU, no pressure.
    split = scenario.split_base(GEMMA4, tmp_path)
    with pytest.raises(ScenarioNotReached, match="kept every Linear4bit on the main device"):
        scenario.require_offloaded_linear4bit(split, scenario.offload_device(GEMMA4.device))


def test_adapter_effect_guard_fires_when_outputs_do_not_change():
    logits = torch.randn(1, 4, 8)
    with pytest.raises(ScenarioNotReached, match="does not change"):
        scenario.require_adapter_changes(logits, logits.clone(), "the language model")


def test_broken_fixture_makes_family_tests_error_not_pass(tmp_path):
    """Rebuild the tiny model with no shared-KV layers and no clipped linears, then run the real family
    tests: they must end as `error` (the tiny model lacks the structures its config declares), never as
    `pass`, nor as `not_applicable` (which a model without those structures would rightly get)."""
    fixtures = tmp_path / "fixtures"
    fixtures.mkdir()
    config = json.loads((tiny.FIXTURES_DIR / "tiny_gemma4.json").read_text())
    config["text_config"]["num_kv_shared_layers"] = 0
    config["vision_config"]["use_clipped_linears"] = False  # the wrapper stays; its clamp buffers go
    (fixtures / "tiny_gemma4.json").write_text(json.dumps(config))
    adapters = json.loads((tiny.FIXTURES_DIR / "adapters.json").read_text())
    adapters["gemma4"]["inner_linear"]["target_modules"] = adapters["gemma4"]["language"]["target_modules"]  # towers untouched
    (fixtures / "adapters.json").write_text(json.dumps(adapters))
    results = tmp_path / "matrix.json"
    env = dict(os.environ, STACKCHECK_FIXTURES=str(fixtures), STACKCHECK_CACHE=str(tmp_path / "cache"))
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--stackcheck-results={results}",
         "tests/families/test_shared_kv_redispatch.py::test_generate_after_peft_redispatch_matches_undispatched[cpu-gemma4-bf16]",
         "tests/families/test_clippable_linear_targeting.py::test_inner_linear_targets_change_tower_and_language_outputs[cpu-gemma4]", "--stackcheck-arch=gemma4"],
        cwd=REPO_ROOT, env=env, capture_output=True, check=False,
    )
    cells = json.loads(results.read_text())["cells"]
    assert len(cells) == 2
    for cell in cells:
        assert cell["verdict"] == "error", cell
        assert "its config declares" in cell["signature"]


def test_dequantize_guard_sees_the_4bit_layers_it_must_remove():
    model = scenario.peft_load(GEMMA4, scenario.load_base(GEMMA4), "language")
    assert scenario.linear4bit_modules(model), "a 4-bit PEFT model must show bnb Linear4bit modules to the guard"


def family(name: str):
    """A family module, for its own guards."""
    return importlib.import_module(f"tests.families.test_{name}")


def test_tower_quantization_guard_fires_on_a_bf16_model():
    with pytest.raises(ScenarioNotReached, match="model.vision_tower holds no bnb Linear4bit"):
        scenario.require_linear4bit_under(scenario.load_base(GEMMA4, quantized=False), "model.vision_tower")


def test_tower_response_guard_fires_when_the_output_ignores_the_input():
    with pytest.raises(ScenarioNotReached, match="does not respond to its input"):
        family("quantized_towers").bf16_response(GEMMA4, lambda under_test, model: torch.zeros(2, 3))


def test_patch_embedder_guard_fires_when_the_pixels_never_reach_it(monkeypatch):
    towers = family("quantized_towers")
    monkeypatch.setattr(towers, "vision_response", lambda under_test, model: torch.ones(2, 3))
    with pytest.raises(ScenarioNotReached, match="never reached the 4-bit patch embedder"):
        towers.test_4bit_vision_tower_sees_the_image(GEMMA4)


def test_skip_list_reading_matches_what_users_mean():
    model = scenario.load_base(GEMMA4)
    skips = scenario.ineffective_skips
    assert skips(model, ["vision_tower", "model.multi_modal_projector", "lm_head"]) == ["vision_tower", "model.multi_modal_projector"]
    assert skips(scenario.load_base(GEMMA4, quantized=False), ["vision_tower", "model.audio_tower"]) == []


def test_redispatch_guards_fire_on_a_base_peft_does_not_redispatch(monkeypatch, tmp_path):
    placement = family("peft_redispatch_placement")
    monkeypatch.setattr(scenario, "split_base", lambda under_test, offload_dir, quantized: scenario.load_base(under_test, quantized=quantized))
    monkeypatch.setattr(place, "split_base", scenario.split_base)  # towers_offloaded_base calls it inside harness.place
    with pytest.raises(ScenarioNotReached, match="sits in one place"):
        placement.redispatched_by_peft(GEMMA4, False, tmp_path)
    monkeypatch.setattr(placement, "placement", lambda model: {"w": "offloaded", "v": "cpu"})
    with pytest.raises(ScenarioNotReached, match="PEFT did not redispatch"):
        placement.redispatched_by_peft(GEMMA4, False, tmp_path)


def test_towers_offload_guard_fires_when_the_towers_stay_loaded(monkeypatch, tmp_path):
    monkeypatch.setattr(scenario, "dispatch_with_offload", lambda under_test, model, offload_dir, *modules: model)
    monkeypatch.setattr(place, "dispatch_with_offload", scenario.dispatch_with_offload)
    with pytest.raises(ScenarioNotReached, match="did not offload the towers"):
        scenario.towers_offloaded_base(GEMMA4, tmp_path)


def test_cache_guard_fires_on_a_forward_that_returned_no_cache():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    with pytest.raises(ScenarioNotReached, match="returned no cache"):
        family("cache_parity").require_cache(CausalLMOutputWithPast(logits=torch.zeros(1, 2, 3)))


@pytest.mark.parametrize(("markers", "gpus", "reason"), [
    ((), 1, None),
    ((), 0, "GPU lane: torch sees no CUDA device"),
    ((pytest.mark.cpu,), 2, "GPU lane: the test is about a CPU code path"),
    ((pytest.mark.gpus(2),), 1, "GPU lane: needs 2 GPUs, torch sees 1"),
    ((pytest.mark.gpus(2),), 2, None),
])
def test_gpu_lane_skips_say_why(markers, gpus, reason):
    class Node:
        def get_closest_marker(self, name):
            return next((m.mark for m in markers if m.mark.name == name), None)

    assert plugin.gpu_lane_skip_reason(Node(), gpus) == reason


def test_optimizer_guard_fires_when_no_lora_weight_moved():
    weights = {"lora_A": torch.ones(2, 2)}
    with pytest.raises(ScenarioNotReached, match="moved no LoRA weight"):
        family("qlora_step").require_optimizer_moved(weights, {"lora_A": torch.ones(2, 2)})


def test_checkpointing_guards_fire_without_recompute_or_without_gradients():
    checkpointing = family("checkpointing_kv_sharing")
    model = checkpointing.lora_model(GEMMA4, quantized=False)
    with pytest.raises(ScenarioNotReached, match="checkpointing did not recompute"):
        checkpointing.checkpointed_gradients(GEMMA4, model)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.zeros_(param)  # LoRA's own init: A gets no gradient at the first step
    with pytest.raises(ScenarioNotReached, match="get no gradient even without checkpointing"):
        checkpointing.reference_gradients(GEMMA4, model)
