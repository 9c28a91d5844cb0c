"""A sharded QLoRA job the Trainer checkpointed resumes, in a fresh job, exactly where it stopped.

Property, under FSDP2 (`fully_shard`, the 4-bit weights in bf16 storage, `SHARDED_STATE_DICT` as fsdp2.yaml writes it)
and DeepSpeed ZeRO-3 (the PEFT guide's recipe), through `transformers.Trainer` launched by `accelerate launch`:
- a job trains 4 steps (AdamW, a sequence of its own for every rank and step), saving a checkpoint after step 2
  (adapter only: the PEFT model's trainable weights, the optimizer's moments, the scheduler, the RNG states);
- a fresh job resumes from that checkpoint (`train(resume_from_checkpoint=...)`) and trains steps 3 and 4;
- every rank's LoRA weights after step 4, and the losses of steps 3 and 4, must equal the uninterrupted job's.
Users' symptoms: a resumed PEFT run under FSDP or ZeRO-3 that restarts from the initial adapter or loses its optimizer
state (transformers#24252, peft#2040, accelerate#3250), or fails to load its own checkpoint.

Precondition proven on every rank: the engine is the one launched (an FSDP2 module, or DeepSpeed's engine at stage
3), the first job wrote `checkpoint-2` with an adapter in it and ended at step 4, and the resumed job took 2 steps of
its own (a callback counts them) and ended at step 4.

Tolerance: a resume restores the same bytes (weights, moments, scheduler, RNG and data order), so the resumed steps
are the same computations: 1e-5 relative on every LoRA weight and on each loss (room for a kernel's order on the GPU).
Moments lost or the adapter restarted from its initial weights put the weights off by order 0.1 and more.

GPU lane only (`ranks(..., gpu_only=...)`): two jobs a cell, about 60 to 90 s of CI's 2 cores for nothing the GPU
lane does not show; the Trainer does not run FSDP on the CPU (accelerate makes it DDP there).
"""

from pathlib import Path

import pytest
import torch

from stackcheck import scenario
from stackcheck.distributed import rank as rank_side, recipes
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import architectures, tiny

MODULE = "tests.contract.distributed.test_sharded_resume"
ARCHITECTURE = "llama3"
STEPS = 4
SAVED_AT = 2
TOLERANCE = 1e-5
GPU_ONLY = "two jobs a cell; the Trainer runs no FSDP on the CPU"


def step_counter():
    from transformers import TrainerCallback

    class Counter(TrainerCallback):
        steps = 0

        def on_step_end(self, args, state, control, **kwargs):
            self.steps += 1

    return Counter()


def train(sharding: str, world_size: int, output_dir: str, resume: bool):
    """The Trainer's job: STEPS steps from scratch (saving at SAVED_AT), or resumed from that checkpoint."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir, per_device_train_batch_size=1, max_steps=STEPS, learning_rate=recipes.LEARNING_RATE,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="steps", save_steps=SAVED_AT,
                             save_only_model=False, report_to="none", seed=0)
    under_test = scenario.UnderTest(architectures.builtin()[ARCHITECTURE], rank_side.device())
    model = recipes.engine_model(under_test, sharding)
    rows = recipes.distinct_rows(STEPS * world_size)
    dataset = [{"input_ids": torch.tensor(row), "labels": torch.tensor(row)} for row in rows]
    counter = step_counter()
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[counter])
    checkpoint = Path(output_dir) / f"checkpoint-{SAVED_AT}"
    trainer.train(resume_from_checkpoint=str(checkpoint) if resume else None)
    trainer.steps_taken = counter.steps
    if sharding == "zero3":
        scenario.require(trainer.is_deepspeed_enabled and trainer.deepspeed.zero_optimization_stage() == 3,
                         "the Trainer did not train under DeepSpeed ZeRO-3")
    else:
        from torch.distributed.fsdp import FSDPModule

        scenario.require(isinstance(trainer.model_wrapped, FSDPModule), f"the Trainer trained a {type(trainer.model_wrapped).__name__}, not an FSDP2 module")
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    weights = recipes.lora_weights(trainer.model_wrapped if sharding == "fsdp2" else trainer.model, sharding)
    return trainer, checkpoint, losses, weights


def uninterrupted(sharding: str, launched: int, output_dir: str, reference: str) -> dict:
    """The first job: STEPS steps, a checkpoint at SAVED_AT; its weights and losses left for the resumed job."""
    trainer, checkpoint, losses, weights = train(sharding, launched, output_dir, resume=False)
    scenario.require(checkpoint.is_dir() and any(checkpoint.glob("adapter_model.*")), f"the Trainer wrote no adapter in {checkpoint}")
    scenario.require(trainer.state.global_step == STEPS, f"the job ended at step {trainer.state.global_step}")
    if torch.distributed.get_rank() == 0:
        torch.save({"losses": losses, "weights": weights}, reference)
    return {"losses": losses}


def resumed(sharding: str, launched: int, output_dir: str, reference: str) -> dict:
    """The fresh job: resumed from the checkpoint, against the uninterrupted job's weights and losses."""
    expected = torch.load(reference)
    trainer, _checkpoint, losses, weights = train(sharding, launched, output_dir, resume=True)
    scenario.require(trainer.steps_taken == STEPS - SAVED_AT and trainer.state.global_step == STEPS,
                     f"the resumed job took {trainer.steps_taken} steps and ended at step {trainer.state.global_step}")
    resumed_steps = [step for step in sorted(losses) if step > SAVED_AT]
    scenario.require(resumed_steps == list(range(SAVED_AT + 1, STEPS + 1)), f"the resumed job logged the losses of steps {sorted(losses)}")
    loss_error = max(abs(losses[step] - expected["losses"][step]) / abs(expected["losses"][step]) for step in resumed_steps)
    weight_error = max(scenario.relative_error(weights[name], expected["weights"][name]) for name in expected["weights"])
    scenario.assert_within(f"the resumed {sharding} job's losses differ from the uninterrupted job's by (relative)", loss_error, TOLERANCE)
    scenario.assert_within(f"the resumed {sharding} job's LoRA weights differ from the uninterrupted job's: worst relative error",
                           weight_error, TOLERANCE)
    return {"losses": losses, "worst_relative_error": weight_error}


@pytest.mark.parametrize("sharding", ["fsdp2", "zero3"])
@WORLD_SIZES
def test_a_resumed_job_continues_the_uninterrupted_one(ranks, world_size, sharding, tmp_path):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])  # built once here, before the ranks read it
    call = dict(sharding=sharding, launched=world_size, output_dir=str(tmp_path / "trained"), reference=str(tmp_path / "uninterrupted.pt"))
    ranks(f"{MODULE}:uninterrupted", world_size, engine=sharding, gpu_only=GPU_ONLY, **call)
    ranks.workdir = tmp_path / "resumed"
    ranks(f"{MODULE}:resumed", world_size, engine=sharding, gpu_only=GPU_ONLY, **call)
