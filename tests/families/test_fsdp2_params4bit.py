"""QLoRA under FSDP2 (`fully_shard`), launched as users launch it: a few training steps on a 4-bit base must give
the single-process run's losses and LoRA weights.

Precondition proven on every rank: the base holds frozen uint8 `Params4bit` (NF4, double quant), input and output
embeddings share one weight, and `prepare` returned an FSDP2 module (accelerate on the CPU needs help to get there:
`stackcheck.distributed.rank.accelerator`).

Symptom, the launch and tolerances: docs/family-notes.md#fsdp2_params4bit.
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.distributed import rank as rank_side, recipes
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import architectures, tiny

ARCHITECTURE = "llama3"
STEPS = 3
TOLERANCE = 1e-3


def qlora_model(under_test):
    """The QLoRA recipe on a fresh 4-bit base, its LoRA initialised from one seed on every rank and in one process."""
    base = scenario.load_base(under_test)
    frozen_uint8 = [name for name, p in base.named_parameters()
                    if type(p).__name__ == "Params4bit" and p.dtype == torch.uint8 and not p.requires_grad]
    scenario.require(frozen_uint8, "the base holds no frozen uint8 Params4bit")
    scenario.require(base.get_input_embeddings().weight is base.get_output_embeddings().weight, "the embeddings are not tied")
    model = recipes.fsdp_qlora_model(under_test, base)
    return model, recipes.optimizer_for(model)


def lora_weights(model) -> dict[str, torch.Tensor]:
    """Every LoRA weight in full (a sharded one gathered from the ranks)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
            for name, p in model.named_parameters() if "lora_" in name}


def qlora_steps_under_fsdp2() -> dict:
    """On every rank: the recipe in one process, then under the launch's FSDP2; the largest differences."""
    from torch.distributed.fsdp import FSDPModule

    accelerator = rank_side.accelerator()
    under_test = scenario.UnderTest(architectures.builtin()[ARCHITECTURE], rank_side.device())
    model, optimizer = qlora_model(under_test)
    single_losses = scenario.train_steps(under_test, model, optimizer, STEPS)
    single_weights = lora_weights(model)

    model, optimizer = qlora_model(under_test)
    model, optimizer = accelerator.prepare(model, optimizer)
    scenario.require(isinstance(model, FSDPModule), f"prepare gave {type(model).__name__}, not an FSDP2 module")
    losses = scenario.train_steps(under_test, model, optimizer, STEPS)
    weights = lora_weights(model)
    return rank_side.assert_matches_one_process("FSDP2", losses, single_losses, weights, single_weights, TOLERANCE)


@pytest.mark.ranks_engine("fsdp2")
@WORLD_SIZES
def test_fsdp2_qlora_steps_match_one_process(ranks, world_size):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])  # built once here, before the ranks read it
    ranks("tests.families.test_fsdp2_params4bit:qlora_steps_under_fsdp2", world_size, engine="fsdp2")
