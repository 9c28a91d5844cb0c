"""The FSDP-QLoRA control, on every architecture: a few QLoRA steps under FSDP2 (`fully_shard`), launched as users
launch them, must give the single-process run's losses and LoRA weights.

Launched by `accelerate launch --config_file fixtures/distributed/fsdp2.yaml` (TRANSFORMER_BASED_WRAP): two ranks over
gloo on the CPU lane, world sizes 1 and 2 over NCCL on the GPU lane. One cell per architecture and world size.

Preconditions and tolerances: docs/family-notes.md#fsdp_end_to_end.
"""

import dataclasses

import pytest

from stackcheck.harness import scenario
from stackcheck.distributed import rank as rank_side, recipes
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import tiny
from stackcheck.models.architectures import Architecture
from tests.families.test_fsdp2_params4bit import lora_weights

STEPS = 3
TOLERANCE = 1e-3


def qlora_model(under_test):
    """The QLoRA recipe on a fresh 4-bit base, its LoRA initialised from one seed on every rank and in one process."""
    base = scenario.load_base(under_test)
    scenario.require(scenario.linear4bit_modules(base), "the base holds no 4-bit layer")
    model = recipes.fsdp_qlora_model(under_test, base)
    return model, recipes.optimizer_for(model)


def require_sharded(model) -> None:
    """`prepare` gave an FSDP2 model whose every decoder layer is a group of its own, and every LoRA weight is a
    shard (a DTensor), so that the steps below are FSDP2's and the weights compared are gathered."""
    from torch.distributed.fsdp import FSDPModule

    scenario.require(isinstance(model, FSDPModule), f"prepare gave {type(model).__name__}, not an FSDP2 module")
    layers = scenario.decoder_layers(model)
    scenario.require(all(isinstance(layer, FSDPModule) for layer in layers), "some decoder layer is not an FSDP2 group")
    unsharded = [name for name, p in model.named_parameters() if "lora_" in name and not hasattr(p, "full_tensor")]
    scenario.require(not unsharded, f"{len(unsharded)} LoRA weights are not sharded: {', '.join(unsharded[:3])}")


def qlora_steps_under_fsdp2(architecture: dict) -> dict:
    """On every rank: the recipe in one process, then under the launch's FSDP2; the largest differences."""
    accelerator = rank_side.accelerator()
    under_test = scenario.UnderTest(Architecture(**architecture), rank_side.device())
    model, optimizer = qlora_model(under_test)
    single_losses = scenario.train_steps(under_test, model, optimizer, STEPS)
    scenario.require(single_losses[-1] < single_losses[0], f"one process's steps do not train: losses {single_losses}")
    single_weights = lora_weights(model)

    model, optimizer = qlora_model(under_test)
    model, optimizer = accelerator.prepare(model, optimizer)
    require_sharded(model)
    losses = scenario.train_steps(under_test, model, optimizer, STEPS)
    weights = lora_weights(model)
    return rank_side.assert_matches_one_process("FSDP2", losses, single_losses, weights, single_weights, TOLERANCE)


@pytest.mark.ranks_engine("fsdp2")
@WORLD_SIZES
def test_fsdp2_qlora_steps_match_one_process(under_test, ranks, world_size):
    arch = under_test.arch
    tiny.base_checkpoint(arch)  # built once here, before the ranks read it
    # The ranks rebuild the architecture from its fields (a user's config.json included), sent as JSON.
    fields = dataclasses.asdict(arch) | {"declared": None if arch.declared is None else sorted(arch.declared)}
    ranks("tests.families.test_fsdp_end_to_end:qlora_steps_under_fsdp2", world_size, engine="fsdp2", architecture=fields)
