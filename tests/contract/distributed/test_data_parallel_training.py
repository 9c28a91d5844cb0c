"""A data-parallel QLoRA job trains at the world size it was launched with, and its update is the one-process update
on the whole global batch.

Properties, preconditions, tolerances and the lanes: docs/family-notes.md#data_parallel_training.
"""

import os
import re

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.distributed import rank as rank_side, recipes
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import architectures, tiny

MODULE = "tests.contract.distributed.test_data_parallel_training"
ARCHITECTURE = "llama3"
LEARNING_RATE = 0.05
STEPS = 3
TOLERANCE = 1e-3
CPU_COSTLY = "its CPU variant reproduces nothing the Trainer's DDP cell does not"
TRAINER_FSDP_GPU_ONLY = "on a CPU host accelerate makes the Trainer's FSDP a DDP job"
# accelerate's refusal of a base that device_map="auto" split across devices, in any distributed mode: clear when it
# names the map and the mode (accelerate 1.13 to 1.15: "You can't train a model that has been loaded with
# `device_map='auto'` in any distributed mode. ...").
CLEAR_AUTO_REFUSAL = re.compile(r"device_map='auto'.*distributed", re.DOTALL)


def subject() -> scenario.UnderTest:
    return scenario.UnderTest(architectures.builtin()[ARCHITECTURE], rank_side.device())


def trainer_model(engine: str, under_test):
    """The engine's QLoRA recipe for the Trainer: DDP on the rank's device in uint8 storage, FSDP2 in bf16 storage
    (its memory recipe, and no uint8 bug on old torch), ZeRO-3 as the PEFT guide writes it."""
    if engine == "zero3":
        return recipes.zero3_qlora_model(under_test)
    return recipes.fsdp_qlora_model(under_test, quant_storage=torch.bfloat16 if engine == "fsdp2" else torch.uint8)


def require_trainer_engine(trainer, engine: str) -> None:
    if engine == "zero3":
        scenario.require(trainer.is_deepspeed_enabled and trainer.deepspeed.zero_optimization_stage() == 3,
                         "the Trainer did not train under DeepSpeed ZeRO-3")
    elif engine == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        scenario.require(trainer.is_fsdp_enabled and isinstance(trainer.model_wrapped, FSDPModule),
                         f"the Trainer trained a {type(trainer.model_wrapped).__name__}, not an FSDP2 module")
    else:
        scenario.require(isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel) or trainer.args.world_size == 1,
                         f"the Trainer trained a {type(trainer.model_wrapped).__name__}, not DDP's module")


def trainer_step(sharding: str, launched: int, output_dir: str) -> dict:
    """On every rank: one process's SGD step on every rank's sequence, then the Trainer's step under the launch."""
    from transformers import Trainer, TrainingArguments, default_data_collator

    engine, world_size = sharding, launched
    args = TrainingArguments(output_dir, per_device_train_batch_size=1, max_steps=1, learning_rate=LEARNING_RATE, optim="sgd",
                             lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, report_to="none",
                             save_strategy="no", use_cpu=rank_side.lane() == "cpu")
    under_test = subject()
    rows = recipes.distinct_rows(world_size)
    reference = recipes.one_process_sgd(trainer_model(engine, under_test), recipes.rows_batch(rows, under_test.device), 1, LEARNING_RATE)

    model = trainer_model(engine, under_test)
    seen = []

    def collate(features):
        batch = default_data_collator(features)
        seen.extend(batch["input_ids"].tolist())
        return batch

    trainer = Trainer(model=model, args=args, train_dataset=recipes.rows_dataset(rows), data_collator=collate)
    before = recipes.lora_weights(trainer.model, "one_process")
    trainer.train()
    require_trainer_engine(trainer, engine)
    sizes = {"launched": world_size, "TrainingArguments.world_size": trainer.args.world_size,
             "process group": torch.distributed.get_world_size(), "WORLD_SIZE": int(os.environ["WORLD_SIZE"])}
    scenario.require(len(set(sizes.values())) == 1, f"the job does not run at the launched world size: {sizes}")
    scenario.require(trainer.state.global_step == 1, f"the Trainer took {trainer.state.global_step} steps, not 1")
    every_rank = [None] * world_size
    torch.distributed.all_gather_object(every_rank, seen)
    scenario.require(sorted(row for rank_rows in every_rank for row in rank_rows) == sorted(rows),
                     f"the ranks' data loaders gave {every_rank}, not each of the {world_size} sequences once")
    after = recipes.lora_weights(trainer.model_wrapped if engine == "fsdp2" else trainer.model, engine)
    update = {name: after[name] - before[name] for name in before}
    worst = recipes.assert_same_update(f"the Trainer under {engine} at world size {world_size}", update, reference, TOLERANCE)
    return {"worst_relative_error": worst, "rows_seen": seen}


def ddp_steps(device_map: str, launched: int) -> dict:
    """On every rank: STEPS SGD steps of one process on every rank's sequence, then the same under the launch's DDP,
    the base loaded with the cell's device map."""
    world_size = launched
    accelerator = rank_side.accelerator()
    under_test = subject()
    rows = recipes.distinct_rows(world_size)
    global_batch = recipes.rows_batch(rows, under_test.device)
    reference = recipes.one_process_sgd(recipes.fsdp_qlora_model(under_test), global_batch, STEPS, LEARNING_RATE, per_sequence=True)
    whole_batch = recipes.one_process_sgd(recipes.fsdp_qlora_model(under_test), global_batch, STEPS, LEARNING_RATE)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # The guides' map of the rank's GPU, `{"": local_rank}`; on the CPU lane the rank's device is the CPU.
    placement = ({"": local_rank} if rank_side.lane() == "gpu" else {"": "cpu"}) if device_map == "rank" else "auto"
    base = scenario.load_base(under_test, device_map=placement)
    # transformers records hf_device_map for some maps only (not for {"": "cpu"}): the devices the base's parameters are on
    devices = sorted({str(p.device) for p in base.parameters()})
    model = recipes.lora_on(under_test, base)
    before = recipes.lora_weights(model, "one_process")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    scenario.require(torch.distributed.get_world_size() == world_size, "the job does not run at the launched world size")
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
    except ValueError as refusal:
        if device_map != "auto" or len(devices) == 1 or not CLEAR_AUTO_REFUSAL.search(str(refusal)):
            raise
        # "auto" split the base across devices: refused before any step, saying why (docs/family-notes.md#data_parallel_training).
        return {"refused_at_prepare": str(refusal), "base_devices": devices}
    scenario.require(world_size == 1 or isinstance(model, torch.nn.parallel.DistributedDataParallel),
                     f"prepare gave {type(model).__name__}, not DDP's module")
    batch = recipes.rows_batch([rows[torch.distributed.get_rank()]], under_test.device)
    recipes.sharded_steps(accelerator, model, optimizer, batch, STEPS)
    after = recipes.lora_weights(accelerator.unwrap_model(model), "one_process")
    update = {name: after[name] - before[name] for name in before}
    worst = recipes.assert_same_update(f"DDP with device_map {placement!r} (base on {', '.join(devices)})", update, reference, TOLERANCE)
    # For the record: against one process's forward of the whole batch (the same mean, other GEMM shapes in bf16).
    against_whole_batch = max(scenario.relative_error(update[name], delta) for name, delta in whole_batch.items() if delta.any())
    return {"worst_relative_error": worst, "against_one_forward_of_the_whole_batch": against_whole_batch, "base_devices": devices}


@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "zero3"])
@WORLD_SIZES
def test_the_trainer_trains_at_the_launched_world_size(ranks, world_size, engine, tmp_path):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])  # built once here, before the ranks read it
    ranks(f"{MODULE}:trainer_step", world_size, engine=engine, gpu_only=TRAINER_FSDP_GPU_ONLY if engine == "fsdp2" else None,
          cpu_costly=CPU_COSTLY if engine == "zero3" else None, sharding=engine, launched=world_size, output_dir=str(tmp_path / "trained"))


@pytest.mark.parametrize("device_map", ["rank", "auto"])
@pytest.mark.ranks_engine("ddp")
@WORLD_SIZES
def test_ddp_qlora_steps_match_one_process(ranks, world_size, device_map):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])
    ranks(f"{MODULE}:ddp_steps", world_size, engine="ddp", cpu_costly=CPU_COSTLY, device_map=device_map, launched=world_size)


@pytest.mark.gpu
@pytest.mark.gpus(2)
def test_one_process_on_two_gpus_matches_one_gpu(tmp_path):
    """In the test's own process, which sees every GPU (under xdist too: stackcheck.child.plugin.worker_gpus)."""
    from transformers import Trainer, TrainingArguments

    under_test = scenario.UnderTest(architectures.builtin()[ARCHITECTURE], scenario.lane_device("gpu"))
    args = TrainingArguments(str(tmp_path / "trained"), per_device_train_batch_size=1, max_steps=1, learning_rate=LEARNING_RATE,
                             optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, report_to="none",
                             save_strategy="no")
    gpus = args.n_gpu
    scenario.require(gpus >= 2 and args.world_size == 1, f"the process sees {gpus} GPUs at world size {args.world_size}, not several in one process")
    rows = recipes.distinct_rows(gpus)  # a sequence a GPU: the Trainer's batch is per_device_train_batch_size x n_gpu
    reference = recipes.one_process_sgd(recipes.fsdp_qlora_model(under_test), recipes.rows_batch(rows, under_test.device), 1, LEARNING_RATE)
    model = recipes.fsdp_qlora_model(under_test)
    seen = []

    def collate(features):
        from transformers import default_data_collator

        batch = default_data_collator(features)
        seen.append(batch["input_ids"].tolist())
        return batch

    trainer = Trainer(model=model, args=args, train_dataset=recipes.rows_dataset(rows), data_collator=collate)
    before = recipes.lora_weights(model, "one_process")
    trainer.train()
    scenario.require(trainer.args.n_gpu == gpus and trainer.args.train_batch_size == gpus and trainer.state.global_step == 1,
                     f"the Trainer ran with n_gpu {trainer.args.n_gpu}, batch {trainer.args.train_batch_size}, {trainer.state.global_step} steps")
    scenario.require(len(seen) == 1 and sorted(seen[0]) == sorted(rows), f"the Trainer's one step took the batches {seen}, not every sequence")
    wrapped = type(trainer.model_wrapped).__name__
    print(f"stackcheck measured: the Trainer stepped a {wrapped} (DataParallel or not is its choice)")
    after = recipes.lora_weights(model, "one_process")
    recipes.assert_same_update(f"the Trainer on {gpus} GPUs in one process ({wrapped})", {n: after[n] - before[n] for n in before},
                               reference, TOLERANCE, scale_over=("n_gpu", gpus))
