"""Every weight the user's `BitsAndBytesConfig` asks to quantize is quantized, as asked, on every layer kind.

The property (the user's journey, step 1, load): after `from_pretrained(..., quantization_config=BitsAndBytesConfig(
load_in_4bit=True, ...))` (or `load_in_8bit=True`), every weight of two or more dimensions is held by a bitsandbytes
layer with a real quantization state, except what is kept in 16 bits by design: embeddings, the output head, MoE
routers, convolutions, the model's `_keep_in_fp32_modules` and the modules the user's `llm_int8_skip_modules` names
(read as a user reads it: a module's full name covers what is inside it). "As asked": a 4-bit layer holds packed
codes with a quant state of the asked type (NF4 or FP4), with or without double quant, its shape, and computes in
the asked dtype; an 8-bit layer holds int8 codes and one scale per row. What the skip list names stays unquantized.
A failure names what was left in 16 bits, by layer kind (`model.layers.*.self_attn.o_proj`), not only how much.

This generalises the `quantized_experts` family (fused experts, one layer kind) to every layer kind, and makes
quantization an axis, covered by pairs with the architecture (`stackcheck.child.axes`): NF4 and FP4, double quant
on and off (LLM.int8 has none: its cells load as without it), the model's dtype which is also the compute dtype
(bf16, fp16, fp32), 8-bit beside 4-bit, and the skip list (`scenario.SKIPS`: transformers' defaults, or the user's
own list with the head, which a user's list must repeat, `skip_modules_drop_default_skips`, beside: the first decoder
layer's attention by its full path, in a hybrid model the first attention of each kind, Qwen3-Next's
`layers.0.linear_attn` and `layers.3.self_attn`; inner linear layers by bare name, `q_proj` and `v_proj`; a module
whose name is a string prefix of its sibling's, Qwen3-Next's `layers.0.mlp.shared_expert` beside
`layers.0.mlp.shared_expert_gate`, not applicable where no model module has such a sibling).

Where the user's list skips layers, PEFT must see what the loader built: LoRA on every linear layer of the decoder (of
a copy of the loaded model) checks that each skipped layer's base is a plain `nn.Linear` in 16 bits (a
`lora.Linear`) and each other one a bitsandbytes layer, then runs a forward through the adapter. A layer replaced by a
bitsandbytes class whose weight stays in 16 bits (the loader and the module replacement reading the list differently:
bitsandbytes#1634's `'Parameter' object has no attribute 'SCB'`, unsloth#4208's "lora Linear4bit whose weight is
16-bit") fails one of the two.

Bugs of this kind (upstream): fused experts left in bf16 under load_in_4bit (bitsandbytes#1849, transformers 5;
ledger `bnb_fused_experts_unquantized`); `load_in_8bit` with a skip list naming inner projections
(bitsandbytes#1634); skip lists that match nothing (ledger `skip_modules_match_nothing`) or more than they name (an
entry that is a sibling's prefix also skips the sibling: transformers PR #47990, ledger `skip_modules_sibling_prefix`,
met here on Qwen3-Next); a VLM's skip list spelled as its checkpoint's keys (unsloth#4208); pre-quantized projections loading as packed uint8 with no quant state
(unsloth#10276).

Precondition proven: the load went through transformers' bitsandbytes quantizer with the config asked, and the model
has weights meant for quantization. No tolerance: the property is structural. Measured (CPU, seed and latest, 21 cells
a set): every layer kind of the dense architectures and Gemma 4 (towers included) quantized as asked, the skip list
honoured; the tiny Mixtral and Qwen3-MoE keep their fused experts in the model's dtype on every quantization, 4-bit and
8-bit (`bnb_fused_experts_unquantized`). The `inner` and `sibling` skip lists (CPU, seed, every architecture, 36
cells): honoured and wrapped by PEFT as asked, except Gemma 4's towers, whose bare `q_proj` names a Gemma4ClippableLinear
container and not the `linear` inside it (`skip_modules_match_nothing`), and Qwen3-Next's `shared_expert_gate`, left
in 16 bits by the entry `model.layers.0.mlp.shared_expert` (`skip_modules_sibling_prefix`, transformers 5.0 to 5.20).
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.models import footprint

def kept_by_the_model(model) -> list[str]:
    """The modules the model class keeps in fp32 (transformers' `_keep_in_fp32_modules`, a documented contract)."""
    return [*(getattr(model, "_keep_in_fp32_modules", None) or []), *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]


def named_by(model, entry: str) -> list[str]:
    """The modules a skip entry names, read as a user reads it: its full name, or its trailing dotted part."""
    return [name for name, _ in model.named_modules() if name == entry or name.endswith("." + entry)]


def skipped_by(name: str, roots: list[str]) -> bool:
    """Whether module `name` is one of the modules a skip list names (`roots`, by `named_by`) or inside one."""
    return any(name == root or name.startswith(root + ".") for root in roots)


@pytest.mark.axes(quant=scenario.QUANT_TYPES, double_quant=scenario.DOUBLE_QUANT, dtype=scenario.DTYPES, skip=scenario.SKIPS)
def test_every_weight_meant_for_quantization_is_quantized(under_test, quant, double_quant, dtype, skip, prompt):
    quantization = scenario.Quantization(quant, double_quant, dtype)
    skip_list = scenario.skip_list(under_test, skip)
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
