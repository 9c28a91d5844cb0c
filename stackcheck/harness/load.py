"""Load: the user's `from_pretrained` with bitsandbytes quantizing while loading, and the proofs that a weight
really is 4-bit (nested quant state included). One library setting is chosen rather than left to the machine:
bitsandbytes' CPU kernel for 4-bit layers (`pin_portable_cpu_kernel`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from stackcheck.core import hostinfo
from stackcheck.harness.proof import require
from stackcheck.harness.subject import UnderTest
from stackcheck.models import tiny


# The base in bf16 (the control) and in NF4 with double quant, for the tests that run on both.
QUANTIZATION = pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "nf4"])


# The `llm_int8_skip_modules` that keeps the towers in bf16: the towers, their projectors (Gemma 4's
# `embed_vision` and `embed_audio`) and, because any list replaces transformers' defaults, the tied head.
TOWER_SKIP_MODULES = ["model.vision_tower", "model.embed_vision", "model.audio_tower", "model.embed_audio", "lm_head"]


def bnb_config(double_quant: bool = True, fp32_cpu_offload: bool = False):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16,
        llm_int8_enable_fp32_cpu_offload=fp32_cpu_offload,
    )


def int8_config(fp32_cpu_offload: bool = False):
    """LLM.int8 as users load it: `load_in_8bit` with transformers' defaults (outlier threshold 6.0)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=fp32_cpu_offload)


def load_base(under_test: UnderTest, quantized: bool = True, double_quant: bool = True, device_map=None,
              checkpoint: Path | None = None, **kwargs):
    """The user's `<ModelClass>.from_pretrained` (the seed's `Gemma4ForConditionalGeneration`), on the tiny
    checkpoint of the architecture (or on `checkpoint`, one that another set's transformers wrote)."""
    if device_map is None:
        device_map = {"": str(under_test.device)}
    checkpoint = checkpoint or tiny.base_checkpoint(under_test.arch)
    return load_pretrained(tiny.model_class(under_test.arch), checkpoint, quantized, double_quant, device_map, **kwargs)


def load_pretrained(model_class, checkpoint: Path, quantized: bool, double_quant: bool, device_map, **kwargs):
    """`from_pretrained` in bf16; when `quantized`, bitsandbytes quantizes to NF4 while loading (a
    `quantization_config` in kwargs, such as one with fp32 CPU offload, wins over the default one)."""
    if quantized:
        kwargs.setdefault("quantization_config", bnb_config(double_quant=double_quant))
    model = model_class.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map=device_map, **kwargs).eval()
    pin_portable_cpu_kernel(model)
    return model


def pin_portable_cpu_kernel(model: torch.nn.Module) -> None:
    """Run every 4-bit layer of `model` on bitsandbytes' portable CPU kernel, on every CPU.

    On a CPU with avx512_bf16, bitsandbytes' CPU build repacks a Linear4bit's weight at its first eval
    forward without grad (`support_avx512bf16_for_cpu`, set from `has_avx512bf16()` when the layer is
    built), un-nesting its quant state and rejecting widths that are not multiples of 32. The families
    that share this loader test offload and PEFT bugs, so their verdicts must not depend on the CPU;
    the packed path is tested on its own by the `bnb_cpu_packed_width` family. A bitsandbytes that has the
    packed path but not the switch stops the scenario rather than silently choosing per machine."""
    if not hostinfo.bnb_has_packed_cpu_path():
        return
    for name, layer in linear4bit_modules(model).items():
        require(hasattr(layer, "support_avx512bf16_for_cpu"), f"{name}: this bitsandbytes packs CPU weights with no per-layer switch")
        layer.support_avx512bf16_for_cpu = False


def linear4bit_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    import bitsandbytes as bnb

    return {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def ineffective_skips(model, skip_modules: list[str]) -> list[str]:
    """The `llm_int8_skip_modules` entries that keep nothing unquantized of what they name, read as a user reads
    them: a module's full name or its trailing dotted part (`vision_tower` names `model.vision_tower`)."""
    modules = dict(model.named_modules())
    quantized = linear4bit_modules(model)
    ineffective = []
    for entry in skip_modules:
        named = [name for name in modules if name == entry or name.endswith("." + entry)]
        still_4bit = [q for q in quantized for name in named if q == name or q.startswith(name + ".")]
        if not named or still_4bit:
            ineffective.append(entry)
    return ineffective


def require_linear4bit_under(model: torch.nn.Module, prefix: str) -> None:
    layers = [name for name in linear4bit_modules(model) if name.startswith(prefix + ".")]
    require(layers, f"{prefix} holds no bnb Linear4bit: it was not quantized")


def require_nested_linear4bit(name: str, module: torch.nn.Module) -> None:
    import bitsandbytes as bnb

    require(isinstance(module, bnb.nn.Linear4bit), f"{name} is {type(module).__name__}, not a bnb Linear4bit")
    weight = module.weight
    require(isinstance(weight, bnb.nn.Params4bit), f"{name}.weight is {type(weight).__name__}, not Params4bit")
    state = weight.quant_state
    require(state is not None and state.nested, f"{name} has no nested (double-quant) quant state")


def quant_state_tensors(state) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes QuantState; with double quant, its nested state's too."""
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.offset, state.state2.absmax, state.state2.code]
    return tensors


def quant_state_devices(module: torch.nn.Module) -> set[str]:
    return {t.device.type for t in quant_state_tensors(module.weight.quant_state)}


def require_hf_initialized(name: str, param: torch.nn.Parameter) -> None:
    require(getattr(param, "_is_hf_initialized", False), f"{name} does not carry transformers' _is_hf_initialized")


def first_nested_linear4bit(model) -> tuple[str, torch.nn.Module]:
    modules = linear4bit_modules(model)
    require(modules, "the model has no bnb Linear4bit modules")
    name, module = next(iter(modules.items()))
    require_nested_linear4bit(name, module)
    return name, module


# --- Quantization as an axis (the load contract) ------------------------------------------------------------------

# The kinds of quantization: bitsandbytes' two 4-bit data types and LLM.int8. The load contract takes its axes from the
# axis model (BitsAndBytesConfig's fields, `Quantization.of`).
QUANT_TYPES = {"nf4": "nf4", "fp4": "fp4", "int8": "int8"}


@dataclass(frozen=True)
class Quantization:
    """What the user asks `BitsAndBytesConfig` for: `kind` nf4, fp4 or int8; double quant (4-bit); the model's dtype,
    which is the 4-bit compute dtype too."""

    kind: str
    double_quant: bool = True
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.kind not in QUANT_TYPES:
            raise ValueError(f"unknown quantization '{self.kind}' (known: {', '.join(QUANT_TYPES)})")

    @property
    def four_bit(self) -> bool:
        return self.kind != "int8"

    @property
    def load_in(self) -> str:
        """The BitsAndBytesConfig flag, as users and failure messages name it."""
        return "load_in_4bit" if self.four_bit else "load_in_8bit"

    @classmethod
    def of(cls, load_in_8bit: bool, bnb_4bit_quant_type: str, bnb_4bit_use_double_quant: bool, bnb_4bit_compute_dtype: str) -> Quantization:
        """The quantization of BitsAndBytesConfig field values (the axis model's): LLM.int8 under `load_in_8bit` (it
        reads no 4-bit field), else 4-bit; the model is loaded in the compute dtype too (transformers' pairing: the T4
        recipe loads fp16 with fp16 compute, transformers 4's default was fp32 for both, QLoRA's is bf16)."""
        kind = "int8" if load_in_8bit else bnb_4bit_quant_type
        return cls(kind, bnb_4bit_use_double_quant, getattr(torch, bnb_4bit_compute_dtype))

    def __str__(self) -> str:
        if not self.four_bit:
            return f"int8 in {self.dtype}"
        return f"{self.kind}{' with double quant' if self.double_quant else ''}, compute {self.dtype}"

    def config(self, skip_modules: list[str] | None = None, fp32_cpu_offload: bool = False):
        from transformers import BitsAndBytesConfig

        common = {"llm_int8_skip_modules": skip_modules, "llm_int8_enable_fp32_cpu_offload": fp32_cpu_offload}
        if not self.four_bit:
            return BitsAndBytesConfig(load_in_8bit=True, **common)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=self.kind, bnb_4bit_use_double_quant=self.double_quant,
                                  bnb_4bit_compute_dtype=self.dtype, **common)


def load_quantized(under_test: UnderTest, quantization: Quantization, device_map=None, skip_modules: list[str] | None = None,
                   fp32_cpu_offload: bool = False, **kwargs):
    """The user's `from_pretrained(..., dtype=, quantization_config=BitsAndBytesConfig(...))` of the tiny checkpoint,
    with the quantization asked for (bitsandbytes quantizes while loading), on the lane's device unless `device_map`
    says otherwise (`"auto"` with `max_memory` in kwargs: transformers places it)."""
    if device_map is None:
        device_map = {"": str(under_test.device)}
    model = tiny.model_class(under_test.arch).from_pretrained(
        tiny.base_checkpoint(under_test.arch), dtype=quantization.dtype, device_map=device_map,
        quantization_config=quantization.config(skip_modules, fp32_cpu_offload), **kwargs).eval()
    pin_portable_cpu_kernel(model)
    return model


def quantized_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """bitsandbytes' 4-bit and 8-bit linear layers of `model`, by name."""
    import bitsandbytes as bnb

    return {name: m for name, m in model.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


def int8_state(module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(CB, SCB) of a Linear8bitLt: on its weight until the first forward, on its state after (bitsandbytes moves
    them there in `init_8bit_state`)."""
    weight, state = module.weight, module.state
    codes = weight.CB if getattr(weight, "CB", None) is not None else state.CB
    scales = weight.SCB if getattr(weight, "SCB", None) is not None else state.SCB
    if codes is None and weight.dtype == torch.int8:
        codes = weight.data
    return codes, scales


class llm_int8_inputs:
    """Within it, each of `model`'s linear layers named in `thresholds` computes on its input as LLM.int8 rounds it:
    cast to fp16, each row quantized to 8 bits at its absmax by bitsandbytes' own `int8_vectorwise_quant` (columns
    holding a value past the layer's outlier threshold kept as they were, as LLM.int8 computes them apart) and
    dequantized (`int8_vectorwise_dequant`). With each weight replaced by the one the int8 layer holds, the layer then
    computes what LLM.int8's matmul computes, in the reference's dtype."""

    def __init__(self, model, thresholds: dict[str, float]):
        self.model, self.thresholds, self.handles = model, thresholds, []

    def __enter__(self):
        import bitsandbytes.functional as F

        def hook_for(threshold):
            def round_input(module, args):
                x = args[0]
                rows = x.reshape(-1, x.shape[-1]).to(torch.float16)
                codes, scales, outliers = F.int8_vectorwise_quant(rows.clone(), threshold=threshold)
                rounded = F.int8_vectorwise_dequant(codes, scales).float()
                if outliers is not None and outliers.numel():
                    rounded[:, outliers] = x.reshape(-1, x.shape[-1])[:, outliers].float()
                return (rounded.to(x.dtype).reshape(x.shape), *args[1:])
            return round_input

        layers = dict(self.model.named_modules())
        self.handles = [layers[name].register_forward_pre_hook(hook_for(threshold)) for name, threshold in self.thresholds.items()]
        return self.model

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return False


def routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """`model`'s mixture-of-experts routers by name: transformers' `*Router` modules (Mixtral's, Qwen3-MoE's and
    Qwen3-Next's `TopKRouter`, Gemma 4's `TextRouter`), each choosing a token's experts with `torch.topk` over its
    scores (the routing probabilities)."""
    return {name: module for name, module in model.named_modules() if type(module).__name__.endswith("Router")}


class _ChosenExperts(torch.overrides.TorchFunctionMode):
    """Active during one router's forward: records what its `torch.topk` ranked (the scores) and chose (the experts,
    one row per token); given `follow` (another model's choice at the same router), the rows that chose another set of
    experts take that one instead, with their own scores at those experts, as topk would have returned them."""

    def __init__(self, follow: torch.Tensor | None):
        super().__init__()
        self.follow, self.scores, self.chosen, self.followed, self.gaps = follow, None, None, None, None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func not in (torch.topk, torch.Tensor.topk):
            return result
        scores, (values, indices) = args[0], result
        if self.follow is not None and self.follow.shape == indices.shape:
            follow = self.follow.to(indices.device)
            rows = (indices.sort(dim=-1).values != follow.sort(dim=-1).values).any(dim=-1)
            if rows.any():
                # How much more its own experts scored than the followed ones, in total: the tie the rounding broke.
                self.gaps = (values.sum(dim=-1) - scores.gather(-1, follow).sum(dim=-1))[rows].detach().float().cpu()
                indices = torch.where(rows[:, None], follow, indices)
                values = torch.where(rows[:, None], scores.gather(-1, indices), values)
                result = torch.return_types.topk((values, indices))
            self.followed = rows.cpu()
        self.scores, self.chosen = scores.detach().float().cpu(), indices.detach().cpu()
        return result


class routing:
    """Within it, each router of `model` records the scores it ranked and the experts it chose on the last forward
    (`scores`, `chosen`: by router name, one row per token). Given `follow` (another model's `chosen`, such as the
    quantized model's), each router takes those experts wherever its own choice differs (`followed`: the rows that
    did; `gaps`: by how much its own choice outscored the followed one there), so that a reference computes along the
    routing the model under test took. Which experts a token gets is a
    discrete decision: where two experts' scores are nearly tied, any rounding (the dtype's, the weights', LLM.int8's
    inputs') may swap them, and the swap moves the logits far more than the rounding itself."""

    def __init__(self, model, follow: dict[str, torch.Tensor] | None = None):
        self.model, self.follow, self.handles = model, follow or {}, []
        self.scores: dict[str, torch.Tensor] = {}
        self.chosen: dict[str, torch.Tensor] = {}
        self.followed: dict[str, torch.Tensor] = {}
        self.gaps: dict[str, torch.Tensor] = {}

    def __enter__(self):
        def enter(name):
            def pre_hook(module, args):
                module._stackcheck_routing = _ChosenExperts(self.follow.get(name))
                module._stackcheck_routing.__enter__()
            return pre_hook

        def leave(name):
            def hook(module, args, output):
                mode = module.__dict__.pop("_stackcheck_routing")
                mode.__exit__(None, None, None)
                if mode.chosen is not None:
                    self.scores[name], self.chosen[name] = mode.scores, mode.chosen
                if mode.followed is not None:
                    self.followed[name] = mode.followed
                if mode.gaps is not None:
                    self.gaps[name] = mode.gaps
            return hook

        for name, module in routers(self.model).items():
            self.handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave(name))]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return False


def offloaded_int8_states(model) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.dtype]]:
    """(codes, scales, the dtype the weights map stores) of every LLM.int8 layer of `model` that an accelerate hook
    offloads, as its forward computes with them: brought back by the hook's own pre_forward (which quantizes a stored
    float weight on the execution device, or restores stored codes with their scales), read, and offloaded again."""
    import bitsandbytes as bnb
    from accelerate.hooks import AlignDevicesHook

    states = {}
    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        if not (isinstance(module, bnb.nn.Linear8bitLt) and isinstance(hook, AlignDevicesHook) and hook.offload):
            continue
        stored = hook.weights_map["weight"].dtype
        hook.pre_forward(module)
        codes, scales = int8_state(module)
        states[name] = (codes.detach().to("cpu", copy=True), scales.detach().float().to("cpu", copy=True), stored)
        hook.post_forward(module, torch.tensor([]))
    return states


def set_int8_states(model, states: dict) -> None:
    """Give `model`'s LLM.int8 layers named in `states` those (codes, scales), on the device they sit on, as a
    quantized load leaves them before the first forward (bitsandbytes moves them into the layer's state there)."""
    import bitsandbytes as bnb

    layers = dict(model.named_modules())
    for name, (codes, scales, *_) in states.items():
        module = layers[name]
        device = module.weight.device
        module.weight = bnb.nn.Int8Params(codes.to(device), requires_grad=False, has_fp16_weights=False,
                                          CB=codes.to(device), SCB=scales.to(device))
        module.state.CB, module.state.SCB = None, None


def dequantized_weight(module) -> torch.Tensor | None:
    """The weight a bitsandbytes layer holds, dequantized by bitsandbytes itself, in fp32; a float weight (one the
    loader never quantized: a key not loaded leaves the initializer's) as it is; None for packed codes with no
    quantization state to read them by."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    weight = module.weight
    if weight.is_floating_point():
        return weight.detach().float()
    if isinstance(module, bnb.nn.Linear4bit):
        state = getattr(weight, "quant_state", None)
        return None if state is None else F.dequantize_4bit(weight.data, state).float()
    codes, scales = int8_state(module)
    return None if codes is None or scales is None else F.int8_vectorwise_dequant(codes, scales).float()


def layer_kind(name: str) -> str:
    """A module's name with its indices starred (`model.layers.*.self_attn.q_proj`): the kind of layer, across layers."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def by_kind(names) -> str:
    """Names grouped by layer kind, in order of first appearance: `kind (count), ...`."""
    counts: dict[str, int] = {}
    for name in names:
        counts[layer_kind(name)] = counts.get(layer_kind(name), 0) + 1
    return ", ".join(f"{kind} ({count})" if count > 1 else kind for kind, count in counts.items())


def reference_model(under_test: UnderTest, dtype: torch.dtype = torch.float32):
    """The tiny model in the checkpoint's bf16 weights, built from its config and seed in memory, not by any loader
    (`from_pretrained`'s renaming, conversions and quantizer are what the load contract tests), on the lane's device,
    computing in `dtype`. Proven to be the checkpoint: every tensor the checkpoint stores under the model's own name
    equals it bit for bit (the keys transformers converts while loading, such as per-expert weights fused into one
    parameter, are checked through the outputs)."""
    model = tiny._new_base_model(under_test.arch).to(torch.bfloat16)
    require_reference_is_checkpoint(under_test.arch, model)
    return model.to(device=under_test.device, dtype=dtype).eval()


_CHECKPOINTS_PROVEN: set = set()


def require_reference_is_checkpoint(arch, model) -> None:
    from safetensors import safe_open

    if arch in _CHECKPOINTS_PROVEN:
        return

    state = model.state_dict()
    compared, differing = 0, []
    for file in sorted(tiny.base_checkpoint(arch).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key, name in checkpoint_names(model, handle.keys()).items():
                compared += 1
                if not torch.equal(handle.get_tensor(key), state[name].cpu()):
                    differing.append(key)
    require(compared, f"the tiny {arch.name} checkpoint stores no tensor under the model's own names")
    require(not differing, f"the seeded {arch.name} model is not the tiny checkpoint ({len(differing)} of {compared} tensors differ, "
                           f"first {differing[:1]}): rebuild the fixture")
    _CHECKPOINTS_PROVEN.add(arch)


def checkpoint_names(model, keys) -> dict[str, str]:
    """The model's own name of each checkpoint key that `from_pretrained` loads as it is stored, renamed the way
    transformers renames it (its conversion mapping: Gemma 3 multimodal's checkpoints spell `language_model.model.*`
    what the model calls `model.language_model.*`); the keys a converter rewrites (per-expert weights fused into one
    parameter) are left out, their tensors being no longer the stored ones. Transformers 4 has no conversion mapping:
    there a key counts only under its stored name."""
    state = model.state_dict()
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return {key: key for key in keys if key in state}
    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    names = {}
    for key in keys:
        # As `convert_and_load_state_dict_in_model` renames: every renaming, at most one converter, the base prefix.
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        if name not in state and key in state:
            name, converted = key, None
        if converted is None and name in state:
            names[key] = name
    return names


def quant_state_faults(module, quantization: Quantization) -> list[str]:
    """Why a bitsandbytes layer does not hold the quantization asked for: a real quantization state (packed codes
    and their scales) of the asked type, double quant and compute dtype; an empty list when it does."""
    import bitsandbytes as bnb

    weight = module.weight
    shape = (module.out_features, module.in_features)
    if quantization.four_bit:
        if not isinstance(module, bnb.nn.Linear4bit):
            return [f"is {type(module).__name__}, not Linear4bit"]
        state = getattr(weight, "quant_state", None)
        if not isinstance(weight, bnb.nn.Params4bit) or state is None:
            return [f"its weight is a {type(weight).__name__} of {weight.dtype} with no quant state"]
        faults = []
        if weight.is_floating_point():
            faults.append(f"its weight is {weight.dtype}, not packed")
        if tuple(state.shape) != shape:
            faults.append(f"quant state shape {tuple(state.shape)}, the layer is {shape}")
        if state.quant_type != quantization.kind:
            faults.append(f"quant type {state.quant_type}")
        if bool(state.nested) != quantization.double_quant:
            faults.append(f"double quant {bool(state.nested)}")
        if module.compute_dtype != quantization.dtype:
            faults.append(f"compute dtype {module.compute_dtype}")
        return faults
    if not isinstance(module, bnb.nn.Linear8bitLt):
        return [f"is {type(module).__name__}, not Linear8bitLt"]
    codes, scales = int8_state(module)
    if not isinstance(weight, bnb.nn.Int8Params) or codes is None or scales is None:
        return [f"its weight is a {type(weight).__name__} of {weight.dtype} with no int8 codes and scales"]
    faults = []
    if codes.dtype != torch.int8 or tuple(codes.shape) != shape:
        faults.append(f"codes {codes.dtype} {tuple(codes.shape)}")
    if scales.numel() != module.out_features:
        faults.append(f"{scales.numel()} row scales for {module.out_features} rows")
    if weight.has_fp16_weights:
        faults.append("keeps fp16 weights")
    return faults



# The quantized loads the load contract's families share in one process (one load per architecture, device,
# quantization and skip list), read only: layers, weights and outputs are all read off the same model. A guard test
# that breaks a library clears it first, so that the family loads under the break.
SHARED_LOADS: dict[tuple, torch.nn.Module] = {}


def shared_quantized(under_test: UnderTest, quantization: Quantization, skip_modules: list[str] | None = None):
    """`load_quantized` on the lane's device, once per process for the same arguments (a load that raises is not kept)."""
    key = (under_test.arch, str(under_test.device), quantization, tuple(skip_modules or ()))
    if key not in SHARED_LOADS:
        SHARED_LOADS[key] = load_quantized(under_test, quantization, skip_modules=skip_modules)
    return SHARED_LOADS[key]


def half_code_step(module, quantization: Quantization) -> float:
    """Half the largest gap between neighbouring values of the quantization's code, in units of the block's (4-bit) or
    row's (int8) absmax: the most a correct rounding can move a value. The 4-bit code is bitsandbytes' own table for the
    type (NF4 or FP4); LLM.int8 rounds to 1/127 of the row's absmax."""
    if not quantization.four_bit:
        return 0.5 / 127
    import bitsandbytes.functional as F

    state = getattr(module.weight, "quant_state", None)
    code = (state.code if state is not None else F.get_4bit_type(quantization.kind, device="cpu")).float().sort().values
    return (code[1:] - code[:-1]).max().item() / 2


def blocksize_of(module, quantization: Quantization) -> int | None:
    """The 4-bit block size the layer was quantized with (bitsandbytes' default where it holds no state); None for int8,
    whose scale is one per row."""
    if not quantization.four_bit:
        return None
    state = getattr(module.weight, "quant_state", None)
    return state.blocksize if state is not None else 64


def scale_of(reference: torch.Tensor, blocksize: int | None) -> torch.Tensor:
    """Each value's absmax scale, read off the bf16 reference weight: its block's (blocks of `blocksize` consecutive
    values of the flattened weight, as bitsandbytes blocks a 4-bit weight), or its row's (int8)."""
    if blocksize is None:
        return reference.abs().amax(dim=1, keepdim=True).expand_as(reference)
    flat = reference.flatten().abs()
    padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % blocksize))
    return padded.view(-1, blocksize).amax(dim=1).repeat_interleave(blocksize)[: flat.numel()].view_as(reference)


def grid_error(module, reference: torch.Tensor, quantization: Quantization) -> float:
    """The largest distance between the weight a layer holds (dequantized by bitsandbytes) and the bf16 checkpoint's,
    in half code steps of its scale (`half_code_step`): at most 1 for a weight that is the checkpoint's value rounded
    to the quantization's grid (with double quant, the scale is itself rounded to 8 bits: a few percent more); far more
    for a weight that is not the checkpoint's (a random initialisation, a transposed or misplaced tensor, a wrong scale:
    measured 12 to 17 for 4-bit, 520 to 590 for int8). Infinite for packed codes with no quantization state."""
    held = dequantized_weight(module)
    if held is None:
        return float("inf")
    reference = reference.float().to(held.device)
    if held.shape != reference.shape:
        return float("inf")
    scale = scale_of(reference, blocksize_of(module, quantization)).clamp_min(torch.finfo(torch.float32).tiny)
    return ((held - reference).abs() / scale).max().item() / half_code_step(module, quantization)


def rows_span_blocks(module, quantization: Quantization) -> bool:
    """Whether a 4-bit layer's rows are not a whole number of blocks (a block straddles two rows)."""
    blocksize = blocksize_of(module, quantization)
    return blocksize is not None and module.in_features % blocksize != 0


# The user's skip list, as an axis of the load contract: the values of llm_int8_skip_modules the axis model gives them
# (stackcheck/axes.toml) -> the list's name here. Every list names the output head again (a user's list replaces
# transformers' defaults, so it must: `skip_modules_drop_default_skips`), beside:
# - `defaults`: no list, transformers' defaults;
# - `attention0`: the first decoder layer's attention by its full path; in a hybrid model the first attention of every
#   other kind too, so that each kind is skipped once (Qwen3-Next: `layers.0.linear_attn` and `layers.3.self_attn`);
# - `inner`: inner linear layers by their bare names, `q_proj` and `v_proj` (bitsandbytes#1634's list, on every layer
#   of the model, towers included): a layer of a quantized block left in 16 bits;
# - `sibling`: the full path of a module whose name is a string prefix of a sibling's (Qwen3-Next's
#   `layers.0.mlp.shared_expert` beside `layers.0.mlp.shared_expert_gate`, as transformers PR #47990's `mlp.gate` beside
#   `mlp.gate_proj`): the entry names the one module, not its sibling. Not applicable on a model with no such pair.
SKIPS = {"<default>": None, "<head and the first attention of each kind>": "attention0", "<head, q_proj and v_proj>": "inner",
         "<head and a module whose name prefixes a sibling's>": "sibling"}
INNER_SKIPS = ("q_proj", "v_proj")


def skip_list(under_test: UnderTest, skip: str | None) -> list[str] | None:
    """The `llm_int8_skip_modules` of a `SKIPS` key or value, read off the model's structure (built on meta)."""
    skip = SKIPS.get(skip, skip)
    if not skip:
        return None
    if skip not in SKIPS.values():
        raise ValueError(f"unknown skip list '{skip}' (known: {', '.join(name for name in SKIPS.values() if name)})")
    from stackcheck.harness.place import first_attention_of_each_kind, module_name

    with torch.device("meta"):
        skeleton = tiny.model_class(under_test.arch)(tiny.tiny_config(under_test.arch))
    head = module_name(skeleton, skeleton.get_output_embeddings())
    if skip == "attention0":
        return [head, *first_attention_of_each_kind(skeleton)]
    if skip == "inner":
        names = {name.rpartition(".")[2] for name, _ in skeleton.named_modules()}
        missing = [entry for entry in INNER_SKIPS if entry not in names]
        if missing:
            raise tiny.NotApplicable(f"{under_test.arch.name} has no module named {', '.join(missing)}")
        return [head, *INNER_SKIPS]
    prefixes = sibling_prefixes(skeleton)
    if not prefixes:
        raise tiny.NotApplicable(f"{under_test.arch.name} has no module whose name is a prefix of a sibling's")
    return [head, prefixes[0]]


def sibling_prefixes(model) -> list[str]:
    """The full names of the modules whose name is a string prefix of a sibling module's (same parent) that holds a
    linear layer: `mlp.shared_expert` beside `mlp.shared_expert_gate`, in module order."""
    children: dict[str, list[str]] = {}
    for name, _ in model.named_modules():
        if name:
            parent, _, child = name.rpartition(".")
            children.setdefault(parent, []).append(child)
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    found = []
    for parent, names in children.items():
        for child in names:
            siblings = [other for other in names if other != child and other.startswith(child)]
            full = [f"{parent}.{other}" if parent else other for other in siblings]
            if any(s in linears or any(name.startswith(s + ".") for name in linears) for s in full):
                found.append(f"{parent}.{child}" if parent else child)
    return found


# --- Placement by transformers' own device_map="auto" (the load contract) -------------------------------------------


def quant_state_bytes(module) -> int:
    """The bytes of a 4-bit layer's scales (absmax; with double quant, the 8-bit absmax, its offset and its own absmax):
    memory beside the packed weight that parameter sizes do not count (0 for other layers and for a weight on meta).
    The code tables are left out as the NF4 arithmetic leaves them (`stackcheck.models.footprint`): a constant 1 KiB a
    layer, a quarter of the tiny Gemma 4's footprint and nothing at a realistic size."""
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    if state is None or module.weight.device.type == "meta":
        return 0
    scales = [state.absmax, *((state.offset, state.state2.absmax) if state.nested else ())]
    return sum(t.nbytes for t in scales)


def bytes_on(model, device_map: dict, device) -> int:
    """The bytes `device_map` placed on `device` (accelerate's key: 0 or 'cpu'), measured on the placed model: accelerate's
    `compute_module_sizes` of each module mapped there (parameters and buffers as they are stored, packed for 4-bit),
    plus the scales of the 4-bit layers among them (`quant_state_bytes`)."""
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model)
    roots = [name for name, placed in device_map.items() if placed == device]
    states = sum(quant_state_bytes(module) for name, module in linear4bit_modules(model).items()
                 if any(root == "" or name == root or name.startswith(root + ".") for root in roots))
    return sum(sizes[root] for root in roots) + states


def model_bytes(model) -> int:
    """The bytes a model holds on its one device, as `bytes_on` counts them."""
    return bytes_on(model, {"": "here"}, "here")


def bf16_bytes(under_test: UnderTest) -> int:
    """What the model weighs in bf16, unquantized (built on meta): the size a map sized before quantization would plan for."""
    from accelerate.utils import compute_module_sizes

    with torch.device("meta"):
        skeleton = tiny.model_class(under_test.arch)(tiny.tiny_config(under_test.arch)).to(torch.bfloat16)
    return compute_module_sizes(skeleton)[""]


# The budgets of the load contract's `device_map="auto"`, by the value the axis model gives them (from_pretrained's
# max_memory, stackcheck/axes.toml): a multiple of the quantized model's footprint on the main device.
AUTO_BUDGETS = {"<1.5 x the quantized footprint on the main device>": 1.5, "<0.9 x the quantized footprint on the main device>": 0.9}


def auto_placed(under_test: UnderTest, quantization: Quantization, budget: int, offload_dir: Path):
    """The user's `from_pretrained(..., device_map="auto", max_memory=...)`: `budget` bytes on the lane's device, what does
    not fit goes one level down (the GPU lane: the CPU, with its whole memory; the CPU lane: disk, in `offload_dir`), with
    `llm_int8_enable_fp32_cpu_offload` as bitsandbytes requires for any offload. Returns the model and its map ({"": main}
    when transformers put it in one place, as it then records none)."""
    from accelerate.utils import get_max_memory

    from stackcheck.harness.place import device_key

    main = device_key(under_test.device)
    max_memory = {main: budget}
    if under_test.device.type == "cuda":
        max_memory["cpu"] = get_max_memory()["cpu"]
    model = load_quantized(under_test, quantization, device_map="auto", max_memory=max_memory, offload_folder=str(offload_dir),
                           fp32_cpu_offload=True)
    return model, dict(getattr(model, "hf_device_map", None) or {"": placed_device(model)})


def placed_device(model):
    """Where a model that transformers did not dispatch sits, as accelerate's maps name it: its parameters' one device,
    or 'disk' when they all wait on meta (transformers mapped the whole model to disk and dispatched nothing)."""
    from stackcheck.harness.place import device_key

    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return "mixed"
    device = devices.pop()
    return "disk" if device.type == "meta" else device_key(device)
