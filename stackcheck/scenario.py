"""Building blocks every family test shares: loading the tiny model under test the way the seed user did,
dispatching it with accelerate, loading adapters through PEFT, and proving preconditions.

The model under test reaches each test as the `under_test` fixture (an `UnderTest`: the architecture and the
lane's device), and every helper that builds, places or feeds a model takes it as its first argument.
Each helper calls the public entry point whose code path the seed traces go through, and the `require_*`
helpers turn a missing precondition into ScenarioNotReached. One library setting is chosen rather than
left to the machine: bitsandbytes' CPU kernel for 4-bit layers (`pin_portable_cpu_kernel`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest
import torch

from stackcheck import hostinfo
from stackcheck.models import architectures, tiny
from stackcheck.models.architectures import Architecture
from stackcheck.models.tiny import NotApplicable

# Chosen so that every greedy step of the tiny Gemma 4 base and adapter, 4-bit and bf16, wins by at least 0.69
# logits (11 bf16 steps at their scale). The other architectures' tiny models have logits near 0.7, where steps
# can win by one bf16 step (0.0039): their token comparisons skip such near-ties (`Decode`).
PROMPT_IDS = [[92, 140, 25, 5, 26, 242, 247, 189]]
# One fixed training batch: the prompt and four more tokens, its own labels.
TRAINING_IDS = [PROMPT_IDS[0] + [3, 17, 99, 45]]
# The seed user's device map (seed 001), and the split the GPU lane loads: the same without
# `model.multi_modal_projector`, which Gemma 4 does not have (from_pretrained accepts the stray key).
SEED_USER_DEVICE_MAP = {"model.vision_tower": "cpu", "model.multi_modal_projector": "cpu", "model.audio_tower": "cpu", "": 0}
SEED_SPLIT_DEVICE_MAP = {"model.vision_tower": "cpu", "model.audio_tower": "cpu", "": 0}
TOWERS = ("model.vision_tower", "model.audio_tower")
# The base in bf16 (the control) and in NF4 with double quant, for the tests that run on both.
QUANTIZATION = pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "nf4"])
# The `llm_int8_skip_modules` that keeps the towers in bf16: the towers, their projectors (Gemma 4's
# `embed_vision` and `embed_audio`) and, because any list replaces transformers' defaults, the tied head.
TOWER_SKIP_MODULES = ["model.vision_tower", "model.embed_vision", "model.audio_tower", "model.embed_audio", "lm_head"]


@dataclass(frozen=True)
class UnderTest:
    """The model under test: an architecture, on the lane's device (the CPU lane stays on the CPU even on a
    GPU host, so its verdicts mean the same on every machine)."""

    arch: Architecture
    device: torch.device

    @cached_property
    def structures(self) -> frozenset[str]:
        found = architectures.structures(tiny.tiny_config(self.arch))
        if self.arch.declared is not None and found != self.arch.declared:
            raise tiny.FixtureError(f"the tiny {self.arch.name} has the structures {sorted(found)}, its config declares {sorted(self.arch.declared)}")
        return found

    def require_structures(self, needed: Iterable[str]) -> None:
        """A test whose bug lives in structures this architecture lacks cannot exist on it: not applicable."""
        missing = sorted(set(needed) - self.structures)
        if missing:
            raise NotApplicable(f"{self.arch.name} has no {', '.join(missing)}")

    def __str__(self) -> str:
        return f"{self.arch.name} on {self.device}"


def seed_model(device: torch.device) -> UnderTest:
    """The seed user's model, the tiny Gemma 4, on `device`: what the benchmarks and the harness's own tests use."""
    return UnderTest(architectures.builtin()[architectures.SEED_ARCHITECTURE], device)


def lane_device(lane: str) -> torch.device:
    return torch.device("cuda", 0) if lane == "gpu" else torch.device("cpu")


class ScenarioNotReached(Exception):
    """The test could not prove its bug's precondition, so its outcome says nothing about the bug."""

    def __init__(self, what: str):
        super().__init__(f"scenario not reached: {what}")


def require(condition: object, what: str) -> None:
    if not condition:
        raise ScenarioNotReached(what)


class ToleranceExceeded(AssertionError):
    """A measured value past its tolerance. The ledger files it under a numeric known bug only when
    `measured` is finite and inside the band that bug was measured at.

    Where the value past the tolerance depends on the model's size or scale (a merge's logit error depends on how
    large the adapter is against the NF4 step), the test also names the quantity its bug's mechanism fixes
    (`judged_by`); that one is `measured`, and the ledger's band is over it."""

    def __init__(self, what: str, value: float, tolerance: float, judged_by: tuple[str, float] | None = None):
        self.measured = value if judged_by is None else judged_by[1]
        explained = "" if judged_by is None else f" ({judged_by[0]} {judged_by[1]:.4f})"
        super().__init__(f"{what} {value:.4f} > {tolerance}{explained}")


def assert_within(what: str, measured: float, tolerance: float, judged_by: tuple[str, float] | None = None) -> None:
    # Captured by pytest: shown for a failure, and for a pass with `-rP`, so passing margins can be reported too.
    explained = "" if judged_by is None else f"; {judged_by[0]} {judged_by[1]:.4f}"
    print(f"stackcheck measured: {what} {measured:.4f} (tolerance {tolerance}){explained}")
    if not measured <= tolerance:  # written so that NaN fails too
        raise ToleranceExceeded(what, measured, tolerance, judged_by)


def effect_kept(changed: torch.Tensor, reference: torch.Tensor, before: torch.Tensor) -> float:
    """How much of the change `before -> reference` the change `before -> changed` carries along its direction:
    1 when it is all there, 0 when none of it is. Error that is not along the change (noise) does not count."""
    effect, carried = (reference - before).float().flatten(), (changed - before).float().flatten()
    return (carried @ effect / (effect @ effect)).item()


def relative_error(measured: torch.Tensor, reference: torch.Tensor) -> float:
    """||measured - reference|| / ||reference||, in fp32."""
    measured, reference = measured.float(), reference.float()
    return ((measured - reference).norm() / reference.norm()).item()


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


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of the language model: the `layers` beside its input embeddings."""
    embeddings = model.get_input_embeddings()
    decoder = next(name.rpartition(".")[0] for name, m in model.named_modules() if m is embeddings)
    return model.get_submodule(f"{decoder}.layers" if decoder else "layers")


def module_name(model, module: torch.nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


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


def memory_pressure(under_test: UnderTest, model, fraction: float = 0.5) -> dict:
    """A `max_memory` whose main-device budget holds only part of the model, forcing the rest off it: the seed
    user's 12 GB GPU, reproduced on any device. The budget is `fraction` of the model, or the least tenth above it
    with which accelerate's own `infer_auto_device_map` (as PEFT's redispatch calls it) keeps `MAIN_DEVICE_SHARE`
    of the model on the main device. Measured on the tiny models (CPU lane): Gemma 4 keeps 29% at 0.5; Llama 3,
    Qwen3 and Phi-4 keep nothing below 0.7 (accelerate then maps the whole model to disk, which 1.15 fails to
    dispatch, `FileNotFoundError: index.json`, and < 1.15 refuses: no user's scenario), 30% from 0.7; the tiny
    MoE models keep only their embeddings at any budget under the whole model (two layers of 45% each): not
    reached. On a GPU the CPU gets room for the overflow, as the user's did; without a CPU budget accelerate would
    send it to disk."""
    from accelerate.utils import compute_module_sizes, get_max_memory, infer_auto_device_map

    main, sizes = under_test.device, compute_module_sizes(model)
    for share in (fraction, *(step / 10 for step in range(int(fraction * 10) + 1, 10))):
        budget = {device_key(main): int(sizes[""] * share)}
        if main.type == "cuda":
            budget["cpu"] = get_max_memory()["cpu"]
        # As PEFT's redispatch calls it: a list (accelerate < 1.15 reads a set, transformers 5's type, as one class name).
        placed = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=list(model._no_split_modules))
        on_main = sum(sizes[name] for name, device in placed.items() if device == device_key(main))
        if on_main >= MAIN_DEVICE_SHARE * sizes[""]:
            return budget
    raise ScenarioNotReached(f"no budget under the whole model keeps {MAIN_DEVICE_SHARE:.0%} of it on {main}: its layers are too coarse to split")

def peft_load(under_test: UnderTest, base, adapter: str | Path, **kwargs):
    """`PeftModel.from_pretrained` with the name of an adapter fixture of the architecture, or an adapter directory."""
    from peft import PeftModel

    checkpoint = adapter if isinstance(adapter, Path) else tiny.adapter_checkpoint(under_test.arch, adapter)
    return PeftModel.from_pretrained(base, checkpoint, is_trainable=False, **kwargs)


def image_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a random image, a grey one, patch positions) as Gemma 4's image processor lays them out: values in
    [0, 1], one row of 3 * patch_size**2 values per patch, (x, y) positions. The tiny tower's patch is 4 pixels:
    a 16 x 16 image is 4 x 4 patches, pooled to 4 soft tokens. Values stay clear of 0 and 1, which a uint8
    cast would not zero."""
    generator = torch.Generator().manual_seed(1)
    image = (0.02 + 0.96 * torch.rand(1, 16, 48, generator=generator)).to(torch.bfloat16)
    grey = torch.full_like(image, 0.5)
    x, y = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy")
    positions = torch.stack([x, y], dim=-1).reshape(1, 16, 2)
    return image.to(device), grey.to(device), positions.to(device)


def audio_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two random log-mel inputs and their mask: 48 frames of 8 bins (the tiny tower's two stride-2
    convolutions need 8), 12 soft tokens each."""
    generator = torch.Generator().manual_seed(2)
    first, second = (torch.randn(1, 48, 8, generator=generator).to(torch.bfloat16) for _ in range(2))
    return first.to(device), second.to(device), torch.ones(1, 48, dtype=torch.bool, device=device)


IMAGE_SOFT_TOKENS, AUDIO_SOFT_TOKENS = 4, 12


def training_batch(device: torch.device, config, multimodal: bool = False) -> dict[str, torch.Tensor]:
    """The fixed training batch as model kwargs. Multimodal: an image and an audio clip between the text
    tokens, their soft-token positions left out of the loss."""
    text = TRAINING_IDS[0]
    if not multimodal:
        ids = torch.tensor([text], device=device)
        return {"input_ids": ids, "labels": ids}
    media = [config.image_token_id] * IMAGE_SOFT_TOKENS + [config.audio_token_id] * AUDIO_SOFT_TOKENS
    ids = torch.tensor([text[:4] + media + text[4:]], device=device)
    labels = ids.masked_fill((ids == config.image_token_id) | (ids == config.audio_token_id), -100)
    image, _grey, positions = image_inputs(device)
    audio, _other, audio_mask = audio_inputs(device)
    return {"input_ids": ids, "labels": labels, "pixel_values": image, "image_position_ids": positions,
            "input_features": audio, "input_features_mask": audio_mask}


def qlora_model(under_test: UnderTest, base, adapter: str = "language"):
    """The QLoRA recipe on `base`: `prepare_model_for_kbit_training` with its defaults, then a fresh LoRA on the
    adapter fixture's targets (`tiny.lora_config`), in training mode."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    model = get_peft_model(prepare_model_for_kbit_training(base), tiny.lora_config(under_test.arch, adapter))
    model.train()
    return model


def train_steps(under_test: UnderTest, model, optimizer, steps: int, multimodal: bool = False) -> list[float]:
    """`steps` optimizer steps on the fixed training batch (`training_batch`); the loss of each."""
    batch = training_batch(under_test.device, model.config, multimodal)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def offloaded_linear4bit(model, device_map: dict[str, object], offloaded_to: Iterable[str]) -> list[str]:
    """Names of Linear4bit modules that `device_map` sent to an offload device."""
    offloaded_to = set(offloaded_to)
    roots = [name for name, device in device_map.items() if device in offloaded_to]
    return [
        name
        for name in linear4bit_modules(model)
        if any(root == "" or name == root or name.startswith(root + ".") for root in roots)
    ]


def prompt(device: torch.device) -> torch.Tensor:
    return torch.tensor(PROMPT_IDS, device=device)


@torch.no_grad()
def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids).logits.float().cpu()


@torch.no_grad()
def greedy(model, input_ids: torch.Tensor, new_tokens: int = 6) -> list[int]:
    out = model.generate(input_ids=input_ids, max_new_tokens=new_tokens, do_sample=False, use_cache=True)
    return out[0, input_ids.shape[1] :].tolist()


# A step whose winner leads by fewer bf16 steps (at its logit's scale) than this is a near-tie: rounding alone
# may swap the top two. Measured: a bf16 merge moves a margin by up to 4 steps (Gemma 4; 1 to 2 on the other
# tiny models), and on the tiny Gemma 3 the adapter's first step wins by 1 step (0.0039), which the merge swaps.
DECISIVE_BF16_STEPS = 8


@dataclass(frozen=True)
class Decode:
    """A reference model's greedy decode: its tokens and, per step, whether the winner led decisively."""

    tokens: list[int]
    decisive: list[bool]


def bf16_step(value: float) -> float:
    """The spacing of bf16 numbers at `value` (8 bits of mantissa)."""
    return 2.0 ** (math.floor(math.log2(abs(value) or 1.0)) - 7)


@torch.no_grad()
def decode(model, input_ids: torch.Tensor, new_tokens: int = 6) -> Decode:
    """`greedy`, with each step's lead of the winner over the runner-up."""
    out = model.generate(input_ids=input_ids, min_new_tokens=new_tokens, max_new_tokens=new_tokens, do_sample=False,
                         use_cache=True, output_logits=True, return_dict_in_generate=True)
    decisive = []
    for step in out.logits:
        top = step[0].float().topk(2).values.tolist()
        decisive.append(top[0] - top[1] >= DECISIVE_BF16_STEPS * bf16_step(top[0]))
    return Decode(out.sequences[0, input_ids.shape[1] :].tolist(), decisive)


@torch.no_grad()
def assert_decodes_alike(model, input_ids: torch.Tensor, reference: Decode, what: str, beside_logits: bool = False) -> None:
    """`model` decodes as `reference` did wherever the reference's choice was decisive: its own greedy tokens
    (generate, with the cache) until the reference's first near-tie, and, fed the reference's tokens, the same
    winner at every decisive step. A reference without one decisive step proves nothing: not reached, unless the
    test compares the logits too (`beside_logits`), which then decide alone. Measured: after the round trip's
    training the tiny Mixtral repeats one token at near-ties on this machine (torch 2.13) and decisively on the
    H100 host's CPU (torch 2.11)."""
    if beside_logits and not any(reference.decisive):
        return
    require(any(reference.decisive), f"every step of the reference decode {reference.tokens} is a near-tie")
    tokens = greedy(model, input_ids, len(reference.tokens))
    prefix = reference.decisive.index(False) if False in reference.decisive else len(reference.tokens)
    assert tokens[:prefix] == reference.tokens[:prefix], f"{what}: greedy tokens {tokens} != {reference.tokens}"
    sequence = torch.cat([input_ids, torch.tensor([reference.tokens], device=input_ids.device)], dim=1)
    winners = logits(model, sequence)[0, input_ids.shape[1] - 1 : -1].argmax(-1).tolist()
    differ = [step for step, decisive in enumerate(reference.decisive) if decisive and winners[step] != reference.tokens[step]]
    assert not differ, f"{what}: fed the reference's tokens, steps {differ} choose {[winners[s] for s in differ]}, not {[reference.tokens[s] for s in differ]}"


def assert_offload_hook_moves_weight_to_meta(module: torch.nn.Module) -> None:
    """What accelerate's offload hook does to a layer when it attaches: `set_module_tensor_to_device(module,
    "weight", "meta")`, which rebuilds a quantized weight as its own parameter class (Params4bit, Int8Params)."""
    from accelerate.utils import set_module_tensor_to_device

    param_class = type(module.weight)

    set_module_tensor_to_device(module, "weight", "meta")

    assert isinstance(module.weight, param_class), f"the weight is {type(module.weight).__name__}, not {param_class.__name__}"
    assert module.weight.device.type == "meta"


def require_hf_initialized(name: str, param: torch.nn.Parameter) -> None:
    require(getattr(param, "_is_hf_initialized", False), f"{name} does not carry transformers' _is_hf_initialized")


def first_nested_linear4bit(model) -> tuple[str, torch.nn.Module]:
    modules = linear4bit_modules(model)
    require(modules, "the model has no bnb Linear4bit modules")
    name, module = next(iter(modules.items()))
    require_nested_linear4bit(name, module)
    return name, module


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


def require_adapter_changes(with_adapter: torch.Tensor, without_adapter: torch.Tensor, where: str) -> None:
    require(not torch.allclose(with_adapter, without_adapter), f"the adapter does not change outputs of {where}")


def shared_kv_layers(model) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """(decoder layers, the KV-shared ones among them); errors when the model has no shared-KV layers."""
    layers = list(decoder_layers(model))
    shared = [layer for layer in layers if getattr(layer.self_attn, "is_kv_shared_layer", False)]
    require(shared, "the model has no KV-shared decoder layers")
    return layers, shared
