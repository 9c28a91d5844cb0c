"""`doctor` reads the ledger against an installed stack: which bugs affect it, what change of one package
leaves each, and what an upgrade brings in. No model, no library import: the seed set's versions stand in
for an install."""

import json
import sys

import pytest

from stackcheck import cli
from stackcheck.core import versions
from stackcheck.commands.triage import doctor
from stackcheck.core.ledger import Ledger
from tests.harness.test_usage_errors import one_usage_line

SEED = {"python": "3.12.0", "torch": "2.11.0", **{lib: pin.version for lib, pin in versions.load_sets()[0]["seed"].pins.items()}}
AVX512_BF16 = "avx2 avx512f avx512_bf16"


def diagnosed(cpu_flags: str = AVX512_BF16, installed: dict = SEED) -> dict[str, doctor.Diagnosis]:
    return {d.bug: d for d in doctor.diagnose(Ledger(), installed, cpu_flags)}


def test_a_bug_lists_the_single_package_changes_that_leave_its_range_upgrades_first():
    remedies = [str(r) for r in diagnosed()["params4bit_kwargs"].remedies]
    assert [r.split(" (brings in ", 1)[0] for r in remedies[:2]] == ["upgrade accelerate to >=1.14.0", "upgrade bitsandbytes to >=0.50.0"]
    assert "downgrade transformers to <5.0.0rc0" in remedies


def test_an_upgrade_names_the_known_bugs_it_brings_in():
    (upgrade,) = [r for r in diagnosed()["shared_kv_redispatch"].remedies if r.upgrade]
    assert (upgrade.package, upgrade.requirement) == ("transformers", ">=5.23.0") and "sdpa_audio_tower" in upgrade.brings_in


def test_bugs_no_release_fixes_are_told_apart():
    found = diagnosed()
    assert found["bnb_optimizers_cpu"].fixed_in_a_release
    assert not found["lora_on_offloaded_layer_meta"].fixed_in_a_release and not found["lora_on_offloaded_layer_meta"].remedies


def test_silent_bugs_are_marked_with_what_to_do_meanwhile():
    """Silent: the library raised nothing and only a family's assertion saw the damage; a crash inside a library
    is not silent, nor is an exception the test's own frame meets from torch (FSDP's refusal)."""
    found = diagnosed()
    assert found["bnb_fused_experts_unquantized"].silent and "scan" in found["bnb_fused_experts_unquantized"].workaround
    assert found["merge_4bit_divergence"].silent and found["merge_4bit_divergence"].workaround
    assert not found["bnb_cpu_packed_out_features"].silent  # bitsandbytes' own assert: it raises
    assert not found["params4bit_kwargs"].silent
    text = doctor.render(SEED, {}, list(found.values()), "verify")
    assert "- SILENT bnb_fused_experts_unquantized [quantized_experts, load_quantized_layers]" in text
    assert "    meanwhile: plan VRAM for the experts in bf16" in text


def test_a_cpu_bound_bug_shows_only_on_its_cpu():
    assert "bnb_cpu_packed_out_features" in diagnosed(AVX512_BF16)
    assert "bnb_cpu_packed_out_features" not in diagnosed("avx2 avx512f")


def test_the_latest_releases_leave_the_fixed_bugs():
    latest = {**SEED, **{lib: pin.version for lib, pin in versions.load_sets()[0]["latest"].pins.items()}}
    assert not [d.bug for d in diagnosed(installed=latest).values() if d.fixed_in_a_release]


def test_doctor_exits_1_on_an_affected_install_with_a_json_report(capsys):
    assert cli.main(["doctor", "--python", sys.executable, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["versions"]["python"] and report["bugs"] and report["verify"].startswith("python -m stackcheck matrix")


@pytest.mark.parametrize("python, message", [
    ("/no/such/python", "--python /no/such/python: no such file"),
    ("/bin/false", "cannot report its packages"),
    ("/usr", "--python /usr is a folder; name a Python interpreter"),
    ("/dev/null", "cannot run it"),
])
def test_an_interpreter_doctor_cannot_read_is_one_line(python, message, capsys):
    assert message in one_usage_line(cli.main(["doctor", "--python", python]), capsys)


def test_the_current_set_pins_what_this_interpreter_has(monkeypatch):
    monkeypatch.setattr(versions, "installed_versions", lambda: dict(SEED))
    (current,) = versions.resolve([versions.CURRENT_SET])
    assert {lib: str(pin) for lib, pin in current.pins.items()} == {lib: SEED[lib] for lib in versions.LIBRARIES}
    monkeypatch.setattr(versions, "installed_versions", lambda: dict(SEED, peft="absent"))
    with pytest.raises(versions.UsageError, match="has no peft installed"):
        versions.resolve([versions.CURRENT_SET])


def test_a_python_without_the_libraries_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "versions_of", lambda python: dict(SEED, peft="absent", bitsandbytes="absent"))
    assert "has no peft, bitsandbytes installed" in one_usage_line(cli.main(["doctor"]), capsys)


def test_an_architecture_narrows_the_bugs_to_those_that_can_live_on_it():
    """No towers, no KV sharing, no Gemma 4: Qwen3-MoE keeps the library bugs and none of Gemma 4's, and has PEFT 0.19's
    mixture-of-experts bugs, which Gemma 4 does not; the text-only Gemma 3's FSDP wrap bug lives on neither."""
    everything = {d.bug for d in doctor.diagnose(Ledger(), SEED, AVX512_BF16)}
    moe, gemma4, gemma3 = ({d.bug for d in doctor.diagnose(Ledger(), SEED, AVX512_BF16, doctor.builtin_arch(arch))}
                           for arch in ("qwen3moe", "gemma4", "gemma3"))
    moe_only = {"peft_moe_weightconverter_kwargs", "peft_moe_all_linear_charset"}
    gemma4_only = {"shared_kv_redispatch", "clippable_linear_targeting", "vision_tower_uint8_cast"}  # that affect seed
    # Every bug of seed lives on some built-in architecture (the newer ones hold the bugs of their own model code).
    from stackcheck.models import architectures
    per_arch = {arch: {d.bug for d in doctor.diagnose(Ledger(), SEED, AVX512_BF16, doctor.builtin_arch(arch))}
                for arch in architectures.builtin()}
    assert set().union(*per_arch.values()) == everything
    assert everything - (gemma4 | moe | gemma3) <= per_arch["qwen3next"] | per_arch["gemma3mm"]
    assert "fsdp_wrap_gemma3_text_siglip_classes" in gemma3 - (gemma4 | moe)
    assert {"params4bit_kwargs", "meta_quant_state"} | moe_only <= moe and not gemma4_only & moe
    assert gemma4_only <= gemma4 and not moe_only & gemma4


def test_an_unknown_architecture_is_one_line(capsys):
    line = one_usage_line(cli.main(["doctor", "--arch", "llama9"]), capsys)
    assert line.startswith("stackcheck: --arch: unknown architecture 'llama9'")
