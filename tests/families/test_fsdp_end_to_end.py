"""The FSDP-QLoRA control, on every architecture: a few QLoRA steps under FSDP2 (`fully_shard`), launched as users
launch them, must give the single-process run's losses and LoRA weights.

`fsdp2_params4bit` checks the same recipe on the tiny Llama 3 for its bugs; this family runs it on the architecture
the run selects (`--stackcheck-arch`, a user's config.json included: the ranks rebuild the architecture from its
fields), so that an architecture FSDP2 cannot train reads as its known bug, never as a pass. Symptoms found here:
- Gemma 4 (transformers < 5.9.0): `RuntimeError: Trying to backward through the graph a second time` at the first
  backward. FSDP2's pre-forward hook on each decoder layer rebuilds the `shared_kv_states` dict the layers share, so
  the KV-shared layers cannot read their source layer's K/V (transformers#45663, fixed by PR #45912). Without
  checkpointing, or with non-reentrant checkpointing, the same run raises `KeyError: 3` in the forward (measured on
  seed); the recipe's default, PEFT's reentrant checkpointing, turns it into the backward error:
  `fsdp2_gemma4_shared_kv_states_copied`.
- The text-only Gemma 3 (transformers < 5.15.0): `ValueError: Could not find the transformer layer class
  SiglipEncoderLayer in the model.` at `prepare`. Gemma 3's `_no_split_modules` names the SigLIP vision classes,
  which `Gemma3ForCausalLM` inherits without having them, and accelerate's TRANSFORMER_BASED_WRAP refuses a
  missing class (https://github.com/verl-project/verl/issues/4950): `fsdp_wrap_gemma3_text_siglip_classes`.
- Qwen3-MoE on seed (peft 0.19): its PEFT targets are "all-linear", which peft 0.19 reads as a set of characters
  before any FSDP step (`peft_moe_all_linear_charset`).

Launched by `accelerate launch --config_file fixtures/distributed/fsdp2.yaml` (TRANSFORMER_BASED_WRAP): two ranks over
gloo on the CPU lane, world sizes 1 and 2 over NCCL on the GPU lane. One cell per architecture and world size.

Precondition proven on every rank: the base holds 4-bit layers; the single-process steps train (the loss falls);
`prepare` returned an FSDP2 module in which every decoder layer is an FSDP2 group of its own and every LoRA weight is
a shard (a DTensor), so the steps are FSDP2's and the weights compared are gathered from the ranks
(`stackcheck.distributed.rank.accelerator` gets accelerate there on the CPU).

Tolerance: each rank also trains the same recipe in one process (same seed, same batch on both ranks, so the averaged
gradient is the single-process one), 3 AdamW steps at lr 1e-3. Measured on this CPU (torch 2.13, 2 gloo ranks, both
ranks alike), every architecture that trains gives the single-process losses to the last bit and LoRA weights with
relative error 0.0; the FSDP2 losses (first to third step):
  seed:   llama3 5.4957 5.4875 5.4773 | qwen3 5.4927 5.4727 5.4497 | mixtral 5.5493 5.5385 5.5241 |
          phi4 5.5701 5.5234 5.4687 (gemma4, gemma3 and qwen3moe: their known bugs)
  latest: gemma4 7.3761 7.1622 6.9769 | gemma3 5.5421 5.5020 5.4579 | llama3 5.4957 5.4874 5.4772 |
          qwen3 5.4926 5.4728 5.4500 | qwen3moe 5.5766 5.5214 5.4583 | mixtral 5.5493 5.5383 5.5242 |
          phi4 5.5701 5.5233 5.4686
1e-3 (on the losses and the LoRA weights' relative error) leaves room for another reduction order on NCCL, as in
`fsdp2_params4bit`. A cell takes 14 to 71 s here on 2 shared, loaded cores.
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
