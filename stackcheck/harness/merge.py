"""Merge: an adapter merged into its base, as users merge it (`merge_and_unload`) and as RL trainers sync weights
(`merge_adapter`, read the weights, `unmerge_adapter`); the measures a merge is judged by; and a base that does not
fit its memory budget, for a merge into an offloaded model."""

from __future__ import annotations

import math

import torch

from stackcheck.harness.adapt import fixture_targets_in, lora_layers
from stackcheck.harness.place import device_key
from stackcheck.harness.proof import assert_within, effect_kept, require
from stackcheck.harness.subject import UnderTest
from stackcheck.models import tiny

# A merge must keep the adapter's effect: ||merged - adapter|| <= 10% of ||adapter - base|| on the prompt's logits
# (tests/families/test_merge_parity.py says where 10% comes from). A 4-bit merge misses it by the re-quantization
# noise (`merge_4bit_divergence`), which is why every merge is also judged by the effect it kept.
MERGE_TOLERANCE = 0.10


def merge_divergence(merged: torch.Tensor, adapter: torch.Tensor, base: torch.Tensor) -> tuple[float, float]:
    """(the merged logits' distance from the adapter's, relative to the adapter's effect; the share of that effect
    the merge kept, `effect_kept`)."""
    error = ((merged.float() - adapter.float()).norm() / (adapter.float() - base.float()).norm()).item()
    return error, effect_kept(merged, adapter, base)


def assert_merge_keeps_effect(label: str, merged: torch.Tensor, adapter: torch.Tensor, base: torch.Tensor) -> None:
    """The merge keeps the adapter's effect, in the message format the ledger knows a 4-bit merge's rounding by
    ("4-bit merge diverges: relative logit error X > 0.1 (of the adapter's effect kept Y)"). The ledger's frame is
    the caller's: this helper's frame is the harness's."""
    error, kept = merge_divergence(merged, adapter, base)
    assert_within(f"{label} merge diverges: relative logit error", error, MERGE_TOLERANCE, judged_by=("of the adapter's effect kept", kept))


def _as_fp32(weight: torch.Tensor) -> torch.Tensor:
    """A weight in fp32: an NF4 one dequantized by bitsandbytes, as PEFT's own 4-bit merge reads it."""
    import bitsandbytes as bnb

    if isinstance(weight, bnb.nn.Params4bit):
        weight = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
    return weight.detach().float().clone()


def lora_base_weights(model) -> dict[str, torch.Tensor]:
    """The base weight under every LoRA layer of a linear (2-D) weight, in fp32 (`_as_fp32`)."""
    weights = {}
    for name, layer in lora_layers(model).items():
        weight = getattr(layer.get_base_layer(), "weight", None)
        if weight is not None and weight.ndim == 2:
            weights[name] = _as_fp32(weight)
    return weights


# The prefix PEFT's wrapper adds to the names of the model it wraps; `merge_and_unload` gives the model back without it.
PEFT_PREFIX = "base_model.model."


def weight_change_kept(merged, start: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor]) -> float:
    """The share of the adapter's weight change that `merged` (what `merge_and_unload` returned) carries, over every
    LoRA layer of `start` (`lora_base_weights` before the merge) together: <W_merged - W_start, dW> / ||dW||^2 with
    dW each layer's `lora_deltas`. 1 when the merge added the whole change, 0 when it added none (a merge that drops
    the adapter), 2 when it added it twice. A 4-bit merge re-quantizes W + dW: its rounding lands beside the change,
    not along it, and leaves this at about 1 whatever the model does with the noise downstream."""
    modules = dict(merged.named_modules())
    along = sum((_as_fp32(modules[name.removeprefix(PEFT_PREFIX)].weight) - start[name]).mul(deltas[name]).sum() for name in start)
    return (along / sum(deltas[name].pow(2).sum() for name in start)).item()


def lora_deltas(model, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """What each LoRA layer adds to its base weight when merged (`get_delta_weight`), in fp32."""
    layers = lora_layers(model)
    return {name: layers[name].get_delta_weight(adapter_name).detach().float() for name in lora_base_weights(model)}


def weight_distance(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], scale: dict[str, torch.Tensor]) -> float:
    """||weights - reference|| / ||scale|| over every layer together (Frobenius norms)."""
    num = sum(((weights[name] - reference[name]) ** 2).sum() for name in reference)
    den = sum((scale[name] ** 2).sum() for name in reference)
    return math.sqrt(num / den)


def merged_state(model) -> set[bool]:
    """Whether each LoRA layer holds its adapter merged into the base weight."""
    return {layer.merged for layer in lora_layers(model).values()}


def offloading_budget(under_test: UnderTest, model) -> dict:
    """A `max_memory` that `model` does not fit: the least tenth of its size, from half, with which accelerate's
    `infer_auto_device_map` keeps part of it on the main device and offloads the rest (to the CPU from a GPU, to
    disk from the CPU). Measured on the tiny models (CPU lane, bf16): every decoder layer goes to disk, Llama 3,
    Qwen3, Phi-4 and Gemma 3 keep their embeddings (and head) at 0.6; the MoE models keep the embeddings at 0.5;
    Gemma 4 keeps its vision tower, embeddings, head and first layers at 0.5. On a GPU the CPU gets room for the
    overflow, as a user's RAM would."""
    from accelerate.utils import compute_module_sizes, get_max_memory, infer_auto_device_map

    main, size = device_key(under_test.device), compute_module_sizes(model)[""]
    for tenth in range(5, 10):
        budget = {main: int(size * tenth / 10)}
        if under_test.device.type == "cuda":
            budget["cpu"] = get_max_memory()["cpu"]
        placed = set(infer_auto_device_map(model, max_memory=budget, no_split_module_classes=list(model._no_split_modules)).values())
        if main in placed and placed - {main}:
            return budget
    require(False, f"no budget under the whole {under_test.arch.name} keeps part of it on {under_test.device}")


def one_layer_adapter(under_test: UnderTest, base, adapter: str = "language"):
    """A LoRA (rank 4, alpha 8, initialised non-zero and seeded) on the first module the adapter fixture targets in
    the first decoder layer, in eval mode: what a weight-sync cycle does to one layer, at the cost of one layer (a
    4-bit merge and unmerge re-quantize the layer each time, a tenth of a second on the CPU)."""
    from peft import get_peft_model

    target = fixture_targets_in(under_test, base, (0,), adapter)[0]
    torch.manual_seed(tiny.SEED + 3)
    return get_peft_model(base, tiny.lora_config(under_test.arch, adapter, target_modules=[target], init_lora_weights=False)).eval()


def effective_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter of `model` as its forward would compute with it, on the CPU: an offloaded module's brought
    back from its accelerate hook's weights map (the hook's own pre_forward, then post_forward to offload it
    again), any other as it is."""
    from accelerate.hooks import AlignDevicesHook

    found = {}
    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        offloaded = isinstance(hook, AlignDevicesHook) and hook.offload
        if offloaded:
            hook.pre_forward(module)
        for leaf, param in module.named_parameters(recurse=False):
            found[f"{name}.{leaf}" if name else leaf] = param.detach().to("cpu", copy=True)
        if offloaded:
            hook.post_forward(module, torch.tensor([]))
    return found


def merges_lost(merged: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> list[str]:
    """The parameters a merge changed in `reference` (the same adapter merged into the base on one device) that
    `merged` still holds bit for bit as the base had them: a merge written where the model does not read it."""
    return [name for name, value in reference.items()
            if name in base and name in merged and not torch.equal(value, base[name]) and torch.equal(merged[name], base[name])]
