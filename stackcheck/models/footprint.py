"""What a 4-bit model should weigh, and which of its weights bitsandbytes leaves in 16 bits.

One home for the NF4 arithmetic (the bench's weight sizes, the quantized_experts family and scan's footprint
prediction all use it) and for the rule of which weights stay unquantized by design; a mixture of experts whose
experts transformers 5 fuses into 3-D parameters stays in bf16 (bitsandbytes#1849). The rule, weight by weight:
docs/internals.md, "models/footprint.py".
"""

from __future__ import annotations

import math

from stackcheck.models.architectures import EXPERT_COUNT_KEYS

NF4_BLOCKSIZE = 64  # bitsandbytes' default blocksize for 4-bit weights
NESTED_BLOCKSIZE = 256  # double quant's blocksize for the absmax


def nf4_bytes(values: int, blocksize: int = NF4_BLOCKSIZE, nested: bool = True, nested_blocksize: int = NESTED_BLOCKSIZE) -> int:
    """The weight-size arithmetic: NF4 packs two 4-bit values a byte and keeps one absmax per block, fp32 (4 bytes),
    or with double quant 8-bit (1 byte) plus one fp32 absmax per `nested_blocksize` of those. The code tables
    (1 KiB a layer) are left out: a constant a layer, negligible at realistic size."""
    blocks = math.ceil(values / blocksize)
    absmax = blocks + 4 * math.ceil(blocks / nested_blocksize) if nested else 4 * blocks
    return math.ceil(values / 2) + absmax


def expert_count(config) -> int:
    text = config.get_text_config()
    return next((getattr(text, key) for key in EXPERT_COUNT_KEYS if getattr(text, key, None)), 0)


def fused_experts(model) -> dict:
    """The 3-D parameters that hold one matrix per expert (not a tower's position table or a depthwise
    convolution, which are 3-D too)."""
    experts = expert_count(model.config)
    return {name: p for name, p in model.named_parameters() if experts and p.ndim == 3 and p.shape[0] == experts}


def kept_by_design(model, skip_modules: list[str]) -> dict[str, str]:
    """The weights of two or more dimensions that 4-bit quantization leaves in 16 bits on purpose, with why.
    `skip_modules`: the quantizer's `modules_to_not_convert` (the user's `llm_int8_skip_modules` and transformers'
    defaults for the model)."""
    import torch  # here, not at import: `scan` and the CLI import this module where torch is not installed

    experts = expert_count(model.config)
    head = model.get_output_embeddings()
    modules = dict(model.named_modules())
    kept = {}
    for name, param in model.named_parameters():
        owner = modules[name.rpartition(".")[0]]
        if param.ndim < 2:
            continue
        if isinstance(owner, torch.nn.Embedding) or "embedding" in name.rpartition(".")[2]:  # a tower's position table too
            kept[name] = "embedding"
        elif head is not None and param is head.weight:
            kept[name] = "head"
        elif experts and param.ndim == 2 and param.shape[0] == experts:
            kept[name] = "router"
        elif isinstance(owner, torch.nn.modules.conv._ConvNd):
            kept[name] = "convolution"
        elif any(name == skip or name.startswith(skip + ".") or f".{skip}." in f".{name}" for skip in skip_modules):
            kept[name] = "not to convert"
        elif not (isinstance(owner, torch.nn.Linear) or type(owner).__name__ == "Conv1D") and not (experts and param.ndim == 3 and param.shape[0] == experts):
            kept[name] = "not a Linear"
    return kept


def meant_for_4bit(model, skip_modules: list[str]) -> dict:
    """Every weight of two or more dimensions the user's 4-bit config asks to have quantized."""
    kept = kept_by_design(model, skip_modules)
    return {name: p for name, p in model.named_parameters() if p.ndim >= 2 and name not in kept}
