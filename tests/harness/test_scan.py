"""`scan` preflights a model folder on the meta device: checked on the seed user's models, Gemma 4 E2B and E4B
(fixtures/gemma4-*/config.json, from transformers' conversion script), with the seed's adapter targets, device
map and quantization, and on the tiny fixture."""

import json

import pytest
import torch

from stackcheck import REPO_ROOT, cli
from stackcheck.core import hostinfo
from stackcheck.harness import scenario
from stackcheck.models import tiny
from tests.harness.test_usage_errors import one_usage_line


def seed_checkpoint():
    return tiny.base_checkpoint(scenario.seed_model(torch.device("cpu")).arch)


# The README's example: the seed user's adapter targets (seed 002) and quantization, as files.
SCAN_EXAMPLE = REPO_ROOT / "fixtures" / "scan-example"
SEED_ADAPTER = SCAN_EXAMPLE / "adapter"
SEED_QUANTIZATION = json.loads((SCAN_EXAMPLE / "seed_bnb.json").read_text())


def scanned(capsys, *argv) -> tuple[int, dict]:
    code = cli.main(["scan", *map(str, argv), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model, linear4bit_hits, kv_stores", [("gemma4-e2b", 205, [13, 14]), ("gemma4-e4b", 258, [22, 23])])
def test_the_seed_users_models_and_targets(model, linear4bit_hits, kv_stores, capsys):
    code, report = scanned(capsys, REPO_ROOT / "fixtures" / model, SEED_ADAPTER, "--quantization", json.dumps(SEED_QUANTIZATION),
                           "--device-map", json.dumps(scenario.SEED_USER_DEVICE_MAP))
    assert code == 1
    # Seed 002 counted 148 clippable and 205 Linear4bit hits on E2B; the shared-KV source of seeds 000/001 is 13 / 22.
    assert report["lora_targets"] == {"Gemma4ClippableLinear": 148, "Linear4bit": linear4bit_hits}
    assert report["kv_sharing"]["stored_by"] == kv_stores
    (rejected,) = report["findings"]["lora_target_rejected_by_peft"]
    assert rejected.startswith("148 targets are Gemma4ClippableLinear: Target module Gemma4ClippableLinear is not supported")
    assert rejected.endswith("target its inner `.linear` instead (e.g. 'q_proj.linear')")
    assert report["findings"]["device_map_key_names_no_module"] == [
        "'model.multi_modal_projector' names no module of Gemma4ForConditionalGeneration: accelerate ignores it"]
    assert report["quantization"]["model.vision_tower"] == {"Linear": 113}  # fp32 CPU offload keeps the CPU towers bf16


def test_a_skip_entry_that_keeps_nothing_and_packed_path_widths(monkeypatch, capsys):
    monkeypatch.setattr(hostinfo, "cpu_facts", lambda: {"cpu_flags": "avx2 avx512f avx512_bf16"})
    quantization = {"load_in_4bit": True, "llm_int8_skip_modules": ["model.vision_tower", "audio_encoder", "lm_head"]}
    _code, report = scanned(capsys, seed_checkpoint(), "--quantization", json.dumps(quantization), "--device-map", '{"": "cpu"}')
    assert report["findings"]["skip_module_keeps_nothing"] == ["llm_int8_skip_modules entry 'audio_encoder' keeps nothing unquantized"]
    assert any(line.startswith("6 4-bit layers 64 -> 16 on this avx512_bf16 CPU") for line in report["findings"]["cpu_packed_path_rejects_width"])
    monkeypatch.setattr(hostinfo, "cpu_facts", lambda: {"cpu_flags": "avx2 avx512f"})
    _code, report = scanned(capsys, seed_checkpoint(), "--quantization", json.dumps(quantization), "--device-map", '{"": "cpu"}')
    assert "cpu_packed_path_rejects_width" not in report["findings"]


@pytest.mark.parametrize("argv, message", [
    (["/no/such/model"], "MODEL /no/such/model: no such folder"),
    (["{tiny}", "--device-map", "{model.vision_tower: cpu}"], "--device-map: not JSON"),
    (["{tiny}", "--device-map", "[1, 2]"], "--device-map: expected a JSON object, got list"),
    (["{tiny}", "--quantization", '{"load_in_4bit": true, "bnb_4bit_quant_type": 3, "no_such_option": 1}'], "--quantization"),
    (["{tiny}", "{tiny}"], "it has no adapter_config.json"),
])
def test_wrong_inputs_are_one_line(argv, message, capsys):
    argv = [a.replace("{tiny}", str(seed_checkpoint())) for a in argv]
    assert message in one_usage_line(cli.main(["scan", *argv]), capsys)


def test_a_mixture_of_experts_config_is_told_its_bugs_and_its_bf16_experts(tmp_path, capsys):
    """A full-size Qwen3-30B-A3B config: the known bugs narrow to those that can live on it (none of Gemma 4's
    towers, clippable linears or KV sharing), and the fused experts that 4-bit leaves in bf16 are a finding."""
    (tmp_path / "config.json").write_text((REPO_ROOT / "fixtures" / "architectures" / "qwen3moe.json").read_text())
    _code, report = scanned(capsys, tmp_path, "--quantization", json.dumps(SEED_QUANTIZATION))
    _code, gemma = scanned(capsys, REPO_ROOT / "fixtures" / "gemma4-e2b", "--quantization", json.dumps(SEED_QUANTIZATION))

    gemma_only = {"shared_kv_redispatch", "clippable_linear_targeting", "sdpa_audio_tower", "seed_map_unknown_module"}
    assert not gemma_only & set(report["known_bugs"]) and gemma_only & set(gemma["known_bugs"])
    assert {"params4bit_kwargs", "meta_quant_state"} <= set(report["known_bugs"])
    (experts,) = report["findings"]["experts_not_quantized"]
    assert experts.startswith("96 fused expert parameters") and "95% of the weights" in experts
    planned, allocated = report["footprint"]["planned_bytes"], report["footprint"]["allocated_bytes"]
    assert 3.0 < allocated / planned < 4.0, (planned, allocated)  # about 57 GiB where 4-bit should take about 17
    assert gemma["footprint"]["planned_bytes"] == gemma["footprint"]["allocated_bytes"]  # no fused experts there
    assert "experts_not_quantized" not in gemma["findings"]
