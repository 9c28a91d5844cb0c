"""Place: dispatching the model across devices as transformers and accelerate do (the seed user's split,
offload to CPU or disk, a memory budget), and proving what was offloaded."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch

from stackcheck.harness.load import TOWER_SKIP_MODULES, bnb_config, linear4bit_modules, load_base, require_nested_linear4bit
from stackcheck.harness.proof import ScenarioNotReached, require
from stackcheck.harness.subject import UnderTest
from stackcheck.models import tiny


# The seed user's device map (seed 001), and the split the GPU lane loads: the same without
# `model.multi_modal_projector`, which Gemma 4 does not have (from_pretrained accepts the stray key).
SEED_USER_DEVICE_MAP = {"model.vision_tower": "cpu", "model.multi_modal_projector": "cpu", "model.audio_tower": "cpu", "": 0}


SEED_SPLIT_DEVICE_MAP = {"model.vision_tower": "cpu", "model.audio_tower": "cpu", "": 0}


TOWERS = ("model.vision_tower", "model.audio_tower")


def device_key(device: torch.device) -> int | str:
    """How accelerate's device maps and max_memory name a device."""
    return device.index if device.type == "cuda" else device.type


def offload_device(main: torch.device) -> str:
    """accelerate offloads (params to meta, weights in a map) to 'cpu' when the main device is a GPU
    and only to 'disk' when the main device is the CPU: the same hooks, one level further down."""
    return "disk" if main.type == "cpu" else "cpu"


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of the language model: the `layers` beside its input embeddings."""
    embeddings = model.get_input_embeddings()
    decoder = next(name.rpartition(".")[0] for name, m in model.named_modules() if m is embeddings)
    return model.get_submodule(f"{decoder}.layers" if decoder else "layers")


def module_name(model, module: torch.nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


# A decoder layer's attention, by the name transformers gives it: `self_attn` (softmax attention), `linear_attn`
# (Qwen3-Next's Gated DeltaNet layers, which have no `self_attn`), or any other `*_attn` / `*attention` child.
_ATTENTION_NAME = re.compile(r"(^|_)attn$|attention$")


def layer_attention(layer: torch.nn.Module) -> torch.nn.Module:
    """The one attention of a decoder layer, whatever its kind (softmax or linear); errors when the layer has none or
    several, so that a harness reading "the layer's attention" never silently picks the wrong module."""
    found = [module for name, module in layer.named_children() if _ATTENTION_NAME.search(name)]
    require(len(found) == 1, f"a {type(layer).__name__} holds {len(found)} attention modules, not one "
                             f"(children: {', '.join(name for name, _ in layer.named_children())})")
    return found[0]


def first_attention_of_each_kind(model) -> list[str]:
    """The full names of the first decoder layer's attention and, in a hybrid model, of the first attention of every
    other kind (Qwen3-Next: `model.layers.0.linear_attn` and `model.layers.3.self_attn`), in layer order."""
    first: dict[type, str] = {}
    for layer in decoder_layers(model):
        attention = layer_attention(layer)
        first.setdefault(type(attention), module_name(model, attention))
    return list(first.values())


def last_layer_4bit_block(model) -> str:
    """The name of the last decoder layer's MLP, or its attention where the MLP holds no 4-bit layer (a
    mixture of experts keeps its fused experts out of bitsandbytes' reach)."""
    last = decoder_layers(model)[-1]
    for child in ("mlp", "self_attn"):
        if linear4bit_modules(getattr(last, child)):
            return module_name(model, getattr(last, child))
    raise ScenarioNotReached("the last decoder layer holds no bnb Linear4bit")


def unquantized_offload_target(model) -> str:
    """A module bitsandbytes leaves in bf16, for a split that PEFT redispatches without any 4-bit layer being
    offloaded: Gemma 4's per-layer embedding table where there is one, else the decoder's final norm."""
    names = [name for name, _ in model.named_modules()]
    per_layer = [name for name in names if name.endswith("embed_tokens_per_layer")]
    if per_layer:
        return per_layer[0]
    decoder = module_name(model, decoder_layers(model)).rpartition(".")[0]
    norm = f"{decoder}.norm" if decoder else "norm"
    require(norm in names and not linear4bit_modules(model.get_submodule(norm)), f"the decoder has no final norm ({norm})")
    return norm


def dispatch_with_offload(under_test: UnderTest, model, offload_dir: Path, *offloaded_modules: str):
    """accelerate's `dispatch_model` as transformers calls it (with `skip_keys`): `offloaded_modules` on the
    offload device, everything else on the main device."""
    from accelerate import dispatch_model

    main = under_test.device
    device_map = {**dict.fromkeys(offloaded_modules, offload_device(main)), "": device_key(main)}
    return dispatch_model(
        model, device_map=device_map, offload_dir=str(offload_dir), skip_keys=model._skip_keys_device_placement
    )


def missing_device_map_keys(model, device_map: dict) -> list[str]:
    """The preflight: keys of a device map that name no module of the model (accelerate ignores them)."""
    names = {name for name, _ in model.named_modules()}
    return [key for key in device_map if key not in names]


def split_base(under_test: UnderTest, offload_dir: Path, quantized: bool = True, double_quant: bool = True):
    """The base split across devices the way the seed user split it, so that PEFT redispatches it.

    GPU lane: the user's own load, transformers dispatching a device map with the modules bitsandbytes leaves
    in bf16 (`llm_int8_enable_fp32_cpu_offload`) on the CPU: the seed's `SEED_SPLIT_DEVICE_MAP` (the towers)
    where the model has towers, else `unquantized_offload_target`.
    CPU lane: the main device is the CPU, so the split goes one level down: `unquantized_offload_target`
    (Gemma 4's per-layer embedding table) is offloaded to disk.
    Either way the base gets an `hf_device_map` with an offloaded entry, which is what makes PEFT redispatch.
    """
    if under_test.device.type == "cpu":
        model = load_base(under_test, quantized=quantized, double_quant=double_quant)
        model = dispatch_with_offload(under_test, model, offload_dir, unquantized_offload_target(model))
    else:
        config = {"quantization_config": bnb_config(double_quant, fp32_cpu_offload=True)} if quantized else {}
        if {"vision_tower", "audio_tower"} <= under_test.structures:
            device_map = SEED_SPLIT_DEVICE_MAP
        else:
            with torch.device("meta"):
                target = unquantized_offload_target(tiny.model_class(under_test.arch)(tiny.tiny_config(under_test.arch)))
            device_map = {target: "cpu", "": 0}
        model = load_base(under_test, quantized=quantized, device_map=device_map, **config)
        missing = missing_device_map_keys(model, device_map)
        require(not missing, f"the split device map names modules the model does not have: {missing}")
    offloaded = {device for device in getattr(model, "hf_device_map", {}).values() if device in ("cpu", "disk")}
    require(offloaded and len(set(model.hf_device_map.values())) > 1, "the split base was not dispatched across devices")
    return model


def towers_offloaded_base(under_test: UnderTest, offload_dir: Path):
    """The 4-bit base with its multimodal towers in bf16 and offloaded by accelerate, as the seed user's split
    leaves them: the towers' weights wait on meta and their offload hooks bring them in for each forward.
    GPU lane: `split_base` itself (the towers on the CPU). CPU lane: the towers kept in bf16 by
    `TOWER_SKIP_MODULES`, offloaded one level down, to disk."""
    under_test.require_structures(("vision_tower", "audio_tower"))
    if under_test.device.type == "cuda":
        model = split_base(under_test, offload_dir)
    else:
        config = bnb_config()
        config.llm_int8_skip_modules = TOWER_SKIP_MODULES
        model = dispatch_with_offload(under_test, load_base(under_test, quantization_config=config), offload_dir, *TOWERS)
    towers = dict(model.named_modules())
    on_meta = [tower for tower in TOWERS if all(p.device.type == "meta" for p in towers[tower].parameters())]
    require(on_meta == list(TOWERS), f"accelerate did not offload the towers (offloaded: {on_meta})")
    return model


# Under memory pressure the main device must still hold a real share of the model: PEFT's redispatch maps its
# own, slightly larger model (the LoRA layers added) with the same budget, and a budget that keeps only the first
# module for the base keeps nothing for the PeftModel (accelerate then maps the whole model to disk).
MAIN_DEVICE_SHARE = 0.25


def memory_pressure(under_test: UnderTest, model, fraction: float = 0.5, mapped=None) -> dict:
    """A `max_memory` whose main-device budget holds only part of the model, forcing the rest off it: the seed
    user's 12 GB GPU, reproduced on any device. The budget is `fraction` of the model, or the least tenth above it
    with which accelerate's own `infer_auto_device_map` (as PEFT's redispatch calls it) keeps `MAIN_DEVICE_SHARE`
    of the model on the main device. Measured on the tiny models (CPU lane): Gemma 4 keeps 29% at 0.5; Llama 3,
    Qwen3 and Phi-4 keep nothing below 0.7 (accelerate then maps the whole model to disk, which 1.15 fails to
    dispatch, `FileNotFoundError: index.json`, and < 1.15 refuses: no user's scenario), 30% from 0.7; the tiny
    MoE models (two decoder layers of 44-47% each, their fused experts left in bf16) keep only their embeddings
    (4-7%) up to 0.9, as accelerate holds room for the largest layer beside what it places, so the search goes on
    to 0.95, 0.97 and 0.99, still under the whole model: Qwen3-MoE keeps 50% from 0.95, Mixtral from 0.97 (their
    second layer, 4-bit attention included, goes to the offload device). On a GPU the CPU gets room for the overflow, as the user's did; without a CPU budget accelerate would
    send it to disk.

    `mapped`: the model the budget's map is asked of instead, where another model than `model` will be dispatched
    with it (PEFT's redispatch maps the PeftModel, its LoRA layers added). On the GPU lane a budget fitted to the base
    alone can hold less than the PeftModel's first module and largest layer, and accelerate then maps all of it to
    the CPU ({'': 'cpu'}: the tiny Phi-4 with its all-linear adapter, both sets, two H100s): a legal map that offloads
    nothing. On the CPU lane the same overflow goes to disk, which reaches the whole-disk-map bugs, so the CPU lane's
    callers fit the budget to the base. Asked of `mapped`, any share on the main device will do: the tiny Phi-4's
    PeftModel keeps its embedding (24.5%) there from 0.7 (CPU check), its two decoder layers (38% each) going off it."""
    from accelerate.utils import compute_module_sizes, get_max_memory, infer_auto_device_map

    model = model if mapped is None else mapped
    main, sizes = under_test.device, compute_module_sizes(model)
    for share in (fraction, *(step / 10 for step in range(int(fraction * 10) + 1, 10)), 0.95, 0.97, 0.99):
        budget = {device_key(main): int(sizes[""] * share)}
        if main.type == "cuda":
            budget["cpu"] = get_max_memory()["cpu"]
        # As PEFT's redispatch calls it: a list (accelerate < 1.15 reads a set, transformers 5's type, as one class name).
        placed = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=list(model._no_split_modules))
        on_main = sum(sizes[name] for name, device in placed.items() if device == device_key(main))
        # Asked of the model that will be dispatched, any real share is the scenario; asked of the base, the share
        # leaves room for PEFT's larger model.
        if on_main >= (MAIN_DEVICE_SHARE * sizes[""] if mapped is None else 1):
            return budget
    raise ScenarioNotReached(f"no budget under the whole model keeps {MAIN_DEVICE_SHARE:.0%} of it on {main}: its layers are too coarse to split")


def offloaded_linear4bit(model, device_map: dict[str, object], offloaded_to: Iterable[str]) -> list[str]:
    """Names of Linear4bit modules that `device_map` sent to an offload device."""
    offloaded_to = set(offloaded_to)
    roots = [name for name, device in device_map.items() if device in offloaded_to]
    return [
        name
        for name in linear4bit_modules(model)
        if any(root == "" or name == root or name.startswith(root + ".") for root in roots)
    ]


def assert_offload_hook_moves_weight_to_meta(module: torch.nn.Module) -> None:
    """What accelerate's offload hook does to a layer when it attaches: `set_module_tensor_to_device(module,
    "weight", "meta")`, which rebuilds a quantized weight as its own parameter class (Params4bit, Int8Params)."""
    from accelerate.utils import set_module_tensor_to_device

    param_class = type(module.weight)

    set_module_tensor_to_device(module, "weight", "meta")

    assert isinstance(module.weight, param_class), f"the weight is {type(module.weight).__name__}, not {param_class.__name__}"
    assert module.weight.device.type == "meta"


def require_offloaded_linear4bit(model, offload_to: str) -> list[str]:
    """Prove the (re)dispatch really moved 4-bit modules off the main device, quant state and all."""
    device_map = getattr(model, "hf_device_map", None)
    require(device_map, "the model has no hf_device_map: it was never dispatched")
    # accelerate maps a model that does not fit its budget's first device wholly to the next one ({'': 'cpu'}) and
    # then moves it there without hooks: nothing is offloaded, the model just left the main device.
    require(len(set(device_map.values())) > 1, f"the dispatch put the whole model in one place ({device_map})")
    names = offloaded_linear4bit(model, device_map, {offload_to})
    require(names, f"the dispatch kept every Linear4bit on the main device ({device_map})")
    modules = dict(model.named_modules())
    for name in names:
        require_nested_linear4bit(name, modules[name])
    return names


def shared_kv_layers(model) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """(decoder layers, the KV-shared ones among them); errors when the model has no shared-KV layers."""
    layers = list(decoder_layers(model))
    shared = [layer for layer in layers if getattr(layer.self_attn, "is_kv_shared_layer", False)]
    require(shared, "the model has no KV-shared decoder layers")
    return layers, shared
