"""Guards of the adapt and merge contract families: each family test, run for real on the tiny Llama 3 with one
library or harness piece broken on purpose in the way its class of bug breaks it, fails with the family's
message (or, where the precondition is what breaks, stops as not reached); and the ledger names what the
families meet by mechanism, on real failures of the real tests."""

import importlib

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.harness import adapt
from stackcheck.core.ledger import KNOWN_BUG, NEW_FAILURE, Failure, Ledger
from stackcheck.models import architectures, tiny
from stackcheck.harness.scenario import ScenarioNotReached, ToleranceExceeded
from stackcheck.core.versions import installed_versions

LLAMA3 = scenario.UnderTest(architectures.builtin()["llama3"], torch.device("cpu"))  # no KV-shared layers


def held_by_the_pairs(module) -> dict:
    """The value a pairwise cell passes for each of a test's explore-only axes (its first: the field left out)."""
    return {name: next(iter(values.values())) for name, values in module.EXPLORED.items()}


def contract(phase: str, family: str):
    return importlib.import_module(f"tests.contract.{phase}.test_{family}")


def judged(family: str, test_name: str, exc: BaseException, model_type: str = "llama"):
    return Ledger().judge(family, test_name, installed_versions(), Failure.from_exception(exc), model_type)


@pytest.fixture
def prompt():
    return scenario.prompt(LLAMA3.device)


# --- adapter_placement ---------------------------------------------------------------------------------------------


def adapter_off_where_the_base_is_offloaded(peft_load):
    """PEFT's load, but every LoRA layer whose base weight waits on meta adds nothing: an adapter lost on the
    offloaded layers (the class of peft PR #3468, whose adapter weights never reached the offload index)."""
    def load(under_test, base, adapter, **kwargs):
        model = peft_load(under_test, base, adapter, **kwargs)
        for layer in scenario.lora_layers(model).values():
            if layer.get_base_layer().weight.device.type == "meta":
                layer.enable_adapters(False)
        return model
    return load


def test_placement_fails_when_the_offloaded_layer_loses_its_adapter(monkeypatch, tmp_path, prompt, capsys):
    placement = contract("adapt", "adapter_placement")
    monkeypatch.setattr(scenario, "peft_load", adapter_off_where_the_base_is_offloaded(scenario.peft_load))
    with pytest.raises(ToleranceExceeded, match=r"the adapter's effect on the offloaded base: \|1 - effect kept\|") as excinfo:
        placement.test_adapter_effect_wherever_the_base_lives(LLAMA3, scenario.placed_offloaded, True, tmp_path, prompt)
    print(f"guard: the offloaded layer's LoRA dropped: |1 - effect kept| {excinfo.value.measured:.4f}")
    assert judged("adapter_placement", "test_adapter_effect_wherever_the_base_lives[cpu-llama3-offloaded-nf4]", excinfo.value).verdict == NEW_FAILURE


def test_placement_fails_when_peft_leaves_the_adapter_off(monkeypatch, tmp_path, prompt):
    """peft#2787's symptom: the model PEFT returns answers as the base does."""
    placement = contract("adapt", "adapter_placement")
    load = scenario.peft_load

    def adapter_off(under_test, base, adapter, **kwargs):
        model = load(under_test, base, adapter, **kwargs)
        if kwargs or getattr(base, "hf_device_map", None):  # the placed model, not the reference
            model.base_model.disable_adapter_layers()
        return model

    monkeypatch.setattr(scenario, "peft_load", adapter_off)
    with pytest.raises(ToleranceExceeded, match=r"the adapter's effect on the split base: \|1 - effect kept\| 1\.0000"):
        placement.test_adapter_effect_wherever_the_base_lives(LLAMA3, scenario.placed_split, False, tmp_path, prompt)


def test_placement_guard_fires_when_nothing_was_offloaded(monkeypatch, tmp_path):
    monkeypatch.setattr(adapt, "dispatch_with_offload", lambda under_test, model, offload_dir, *modules: model)
    with pytest.raises(ScenarioNotReached, match="was not offloaded"):
        scenario.placed_offloaded(LLAMA3, False, tmp_path)


# --- adapter_configs -----------------------------------------------------------------------------------------------


def test_configs_fail_when_the_save_drops_the_trained_copies(monkeypatch, tmp_path, prompt):
    """The head's trained copy left out of the saved adapter (the class of unsloth#9331 and of keys lost on save)."""
    import peft.peft_model

    configs = contract("adapt", "adapter_configs")
    state_dict = peft.peft_model.get_peft_model_state_dict
    monkeypatch.setattr(peft.peft_model, "get_peft_model_state_dict",
                        lambda *args, **kwargs: {k: v for k, v in state_dict(*args, **kwargs).items() if "lm_head" not in k})
    with pytest.raises(AssertionError, match="the saved modules_to_save adapter holds no copy of 1 of its"):
        configs.test_adapter_config_trains_saves_and_reloads(LLAMA3, use_dora=False, use_rslora=False, lora_bias=False,
                                                             modules_to_save=list(scenario.MODULES_TO_SAVE), quant=False,
                                                             **held_by_the_pairs(configs), tmp_path=tmp_path, prompt=prompt)


def test_configs_guard_fires_when_peft_ignores_the_configuration(monkeypatch):
    variant = scenario.ADAPTER_VARIANTS["rslora"]
    model = scenario.train_adapter(LLAMA3, scenario.load_base(LLAMA3, quantized=False), scenario.ADAPTER_VARIANTS["lora"], False)
    with pytest.raises(ScenarioNotReached, match="LoRA layers do not scale by"):
        scenario.require_variant_applied(model, variant)
    with pytest.raises(ScenarioNotReached, match="without a DoRA magnitude"):
        scenario.require_variant_applied(model, scenario.ADAPTER_VARIANTS["dora"])
    with pytest.raises(ScenarioNotReached, match="gave lm_head no copy"):
        scenario.require_variant_applied(model, scenario.ADAPTER_VARIANTS["modules_to_save"])


# --- merge_effect --------------------------------------------------------------------------------------------------


def test_merge_effect_fails_when_the_merge_drops_the_adapter(monkeypatch, prompt):
    from peft.tuners.lora.layer import Linear

    merge_effect = contract("merge", "merge_effect")
    delta = Linear.get_delta_weight
    monkeypatch.setattr(Linear, "get_delta_weight", lambda self, adapter: torch.zeros_like(delta(self, adapter)))
    with pytest.raises(ToleranceExceeded, match=r"bf16 merge diverges: relative logit error 1\.0000 > 0\.1 \(of the adapter's effect kept 0\.0000\)"):
        merge_effect.test_merge_keeps_the_adapters_effect(LLAMA3, scenario.ADAPTER_VARIANTS["lora"], False, prompt)


def test_merge_effect_meets_the_known_4bit_rounding_by_its_mechanism(monkeypatch, prompt):
    """The fixture's smaller adapter (merge_parity's) merged into the 4-bit Llama 3 through the real family test: the
    re-quantization noise exceeds 10% of its effect and keeps the effect, which the ledger files under
    merge_4bit_divergence from this family's frame; the same merge dropping the adapter is a new failure."""
    merge_effect = contract("merge", "merge_effect")
    lora = scenario.ADAPTER_VARIANTS["lora"]
    monkeypatch.setitem(adapt._TRAINED, adapt._trained_key(LLAMA3, lora, True), tiny.adapter_checkpoint(LLAMA3.arch, "language"))
    name = "test_merge_keeps_the_adapters_effect[cpu-llama3-lora-nf4]"
    with pytest.raises(ToleranceExceeded, match="4-bit merge diverges") as excinfo:
        merge_effect.test_merge_keeps_the_adapters_effect(LLAMA3, lora, True, prompt)
    judgement = judged("merge_effect", name, excinfo.value)
    assert (judgement.verdict, judgement.bug) == (KNOWN_BUG, "merge_4bit_divergence"), judgement

    from peft.tuners.lora.bnb import Linear4bit

    delta = Linear4bit.get_delta_weight
    monkeypatch.setattr(Linear4bit, "get_delta_weight", lambda self, adapter: torch.zeros_like(delta(self, adapter)))
    with pytest.raises(ToleranceExceeded, match="4-bit merge diverges") as excinfo:
        merge_effect.test_merge_keeps_the_adapters_effect(LLAMA3, lora, True, prompt)
    assert judged("merge_effect", name, excinfo.value).verdict == NEW_FAILURE


def test_merge_parity_files_the_known_rounding_by_the_weights_and_a_dropped_merge_as_new(monkeypatch, prompt):
    """merge_parity's 4-bit test on the tiny Llama 3, for real: the merged weights carry the adapter's weight change
    (0.9955) beside the re-quantization noise, which the ledger files under merge_4bit_divergence; a 4-bit merge that
    changes no weight (PEFT's Linear4bit.merge made a no-op) keeps 0 of it, a new failure."""
    family = importlib.import_module("tests.families.test_merge_parity")
    name = "test_merge_into_4bit_base_reproduces_adapter_outputs[cpu-llama3]"
    with pytest.raises(ToleranceExceeded, match=r"4-bit merge diverges: .*\(of the adapter's weight change kept 0\.99\d\d\)") as excinfo:
        family.test_merge_into_4bit_base_reproduces_adapter_outputs(LLAMA3, prompt)
    judgement = judged("merge_parity", name, excinfo.value)
    assert (judgement.verdict, judgement.bug) == (KNOWN_BUG, "merge_4bit_divergence"), judgement

    from peft.tuners.lora.bnb import Linear4bit

    monkeypatch.setattr(Linear4bit, "merge", lambda self, *args, **kwargs: None)
    with pytest.raises(ToleranceExceeded, match=r"\(of the adapter's weight change kept 0\.0000\)") as excinfo:
        family.test_merge_into_4bit_base_reproduces_adapter_outputs(LLAMA3, prompt)
    assert judged("merge_parity", name, excinfo.value).verdict == NEW_FAILURE


# --- merge_cycles --------------------------------------------------------------------------------------------------


def test_merge_cycles_pass_where_unmerge_restores_the_base(monkeypatch, prompt):
    """A PEFT that kept the unmerged weight and restored it would pass: the family measures accumulation, not rounding."""
    from peft.tuners.lora.layer import Linear

    cycles = contract("merge", "merge_cycles")
    merge, unmerge = Linear.merge, Linear.unmerge

    def keeping_merge(self, *args, **kwargs):
        self._guard_kept = self.get_base_layer().weight.data.clone()
        merge(self, *args, **kwargs)

    def restoring_unmerge(self):
        unmerge(self)
        self.get_base_layer().weight.data.copy_(self._guard_kept)

    monkeypatch.setattr(Linear, "merge", keeping_merge)
    monkeypatch.setattr(Linear, "unmerge", restoring_unmerge)
    cycles.test_merge_unmerge_cycles_do_not_drift(LLAMA3, False, prompt)


def test_merge_cycles_fail_beyond_rounding_where_unmerge_subtracts_too_little(monkeypatch, prompt):
    """An unmerge that leaves a tenth of the delta behind: the drift grows past what rounding can do (a new failure,
    outside the known drift's band)."""
    from peft.tuners.lora.layer import Linear

    cycles = contract("merge", "merge_cycles")
    unmerge = Linear.unmerge

    def short_unmerge(self):
        adapters = list(self.merged_adapters)
        unmerge(self)
        for adapter in adapters:
            self.get_base_layer().weight.data += (0.1 * self.get_delta_weight(adapter)).to(self.get_base_layer().weight.dtype)

    monkeypatch.setattr(Linear, "unmerge", short_unmerge)
    with pytest.raises(ToleranceExceeded, match="20 merge/unmerge cycles drift") as excinfo:
        cycles.test_merge_unmerge_cycles_do_not_drift(LLAMA3, False, prompt)
    assert excinfo.value.measured > 40
    assert judged("merge_cycles", "test_merge_unmerge_cycles_do_not_drift[cpu-llama3-bf16]", excinfo.value).verdict == NEW_FAILURE


# --- merge_offloaded_save ------------------------------------------------------------------------------------------


def test_offloaded_save_guard_fires_when_the_base_fits(monkeypatch, tmp_path, prompt):
    from accelerate.utils import get_max_memory

    save = contract("merge", "merge_offloaded_save")
    monkeypatch.setattr(scenario, "offloading_budget", lambda under_test, model: {"cpu": get_max_memory()["cpu"]})
    with pytest.raises(ScenarioNotReached, match="the base was not offloaded"):
        save.test_merge_of_an_offloaded_base_saves_and_reloads(LLAMA3, prompt, tmp_path)


def test_offloaded_save_fails_when_the_save_loses_the_offloaded_layers(monkeypatch, tmp_path, prompt):
    """A save that writes no tensor of the offloaded decoder layers (the class of transformers#47333): the reload
    fills them from its initialisation."""
    if Ledger().bugs["peft_disk_offload_index_keys"].affects(installed_versions()):
        pytest.skip("this PEFT cannot load an adapter onto a disk-offloaded base (peft_disk_offload_index_keys): the save is never reached")
    from safetensors.torch import load_file, save_file
    from transformers import PreTrainedModel

    save = contract("merge", "merge_offloaded_save")
    save_pretrained = PreTrainedModel.save_pretrained

    def losing_save(self, directory, *args, **kwargs):
        save_pretrained(self, directory, *args, **kwargs)
        for shard in directory.glob("*.safetensors"):
            tensors = load_file(shard)
            save_file({k: v for k, v in tensors.items() if ".layers." not in k}, shard, metadata={"format": "pt"})

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", losing_save)
    with pytest.raises(ToleranceExceeded, match="the saved merge reloads otherwise"):
        save.test_merge_of_an_offloaded_base_saves_and_reloads(LLAMA3, prompt, tmp_path)
