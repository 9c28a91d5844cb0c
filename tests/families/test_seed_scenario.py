"""The seed user's setup end to end on the GPU: the controls that must work on every set, and the preflight.

Upstream: https://discuss.huggingface.co/t/cpu-offloading-error-scenario/175522 (seed 001).

Precondition proven: the base is 4-bit NF4 with nested quant state where double quant is on, the towers of
the split base really sit on the CPU while the 4-bit language layers sit on the GPU, and the adapter changes
the logits.

Symptom: docs/family-notes.md#seed_scenario.
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.models import tiny

pytestmark = pytest.mark.needs("vision_tower", "audio_tower")


def test_seed_device_map_names_existing_modules(under_test):
    with torch.device("meta"):  # the class the architecture names (not_applicable on a release that predates it)
        model = tiny.model_class(under_test.arch)(tiny.tiny_config(under_test.arch))

    missing = scenario.missing_device_map_keys(model, scenario.SEED_USER_DEVICE_MAP)

    assert not missing, f"device_map keys that match no module of Gemma 4: {', '.join(missing)}"


@pytest.mark.gpu
def test_all_gpu_4bit_peft_generate(under_test, prompt):
    """Seed 001's working setup: everything on GPU 0, 4-bit NF4 with double quant, adapter, generate."""
    base = scenario.load_base(under_test, device_map={"": 0})
    scenario.first_nested_linear4bit(base)
    base_logits = scenario.logits(base, prompt)

    model = scenario.peft_load(under_test, base, "language")

    scenario.require_adapter_changes(scenario.logits(model, prompt), base_logits, "the language model")
    assert len(scenario.greedy(model, prompt)) == 6


@pytest.mark.gpu
@pytest.mark.parametrize("double_quant", [True, False], ids=["double_quant", "single_quant"])
def test_seed_split_map_loads_and_generates(under_test, double_quant, offload_dir, prompt):
    """The seed's split map without PEFT: the towers on the CPU must not change text generation."""
    all_gpu_decode = scenario.decode(scenario.load_base(under_test, double_quant=double_quant, device_map={"": 0}), prompt)

    model = scenario.split_base(under_test, offload_dir, double_quant=double_quant)

    for tower in ("model.vision_tower", "model.audio_tower"):
        scenario.require(model.hf_device_map.get(tower) == "cpu", f"{tower} is not on the CPU: {model.hf_device_map}")
    language = {name: m for name, m in scenario.linear4bit_modules(model).items() if ".language_model." in name}
    scenario.require(language, "the split base has no 4-bit language layers")
    name, module = next(iter(language.items()))
    scenario.require(module.weight.device.type == "cuda", f"{name} is not on the GPU")
    if double_quant:
        scenario.require_nested_linear4bit(name, module)
    scenario.assert_decodes_alike(model, prompt, all_gpu_decode, "the split map decodes otherwise than all-GPU")
