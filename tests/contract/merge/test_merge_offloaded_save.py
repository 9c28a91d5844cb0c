"""A merge into a bf16 base that does not fit its memory budget works, saves, and reloads to the merged outputs.

Precondition proven: the base really was offloaded (its map names the offload device, and those modules sit on
meta), and still is after PEFT's load; the adapter changes the outputs of the unsplit base.

The journey, properties, what it found, upstream and tolerances: docs/family-notes.md#merge_offloaded_save.
"""

import torch

from stackcheck.harness import scenario
from stackcheck.models import tiny

RELOAD_TOLERANCE = 0.01


def test_merge_of_an_offloaded_base_saves_and_reloads(under_test, prompt, tmp_path):
    unsplit = scenario.load_base(under_test, quantized=False)
    base_logits = scenario.logits(unsplit, prompt)
    base_weights = scenario.effective_parameters(unsplit)
    on_one_device = scenario.peft_load(under_test, unsplit, "language")
    adapter_logits = scenario.logits(on_one_device, prompt)
    scenario.require_adapter_changes(adapter_logits, base_logits, "the unsplit base")
    budget = scenario.offloading_budget(under_test, unsplit)
    # The same merge on one device: the parameters a merge changes, and to what.
    merged_weights = scenario.effective_parameters(on_one_device.merge_and_unload())
    del unsplit, on_one_device

    base = scenario.load_base(under_test, quantized=False, device_map="auto", max_memory=budget, offload_folder=str(tmp_path / "base"))
    offload = scenario.offload_device(under_test.device)
    offloaded = [name for name, device in getattr(base, "hf_device_map", {}).items() if device == offload]
    scenario.require(offloaded and scenario.offloaded_modules(base, offloaded) == offloaded,
                     f"the base was not offloaded to {offload} under {budget}: {getattr(base, 'hf_device_map', None)}")
    model = scenario.peft_load(under_test, base, "language", max_memory=budget, offload_dir=str(tmp_path / "peft"))
    scenario.require(any(p.device.type == "meta" for p in model.parameters()), "PEFT's load brought the whole model back from offload")

    merged = model.merge_and_unload()

    scenario.require(not scenario.lora_wrapped(merged), "merge_and_unload left LoRA layers in place")
    lost = scenario.merges_lost(scenario.effective_parameters(merged), merged_weights, base_weights)
    print(f"stackcheck measured: {len(lost)} of {sum(not torch.equal(w, base_weights[n]) for n, w in merged_weights.items() if n in base_weights)} "
          f"parameters the merge changes on one device hold the base's values after the offloaded merge ({scenario.by_kind(lost)})")
    assert not lost, f"merge_and_unload left {len(lost)} offloaded parameters as the base had them: {scenario.by_kind(lost)}"
    merged_logits = scenario.logits(merged, prompt)
    scenario.assert_merge_keeps_effect("offloaded bf16", merged_logits, adapter_logits, base_logits)
    merged.save_pretrained(tmp_path / "merged")
    reloaded = scenario.load_pretrained(tiny.model_class(under_test.arch), tmp_path / "merged", False, False,
                                        {"": scenario.device_key(under_test.device)})
    error = ((scenario.logits(reloaded, prompt) - merged_logits).norm() / (adapter_logits - base_logits).norm()).item()
    scenario.assert_within("the saved merge reloads otherwise: relative logit error (of the adapter's effect)", error, RELOAD_TOLERANCE)
