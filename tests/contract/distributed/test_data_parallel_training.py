"""A data-parallel QLoRA job trains at the world size it was launched with, and its update is the one-process update
on the whole global batch.

Properties:
- **The Trainer trains at the launched world size, gradients all-reduced.** `accelerate launch` with DDP
  (`fixtures/distributed/ddp.yaml`), FSDP2 or ZeRO-3, then `transformers.Trainer` with plain SGD, a constant rate and
  no clipping, one step of one sequence a rank. The ranks see different sequences, so a rank that trained alone (no
  all-reduce), a job that ran on one process, or a loss scaled by the world size moves the LoRA weights otherwise than
  one process's SGD step on every rank's sequence at once (users' symptoms: transformers#34191 and #35839 on the
  loss's scaling across devices; a Trainer quietly training one process, accelerate#2434).
- **DDP QLoRA through `accelerate launch` matches one process.** The bare loop users write (`Accelerator`, `prepare`,
  `accelerator.backward`) on a 4-bit base loaded with `device_map={"": local_rank}`, as the bitsandbytes and PEFT
  guides write it, and with `device_map="auto"`, which users also pass: three SGD steps, each rank its own sequence.
- **`device_map="auto"` under DDP: the same steps, or a clear refusal before any.** Where "auto" keeps the base on one
  device (the CPU lane; a rank that sees one GPU) it is the rank's map and must train as one process. Where it splits
  the base across devices (a rank that sees several GPUs: transformers' "auto" balances the model over all of them),
  DDP cannot replicate the model, and accelerate refuses it in `prepare` (`Accelerator.verify_device_map`: an
  `hf_device_map` of more than one entry, in any distributed mode): "You can't train a model that has been loaded with
  `device_map='auto'` in any distributed mode. Please rerun your script specifying `--num_processes=1` or by launching
  with `python {{myscript.py}}`." That refusal is the maintainers' answer (accelerate#1802: "You need to remove
  `device_map="auto"` if you want to use DistributedDataParallel"; PR #1810 made it this explicit error; transformers
  PR #38942 keeps "auto" from turning into tensor parallelism in a distributed run) and what a demanding user wants:
  it comes at `prepare`, before any step, and says what was wrong. So the cell expects it there: a `ValueError` from
  `prepare` whose message names `device_map='auto'` and the distributed mode passes (the message is the cell's
  result); any other refusal, one of a base on one device, or a split base that `prepare` accepts and then trains
  otherwise than one process, fails.
  Measured on two H200s (both sets, before this expectation): every auto cell, world sizes 1 and 2, met that refusal
  at `prepare` (at world size 1 too: `accelerate launch` with the DDP config keeps its distributed mode for one
  process, so the advice to rerun with `--num_processes=1` does not apply there; launching with `python` does). Not
  re-run on a GPU since; the cell's result records the base's devices and the refusal.
- **One process that sees two GPUs** (the Trainer's `n_gpu > 1`, `python train.py` on a two-GPU host): the same step
  as one process on one GPU. The Trainer multiplies the batch by `n_gpu` but leaves a 4-bit model out of
  `torch.nn.DataParallel` ("quantized models do not support DP", `Trainer._wrap_model`, transformers PR #45407):
  measured on two H200s, both sets, the model stays a PeftModel on one GPU, which then takes both sequences. The
  Trainer still scales the loss for DataParallel's mean over replicas (`compute_loss`: `loss *= n_gpu` where
  `average_tokens_across_devices`), so the loss and the update come out `n_gpu` times one process's
  (`trainer_ngpu_quantized_loss_scaled`; the factor is in the failure's message). Measured on the CPU with
  `TrainingArguments._n_gpu` set to 2 after its device setup (research, not this cell): the update is 2.00 times one
  process's and the logged loss 11.07 against 5.54, on seed and latest.

Precondition proven: `TrainingArguments.world_size`, the process group's size and `WORLD_SIZE` are the launched world
size; the Trainer took one step; the sequences the ranks' data loaders gave them are the dataset, each once, none on two
ranks; `prepare` gave DDP's module (or FSDP2's, or DeepSpeed's engine at stage 3); the single-process Trainer ran with
`n_gpu == 2`, a batch of 2, one step, both sequences in it, with the model wrapped in DataParallel or not (either is
the Trainer's choice; the cell records which).

Every sequence's first label is -100 (`recipes.labelled`): no causal LM loss predicts the first token, and the
Trainer's count of label tokens is then the same before and after the shift, so transformers 5.6.2's count before
it (train_equivalences' `trainer_num_items_unshifted`, an (L-1)/L scale) does not show here as this family's failure.

Tolerance: the update (weights after - before, over the LoRA weights one process moves) against one process's, by
relative error: 1e-3. A rank that trained alone, or a loss scaled by the world size, is off by order 1 (a 2x scale is
0.5). The global mean over sequences of one length is the mean of the ranks' means, but not in the same arithmetic:
one process's forward of the whole batch runs its bf16 GEMMs in other shapes than a rank's forward of one sequence,
and on a GPU cuBLAS then takes other kernels, whose bf16 roundings differ. The two-GPU run of session 13 (H100s,
seed) read 0.0022 for accelerate's DDP loop at world size 2 (three SGD steps at rate 0.05) against one forward of the
whole batch; latest read under 1e-3. Not the all-reduce: the sum of two ranks is one addition per element, the same
whichever rank comes first. What the shapes can move is bounded by the bf16 compute's own effect, measured in one
process on the CPU (seed, the same three steps): the update with bf16 compute is 0.025 off the update with fp32
compute, so two bf16 computations may differ by up to 0.05, too wide a band to judge a data-parallel job by. So the
DDP loop's reference is one process computing the same mean in the ranks' shapes (`one_process_sgd(per_sequence=True)`:
each sequence its own forward, its loss over the batch size, the gradients accumulated): the ranks' kernels, halves
exact in binary, the all-reduce's one addition the only difference left (on the CPU the two references differ by
1.5e-6). The cell's result records its update against one forward of the whole batch too. The Trainer cells take one
step and compare with one forward of the whole batch (they passed wherever they stepped, on both sets).

CPU lane: the Trainer cell under DDP (two gloo ranks, 30 to 45 s on 2 shared cores). The Trainer under ZeRO-3 (DeepSpeed's
CPU accelerator) and accelerate's DDP loop run on the CPU too, left out of the default run for their cost
(STACKCHECK_DIST_CPU=all runs them); the Trainer under FSDP2 is GPU only (on a CPU host accelerate makes it DDP).
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
        # "auto" split the base across devices: refused before any step, saying why (the module's docstring).
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
