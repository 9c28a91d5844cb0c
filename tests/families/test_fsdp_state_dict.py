"""The full state dict of a 4-bit QLoRA model under FSDP1, as a user saves it: every 4-bit weight with its quant
state, equal to the single-process model's.

Precondition proven on every rank: the single-process model's own state dict holds the 4-bit quant state of every
`Linear4bit` (70 keys of 99 in the tiny Llama 3: 14 layers, 5 keys each), and `prepare` returned an FSDP1 module.

Symptom, the launch, the judgement and what is not tested: docs/family-notes.md#fsdp_state_dict.
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.distributed import rank as rank_side
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import architectures, tiny
from tests.families.test_fsdp1_quant_storage import ARCHITECTURE, qlora_model


def quant_state_keys(model) -> dict[str, list[str]]:
    """Each Linear4bit's weight name -> the state-dict keys of its quant state, as the layer writes them."""
    return {f"{name}.weight": [f"{name}.weight.{key}" for key in layer.weight.quant_state.as_dict(packed=True)]
            for name, layer in scenario.linear4bit_modules(model).items()}


def dequantized(weight: torch.Tensor, state: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """A 4-bit weight rebuilt from a state dict's entries under `prefix` (`<layer>.weight.`), dequantized."""
    from bitsandbytes.functional import QuantState, dequantize_4bit

    quant_state = QuantState.from_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, device=weight.device)
    return dequantize_4bit(weight.view(torch.uint8), quant_state)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bytes: packed 4-bit weights stored as bf16 hold NaN bit patterns, which `torch.equal` calls unequal."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def full_state_dict_under_fsdp1() -> dict:
    """On every rank: the single-process model's state dict, then FSDP1's full one; every difference."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    accelerator = rank_side.accelerator()
    under_test = scenario.UnderTest(architectures.builtin()[ARCHITECTURE], rank_side.device())
    single, _ = qlora_model(under_test, torch.bfloat16, torch.bfloat16)
    expected = {key: value.detach().cpu() for key, value in single.state_dict().items()}
    quantized = quant_state_keys(single)
    scenario.require(quantized and all(key in expected for keys in quantized.values() for key in keys),
                     "the single-process state dict lacks the 4-bit quant state")

    model, _ = qlora_model(under_test, torch.bfloat16, torch.bfloat16)
    model = accelerator.prepare(model)
    scenario.require(isinstance(model, FSDP), f"prepare gave {type(model).__name__}, not an FSDP1 module")
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    state = {key: value.detach().cpu() for key, value in state.items()}
    missing = sorted(expected.keys() - state.keys())
    assert not missing, f"FSDP1's full state dict lacks {len(missing)} of the model's {len(expected)} keys: {', '.join(missing[:3])}"
    differing = sorted(key for key in expected if not bitwise_equal(state[key], expected[key]))
    assert not differing, f"{len(differing)} tensors of FSDP1's full state dict differ from one process's: {', '.join(differing[:3])}"
    wrong = sorted(name for name in quantized
                   if not bitwise_equal(dequantized(state[name], state, f"{name}."), dequantized(expected[name], expected, f"{name}.")))
    assert not wrong, f"{len(wrong)} 4-bit weights of FSDP1's full state dict dequantize otherwise: {', '.join(wrong[:3])}"
    return {"keys": len(state), "quant_state_keys": sum(len(keys) for keys in quantized.values()), "linear4bit": len(quantized)}


@pytest.mark.ranks_engine("fsdp1")
@WORLD_SIZES
def test_full_state_dict_holds_the_4bit_weights(ranks, world_size):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])  # built once here, before the ranks read it
    ranks("tests.families.test_fsdp_state_dict:full_state_dict_under_fsdp1", world_size, engine="fsdp1")
