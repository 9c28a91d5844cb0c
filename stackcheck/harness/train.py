"""Train: the fixed training batch (text, or text with an image and an audio clip), the optimizer steps, and what a
training contract reads: mixed precision as users run it, checkpointing as PEFT's QLoRA recipe sets it up, the LoRA
gradients, the frozen base's bits."""

from __future__ import annotations

import torch

from stackcheck.harness.generate import PROMPT_IDS
from stackcheck.harness.proof import require
from stackcheck.harness.subject import UnderTest
from stackcheck.models import tiny


# One fixed training batch: the prompt and four more tokens, its own labels.
TRAINING_IDS = [PROMPT_IDS[0] + [3, 17, 99, 45]]


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


# --- Precision, checkpointing and the LoRA gradients: the building blocks of the train contract (and of the
# distributed one). Free of pytest fixtures: an `UnderTest` and a model are all they take.

# Gradient checkpointing as `prepare_model_for_kbit_training(gradient_checkpointing_kwargs=...)` sets it up (it calls
# transformers' `gradient_checkpointing_enable`): off, or on with `use_reentrant` chosen explicitly.
CHECKPOINTING = {"off": None, "reentrant": True, "non_reentrant": False}

# The half precision of a QLoRA run: the base loaded in it, bitsandbytes computing in it, the forward under autocast.
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def load_base_in(under_test: UnderTest, dtype: torch.dtype, quant: str = "nf4", **kwargs):
    """The user's 4-bit load for a run in `dtype`: `from_pretrained(dtype=...)` with `bnb_4bit_compute_dtype` the same
    (a T4 user's fp16, everyone else's bf16), NF4 with double quant; `quant="int8"`: LLM.int8 (`load_in_8bit=True`)."""
    from stackcheck.harness.load import Quantization, bnb_config, pin_portable_cpu_kernel

    if quant == "int8":
        config = Quantization("int8", dtype=dtype).config()
    else:
        config = bnb_config()
        config.bnb_4bit_compute_dtype = dtype
    device_map = kwargs.pop("device_map", {"": str(under_test.device)})
    model = tiny.model_class(under_test.arch).from_pretrained(tiny.base_checkpoint(under_test.arch), dtype=dtype, device_map=device_map,
                                                             quantization_config=config, **kwargs).eval()
    pin_portable_cpu_kernel(model)
    return model


def kbit_lora_model(under_test: UnderTest, base, use_reentrant: bool | None, adapter: str = "language", seed: int = tiny.SEED + 1,
                    **lora_overrides):
    """The QLoRA recipe with checkpointing chosen: `prepare_model_for_kbit_training` (its fp32 upcast, its
    checkpointing with `use_reentrant`, none for None), then `get_peft_model` with the adapter fixture's targets, its
    LoRA initialised from `seed`, in training mode."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    checkpointing = use_reentrant is not None
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=checkpointing,
                                           gradient_checkpointing_kwargs={"use_reentrant": use_reentrant} if checkpointing else None)
    torch.manual_seed(seed)
    model = get_peft_model(base, tiny.lora_config(under_test.arch, adapter, **lora_overrides))
    model.train()
    return model


def half_precision_parameters(model) -> list[str]:
    """The floating parameters of `model` still in fp16 or bf16 (none after `prepare_model_for_kbit_training`'s upcast;
    4-bit weights are not floating)."""
    return [name for name, p in model.named_parameters() if p.dtype in (torch.float16, torch.bfloat16)]


class MixedPrecision:
    """Mixed precision as users run it (what `Trainer(bf16=True)` or `Trainer(fp16=True)` does through accelerate):
    each forward under `torch.autocast` in `dtype`, and for fp16 a `torch.amp.GradScaler` with its defaults, which scales
    the loss, unscales the gradients before the step and skips a step whose gradients are not finite."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.dtype)

    def loss(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.autocast():
            return model(**batch).loss

    @property
    def scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.get_scale()

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> bool:
        """The optimizer step (after `unscale`); whether it was taken (the scaler skips it on inf or NaN gradients)."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before


def lora_parameters(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if "lora_" in name}


def lora_reached_by_text(model) -> dict[str, torch.nn.Parameter]:
    """The LoRA parameters a text batch can train: not those PEFT's default targets put inside an image model's
    vision or audio tower (Gemma 3's SigLIP q/k/v), which a text batch never runs."""
    return {name: p for name, p in lora_parameters(model).items() if not any(tower in name for tower in ("vision_tower", "audio_tower"))}


def gradient_copies(parameters: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor | None]:
    """Copies of the gradients of `parameters` in fp32 (None where there is none)."""
    return {name: None if p.grad is None else p.grad.detach().float().clone() for name, p in parameters.items()}


def grads_missing(grads: dict[str, torch.Tensor | None]) -> list[str]:
    """The tensors whose gradient is missing, not finite, or zero everywhere."""
    return [name for name, g in grads.items() if g is None or not torch.isfinite(g).all() or not g.any()]


def frozen_state(model) -> dict[str, torch.Tensor]:
    """Copies of every frozen tensor of the base: parameters, each 4-bit layer's quant state and each 8-bit layer's row
    scales (SCB, on its weight or, after a forward, on its state). Parameters an offload hook keeps on meta hold no data
    to compare (on a split base: unquantized tables and towers)."""
    import bitsandbytes as bnb

    from stackcheck.harness.load import int8_state, linear4bit_modules, quant_state_tensors

    state = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad and p.device.type != "meta"}
    for name, layer in linear4bit_modules(model).items():
        for index, tensor in enumerate(quant_state_tensors(layer.weight.quant_state)):
            state[f"{name}.quant_state.{index}"] = tensor.detach().clone()
    for name, layer in model.named_modules():
        if isinstance(layer, bnb.nn.Linear8bitLt) and (scales := int8_state(layer)[1]) is not None and scales.device.type != "meta":
            state[f"{name}.SCB"] = scales.detach().clone()
    return state


def tensors_changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensor is not bit-identical between two snapshots (`frozen_state`, or any name -> tensor map)."""
    return [name for name, tensor in before.items() if not torch.equal(tensor, after[name])]


class CheckpointingSeen:
    """Whether each decoder layer ran with checkpointing on, read at its forward as transformers'
    `GradientCheckpointingLayer` reads it (`gradient_checkpointing` and training mode)."""

    def __init__(self, model):
        from stackcheck.harness.place import decoder_layers

        self.layers = list(decoder_layers(model))
        self.checkpointed: dict[int, bool] = {}
        self.handles = [layer.register_forward_pre_hook(self.record) for layer in self.layers]

    def record(self, layer, args) -> None:
        index = self.layers.index(layer)
        self.checkpointed[index] = self.checkpointed.get(index, True) and bool(layer.gradient_checkpointing and layer.training)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def all(self) -> bool:
        """Whether every layer ran checkpointed (the hooks removed)."""
        self.remove()
        return all(self.checkpointed.get(i, False) for i in range(len(self.layers)))

    def require_all(self) -> None:
        self.remove()
        off = [i for i in range(len(self.layers)) if not self.checkpointed.get(i, False)]
        require(not off, f"decoder layers {off} of {len(self.layers)} ran without checkpointing (or not at all)")

    def require_none(self) -> None:
        self.remove()
        on = [i for i, checkpointed in self.checkpointed.items() if checkpointed]
        require(len(self.checkpointed) == len(self.layers) and not on,
                f"decoder layers {on} of {len(self.layers)} ran with checkpointing (or some not at all)")


def forward_runs(module: torch.nn.Module, run) -> int:
    """How often `module` ran its forward during `run()`. Hooked on a child of a checkpointed decoder layer (its
    attention), it counts the recomputation too: 2 for a forward and backward that recomputed the layer, 1 without (the
    layer's own hooks sit outside transformers' checkpoint wrapper and see the first pass only)."""
    calls = []
    handle = module.register_forward_hook(lambda *args: calls.append(1))
    try:
        run()
    finally:
        handle.remove()
    return len(calls)


# bitsandbytes' AdamW by the constructor arguments the axis model makes axes (bnb_optim's optim_bits and is_paged), named
# as the Trainer's `optim` names them (the unpaged 32-bit one has none): AdamW8bit, PagedAdamW8bit and PagedAdamW are
# bnb.optim.AdamW with these arguments fixed.
BNB_ADAMW = {"adamw_8bit": (8, False), "paged_adamw_8bit": (8, True), "adamw_32bit": (32, False), "paged_adamw_32bit": (32, True)}


def bnb_adamw_name(optim_bits: int, is_paged: bool) -> str:
    """The BNB_ADAMW name of bitsandbytes' AdamW with these arguments."""
    return next(name for name, arguments in BNB_ADAMW.items() if arguments == (optim_bits, is_paged))


def bnb_adamw(name: str, params, **hyperparameters) -> torch.optim.Optimizer:
    """The bitsandbytes optimizer `name` (a key of BNB_ADAMW) over `params`. bitsandbytes keeps the state of a tensor
    under `min_8bit_size` elements (4096) in 32 bits; the tiny models' LoRA tensors all are, so the 8-bit optimizers get
    `min_8bit_size=0`: the 8-bit state a full-size model's LoRA tensors (rank 16 x 4096 = 65536 elements) get."""
    import bitsandbytes as bnb

    bits, paged = BNB_ADAMW[name]
    if bits == 8:
        hyperparameters = {**hyperparameters, "min_8bit_size": 0}
    return bnb.optim.AdamW(params, optim_bits=bits, is_paged=paged, **hyperparameters)


def state_dtypes(optimizer: torch.optim.Optimizer, parameters: dict[str, torch.nn.Parameter]) -> dict[str, torch.dtype | None]:
    """The dtype of each parameter's first optimizer state (bitsandbytes' `state1`, torch's `exp_avg`); None where the
    optimizer holds no state for it."""
    dtypes = {}
    for name, p in parameters.items():
        state = optimizer.state.get(p, {})
        first = state.get("state1", state.get("exp_avg"))
        dtypes[name] = None if first is None else first.dtype
    return dtypes
