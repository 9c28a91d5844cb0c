"""QLoRA under FSDP1 (`use_orig_params`), launched as users launch it: `bnb_4bit_quant_storage` decides whether
the 4-bit base can be sharded at all.

FSDP1 flattens every parameter of a wrapped unit (a decoder layer) into one flat parameter of one floating dtype.
Symptoms, at `accelerator.prepare`:
- the default `bnb_4bit_quant_storage=torch.uint8`: `ValueError: Cannot flatten integer dtype tensors`
  (peft#1432 and its many downstream duplicates; storing the 4-bit weights as bf16 avoids it);
- bf16 storage beside the QLoRA recipe's fp32 trainables (`prepare_model_for_kbit_training` upcasts the norms, PEFT
  makes the LoRA weights fp32): `ValueError: Must flatten tensors with uniform dtype but got torch.bfloat16 and
  torch.float32`. Casting everything beside the 4-bit weights to bf16 (the control) is the workaround.
Link: https://github.com/huggingface/peft/issues/1432. Both are torch's FSDP1 flat-parameter rules
(`_flat_param.py:_validate_tensors_to_flatten`, raised under accelerate's `prepare_model`); the recipe is what makes
users meet them. Measured on torch 2.13 with seed and latest only; older torch releases not checked (no wheel here).

Launched by `accelerate launch --config_file fixtures/distributed/fsdp1.yaml` (TRANSFORMER_BASED_WRAP, FULL_SHARD,
use_orig_params), two ranks over gloo on the CPU lane, world sizes 1 and 2 over NCCL on the GPU lane; the tiny
Llama 3 for every architecture run, as in `fsdp2_params4bit` (a job costs two ranks' start and load).

Precondition proven on every rank, before `prepare`: every 4-bit weight is stored in the cell's dtype and the
trainable parameters are in the cell's dtype (the bf16 + fp32 cell: frozen bf16 beside trainable fp32 in each
decoder layer, the unit FSDP1 flattens); after it: `prepare` returned an FSDP1 module whose decoder layers are
FSDP units (accelerate on the CPU needs help to get there: `stackcheck.distributed.rank.accelerator`).

The control (bf16 storage, everything else bf16) trains under FSDP1 and must give the single-process run's losses and
LoRA weights (same seed, same batch on both ranks, so the averaged gradient is the single-process one). Measured
on this CPU, 3 steps, both ranks: seed and latest give the single-process losses to the last bit (seed 5.4958,
5.4871, 5.4767; latest 5.4955, 5.4875, 5.4769) and LoRA weights with relative error 0.0; 1e-3 leaves room for another
reduction order on NCCL. A cell takes 12 to 14 s here on an idle machine (46 s under load).

At world size 1 (the GPU lane's ws1) the control fails in torch: FSDP1 turns FULL_SHARD into NO_SHARD there, the
root unit (embeddings, final norm, tied head) is all frozen under PEFT, and from the second step on its
parameters come back as plain Tensor views that the tied-parameter loop refuses (`AssertionError: as_params=True
type(prim_param)=<class 'torch.Tensor'>`, `fsdp1_no_shard_frozen_root_tied`). Measured on the H100 (torch 2.11,
NCCL, seed and latest) and on this CPU with one gloo rank (torch 2.13); raw FSDP1 without accelerate, PEFT or
bitsandbytes fails the same way once everything outside the decoder layers is frozen.
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
