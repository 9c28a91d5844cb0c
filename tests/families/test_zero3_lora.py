"""LoRA and QLoRA under DeepSpeed ZeRO-3, launched as users launch them: the sharded steps must give the single-process
run's losses and LoRA weights, and the Trainer must save the adapter it trained.

Launched by `accelerate launch --config_file fixtures/distributed/zero3.yaml` (`zero3_init_flag` on, the JSON
beside it), two ranks over gloo on the CPU lane (DeepSpeed's CPU accelerator), world sizes 1 and 2 over NCCL on the
GPU lane. QLoRA is the ZeRO-3 recipe of the PEFT guide: NF4 with double quant, `bnb_4bit_quant_storage=bfloat16` (so
ZeRO-3 can flatten the 4-bit weights with the rest), the tiny Llama 3; expert LoRA runs on the tiny Qwen3-MoE in bf16,
since `zero.Init` never runs for a quantized model.

Symptom, preconditions and tolerances: docs/family-notes.md#zero3_lora.
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.distributed import rank as rank_side
from stackcheck.distributed.recipes import LEARNING_RATE, LORA_SEED, deepspeed_stage3_accelerator, optimizer_for, zero3_qlora_model
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import architectures, tiny

ARCHITECTURE = "llama3"
EXPERT_ARCHITECTURE = "qwen3moe"
# The fused expert parameter the expert LoRA targets, as `test_adapter_round_trip` does.
EXPERT_TARGET = "experts.down_proj"
STEPS = 3
TOLERANCE = 2e-3


def require_partitioned(named: dict[str, torch.nn.Parameter], what: str) -> None:
    """Every parameter is ZeRO-3's, holding at most its share of the elements (fewer than all on two ranks)."""
    scenario.require(named, f"the model has no {what}")
    world_size = torch.distributed.get_world_size()
    whole = [name for name, p in named.items() if not hasattr(p, "ds_tensor")
             or (world_size > 1 and p.ds_tensor.numel() >= p.ds_numel)]
    scenario.require(not whole, f"ZeRO-3 left {len(whole)} of {len(named)} {what} whole on this rank, e.g. {whole[:1]}")


def lora_weights(model) -> dict[str, torch.Tensor]:
    """Every LoRA weight in full, gathered from the ranks' partitions where ZeRO-3 holds it."""
    import deepspeed

    named = {name: p for name, p in model.named_parameters() if "lora_" in name}
    with deepspeed.zero.GatheredParameters(list(named.values())):
        return {name: p.detach().float().cpu().clone() for name, p in named.items()}


def batch_loader(batch: dict[str, torch.Tensor]):
    """The training batch as a DataLoader: accelerate fills ZeRO's "auto" batch sizes from the one it prepares."""
    return torch.utils.data.DataLoader([{k: v[0] for k, v in batch.items()}], batch_size=1)


def sharded_steps(accelerator, under_test, model, optimizer) -> list[float]:
    batch = scenario.training_batch(under_test.device, model.config)
    model, optimizer, _ = accelerator.prepare(model, optimizer, batch_loader(batch))
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


def qlora_steps_under_zero3() -> dict:
    """On every rank: the recipe in one process, then under the launch's ZeRO-3; the largest differences."""
    under_test = scenario.UnderTest(architectures.builtin()[ARCHITECTURE], rank_side.device())
    model = zero3_qlora_model(under_test)
    single_losses = scenario.train_steps(under_test, model, optimizer_for(model), STEPS)
    single_weights = lora_weights(model)

    accelerator = deepspeed_stage3_accelerator()
    model = zero3_qlora_model(under_test)
    engine, losses = sharded_steps(accelerator, under_test, model, optimizer_for(model))
    require_partitioned({n: p for n, p in engine.module.named_parameters() if type(p).__name__ == "Params4bit"}, "4-bit weights")
    return rank_side.assert_matches_one_process("ZeRO-3", losses, single_losses, lora_weights(engine.module), single_weights, TOLERANCE)


def expert_lora_model(arch, base):
    from peft import get_peft_model

    torch.manual_seed(LORA_SEED)
    model = get_peft_model(base, tiny.lora_config(arch, "language", target_modules=[], target_parameters=[EXPERT_TARGET]))
    return model.train()


def fused_experts(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if name.endswith(EXPERT_TARGET) and len(getattr(p, "ds_shape", p.shape)) == 3}


def expert_lora_steps_under_zero3() -> dict:
    """On every rank: LoRA on the fused experts of a bf16 mixture of experts in one process, then built under
    `zero.Init` and trained under ZeRO-3."""
    arch = architectures.builtin()[EXPERT_ARCHITECTURE]
    under_test = scenario.UnderTest(arch, rank_side.device())
    load = lambda: tiny.model_class(arch).from_pretrained(tiny.base_checkpoint(arch), dtype=torch.bfloat16)  # noqa: E731
    model = expert_lora_model(arch, load().to(under_test.device))
    single_losses = scenario.train_steps(under_test, model, optimizer_for(model), STEPS)
    single_weights = lora_weights(model)

    accelerator = deepspeed_stage3_accelerator()
    base = load()
    experts = fused_experts(base)
    scenario.require(experts and all(p.numel() == 0 and hasattr(p, "ds_shape") for p in experts.values()),
                     "zero.Init did not partition the fused expert parameters while the model loaded")
    model = expert_lora_model(arch, base)
    scenario.require(any("lora_" in name for name in model.state_dict()), "PEFT injected no LoRA on the experts")
    engine, losses = sharded_steps(accelerator, under_test, model, optimizer_for(model))
    require_partitioned(fused_experts(engine.module), "fused expert parameters")
    return rank_side.assert_matches_one_process("ZeRO-3", losses, single_losses, lora_weights(engine.module), single_weights, TOLERANCE)


def trainer_saves_the_adapter(output_dir: str) -> dict:
    """On every rank: the QLoRA recipe trained a few steps by the Trainer under the launch's ZeRO-3, then
    `save_model`; the saved adapter against the trained LoRA weights gathered from the ranks."""
    from safetensors.torch import load_file
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir, per_device_train_batch_size=1, max_steps=STEPS, learning_rate=LEARNING_RATE,
                             report_to="none", save_strategy="no", use_cpu=rank_side.lane() == "cpu")
    under_test = scenario.UnderTest(architectures.builtin()[ARCHITECTURE], rank_side.device())
    model = zero3_qlora_model(under_test)
    batch = scenario.training_batch(torch.device("cpu"), model.config)
    trainer = Trainer(model=model, args=args, train_dataset=[{k: v[0] for k, v in batch.items()}] * STEPS)
    trainer.train()
    scenario.require(trainer.is_deepspeed_enabled and trainer.deepspeed.zero_optimization_stage() == 3,
                     "the Trainer did not train under DeepSpeed ZeRO-3")
    scenario.require(not trainer.deepspeed.zero_gather_16bit_weights_on_model_save(),
                     "the DeepSpeed config gathers 16-bit weights on save (the users' default is off)")
    trained = lora_weights(trainer.model)
    require_partitioned({n: p for n, p in trainer.model.named_parameters() if "lora_" in n}, "LoRA weights")

    trainer.save_model(output_dir)
    trainer.accelerator.wait_for_everyone()
    saved = load_file(f"{output_dir}/adapter_model.safetensors")
    expected = {name.replace(".default.", "."): weight for name, weight in trained.items()}
    missing = sorted(expected.keys() - saved.keys())
    assert not missing, f"the saved adapter lacks {len(missing)} of {len(expected)} LoRA tensors (it holds {len(saved)}), e.g. {missing[0]}"
    unequal = [name for name, weight in expected.items() if not torch.equal(saved[name].float(), weight)]
    assert not unequal, f"{len(unequal)} of {len(expected)} saved LoRA tensors differ from the trained ones, e.g. {unequal[0]}"
    return {"saved_tensors": len(saved)}


@pytest.mark.ranks_engine("zero3")
@WORLD_SIZES
def test_zero3_qlora_steps_match_one_process(ranks, world_size):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])  # built once here, before the ranks read it
    ranks("tests.families.test_zero3_lora:qlora_steps_under_zero3", world_size, engine="zero3")


@pytest.mark.ranks_engine("zero3-moe")
@WORLD_SIZES
def test_zero3_expert_lora_steps_match_one_process(ranks, world_size):
    tiny.base_checkpoint(architectures.builtin()[EXPERT_ARCHITECTURE])
    ranks("tests.families.test_zero3_lora:expert_lora_steps_under_zero3", world_size, engine="zero3-moe")


@pytest.mark.ranks_engine("zero3")
@WORLD_SIZES
def test_zero3_trainer_saves_the_adapter(ranks, world_size, tmp_path):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])
    ranks("tests.families.test_zero3_lora:trainer_saves_the_adapter", world_size, engine="zero3", output_dir=str(tmp_path / "trained"))
