"""Reproduces stackcheck cell tests/families/test_qlora_step.py::test_qlora_steps_learn_and_leave_the_4bit_base_untouched[cpu-inner_linear-split-torch_adamw] on set latest (known_bug: lora_on_offloaded_layer_meta).

Expected failure: RuntimeError: Function MmBackward0 returned an invalid gradient at index 1 - expected device meta but got cpu
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"  # no network: every model is built from its config
import shutil
from functools import cache
import torch
import re

FIXTURES = {'tiny_gemma4.json': {'_comment': 'Tiny random Gemma 4 (transformers testing_utils style). Text: 6 layers, '
                                  'mixed sliding/full, last 2 layers share KV. Towers use '
                                  'Gemma4ClippableLinear (use_clipped_linears=true).',
                      'text_config': {'vocab_size': 256,
                                      'hidden_size': 64,
                                      'intermediate_size': 128,
                                      'num_hidden_layers': 6,
                                      'num_attention_heads': 2,
                                      'num_key_value_heads': 1,
                                      'head_dim': 32,
                                      'global_head_dim': 32,
                                      'vocab_size_per_layer_input': 256,
                                      'hidden_size_per_layer_input': 16,
                                      'num_kv_shared_layers': 2,
                                      'layer_types': ['sliding_attention',
                                                      'full_attention',
                                                      'sliding_attention',
                                                      'full_attention',
                                                      'sliding_attention',
                                                      'full_attention'],
                                      'sliding_window': 16,
                                      'max_position_embeddings': 256,
                                      'initializer_range': 0.2},
                      'vision_config': {'hidden_size': 32,
                                        'intermediate_size': 64,
                                        'num_hidden_layers': 1,
                                        'num_attention_heads': 2,
                                        'num_key_value_heads': 2,
                                        'head_dim': 16,
                                        'patch_size': 4,
                                        'position_embedding_size': 64,
                                        'pooling_kernel_size': 2,
                                        'use_clipped_linears': True},
                      'audio_config': {'hidden_size': 32,
                                       'num_hidden_layers': 1,
                                       'num_attention_heads': 2,
                                       'subsampling_conv_channels': [8, 4],
                                       'output_proj_dims': 32,
                                       'use_clipped_linears': True}},
 'adapters.json': {'_comment': 'LoRA adapter fixtures. Weights are random and non-zero '
                               "(init_lora_weights=false) so every adapter changes outputs. 'weights_from' "
                               "builds the weights on that adapter's targets and saves them under this "
                               "adapter's own config.",
                   'language': {'target_modules': '.*language_model\\.layers\\.\\d+\\.(self_attn|mlp)\\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)'},
                   'inner_linear': {'target_modules': '.*(?:language_model\\.layers\\.\\d+\\.(?:self_attn|mlp)\\.(?:q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)|vision_tower\\.encoder\\.layers\\.\\d+\\.(?:self_attn|mlp)\\.(?:q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\\.linear|audio_tower\\.layers\\.\\d+\\.self_attn\\.(?:q_proj|k_proj|v_proj)\\.linear)$'},
                   'broad': {'target_modules': ['q_proj',
                                                'k_proj',
                                                'v_proj',
                                                'o_proj',
                                                'gate_proj',
                                                'up_proj',
                                                'down_proj'],
                             'weights_from': 'language'}}}
CACHE = Path(tempfile.mkdtemp(prefix="repro-tiny-"))  # where the tiny checkpoints are built

SEED = 0


def _fixture(name: str) -> dict:
    return json.loads(json.dumps(FIXTURES[name]))


def adapter_spec(name: str) -> dict:
    return _fixture("adapters.json")[name]


def _cache_dir(model: str = "tiny-gemma4", fixtures=()) -> Path:
    return CACHE


class FixtureError(Exception):
    """A fixture could not be built with the installed libraries: the cell's setup broke, which says
    nothing about the bug under test (the verdict is `error`, never `new_failure`)."""


def tiny_config():
    try:
        from transformers import Gemma4Config

        return Gemma4Config(**_fixture("tiny_gemma4.json"))
    except Exception as exc:
        raise FixtureError(f"the tiny Gemma 4 config cannot be built: {type(exc).__name__}: {exc}") from exc


def _build_once(target: Path, build) -> Path:
    """Build into a temp dir and rename it into place, so parallel workers never see half a checkpoint."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        try:
            build(scratch)
        except FixtureError:
            raise
        except Exception as exc:
            raise FixtureError(f"fixture {target.name} cannot be built: {type(exc).__name__}: {exc}") from exc
        os.replace(scratch, target)
    except OSError:
        if not target.exists():  # lost a race to another worker: theirs is as good as ours
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _new_base_model():
    import torch
    from transformers import Gemma4ForConditionalGeneration

    torch.manual_seed(SEED)
    return Gemma4ForConditionalGeneration(tiny_config()).eval()


@cache
def base_checkpoint() -> Path:
    """Directory of the bf16 safetensors checkpoint of the tiny model."""
    import torch

    def build(out: Path) -> None:
        _new_base_model().to(torch.bfloat16).save_pretrained(out, safe_serialization=True)

    return _build_once(_cache_dir() / "base", build)


def lora_config(name: str, **overrides):
    """The LoRA config of the adapter fixture `name`: its targets (fixtures/adapters.json), rank 4, alpha 8."""
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": adapter_spec(name)["target_modules"], **overrides})


def bnb_has_packed_cpu_path() -> bool:
    """Whether this bitsandbytes has the packed AVX512-BF16 CPU path for 4-bit layers (0.49.0 on)."""
    import bitsandbytes.functional

    return hasattr(bitsandbytes.functional, "_convert_weight_packed_for_cpu")


PROMPT_IDS = [[92, 140, 25, 5, 26, 242, 247, 189]]


TRAINING_IDS = [PROMPT_IDS[0] + [3, 17, 99, 45]]


SEED_SPLIT_DEVICE_MAP = {"model.vision_tower": "cpu", "model.audio_tower": "cpu", "": 0}


TOWERS = ("model.vision_tower", "model.audio_tower")


TOWER_SKIP_MODULES = ["model.vision_tower", "model.embed_vision", "model.audio_tower", "model.embed_audio", "lm_head"]


_lane_device = torch.device("cpu")


class ScenarioNotReached(Exception):
    """The test could not prove its bug's precondition, so its outcome says nothing about the bug."""

    def __init__(self, what: str):
        super().__init__(f"scenario not reached: {what}")


def require(condition: object, what: str) -> None:
    if not condition:
        raise ScenarioNotReached(what)


def use_lane(lane: str) -> None:
    """Point `main_device()` at the lane's device. The CPU lane stays on the CPU even on a GPU host, so its
    verdicts mean the same on every machine."""
    global _lane_device
    _lane_device = torch.device("cuda", 0) if lane == "gpu" else torch.device("cpu")


def main_device() -> torch.device:
    return _lane_device


def device_key(device: torch.device) -> int | str:
    """How accelerate's device maps and max_memory name a device."""
    return device.index if device.type == "cuda" else device.type


def offload_device(main: torch.device) -> str:
    """accelerate offloads (params to meta, weights in a map) to 'cpu' when the main device is a GPU
    and only to 'disk' when the main device is the CPU: the same hooks, one level further down."""
    return "disk" if main.type == "cpu" else "cpu"


def bnb_config(double_quant: bool = True, fp32_cpu_offload: bool = False):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16,
        llm_int8_enable_fp32_cpu_offload=fp32_cpu_offload,
    )


def load_base(quantized: bool = True, double_quant: bool = True, device_map=None, checkpoint: Path | None = None, **kwargs):
    """The seed's `Gemma4ForConditionalGeneration.from_pretrained`, on the tiny checkpoint (or on `checkpoint`,
    one that another set's transformers wrote)."""
    from transformers import Gemma4ForConditionalGeneration

    if device_map is None:
        device_map = {"": str(main_device())}
    checkpoint = checkpoint or base_checkpoint()
    return load_pretrained(Gemma4ForConditionalGeneration, checkpoint, quantized, double_quant, device_map, **kwargs)


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
    if not bnb_has_packed_cpu_path():
        return
    for name, layer in linear4bit_modules(model).items():
        require(hasattr(layer, "support_avx512bf16_for_cpu"), f"{name}: this bitsandbytes packs CPU weights with no per-layer switch")
        layer.support_avx512bf16_for_cpu = False


def linear4bit_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    import bitsandbytes as bnb

    return {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


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


def dispatch_with_offload(model, offload_dir: Path, *offloaded_modules: str):
    """accelerate's `dispatch_model` as transformers calls it (with `skip_keys`): `offloaded_modules` on the
    offload device, everything else on the main device."""
    from accelerate import dispatch_model

    main = main_device()
    device_map = {**dict.fromkeys(offloaded_modules, offload_device(main)), "": device_key(main)}
    return dispatch_model(
        model, device_map=device_map, offload_dir=str(offload_dir), skip_keys=model._skip_keys_device_placement
    )


def missing_device_map_keys(model, device_map: dict) -> list[str]:
    """The preflight: keys of a device map that name no module of the model (accelerate ignores them)."""
    names = {name for name, _ in model.named_modules()}
    return [key for key in device_map if key not in names]


def split_base(offload_dir: Path, quantized: bool = True, double_quant: bool = True):
    """The base split across devices the way the seed user split it, so that PEFT redispatches it.

    GPU lane: the seed's own load, transformers dispatching `SEED_SPLIT_DEVICE_MAP` with the multimodal
    towers on the CPU (left unquantized by `llm_int8_enable_fp32_cpu_offload`).
    CPU lane: the main device is the CPU, so the split goes one level down: the per-layer embedding table,
    which bitsandbytes never quantizes, is offloaded to disk.
    Either way the base gets an `hf_device_map` with an offloaded entry, which is what makes PEFT redispatch.
    """
    if main_device().type == "cpu":
        model = load_base(quantized=quantized, double_quant=double_quant)
        model = dispatch_with_offload(model, offload_dir, "model.language_model.embed_tokens_per_layer")
    else:
        config = {"quantization_config": bnb_config(double_quant, fp32_cpu_offload=True)} if quantized else {}
        model = load_base(quantized=quantized, device_map=SEED_SPLIT_DEVICE_MAP, **config)
        missing = missing_device_map_keys(model, SEED_SPLIT_DEVICE_MAP)
        require(not missing, f"the split device map names modules Gemma 4 does not have: {missing}")
    offloaded = {device for device in getattr(model, "hf_device_map", {}).values() if device in ("cpu", "disk")}
    require(offloaded and len(set(model.hf_device_map.values())) > 1, "the split base was not dispatched across devices")
    return model


def towers_offloaded_base(offload_dir: Path):
    """The 4-bit base with its multimodal towers in bf16 and offloaded by accelerate, as the seed user's split
    leaves them: the towers' weights wait on meta and their offload hooks bring them in for each forward.
    GPU lane: `split_base` itself (the towers on the CPU). CPU lane: the towers kept in bf16 by
    `TOWER_SKIP_MODULES`, offloaded one level down, to disk."""
    if main_device().type == "cuda":
        model = split_base(offload_dir)
    else:
        config = bnb_config()
        config.llm_int8_skip_modules = TOWER_SKIP_MODULES
        model = dispatch_with_offload(load_base(quantization_config=config), offload_dir, *TOWERS)
    towers = dict(model.named_modules())
    on_meta = [tower for tower in TOWERS if all(p.device.type == "meta" for p in towers[tower].parameters())]
    require(on_meta == list(TOWERS), f"accelerate did not offload the towers (offloaded: {on_meta})")
    return model


def image_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a random image, a grey one, patch positions) as Gemma 4's image processor lays them out: values in
    [0, 1], one row of 3 * patch_size**2 values per patch, (x, y) positions. The tiny tower's patch is 4 pixels:
    a 16 x 16 image is 4 x 4 patches, pooled to 4 soft tokens. Values stay clear of 0 and 1, which a uint8
    cast would not zero."""
    generator = torch.Generator().manual_seed(1)
    image = (0.02 + 0.96 * torch.rand(1, 16, 48, generator=generator)).to(torch.bfloat16)
    grey = torch.full_like(image, 0.5)
    x, y = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy")
    positions = torch.stack([x, y], dim=-1).reshape(1, 16, 2)
    return image.to(main_device()), grey.to(main_device()), positions.to(main_device())


def audio_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two random log-mel inputs and their mask: 48 frames of 8 bins (the tiny tower's two stride-2
    convolutions need 8), 12 soft tokens each."""
    generator = torch.Generator().manual_seed(2)
    first, second = (torch.randn(1, 48, 8, generator=generator).to(torch.bfloat16) for _ in range(2))
    return first.to(main_device()), second.to(main_device()), torch.ones(1, 48, dtype=torch.bool, device=main_device())


IMAGE_SOFT_TOKENS, AUDIO_SOFT_TOKENS = 4, 12


def training_batch(config, multimodal: bool = False) -> dict[str, torch.Tensor]:
    """The fixed training batch as model kwargs. Multimodal: an image and an audio clip between the text
    tokens, their soft-token positions left out of the loss."""
    text = TRAINING_IDS[0]
    if not multimodal:
        ids = torch.tensor([text], device=main_device())
        return {"input_ids": ids, "labels": ids}
    media = [config.image_token_id] * IMAGE_SOFT_TOKENS + [config.audio_token_id] * AUDIO_SOFT_TOKENS
    ids = torch.tensor([text[:4] + media + text[4:]], device=main_device())
    labels = ids.masked_fill((ids == config.image_token_id) | (ids == config.audio_token_id), -100)
    image, _grey, positions = image_inputs()
    audio, _other, audio_mask = audio_inputs()
    return {"input_ids": ids, "labels": labels, "pixel_values": image, "image_position_ids": positions,
            "input_features": audio, "input_features_mask": audio_mask}


def qlora_model(base, adapter: str = "language"):
    """The QLoRA recipe on `base`: `prepare_model_for_kbit_training` with its defaults, then a fresh LoRA on the
    adapter fixture's targets (`lora_config`), in training mode."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    model = get_peft_model(prepare_model_for_kbit_training(base), lora_config(adapter))
    model.train()
    return model


def train_steps(model, optimizer, steps: int, multimodal: bool = False) -> list[float]:
    """`steps` optimizer steps on the fixed training batch (`training_batch`); the loss of each."""
    batch = training_batch(model.config, multimodal)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def first_nested_linear4bit(model) -> tuple[str, torch.nn.Module]:
    modules = linear4bit_modules(model)
    require(modules, "the model has no bnb Linear4bit modules")
    name, module = next(iter(modules.items()))
    require_nested_linear4bit(name, module)
    return name, module


scenario = SimpleNamespace(first_nested_linear4bit=first_nested_linear4bit, linear4bit_modules=linear4bit_modules, load_base=load_base, qlora_model=qlora_model, quant_state_tensors=quant_state_tensors, require=require, towers_offloaded_base=towers_offloaded_base, train_steps=train_steps)  # stackcheck's scenario helpers, as the test calls them


tiny = SimpleNamespace(lora_config=lora_config)  # stackcheck's tiny helpers, as the test calls them


STEPS = 5


def frozen_state(model) -> dict[str, torch.Tensor]:
    """Copies of every frozen tensor of the base: parameters, and each 4-bit layer's quant state. Parameters an
    offload hook keeps on meta hold no data to compare (on the split base: unquantized tables and towers)."""
    state = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad and p.device.type != "meta"}
    for name, layer in scenario.linear4bit_modules(model).items():
        for index, tensor in enumerate(scenario.quant_state_tensors(layer.weight.quant_state)):
            state[f"{name}.quant_state.{index}"] = tensor.detach().clone()
    return state


def expected_trainable(base, target_modules: str, rank: int) -> int:
    return sum(rank * (m.in_features + m.out_features) for name, m in base.named_modules()
               if re.fullmatch(target_modules, name) and hasattr(m, "in_features"))


def require_optimizer_moved(trainable: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> None:
    scenario.require(any(not torch.equal(p, start[name]) for name, p in trainable.items()), "the optimizer moved no LoRA weight")


def paged_adamw_8bit(params, lr):
    import bitsandbytes as bnb

    return bnb.optim.PagedAdamW8bit(params, lr=lr)


OPTIMIZERS = {"torch_adamw": torch.optim.AdamW, "bnb_paged_adamw_8bit": paged_adamw_8bit}


def whole_base(offload_dir):
    return scenario.load_base()


BASES = {"whole": whole_base, "split": scenario.towers_offloaded_base}


ADAPTERS = {"language": False, "inner_linear": True}


def test_qlora_steps_learn_and_leave_the_4bit_base_untouched(adapter, base_name, optimizer_name, offload_dir):
    base = BASES[base_name](offload_dir)
    scenario.first_nested_linear4bit(base)
    config = tiny.lora_config(adapter)
    expected = expected_trainable(base, config.target_modules, config.r)
    model = scenario.qlora_model(base, adapter)
    before = frozen_state(model)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    start = {name: p.detach().clone() for name, p in trainable.items()}

    losses = scenario.train_steps(model, OPTIMIZERS[optimizer_name](list(trainable.values()), lr=1e-2), STEPS, ADAPTERS[adapter])

    require_optimizer_moved(trainable, start)
    assert losses[-1] < losses[0], f"the loss did not decrease over {STEPS} steps: {losses}"
    dead = [name for name, p in trainable.items() if p.grad is None or not torch.isfinite(p.grad).all() or not p.grad.any()]
    assert not dead, f"{len(dead)} of {len(trainable)} LoRA parameters got no finite non-zero gradient: {dead[:3]}"
    changed = [name for name, tensor in frozen_state(model).items() if not torch.equal(tensor, before[name])]
    assert not changed, f"training changed {len(changed)} frozen base tensors: {changed[:3]}"
    assert sum(p.numel() for p in trainable.values()) == expected


def main():
    use_lane('cpu')
    test_qlora_steps_learn_and_leave_the_4bit_base_untouched(adapter='inner_linear', base_name='split', optimizer_name='torch_adamw', offload_dir=Path(tempfile.mkdtemp()) / 'offload')


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        traceback.print_exc()
        first_line = (str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)).strip().splitlines()
        print(f"REPRODUCED {type(exc).__name__}: {first_line[0] if first_line else ''}")
        sys.exit(1)
    print("NOT REPRODUCED: the test passed")
