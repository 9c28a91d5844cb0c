"""The QLoRA recipes the distributed families judge and the bench's distributed case times: one home, so that what
the bench measures is what the families check. Each rank and the one-process reference build the same model: a
fresh 4-bit base, `scenario.qlora_model`'s recipe, its LoRA initialised from one seed, AdamW over the trainables."""

from __future__ import annotations

import torch

from stackcheck import scenario
from stackcheck.distributed import rank as rank_side
from stackcheck.models import tiny

LEARNING_RATE = 1e-3
# The LoRA's initialisation seed, the same on every rank and in one process.
LORA_SEED = 0


def optimizer_for(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)


def lora_on(under_test, base):
    torch.manual_seed(LORA_SEED)
    return scenario.qlora_model(under_test, base)


def quantization_config(quant_storage: torch.dtype = torch.uint8):
    """NF4 with double quant, the 4-bit weights packed into `quant_storage` (bitsandbytes' default uint8)."""
    config = scenario.bnb_config()
    config.bnb_4bit_quant_storage = quant_storage
    return config


def fsdp_qlora_model(under_test, base=None, quant_storage: torch.dtype = torch.uint8):
    """The FSDP-QLoRA recipe: NF4 with double quant in `quant_storage` (bitsandbytes' default uint8; bf16 is the
    storage FSDP can shard with the rest), on the rank's device (`base` when the caller loaded it, to prove something
    of it first)."""
    if base is None:
        base = scenario.load_base(under_test, quantization_config=quantization_config(quant_storage))
    return lora_on(under_test, base)


def zero3_qlora_model(under_test, quant_storage: torch.dtype = torch.bfloat16):
    """The ZeRO-3 QLoRA recipe of the PEFT guide: the 4-bit weights stored as bf16, so ZeRO-3 can flatten them with the
    rest. No device map: transformers refuses one under ZeRO-3, and a quantized load without one goes to the current
    CUDA device (`{"": torch.cuda.current_device()}`), which is the rank's once accelerate (or the Trainer's
    arguments) has set it, as in the users' order. The one-process reference is built before the Accelerator, so the
    rank's device is made current here: without it, rank 1 loaded onto cuda:0 and its batch on cuda:1 failed the
    first forward (`Expected all tensors to be on the same device, but got index is on cuda:1, different from other
    tensors on cuda:0`, the two-GPU run of latest), ours, not a library's."""
    if under_test.device.type == "cuda":
        torch.cuda.set_device(under_test.device)
    config = quantization_config(quant_storage)
    arch = under_test.arch
    return lora_on(under_test, scenario.load_pretrained(tiny.model_class(arch), tiny.base_checkpoint(arch), True, True, None,
                                                        quantization_config=config))


def deepspeed_stage3_accelerator():
    """The launch's Accelerator, proven to be DeepSpeed at ZeRO stage 3 (create it before loading: under ZeRO-3 the
    rank's device is made current there)."""
    accelerator = rank_side.accelerator()
    plugin = accelerator.state.deepspeed_plugin
    scenario.require(plugin is not None and plugin.zero_stage == 3,
                     f"accelerate's state is {accelerator.distributed_type}, not DeepSpeed ZeRO-3")
    return accelerator
