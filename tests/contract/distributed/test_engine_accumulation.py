"""Gradient accumulation under the DeepSpeed engine: k micro-batches make the update of one batch of the same tokens.

The property, preconditions, tolerances, measurements and the lanes: docs/family-notes.md#engine_accumulation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.distributed import rank as rank_side, recipes
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import architectures, tiny

MODULE = "tests.contract.distributed.test_engine_accumulation"
ARCHITECTURE = "llama3"
MICRO_BATCHES = 3
LEARNING_RATE = 0.05
TOLERANCE = 0.03
# The ranks step from one reduced gradient: the same weights (0.0 measured at stage 0, every 0.19.8 cell within 1e-6).
RANKS_TOLERANCE = 1e-6
CPU_COSTLY = "25 to 40 s a cell on 2 cores, over the family's CI budget"
DEFAULT_CPU_CELL = None  # e.g. "z2-bf16-offload" (the QLoRA memory recipe; it shows the hooks and the dropped micro-batch)


@dataclass(frozen=True)
class Engine:
    stage: int
    bf16: bool
    offload: bool = False
    fp32_accumulation: bool = False
    driver: str = "accelerate"

    def gradient_accumulation_steps(self) -> int:
        return MICRO_BATCHES if self.driver == "accelerate" else 1

    def deepspeed_config(self) -> dict:
        """The cell's DeepSpeed JSON, as a user writes it."""
        zero = {"stage": self.stage}
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        config = {"zero_optimization": zero, "bf16": {"enabled": self.bf16}, "train_micro_batch_size_per_gpu": 1,
                  "gradient_accumulation_steps": self.gradient_accumulation_steps(), "gradient_clipping": 0.0}
        if self.offload:
            config["zero_force_ds_cpu_optimizer"] = False  # torch's SGD steps the offloaded partition
        if self.fp32_accumulation:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        return config


ENGINES = {
    "z0-fp32": Engine(0, False),
    "z0-bf16": Engine(0, True),
    "z1-fp32": Engine(1, False),
    "z1-bf16": Engine(1, True),
    "z1-bf16-fp32accum": Engine(1, True, fp32_accumulation=True),
    "z1-bf16-offload": Engine(1, True, offload=True),
    "z2-fp32": Engine(2, False),
    "z2-bf16": Engine(2, True),
    "z2-fp32-offload": Engine(2, False, offload=True),
    "z2-bf16-offload": Engine(2, True, offload=True),
    "z2-bf16-offload-boundary": Engine(2, True, offload=True, driver="boundary"),
    "z3-bf16": Engine(3, True),
}


def subject() -> scenario.UnderTest:
    return scenario.UnderTest(architectures.builtin()[ARCHITECTURE], rank_side.device())


def qlora_model(under_test, engine: Engine):
    """The QLoRA recipe the engine trains: uint8 storage on the rank's device (stages 0 to 2 keep the frozen 4-bit
    weights whole on every rank), ZeRO-3's bf16 storage as the PEFT guide writes it."""
    return recipes.zero3_qlora_model(under_test) if engine.stage == 3 else recipes.fsdp_qlora_model(under_test)


def require_engine(model, accelerator, engine: Engine) -> dict:
    """The engine the cell asked for, proven from the engine itself; what it is, for the cell's record."""
    from deepspeed import DeepSpeedEngine

    scenario.require(isinstance(model, DeepSpeedEngine), f"prepare gave {type(model).__name__}, not DeepSpeed's engine")
    optimizer = model.optimizer
    found = {"stage": model.zero_optimization_stage(), "bf16": model.bfloat16_enabled(),
             "gradient_accumulation_steps": model.gradient_accumulation_steps(),
             "accelerate_gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
             "offload": bool(getattr(optimizer, "cpu_offload", False)), "grad_accum_dtype": str(model.get_data_types()[1]),
             "optimizer": type(optimizer).__name__}
    asked = {"stage": engine.stage, "bf16": engine.bf16, "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
             "accelerate_gradient_accumulation_steps": engine.gradient_accumulation_steps(), "offload": engine.offload}
    if engine.fp32_accumulation:
        asked["grad_accum_dtype"] = str(torch.float32)
    scenario.require(all(found[key] == value for key, value in asked.items()), f"the engine is {found}, not {asked}")
    return found


def accumulate(accelerator, model, optimizer, micro_batches: list[dict], engine: Engine) -> list[bool]:
    """The cell's driver over the rank's micro-batches; the boundary flag the engine saw at each."""
    boundaries = []
    if engine.driver == "accelerate":
        for micro_batch in micro_batches:
            with accelerator.accumulate(model):
                loss = model(**micro_batch).loss
                accelerator.backward(loss)
                boundaries.append(model.is_gradient_accumulation_boundary())
                optimizer.step()
                optimizer.zero_grad()
        return boundaries
    for index, micro_batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        model.set_gradient_accumulation_boundary(last)
        loss = model(**micro_batch).loss
        model.backward(loss / len(micro_batches))
        boundaries.append(model.is_gradient_accumulation_boundary())
        if last:
            model.step()
    return boundaries


def accumulated_step(cell: str, launched: int) -> dict:
    """On every rank: one process's SGD step on the global batch, then the engine's accumulated step."""
    engine, world_size = ENGINES[cell], launched
    accelerator = rank_side.accelerator()
    under_test = subject()
    rows = recipes.distinct_rows(world_size * MICRO_BATCHES)
    reference = recipes.one_process_sgd(qlora_model(under_test, engine), recipes.rows_batch(rows, under_test.device), 1, LEARNING_RATE)

    model = qlora_model(under_test, engine)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    rank = torch.distributed.get_rank()
    mine = rows[rank * MICRO_BATCHES:(rank + 1) * MICRO_BATCHES]
    loader = torch.utils.data.DataLoader(recipes.rows_dataset(mine), batch_size=1)  # accelerate reads the micro batch size
    model, optimizer, _loader = accelerator.prepare(model, optimizer, loader)
    found = require_engine(model, accelerator, engine)
    scenario.require(torch.distributed.get_world_size() == world_size == int(os.environ["WORLD_SIZE"]),
                     "the job does not run at the launched world size")
    sharded = "zero3" if engine.stage == 3 else "one_process"
    before = recipes.lora_weights(model.module, sharded)
    boundaries = accumulate(accelerator, model, optimizer, [recipes.rows_batch([row], under_test.device) for row in mine], engine)
    expected = [False] * (MICRO_BATCHES - 1) + [True]
    scenario.require(boundaries == expected, f"the engine's accumulation boundaries were {boundaries}, not {expected}")
    scenario.require(model.global_steps == 1, f"the engine took {model.global_steps} optimizer steps, not 1")
    every_rank = [None] * world_size
    torch.distributed.all_gather_object(every_rank, mine)
    scenario.require(sorted(row for rank_rows in every_rank for row in rank_rows) == sorted(rows),
                     "the ranks' micro-batches are not the global batch, each sequence once")
    after = recipes.lora_weights(model.module, sharded)
    update = {name: after[name] - before[name] for name in before}
    spread = ranks_spread(update)
    scenario.assert_within(f"the ranks hold other LoRA weights after the engine's step ({cell}): largest relative difference "
                           f"of a rank's update from rank 0's", spread, RANKS_TOLERANCE)
    moved = [name for name, delta in reference.items() if delta.any()]
    scenario.require(moved and update.keys() == reference.keys(), "one process's step moved no LoRA weight, or other weights train")
    worst = max(scenario.relative_error(update[name], reference[name]) for name in moved)
    scale = recipes.update_scale(update, reference)
    scenario.assert_within(f"{MICRO_BATCHES} micro-batches under the engine ({cell}) update the LoRA unlike one batch of "
                           f"their tokens: the update is {scale:.4g} times one process's, worst relative error",
                           worst, TOLERANCE, judged_by=("the update's scale", scale))
    return {**found, "worst_relative_error": worst, "update_scale": scale, "ranks_spread": spread}


def ranks_spread(update: dict[str, torch.Tensor]) -> float:
    """How far this rank's LoRA update is from rank 0's (relative, over every LoRA weight): 0 where every rank
    steps from the same reduced gradient, as data parallelism does at every stage."""
    flat = torch.cat([update[name].flatten() for name in sorted(update)])
    every_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every_rank, flat)
    return max(scenario.relative_error(other, every_rank[0]) for other in every_rank)


@pytest.mark.parametrize("cell", list(ENGINES))
@pytest.mark.ranks_engine("zero")
@WORLD_SIZES
def test_accumulated_micro_batches_update_as_one_batch(ranks, world_size, cell):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])  # built once here, before the ranks read it
    engine = ENGINES[cell]
    config = ranks.deepspeed_config(engine.deepspeed_config())  # the cell's own file; a warm pool gets its path as a variable
    ranks(f"{MODULE}:accumulated_step", world_size, engine="zero", cpu_costly=None if cell == DEFAULT_CPU_CELL else CPU_COSTLY,
          engine_options={"deepspeed_config_file": str(config), "zero3_init_flag": engine.stage == 3}, cell=cell, launched=world_size)
