"""Load: the user's `from_pretrained` with bitsandbytes quantizing while loading, and the proofs that a weight
really is 4-bit (nested quant state included). One library setting is chosen rather than left to the machine:
bitsandbytes' CPU kernel for 4-bit layers (`pin_portable_cpu_kernel`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stackcheck import hostinfo
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
