"""QLoRA under FSDP1 (`use_orig_params`), launched as users launch it: `bnb_4bit_quant_storage` decides whether
the 4-bit base can be sharded at all.

Launched by `accelerate launch --config_file fixtures/distributed/fsdp1.yaml` (TRANSFORMER_BASED_WRAP, FULL_SHARD,
use_orig_params), two ranks over gloo on the CPU lane, world sizes 1 and 2 over NCCL on the GPU lane; the tiny
Llama 3 for every architecture run, as in `fsdp2_params4bit` (a job costs two ranks' start and load).

Preconditions: docs/family-notes.md#fsdp1_quant_storage.
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.distributed import rank as rank_side
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import architectures, tiny

ARCHITECTURE = "llama3"
STEPS = 3
LEARNING_RATE = 1e-3
TOLERANCE = 1e-3
# FSDP1's name for the module it wraps, in every parameter name under a unit.
WRAPPED = "_fsdp_wrapped_module."


def qlora_model(under_test, quant_storage: torch.dtype, trainable_dtype: torch.dtype):
    """The QLoRA recipe on a 4-bit base stored as `quant_storage`, its LoRA initialised from one seed on every rank
    and in one process; with bf16 trainables, every float parameter beside the 4-bit weights cast to bf16."""
    config = scenario.bnb_config()
    config.bnb_4bit_quant_storage = quant_storage
    base = scenario.load_base(under_test, quantization_config=config)
    stored = {p.dtype for p in base.parameters() if type(p).__name__ == "Params4bit"}
    scenario.require(stored == {quant_storage}, f"the 4-bit weights are stored as {stored}, not {quant_storage}")
    torch.manual_seed(0)
    model = scenario.qlora_model(under_test, base)
    if trainable_dtype != torch.float32:
        for param in model.parameters():
            if type(param).__name__ != "Params4bit" and param.is_floating_point():
                param.data = param.data.to(trainable_dtype)
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    scenario.require(trainable == {trainable_dtype}, f"the trainable parameters are {trainable}, not {trainable_dtype}")
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)


def lora_weights(model) -> dict[str, torch.Tensor]:
    """Every LoRA weight in full, named as in the unwrapped model (an FSDP1 model's gathered from the ranks)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if not isinstance(model, FSDP):
        return {name: p.detach().float().clone() for name, p in model.named_parameters() if "lora_" in name}
    with FSDP.summon_full_params(model):
        return {name.replace(WRAPPED, ""): p.detach().float().clone() for name, p in model.named_parameters() if "lora_" in name}


def qlora_steps_under_fsdp1(quant_storage: str, trainable_dtype: str) -> dict:
    """On every rank: the recipe in one process, then under the launch's FSDP1; the largest differences."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    quant_storage, trainable_dtype = getattr(torch, quant_storage), getattr(torch, trainable_dtype)
    accelerator = rank_side.accelerator()
    under_test = scenario.UnderTest(architectures.builtin()[ARCHITECTURE], rank_side.device())
    model, optimizer = qlora_model(under_test, quant_storage, trainable_dtype)
    single_losses = scenario.train_steps(under_test, model, optimizer, STEPS)
    single_weights = lora_weights(model)

    model, optimizer = qlora_model(under_test, quant_storage, trainable_dtype)
    model, optimizer = accelerator.prepare(model, optimizer)
    scenario.require(isinstance(model, FSDP), f"prepare gave {type(model).__name__}, not an FSDP1 module")
    units = [m for m in model.modules() if isinstance(m, FSDP) and m is not model]
    scenario.require(len(units) >= len(scenario.decoder_layers(model.module)), f"only {len(units)} FSDP units below the root")
    losses = scenario.train_steps(under_test, model, optimizer, STEPS)
    weights = lora_weights(model)
    return rank_side.assert_matches_one_process("FSDP1", losses, single_losses, weights, single_weights, TOLERANCE)


@pytest.mark.parametrize(("quant_storage", "trainable_dtype"), [("uint8", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")],
                         ids=["uint8", "bf16_fp32_lora", "bf16"])
@pytest.mark.ranks_engine("fsdp1")
@WORLD_SIZES
def test_fsdp1_qlora_steps_match_one_process(ranks, world_size, quant_storage, trainable_dtype):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])  # built once here, before the ranks read it
    ranks("tests.families.test_fsdp1_quant_storage:qlora_steps_under_fsdp1", world_size, engine="fsdp1",
          quant_storage=quant_storage, trainable_dtype=trainable_dtype)
