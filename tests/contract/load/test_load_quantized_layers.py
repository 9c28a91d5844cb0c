"""Every weight the user's `BitsAndBytesConfig` asks to quantize is quantized, as asked, on every layer kind.

The property, the bugs it catches and preconditions: docs/family-notes.md#load_quantized_layers.
"""

import pytest
import torch

from stackcheck.harness import scenario, surfaces
from stackcheck.models import footprint

# BitsAndBytesConfig's fields, from the axis model: LLM.int8 or 4-bit (its data type and double quant), the compute
# dtype (the model is loaded in it too) and the skip list; the 4-bit fields held at their defaults under LLM.int8.
BNB = surfaces.model_axes("bnb_config", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype",
                          "llm_int8_skip_modules")


def kept_by_the_model(model) -> list[str]:
    """The modules the model class keeps in fp32 (transformers' `_keep_in_fp32_modules`, a documented contract)."""
    return [*(getattr(model, "_keep_in_fp32_modules", None) or []), *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]


def named_by(model, entry: str) -> list[str]:
    """The modules a skip entry names, read as a user reads it: its full name, or its trailing dotted part."""
    return [name for name, _ in model.named_modules() if name == entry or name.endswith("." + entry)]


def skipped_by(name: str, roots: list[str]) -> bool:
    """Whether module `name` is one of the modules a skip list names (`roots`, by `named_by`) or inside one."""
    return any(name == root or name.startswith(root + ".") for root in roots)


@pytest.mark.axes(**BNB)
@pytest.mark.axes_invalid(*surfaces.model_invalid("bnb_config", BNB))
def test_every_weight_meant_for_quantization_is_quantized(under_test, load_in_8bit, bnb_4bit_quant_type, bnb_4bit_use_double_quant, bnb_4bit_compute_dtype,
                                                          llm_int8_skip_modules, prompt):
    quantization = scenario.Quantization.of(load_in_8bit, bnb_4bit_quant_type, bnb_4bit_use_double_quant, bnb_4bit_compute_dtype)
    skip_list = scenario.skip_list(under_test, llm_int8_skip_modules)
    model = scenario.shared_quantized(under_test, quantization, skip_list)
    quantizer = getattr(model, "hf_quantizer", None)
    scenario.require(quantizer is not None and getattr(quantizer.quantization_config, quantization.load_in),
                     f"the model was not loaded through transformers' bitsandbytes quantizer with {quantization.load_in}")
    meant = footprint.meant_for_4bit(model, [*(skip_list or []), *kept_by_the_model(model)])
    scenario.require(meant, "the model has no weight meant for quantization")
    experts = footprint.fused_experts(model)

    quantized = scenario.quantized_modules(model)
    owners = {name: name.rpartition(".")[0] for name in meant}
    left = [name for name, owner in owners.items() if owner not in quantized and name not in experts]
    prefixes = [entry for entry in skip_list or () if any(owners[name].startswith(entry) for name in left)]
    assert not left, (f"{len(left)} weights meant for {quantization.load_in} stay in {meant[left[0]].dtype}: {scenario.by_kind(owners[name] for name in left)}"
                      + (f" (skip entries their names begin with, naming other modules: {', '.join(prefixes)})" if prefixes else ""))
    faults = {owner: scenario.quant_state_faults(quantized[owner], quantization) for owner in set(owners.values()) if owner in quantized}
    faults = {owner: why for owner, why in sorted(faults.items()) if why}
    assert not faults, (f"{len(faults)} layers do not hold the quantization asked ({quantization}): "
                        + "; ".join(f"{owner}: {', '.join(why)}" for owner, why in list(faults.items())[:4]))
    if skip_list:
        overruled = [entry for entry in skip_list if not named_by(model, entry)
                     or any(q == name or q.startswith(name + ".") for name in named_by(model, entry) for q in quantized)]
        assert not overruled, f"llm_int8_skip_modules entries whose modules are quantized anyway: {', '.join(overruled)}"
        peft_wraps_what_the_list_kept(under_test, model, quantization, skip_list, prompt)
    unquantized_experts = [name for name in experts if owners[name] not in quantized]
    assert not unquantized_experts, (f"{len(unquantized_experts)} fused expert parameters stay in "
                                     f"{experts[unquantized_experts[0]].dtype} under {quantization.load_in}: {', '.join(unquantized_experts[:2])}")


def peft_wraps_what_the_list_kept(under_test, model, quantization, skip_list, prompt) -> None:
    """PEFT on a copy of the loaded model (the shared load stays untouched): LoRA on every linear layer of the decoder;
    each layer the list skips must be wrapped as a plain `nn.Linear` in 16 bits, each other one as a bitsandbytes layer;
    then one forward through the adapter."""
    import copy

    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    model = copy.deepcopy(model)
    roots = [name for entry in skip_list for name in named_by(model, entry)]
    decoder = scenario.module_name(model, scenario.decoder_layers(model))
    linears = [name for name, m in model.named_modules()
               if name.startswith(decoder + ".") and isinstance(m, (torch.nn.Linear, bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))]
    skipped = [name for name in linears if skipped_by(name, roots)]
    scenario.require(skipped and len(skipped) < len(linears),
                     f"the skip list {skip_list} keeps {len(skipped)} of the decoder's {len(linears)} linear layers out of {quantization.load_in}")

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=linears))
    layers = {name.removeprefix("base_model.model."): m for name, m in peft_model.named_modules() if isinstance(m, LoraLayer)}
    # PEFT may leave some targets out (its mixture-of-experts conversion retargets Qwen3-Next's shared experts:
    # ledger `peft_moe_shared_expert_retargeted`): what it wraps is judged, as long as that holds a layer the list
    # skips or one whose name a skip entry begins (the sibling).
    linears = [name for name in linears if name in layers]
    near = [name for name in linears if any(name.startswith(root) for root in roots)]  # skipped, or a skipped module's sibling
    scenario.require(near, f"PEFT wrapped none of the layers the skip list {skip_list} names or borders ({len(linears)} wrapped)")
    wrong = []
    for name in linears:
        base = layers[name].get_base_layer()
        plain = type(base) is torch.nn.Linear and base.weight.is_floating_point()
        if (name in skipped and not plain) or (name not in skipped and not isinstance(base, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))):
            wrong.append(f"{name}: lora {type(layers[name]).__name__} around {type(base).__name__} of {base.weight.dtype}")
    prefixes = [entry for entry in skip_list if any(line.startswith(entry) and not skipped_by(line.partition(":")[0], roots) for line in wrong)]
    assert not wrong, (f"{len(wrong)} LoRA layers do not wrap what the skip list asked ({quantization.load_in}, skipped: "
                       f"{scenario.by_kind(skipped)}): {'; '.join(wrong[:3])}"
                       + (f" (skip entries their names begin with, naming other modules: {', '.join(prefixes)})" if prefixes else ""))
    logits = scenario.logits(peft_model, prompt)
    assert torch.isfinite(logits).all(), f"the LoRA model on the {quantization.load_in} base with the skip list {skip_list} gives non-finite logits"
