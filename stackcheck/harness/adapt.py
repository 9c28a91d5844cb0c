"""Adapt: PEFT adapters on the base, loaded (`peft_load`) or fresh for training (`qlora_model`), and where
they sit; the adapter configurations users ship (`ADAPTER_VARIANTS`) and the places a base lives (`placed_*`)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from stackcheck.harness.load import bnb_config, linear4bit_modules, load_base
from stackcheck.harness.place import decoder_layers, device_key, dispatch_with_offload, module_name, split_base
from stackcheck.harness.proof import require
from stackcheck.harness.subject import UnderTest
from stackcheck.harness.train import train_steps
from stackcheck.models import tiny


def peft_load(under_test: UnderTest, base, adapter: str | Path, **kwargs):
    """`PeftModel.from_pretrained` with the name of an adapter fixture of the architecture, or an adapter directory."""
    from peft import PeftModel

    checkpoint = adapter if isinstance(adapter, Path) else tiny.adapter_checkpoint(under_test.arch, adapter)
    return PeftModel.from_pretrained(base, checkpoint, is_trainable=False, **kwargs)


def peft_load_on_4bit_layers(under_test: UnderTest, base, adapter: str = "language"):
    """`peft_load` of an adapter fixture with its LoRA on `base`'s 4-bit layers only: the targets bitsandbytes left in
    bf16 are excluded (`exclude_modules`: a mixture of experts' router gates; its fused experts' `target_parameters`
    dropped), and their LoRA weights in the file are not loaded. The rest loads as the file says."""
    from peft import PeftConfig, PeftModel

    checkpoint = tiny.adapter_checkpoint(under_test.arch, adapter)
    config = PeftConfig.from_pretrained(checkpoint)
    # Names, each matching a module's name or its last parts (PEFT's rule for a list); a pattern string is left as it is.
    targets = [] if isinstance(config.target_modules, str) else list(config.target_modules or [])
    quantized = set(linear4bit_modules(base))
    left_in_bf16 = sorted(name for name, _ in base.named_modules()
                          if name not in quantized and any(name == target or name.endswith(f".{target}") for target in targets))
    config.exclude_modules = left_in_bf16 or None
    if getattr(config, "target_parameters", None):
        config.target_parameters = None
    return PeftModel.from_pretrained(base, checkpoint, config=config, is_trainable=False)


def qlora_model(under_test: UnderTest, base, adapter: str = "language"):
    """The QLoRA recipe on `base`: `prepare_model_for_kbit_training` with its defaults, then a fresh LoRA on the
    adapter fixture's targets (`tiny.lora_config`), in training mode."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    model = get_peft_model(prepare_model_for_kbit_training(base), tiny.lora_config(under_test.arch, adapter))
    model.train()
    return model


def clippable_linears(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if type(m).__name__ == "Gemma4ClippableLinear"}


def lora_wrapped(model) -> list[str]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)]


def lora_on_unquantized_weights(model) -> list[str]:
    """The LoRA layers of `model` whose base is no bnb 4-bit layer (PEFT's ParamWrapper on fused experts, say)."""
    import bitsandbytes as bnb
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, m in model.named_modules()
            if isinstance(m, BaseTunerLayer) and not isinstance(m.get_base_layer(), bnb.nn.Linear4bit)]


def lora_tensors(model) -> list[str]:
    return [name for name, _ in model.named_parameters() if "lora_" in name]


# --- Adapter configurations users ship, and where the base lives (the adapt contract) ---------------------------


@dataclass(frozen=True)
class AdapterVariant:
    """An adapter configuration users ship: its name and the `LoraConfig` keyword arguments (PEFT's own names) it
    adds to the adapter fixture's targets."""

    name: str
    lora_kwargs: tuple[tuple[str, object], ...] = ()

    def config(self, under_test: UnderTest, adapter: str = "language", **overrides):
        """The LoraConfig, with copies of the variant's values: PEFT changes a config's lists in place (under
        ensure_weight_tying it rewrites `modules_to_save`), and the same value serves every cell of a process."""
        return tiny.lora_config(under_test.arch, adapter, **copy.deepcopy({**dict(self.lora_kwargs), **overrides}))

    @classmethod
    def of(cls, **fields) -> AdapterVariant:
        """The variant of LoraConfig field values (the axis model's: `axis_model.DEFAULT` and False leave a field
        out), named as ADAPTER_VARIANTS names it where it is one of them (`lora` when nothing is set), so the merge
        contract finds the adapter this one trained."""
        kwargs = tuple((name, value) for name, value in fields.items() if value is not False and value != LEFT_OUT)
        known = next((name for name, variant in ADAPTER_VARIANTS.items() if variant.lora_kwargs == kwargs), None)
        return cls(known or "+".join(f"{name}={value}" for name, value in kwargs), kwargs)


# axis_model.DEFAULT (an axis value that leaves its field out), spelled here so that the standalone repro.py cut from
# this module needs no stackcheck import (tests/harness/test_explore.py checks the two agree).
LEFT_OUT = "<default>"

# The head and the input embeddings trained as full copies, by the names users write.
MODULES_TO_SAVE = ("lm_head", "embed_tokens")

ADAPTER_VARIANTS = {
    "lora": AdapterVariant("lora"),
    "modules_to_save": AdapterVariant("modules_to_save", (("modules_to_save", list(MODULES_TO_SAVE)),)),
    "dora": AdapterVariant("dora", (("use_dora", True),)),
    "rslora": AdapterVariant("rslora", (("use_rslora", True),)),
}


def lora_layers(model) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def require_variant_applied(model, variant: AdapterVariant, adapter_name: str = "default") -> None:
    """Prove that PEFT built what the configuration asks for: a DoRA magnitude on every LoRA layer, rsLoRA's
    scaling alpha / sqrt(r), a trainable copy of the head and of the input embeddings.

    The scaling is judged by each layer's own rank and alpha: PEFT gives a layer those of `rank_pattern` and
    `alpha_pattern` where they match it, and its transformers-5 conversion of a mixture of experts writes such
    patterns itself (a fused gate_up_proj gets twice the config's rank and alpha: 8 and 16 for 4 and 8, so rsLoRA
    scales it by 16 / sqrt(8), not 8 / sqrt(4)). A layer whose scaling follows plain LoRA's alpha / r under
    use_rslora=True, or rsLoRA's without it, still fails."""
    layers = lora_layers(model)
    require(layers, "the adapter put no LoRA layer on the model")
    kwargs = dict(variant.lora_kwargs)
    if kwargs.get("use_dora"):
        plain = [name for name, layer in layers.items() if adapter_name not in getattr(layer, "lora_magnitude_vector", {})]
        require(not plain, f"use_dora=True left {len(plain)} of {len(layers)} LoRA layers without a DoRA magnitude: {plain[:2]}")
    rslora = bool(kwargs.get("use_rslora"))

    def expected(layer) -> float:
        r, alpha = layer.r[adapter_name], layer.lora_alpha[adapter_name]
        return alpha / (math.sqrt(r) if rslora else r)

    off = [(name, layer.scaling[adapter_name], expected(layer)) for name, layer in layers.items()
           if not math.isclose(layer.scaling[adapter_name], expected(layer))]
    rule = "alpha / sqrt(r)" if rslora else "alpha / r"
    require(not off, f"{len(off)} LoRA layers do not scale by their {rule} ({variant.name}; name, scaling, expected): {off[:2]}")
    for module in kwargs.get("modules_to_save", ()):
        require(auxiliary_copies(model, module), f"modules_to_save gave {module} no copy of its own")
    if kwargs.get("lora_bias"):
        plain = [name for name, layer in layers.items() if getattr(layer.lora_B[adapter_name], "bias", None) is None]
        require(not plain, f"lora_bias=True left {len(plain)} of {len(layers)} LoRA layers without a bias on lora_B: {plain[:2]}")


def auxiliary_copies(model, module: str) -> list[str]:
    """The modules named `module` (its trailing dotted part) that PEFT wrapped to train a copy of: a
    `ModulesToSaveWrapper`, or the wrapper PEFT uses for a tied layer (`TrainableTokensWrapper`, PEFT >= 0.15)."""
    from peft.utils import other

    wrappers = tuple(getattr(other, name) for name in ("ModulesToSaveWrapper", "TrainableTokensWrapper") if hasattr(other, name))
    return [name for name, m in model.named_modules() if name.rpartition(".")[2] == module and isinstance(m, wrappers)]


def fixture_targets_in(under_test: UnderTest, base, layers: tuple[int, ...], adapter: str = "language") -> list[str]:
    """The modules of decoder layers `layers` (indices) that the adapter fixture targets, as PEFT matches them
    (`check_target_module_exists`; "all-linear": every linear layer), by full name: a LoRA config of these targets
    trains the fixture's kinds of layer at a fraction of the layers (merging into 4-bit layers costs a
    dequantization and a re-quantization each, seconds on the CPU for Gemma 4's 42)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    config = tiny.lora_config(under_test.arch, adapter)
    decoder = decoder_layers(base)
    chosen = [module_name(base, decoder[index]) for index in layers]
    names = [name for name, m in base.named_modules()
             if isinstance(m, torch.nn.Linear) and any(name.startswith(layer + ".") for layer in chosen)]
    targets = names if config.target_modules == "all-linear" else [name for name in names if check_target_module_exists(config, name)]
    require(targets, f"the {adapter} adapter targets nothing in decoder layers {layers}")
    return targets


# The decoder layers a trained adapter targets: the first and the last, the two ends of every tiny model's pattern
# of layer kinds (Gemma 4: sliding and full attention, KV-sharing and not).
TRAINED_LAYERS = (0, -1)


def train_adapter(under_test: UnderTest, base, variant: AdapterVariant, quantized: bool, steps: int = 1):
    """The user's QLoRA (or, on a bf16 base, LoRA) training of `variant` on the adapter fixture's targets in
    `TRAINED_LAYERS`, for `steps` AdamW steps on the fixed batch: `prepare_model_for_kbit_training` on a 4-bit
    base (without gradient checkpointing, which the train contract covers), then `get_peft_model` with LoRA
    initialised non-zero (`init_lora_weights=False`, so every tensor gets a gradient from the first step).
    Returns the model in eval mode, its gradients kept."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    targets = fixture_targets_in(under_test, base, TRAINED_LAYERS)
    if quantized:
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    torch.manual_seed(tiny.SEED + 2)
    model = get_peft_model(base, variant.config(under_test, target_modules=targets, init_lora_weights=False))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    train_steps(under_test, model, torch.optim.AdamW(trainable, lr=1e-2), steps)
    return model.eval()


# Trained adapters saved in this process, by (architecture, device, configuration, quantized): the adapt contract
# trains and checks one, the merge contract merges the same one instead of training it again.
_TRAINED: dict[tuple, Path] = {}


def _trained_key(under_test: UnderTest, variant: AdapterVariant, quantized: bool) -> tuple:
    return (under_test.arch.name, str(under_test.device), variant.name, quantized)


def remember_trained_adapter(under_test: UnderTest, variant: AdapterVariant, quantized: bool, directory: Path) -> None:
    _TRAINED[_trained_key(under_test, variant, quantized)] = directory


def trained_adapter(under_test: UnderTest, variant: AdapterVariant, quantized: bool) -> Path:
    """The directory of `variant` trained by `train_adapter` on the base (4-bit or bf16): the one this process
    already saved, or one trained and saved now (training is seeded: the same adapter either way)."""
    key = _trained_key(under_test, variant, quantized)
    if key not in _TRAINED or not (_TRAINED[key] / "adapter_model.safetensors").is_file():
        import atexit
        import shutil
        import tempfile

        directory = Path(tempfile.mkdtemp(prefix="stackcheck-adapter-"))
        atexit.register(shutil.rmtree, directory, True)
        train_adapter(under_test, load_base(under_test, quantized=quantized), variant, quantized).save_pretrained(directory)
        _TRAINED[key] = directory
    return _TRAINED[key]


def prepared_base(under_test: UnderTest, quantized: bool, **kwargs):
    """A fresh base as `train_adapter` prepared its own (the 4-bit one through `prepare_model_for_kbit_training`),
    to load a trained adapter onto and compare like with like."""
    from peft import prepare_model_for_kbit_training

    base = load_base(under_test, quantized=quantized, **kwargs)
    return prepare_model_for_kbit_training(base, use_gradient_checkpointing=False) if quantized else base


def trainable_tensors(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def without_gradient(model) -> list[str]:
    """The trainable tensors whose last gradient is missing, zero somewhere in full, or not finite."""
    return [name for name, p in trainable_tensors(model).items()
            if p.grad is None or not p.grad.any() or not torch.isfinite(p.grad).all()]


def saved_adapter_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "adapter_model.safetensors")


def missing_from_saved(model, saved: dict[str, torch.Tensor]) -> list[str]:
    """The trainable tensors of `model` of which the saved adapter holds no exact copy, found by value (a
    trained tensor is unique), so that no naming convention of PEFT's is assumed."""
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for tensor in saved.values():
        by_shape.setdefault(tuple(tensor.shape), []).append(tensor)
    missing = []
    for name, p in trainable_tensors(model).items():
        value = p.detach().cpu()
        if not any(t.dtype == value.dtype and torch.equal(t, value) for t in by_shape.get(tuple(value.shape), [])):
            missing.append(name)
    return missing


def in_peft_names(base_map: dict) -> dict:
    """A base's device map in the names PEFT dispatches by (`base_model.model.<name>`): PEFT's documented way to
    keep a placement through its redispatch."""
    return {"base_model.model" + (f".{key}" if key else ""): device for key, device in base_map.items()}


def last_decoder_layer_name(under_test: UnderTest) -> str:
    """The name of the last decoder layer, read off the model built on meta (no weights)."""
    with torch.device("meta"):
        model = tiny.model_class(under_test.arch)(tiny.tiny_config(under_test.arch))
    return module_name(model, decoder_layers(model)[-1])


def output_head_name(under_test: UnderTest) -> str:
    with torch.device("meta"):
        model = tiny.model_class(under_test.arch)(tiny.tiny_config(under_test.arch))
    return module_name(model, model.get_output_embeddings())


def offloaded_modules(model, names: list[str]) -> list[str]:
    """Those of `names` (modules of the base, looked up in `model`, a PeftModel's names included) whose every
    parameter sits on meta: an accelerate hook holds their weights in RAM or on disk."""
    modules = {name.removeprefix("base_model.model.").replace(".base_layer", ""): m for name, m in model.named_modules()}
    return [name for name in names
            if name in modules and all(p.device.type == "meta" for n, p in modules[name].named_parameters() if "lora_" not in n)]


@dataclass
class Placement:
    """A base placed somewhere, as the user placed it, with what the user hands `PeftModel.from_pretrained`."""

    base: torch.nn.Module
    device: torch.device  # where its inputs go
    peft_kwargs: dict
    offloaded: list[str]  # modules the placement put off the main device (offloaded: on meta, behind hooks)
    skip_modules: tuple[str, ...] = ()  # what the placement kept in bf16 on a 4-bit base (its reference keeps it too)


def placed_on_default_device(under_test: UnderTest, quantized: bool, offload_dir: Path) -> Placement:
    """The user's `device_map="auto"` with the whole main device to fill (the CPU lane's budget names the CPU
    alone, so that a GPU host's lane means the same): the base fits, and lands whole on the main device."""
    from accelerate.utils import get_max_memory

    main = device_key(under_test.device)
    base = load_base(under_test, quantized=quantized, device_map="auto", max_memory={main: get_max_memory()[main]})
    where = {p.device for p in base.parameters()}
    require(where == {under_test.device}, f"device_map='auto' did not keep the base whole on {under_test.device}: {where}")
    return Placement(base, under_test.device, {}, [])


def placed_on_gpu(under_test: UnderTest, quantized: bool, index: int) -> Placement:
    """The whole base on GPU `index` (`device_map={"": index}`), as a user with a busy GPU 0 places it."""
    base = load_base(under_test, quantized=quantized, device_map={"": index})
    device = torch.device("cuda", index)
    where = {p.device for p in base.parameters()}
    require(where == {device}, f"device_map={{'': {index}}} put the base on {where}")
    return Placement(base, device, {}, [])


def placed_split(under_test: UnderTest, quantized: bool, offload_dir: Path) -> Placement:
    """The seed user's split (`split_base`): a module bitsandbytes leaves in bf16 offloaded, on the CPU (GPU lane)
    or on disk (CPU lane). PEFT gets the base's own map (in its names), so its redispatch keeps the split."""
    base = split_base(under_test, offload_dir / "base", quantized=quantized)
    offloaded = [name for name, device in base.hf_device_map.items() if device in ("cpu", "disk") and device != device_key(under_test.device)]
    require(offloaded_modules(base, offloaded) == offloaded, f"the split base's offloaded modules are not on meta: {offloaded}")
    kwargs = {"device_map": in_peft_names(base.hf_device_map), "offload_dir": str(offload_dir / "peft")}
    return Placement(base, under_test.device, kwargs, offloaded)


def placed_offloaded(under_test: UnderTest, quantized: bool, offload_dir: Path) -> Placement:
    """The last decoder layer, which the adapter targets, offloaded: what a budget that the base does not fit
    does to its last layers. GPU lane: transformers' own load with that layer mapped to the CPU (a 4-bit base
    keeps it in bf16, `llm_int8_enable_fp32_cpu_offload`). CPU lane, one level down: the layer kept in bf16 by
    `llm_int8_skip_modules` (with the head, which any list must name again) and dispatched to disk by accelerate
    as transformers dispatches (transformers' own disk map on a CPU-only 4-bit load leaves no main device to
    quantize for). PEFT gets the base's own map (in its names), so its redispatch keeps the layer offloaded."""
    layer, head = last_decoder_layer_name(under_test), output_head_name(under_test)
    skip = (layer, head) if quantized else ()
    if under_test.device.type == "cuda":
        kwargs = {"quantization_config": bnb_config(fp32_cpu_offload=True)} if quantized else {}
        base = load_base(under_test, quantized=quantized, device_map={layer: "cpu", "": under_test.device.index},
                         offload_folder=str(offload_dir / "base"), **kwargs)
    else:
        kwargs = {}
        if quantized:
            kwargs["quantization_config"] = bnb_config()
            kwargs["quantization_config"].llm_int8_skip_modules = list(skip)
        base = dispatch_with_offload(under_test, load_base(under_test, quantized=quantized, **kwargs), offload_dir / "base", layer)
    require(offloaded_modules(base, [layer]) == [layer], f"{layer} was not offloaded ({getattr(base, 'hf_device_map', None)})")
    still_4bit = [name for name in linear4bit_modules(base) if name.startswith(layer + ".")]
    require(not still_4bit, f"the offloaded layer stayed 4-bit: {still_4bit[:2]}")
    kwargs = {"device_map": in_peft_names(base.hf_device_map), "offload_dir": str(offload_dir / "peft")}
    return Placement(base, under_test.device, kwargs, [layer], skip)


def reference_base(under_test: UnderTest, quantized: bool, skip_modules: tuple[str, ...] = ()):
    """The unsplit base on the main device, quantized as a placement's base is (the same modules kept in bf16)."""
    kwargs = {}
    if quantized and skip_modules:
        kwargs["quantization_config"] = bnb_config()
        kwargs["quantization_config"].llm_int8_skip_modules = list(skip_modules)
    return load_base(under_test, quantized=quantized, **kwargs)
