"""Adapt: PEFT adapters on the base, loaded (`peft_load`) or fresh for training (`qlora_model`), and where
they sit."""

from __future__ import annotations

from pathlib import Path

import torch

from stackcheck.harness.subject import UnderTest
from stackcheck.models import tiny


def peft_load(under_test: UnderTest, base, adapter: str | Path, **kwargs):
    """`PeftModel.from_pretrained` with the name of an adapter fixture of the architecture, or an adapter directory."""
    from peft import PeftModel

    checkpoint = adapter if isinstance(adapter, Path) else tiny.adapter_checkpoint(under_test.arch, adapter)
    return PeftModel.from_pretrained(base, checkpoint, is_trainable=False, **kwargs)


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
