"""Serialize: a quantized (or bf16) model saved with `save_pretrained`, one file or several shards, read back with
`from_pretrained`, and the proofs that what was written is what the reader holds. Independent of pytest's
fixtures, so the distributed contract can reuse it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from stackcheck.harness.load import bnb_config, int8_config, load_base
from stackcheck.harness.proof import require
from stackcheck.harness.subject import UnderTest

# The quantizations a checkpoint is written in, by axis id: NF4 with and without double quant, FP4, LLM.int8.
QUANTIZATIONS = ("nf4_dq", "nf4", "fp4", "int8")
# Small enough that every tiny model is saved in several shards (2 to 6 of them, measured), as every real one is.
SMALL_SHARD = "200KB"
# The keys a checkpoint holds beside each quantized weight: the packed 4-bit state, or LLM.int8's row scales.
QUANT_STATE_SUFFIXES = {"nf4": ".weight.quant_state.bitsandbytes__nf4", "fp4": ".weight.quant_state.bitsandbytes__fp4", "int8": ".SCB"}


def quantization_config(quantization: str):
    """The `BitsAndBytesConfig` of a quantization id (`QUANTIZATIONS`); None for `bf16`."""
    if quantization == "bf16":
        return None
    if quantization == "int8":
        return int8_config()
    config = bnb_config(double_quant=quantization.endswith("_dq"))
    config.bnb_4bit_quant_type = quantization.split("_")[0]
    return config


def load_quantized(under_test: UnderTest, quantization: str, checkpoint: Path | None = None, **kwargs):
    """The user's `from_pretrained` of the bf16 checkpoint (the architecture's tiny one, or `checkpoint`), quantized
    while loading as `quantization` says (`bf16`: not at all)."""
    config = quantization_config(quantization)
    if config is None:
        return load_base(under_test, quantized=False, checkpoint=checkpoint, **kwargs)
    return load_base(under_test, checkpoint=checkpoint, quantization_config=config, **kwargs)


def load_saved(under_test: UnderTest, checkpoint: Path, **kwargs):
    """`from_pretrained` of a saved checkpoint, quantized or not, as it was written: its own `quantization_config`
    decides, nothing is quantized again."""
    return load_base(under_test, quantized=False, checkpoint=checkpoint, **kwargs)


def quantized_layers(model) -> dict[str, torch.nn.Module]:
    """The bitsandbytes layers of `model`: Linear4bit and Linear8bitLt."""
    import bitsandbytes as bnb

    return {name: m for name, m in model.named_modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))}


def require_quantized(model, quantization: str, what: str) -> dict[str, torch.nn.Module]:
    """Prove `model` really is quantized as `quantization` says: bitsandbytes layers of that kind, 4-bit ones of
    that quant type, nested (double quant) or not as asked, 8-bit ones holding int8 weights."""
    import bitsandbytes as bnb

    layers = quantized_layers(model)
    require(layers, f"{what} has no bitsandbytes layer: it was not quantized")
    if quantization == "int8":
        wrong = [n for n, m in layers.items() if not isinstance(m, bnb.nn.Linear8bitLt) or m.weight.dtype != torch.int8]
    else:
        quant_type, nested = quantization.split("_")[0], quantization.endswith("_dq")
        wrong = [n for n, m in layers.items() if not isinstance(m, bnb.nn.Linear4bit) or m.weight.quant_state is None
                 or m.weight.quant_state.quant_type != quant_type or bool(m.weight.quant_state.nested) != nested]
    require(not wrong, f"{what}: {len(wrong)} of {len(layers)} bitsandbytes layers are not {quantization} ({wrong[:3]})")
    return layers


def save(model, folder: Path) -> Path:
    """`save_pretrained` as users call it, in shards of `SMALL_SHARD`: a real model's several shards and their index
    (one file, the tiny models' default, is the `quantized_serialization` family's round trip)."""
    model.save_pretrained(folder, max_shard_size=SMALL_SHARD)
    return folder


def checkpoint_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor a safetensors checkpoint holds, by key, read with safetensors alone (no transformers)."""
    from safetensors.torch import load_file

    return {key: value for file in checkpoint_files(folder) for key, value in load_file(file).items()}


def quant_state_keys(tensors: dict[str, torch.Tensor], quantization: str) -> list[str]:
    suffix = QUANT_STATE_SUFFIXES[quantization.split("_")[0]]
    return [key for key in tensors if key.endswith(suffix)]


def require_checkpoint_written(folder: Path, quantization: str) -> dict[str, torch.Tensor]:
    """Prove the checkpoint is what the cell says: several shards with their index, a `quantization_config` and a
    quantized state for some weights (none for bf16). Returns its tensors."""
    files = checkpoint_files(folder)
    require(len(files) > 1 and (folder / "model.safetensors.index.json").exists(),
            f"save_pretrained wrote {len(files)} safetensors files{'' if (folder / 'model.safetensors.index.json').exists() else ' and no index'}: not sharded")
    tensors = checkpoint_tensors(folder)
    config = json.loads((folder / "config.json").read_text())
    if quantization == "bf16":
        require("quantization_config" not in config, "the bf16 checkpoint says it is quantized")
        return tensors
    require("quantization_config" in config, "the checkpoint's config.json has no quantization_config")
    require(quant_state_keys(tensors, quantization), f"the checkpoint holds no {quantization} quantized weight")
    return tensors


def held_otherwise(model, written: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """(keys the model holds with other values or dtype than the checkpoint wrote, written keys the model does not
    hold under that name), comparing the model's `state_dict()` (packed weights and quant states included) with the
    tensors of the checkpoint. A reader that converts keys (renames, fuses experts) holds some under other names."""
    held = {key: value.detach().cpu() for key, value in model.state_dict().items()}
    changed = [key for key, value in written.items() if key in held
               and not (held[key].dtype == value.dtype and held[key].shape == value.shape and torch.equal(held[key], value))]
    return changed, [key for key in written if key not in held]


def offload_target(model, quantization: str) -> str:
    """The block an offloaded cell sends off the main device: the last decoder layer's 4-bit MLP (or attention) for a
    4-bit model, so that quantized weights are offloaded; the last decoder layer otherwise."""
    from stackcheck.harness.place import decoder_layers, last_layer_4bit_block, module_name

    if quantization.startswith(("nf4", "fp4")):
        return last_layer_4bit_block(model)
    return module_name(model, decoder_layers(model)[-1])


def per_module_map(model, target: str, main, offload: str) -> dict[str, object]:
    """A device map of the shape `device_map="auto"` gives: one entry per top module (no "" key), `target` on the
    offload device and every other module on the main device."""
    ancestors = {target.rsplit(".", depth)[0] for depth in range(target.count(".") + 1)}
    device_map: dict[str, object] = {}

    def walk(prefix: str, module) -> None:
        # An ancestor's own tensors (Gemma 4's per-layer `layer_scalar` beside its children) get an entry each, as
        # accelerate's `infer_auto_device_map` gives them: a map of children alone leaves them without a device.
        for name, _tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            device_map[f"{prefix}.{name}" if prefix else name] = main
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if full == target:
                device_map[full] = offload
            elif full in ancestors:
                walk(full, child)
            else:
                device_map[full] = main

    walk("", model)
    return device_map


def dispatch_offloaded(under_test: UnderTest, model, offload_dir: Path, target: str, with_root: bool):
    """accelerate's `dispatch_model` as transformers calls it (with `skip_keys`), `target` on the offload device
    (the CPU under a GPU, the disk under the CPU). `with_root`: the map a user writes, `{target: offload, "": main}`;
    else the shape of an `auto` map (`per_module_map`). The model keeps the map as `hf_device_map`, as
    `from_pretrained` leaves it."""
    from accelerate import dispatch_model

    from stackcheck.harness.place import device_key, offload_device

    main, offload = device_key(under_test.device), offload_device(under_test.device)
    device_map = {target: offload, "": main} if with_root else per_module_map(model, target, main, offload)
    model = dispatch_model(model, device_map=device_map, offload_dir=str(offload_dir), skip_keys=model._skip_keys_device_placement)
    model.hf_device_map = device_map
    return model


def require_offloaded(model, target: str) -> None:
    """Prove `target` really was offloaded: every parameter of it waits on meta, behind accelerate's hooks."""
    params = list(model.get_submodule(target).parameters())
    require(params and all(p.device.type == "meta" for p in params), f"accelerate did not offload {target}: its weights are not on meta")
    require(any(hasattr(m, "_hf_hook") for m in model.get_submodule(target).modules()), f"{target} has no accelerate hook")
