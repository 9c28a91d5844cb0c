"""A sharded QLoRA job the Trainer checkpointed resumes, in a fresh job, exactly where it stopped.

The property, preconditions, tolerances, known bugs met and the lanes: docs/family-notes.md#sharded_resume.
"""

from pathlib import Path

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.distributed import rank as rank_side, recipes
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import architectures, tiny

MODULE = "tests.contract.distributed.test_sharded_resume"
ARCHITECTURE = "llama3"
STEPS = 4
SAVED_AT = 2
TOLERANCE = 1e-5
TRAINER_FSDP_GPU_ONLY = "on a CPU host accelerate makes the Trainer's FSDP a DDP job"
CPU_COSTLY = "two jobs a cell, for nothing the GPU lane does not show"
# (engine, the config's fsdp_state_dict_type): ZeRO-3 and ZeRO-0 have one way to checkpoint.
SHARDINGS = {"fsdp1-sharded": ("fsdp1", "SHARDED_STATE_DICT"), "fsdp1-full": ("fsdp1", "FULL_STATE_DICT"),
             "fsdp2-sharded": ("fsdp2", "SHARDED_STATE_DICT"), "fsdp2-full": ("fsdp2", "FULL_STATE_DICT"), "zero3": ("zero3", None),
             "zero0-bf16": ("zero0", None)}
# ZeRO stage 0 with bf16, as users write its DeepSpeed JSON for the Trainer (its "auto" entries filled from the
# TrainingArguments, bf16=True among them), launched with fixtures/distributed/zero.yaml naming it.
ZERO0_BF16 = {"zero_optimization": {"stage": 0}, "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto"}
ADAPTERS = {"lora": None, "modules_to_save": recipes.MODULES_TO_SAVE}


def step_counter(sharding: str):
    """A callback that counts the job's steps, and records what the checkpoint holds on both sides: in the first job
    the adapter (gathered) and the optimizer's step counts when the Trainer has saved checkpoint-SAVED_AT; in the resumed job, once the Trainer has
    loaded it (on_train_begin comes after `_load_from_checkpoint` and `_load_optimizer_and_scheduler`), the adapter and
    the optimizer's step counts. Set `.trainer` before training. Every rank records (the gathers are collectives)."""
    from transformers import TrainerCallback

    class Counter(TrainerCallback):
        steps = 0
        trainer = None
        at_checkpoint = None
        steps_at_checkpoint = None
        loaded = None

        def adapter(self):
            model = self.trainer.model_wrapped if sharding == "fsdp2" else self.trainer.model
            return recipes.lora_weights(model, sharding)

        def on_step_end(self, args, state, control, **kwargs):
            self.steps += 1

        def on_save(self, args, state, control, **kwargs):
            if state.global_step == SAVED_AT:
                self.at_checkpoint = self.adapter()
                self.steps_at_checkpoint = optimizer_steps(self.trainer.optimizer)

        def on_train_begin(self, args, state, control, **kwargs):
            if state.global_step == SAVED_AT:  # resumed from the checkpoint
                self.loaded = {"weights": self.adapter(), "steps": optimizer_steps(self.trainer.optimizer)}

    return Counter()


def optimizer_steps(optimizer) -> list:
    """The step count of every tensor the rank's optimizer steps that holds elements on this rank (None: no state)."""
    inner, held = recipes.stepped_tensors(optimizer)
    return [float(inner.state[p]["step"]) if "step" in inner.state.get(p, {}) else None for p in held]


def step_counts(steps: list) -> list:
    """The distinct step counts of `optimizer_steps` ('none': a tensor without state), in order."""
    return sorted({"none" if step is None else step for step in steps}, key=str)


def require_engine(trainer, engine: str, state_dict_type: str | None) -> None:
    """The Trainer trained under the launched engine, with the config's state dict type (ZeRO-0: in bf16)."""
    if engine == "zero0":
        scenario.require(trainer.is_deepspeed_enabled and trainer.deepspeed.zero_optimization_stage() == 0
                         and trainer.deepspeed.bfloat16_enabled(), "the Trainer did not train under DeepSpeed ZeRO stage 0 with bf16")
        return
    if engine == "zero3":
        scenario.require(trainer.is_deepspeed_enabled and trainer.deepspeed.zero_optimization_stage() == 3,
                         "the Trainer did not train under DeepSpeed ZeRO-3")
        return
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        sharded = isinstance(trainer.model_wrapped, FSDP)
    else:
        from torch.distributed.fsdp import FSDPModule

        sharded = isinstance(trainer.model_wrapped, FSDPModule)
    scenario.require(sharded, f"the Trainer trained a {type(trainer.model_wrapped).__name__}, not an {engine} module")
    kind = str(trainer.accelerator.state.fsdp_plugin.state_dict_type)
    scenario.require(kind.endswith(state_dict_type), f"the Trainer's FSDP state dict type is {kind}, not {state_dict_type}")


def train(sharding: str, state_dict_type: str | None, adapter: str, world_size: int, output_dir: str, resume: bool):
    """The Trainer's job: STEPS steps from scratch (saving at SAVED_AT), or resumed from that checkpoint."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir, per_device_train_batch_size=1, max_steps=STEPS, learning_rate=recipes.LEARNING_RATE,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="steps", save_steps=SAVED_AT,
                             save_only_model=False, report_to="none", seed=0, use_cpu=rank_side.lane() == "cpu",
                             bf16=sharding == "zero0")
    under_test = scenario.UnderTest(architectures.builtin()[ARCHITECTURE], rank_side.device())
    if sharding == "zero0":  # stage 0 keeps the frozen 4-bit weights whole on every rank: bitsandbytes' uint8 storage
        model = recipes.fsdp_qlora_model(under_test, lora=ADAPTERS[adapter])
    else:
        model = recipes.engine_model(under_test, sharding, lora=ADAPTERS[adapter])
    whole = [name for name, p in model.named_parameters() if p.requires_grad and ".modules_to_save." in name]
    scenario.require(bool(whole) == (adapter == "modules_to_save"), f"the adapter trains {whole or 'no module'} whole")
    rows = recipes.distinct_rows(STEPS * world_size)
    counter = step_counter(sharding)
    trainer = Trainer(model=model, args=args, train_dataset=recipes.rows_dataset(rows), callbacks=[counter])
    counter.trainer = trainer
    checkpoint = Path(output_dir) / f"checkpoint-{SAVED_AT}"
    trainer.train(resume_from_checkpoint=str(checkpoint) if resume else None)
    trainer.steps_taken, trainer.at_checkpoint, trainer.loaded = counter.steps, counter.at_checkpoint, counter.loaded
    trainer.steps_at_checkpoint = counter.steps_at_checkpoint
    require_engine(trainer, sharding, state_dict_type)
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    weights = recipes.lora_weights(trainer.model_wrapped if sharding == "fsdp2" else trainer.model, sharding)
    return trainer, checkpoint, losses, weights


def uninterrupted(sharding: str, state_dict_type: str | None, adapter: str, launched: int, output_dir: str, reference: str) -> dict:
    """The first job: STEPS steps, a checkpoint at SAVED_AT; its weights and losses left for the resumed job."""
    trainer, checkpoint, losses, weights = train(sharding, state_dict_type, adapter, launched, output_dir, resume=False)
    scenario.require(checkpoint.is_dir(), f"the Trainer wrote no checkpoint {checkpoint}")
    scenario.require(trainer.state.global_step == STEPS, f"the job ended at step {trainer.state.global_step}")
    scenario.require(trainer.at_checkpoint is not None, f"the job recorded no adapter when it saved checkpoint-{SAVED_AT}")
    saved_steps = [None] * torch.distributed.get_world_size()  # by rank: what each rank's checkpoint must give back
    torch.distributed.all_gather_object(saved_steps, step_counts(trainer.steps_at_checkpoint))
    if torch.distributed.get_rank() == 0:
        torch.save({"losses": losses, "weights": weights, "at_checkpoint": trainer.at_checkpoint,
                    "steps_at_checkpoint": saved_steps}, reference)
    return {"losses": losses}


def resumed(sharding: str, state_dict_type: str | None, adapter: str, launched: int, output_dir: str, reference: str) -> dict:
    """The fresh job: resumed from the checkpoint, against the uninterrupted job's weights and losses."""
    expected = torch.load(reference)
    trainer, _checkpoint, losses, weights = train(sharding, state_dict_type, adapter, launched, output_dir, resume=True)
    scenario.require(trainer.steps_taken == STEPS - SAVED_AT and trainer.state.global_step == STEPS,
                     f"the resumed job took {trainer.steps_taken} steps and ended at step {trainer.state.global_step}")
    scenario.require(trainer.loaded is not None, "the resumed job recorded nothing once it had loaded the checkpoint")
    restored = restored_from_checkpoint(sharding, trainer.loaded, expected["at_checkpoint"],
                                        expected["steps_at_checkpoint"][torch.distributed.get_rank()])
    resumed_steps = [step for step in sorted(losses) if step > SAVED_AT]
    scenario.require(resumed_steps == list(range(SAVED_AT + 1, STEPS + 1)), f"the resumed job logged the losses of steps {sorted(losses)}")
    loss_error = max(abs(losses[step] - expected["losses"][step]) / abs(expected["losses"][step]) for step in resumed_steps)
    weight_error = max(scenario.relative_error(weights[name], expected["weights"][name]) for name in expected["weights"])
    scenario.assert_within(f"the resumed {sharding} job's losses differ from the uninterrupted job's by (relative)", loss_error, TOLERANCE)
    scenario.require(weights.keys() == expected["weights"].keys(), "the resumed job trains other adapter weights")
    scenario.assert_within(f"the resumed {sharding} job's adapter weights differ from the uninterrupted job's: worst relative error",
                           weight_error, TOLERANCE)
    return {"losses": losses, "worst_relative_error": weight_error, **restored}


def restored_from_checkpoint(sharding: str, loaded: dict, at_checkpoint: dict, saved_steps: list) -> dict:
    """What the checkpoint gave back, checked before the steps that follow it: the adapter the resumed job holds once
    it has loaded checkpoint-SAVED_AT must be the uninterrupted job's when it saved it (the same bytes: TOLERANCE), and
    its optimizer's moments must be there (every tensor the rank steps holds the step count this rank's optimizer held
    when the uninterrupted job saved: SAVED_AT, or SAVED_AT + 1 under ZeRO stage 0 with bf16, whose optimizer wrapper
    steps the AdamW once at its creation to make its states; a moment the load left out has no state, or a fresh
    wrapper's one step, and a fresh AdamW's first steps are unlike the uninterrupted job's third). A state the
    checkpoint did not restore is named here rather than through the losses it changes later."""
    counts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(counts, len(loaded["steps"]))  # first: a collective every rank reaches
    scenario.require(loaded["weights"].keys() == at_checkpoint.keys(), "the resumed job trains other adapter weights")
    error = max(scenario.relative_error(loaded["weights"][name], at_checkpoint[name]) for name in at_checkpoint)
    scenario.assert_within(f"the resumed {sharding} job's adapter, loaded from checkpoint-{SAVED_AT}, differs from the uninterrupted "
                           f"job's at step {SAVED_AT}: worst relative error", error, TOLERANCE)
    scenario.require(sum(counts) > 0, f"no rank's optimizer steps a tensor with elements (by rank: {counts})")
    steps = step_counts(loaded["steps"])
    if steps and steps != saved_steps:
        raise AssertionError(f"the resumed {sharding} job's optimizer, loaded from checkpoint-{SAVED_AT}, holds the step counts "
                             f"{steps} for the {len(loaded['steps'])} tensors it steps on this rank, not "
                             f"{', '.join(map(str, saved_steps))}: their moments were not restored")
    return {"adapter_loaded_relative_error": error, "optimizer_tensors_by_rank": counts, "optimizer_steps_loaded": steps}


@pytest.mark.parametrize("adapter", list(ADAPTERS))
@pytest.mark.parametrize("sharding", list(SHARDINGS))
@pytest.mark.ranks_engine(lambda params: "zero" if SHARDINGS[params["sharding"]][0] == "zero0" else SHARDINGS[params["sharding"]][0])
@WORLD_SIZES
def test_a_resumed_job_continues_the_uninterrupted_one(ranks, world_size, sharding, adapter, tmp_path):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])  # built once here, before the ranks read it
    engine, state_dict_type = SHARDINGS[sharding]
    call = dict(sharding=engine, state_dict_type=state_dict_type, adapter=adapter, launched=world_size,
                output_dir=str(tmp_path / "trained"), reference=str(tmp_path / "uninterrupted.pt"))
    launch = dict(engine=engine, gpu_only=None if engine.startswith("zero") else TRAINER_FSDP_GPU_ONLY, cpu_costly=CPU_COSTLY,
                  engine_options={"fsdp_state_dict_type": state_dict_type} if state_dict_type else None)
    if engine == "zero0":
        config = ranks.deepspeed_config(ZERO0_BF16)
        launch.update(engine="zero", engine_options={"deepspeed_config_file": str(config), "zero3_init_flag": False})
    ranks(f"{MODULE}:uninterrupted", world_size, **launch, **call)
    ranks.workdir = tmp_path / "resumed"
    ranks(f"{MODULE}:resumed", world_size, **launch, **call)
