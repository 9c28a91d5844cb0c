"""Switches a sharded QLoRA job takes from one-process training must not change its steps: non-reentrant gradient
checkpointing, and bitsandbytes' optimizers.

Properties, under FSDP2 (`fully_shard`) and DeepSpeed ZeRO-3, launched as users launch them, the 4-bit weights in bf16
storage (the storage both engines shard):
- **Non-reentrant checkpointing under a sharding engine gives one process's steps.** The mode most users now get by
  default (transformers 5 made it the default, PR #43203); under ZeRO-3 a recompute sees parameters partitioned
  again (empty) where the first forward saw them gathered, the metadata check of `torch.utils.checkpoint`'s
  non-reentrant mode compares them (users' symptom: `CheckpointError: torch.utils.checkpoint: Recomputed values for
  the following tensors have different metadata than during the forward pass`, deepspeed#4595, transformers#28499).
- **bitsandbytes' 8-bit AdamW and paged AdamW under a sharding engine match one process with the same optimizer.**
  Under FSDP2 the optimizer steps DTensors (each rank its shard); under ZeRO-3 it steps the rank's flat fp32 partition,
  so 8-bit AdamW's blockwise state quantization sees other blocks than in one process.

Precondition proven on every rank: `prepare` gave the engine's module; every decoder layer runs under gradient
checkpointing in non-reentrant mode (its checkpoint function's `use_reentrant` is False); the optimizer the engine
steps is bitsandbytes' and, for 8-bit AdamW, holds uint8 states (`min_8bit_size=1`: the tiny model's LoRA tensors are
below bitsandbytes' default 4096 elements, so without it they would get 32-bit states, unlike a full-size model's).

Tolerance: both ranks train on the same batch, so the averaged gradient is one process's. Checkpointing recomputes
the same operations: 2e-3 as in `zero3_lora` (reduction order over NCCL). Paged AdamW keeps 32-bit states element by
element: 2e-3. 8-bit AdamW's states are quantized per block of 256 values, and the blocks differ between a tensor and
a flat partition: the difference is judged against the quantization's own effect, measured on every rank in one
process (8-bit AdamW against torch's AdamW, same steps): the sharded run may differ from one process's 8-bit run by
at most twice that effect (or 2e-3, whichever is larger). A step skipped or a state reset is order 1.

Measured on two H200s (torch 2.11, world sizes 1 and 2): non-reentrant checkpointing matches one process under FSDP2
and ZeRO-3 on both sets (the CPU, seed, two gloo ranks, FSDP2: relative error 0.0). Under FSDP2 both of bitsandbytes'
optimizers fail at the first step, on both sets (`bnb_8bit_optimizer_fsdp2_dtensor`, `bnb_32bit_optimizer_fsdp2_dtensor`).
Under ZeRO-3: paged AdamW within 0.0017 (seed) and 0.0 (latest); 8-bit AdamW 0.0044 and 0.010 on seed (world sizes 1
and 2; the quantization's own effect 0.0095, so a tolerance of 0.019), 0.0 at world size 1 on latest, and **0.058 at
world size 2 on latest** against a tolerance of 0.021 (effect 0.0104): a `new_failure`, not yet researched (bitsandbytes
0.50.2 against 0.49.2 is the difference between the sets' runs; whether it is the blocks over the flat partition or a
bug is open).

GPU lane only: bitsandbytes' optimizers need CUDA, and the CPU variant of checkpointing reproduces nothing the
GPU lane does not (`ranks(..., gpu_only=...)`).
"""

import pytest
import torch

from stackcheck import scenario
from stackcheck.distributed import rank as rank_side, recipes
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import architectures, tiny

MODULE = "tests.contract.distributed.test_sharded_training"
ARCHITECTURE = "llama3"
ENGINES = pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
STEPS = 3
TOLERANCE = 2e-3


def subject() -> scenario.UnderTest:
    return scenario.UnderTest(architectures.builtin()[ARCHITECTURE], rank_side.device())


def require_non_reentrant(model) -> None:
    layers = scenario.decoder_layers(model)
    modes = {getattr(getattr(layer, "_gradient_checkpointing_func", None), "keywords", {}).get("use_reentrant", "off")
             if getattr(layer, "gradient_checkpointing", False) else "off" for layer in layers}
    scenario.require(modes == {False}, f"the decoder layers' checkpointing is {modes}, not non-reentrant on every layer")


def one_process(under_test, engine: str, make_optimizer, use_reentrant: bool | None = None):
    """(losses, LoRA weights) of STEPS steps of the engine's recipe in one process."""
    model = recipes.engine_model(under_test, engine, use_reentrant)
    losses = scenario.train_steps(under_test, model, make_optimizer(model), STEPS)
    return losses, recipes.lora_weights(model, "one_process")


def sharded(under_test, engine: str, make_optimizer, use_reentrant: bool | None = None):
    """(losses, LoRA weights, the plain model, the optimizer the engine steps) of STEPS steps under the launch."""
    accelerator = recipes.engine_accelerator(engine)
    model = recipes.engine_model(under_test, engine, use_reentrant)
    batch = scenario.training_batch(under_test.device, model.config)
    model, optimizer, plain = recipes.prepare(accelerator, engine, model, make_optimizer(model), batch)
    losses = recipes.sharded_steps(accelerator, model, optimizer, batch, STEPS)
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper, or DeepSpeed's stage-3 optimizer
    inner = getattr(inner, "optimizer", inner)
    return losses, recipes.lora_weights(model if engine == "fsdp2" else plain, engine), plain, inner


def checkpointed_steps(sharding: str) -> dict:
    """On every rank: STEPS AdamW steps with non-reentrant checkpointing in one process, then under the engine."""
    engine = sharding
    under_test = subject()
    if under_test.device.type == "cuda":
        torch.cuda.set_device(under_test.device)
    single_losses, single_weights = one_process(under_test, engine, recipes.optimizer_for, use_reentrant=False)
    losses, weights, plain, _optimizer = sharded(under_test, engine, recipes.optimizer_for, use_reentrant=False)
    require_non_reentrant(plain)
    return rank_side.assert_matches_one_process(engine, losses, single_losses, weights, single_weights, TOLERANCE)


def bnb_optimizer(name: str):
    import bitsandbytes as bnb

    if name == "adamw8bit":
        return lambda model: bnb.optim.AdamW8bit([p for p in model.parameters() if p.requires_grad], lr=recipes.LEARNING_RATE, min_8bit_size=1)
    return lambda model: bnb.optim.PagedAdamW([p for p in model.parameters() if p.requires_grad], lr=recipes.LEARNING_RATE)


def optimizer_steps(sharding: str, optimizer: str) -> dict:
    """On every rank: STEPS steps of bitsandbytes' optimizer in one process, then under the engine."""
    engine = sharding
    under_test = subject()
    torch.cuda.set_device(under_test.device)
    make = bnb_optimizer(optimizer)
    single_losses, single_weights = one_process(under_test, engine, make)
    losses, weights, _plain, stepped = sharded(under_test, engine, make)
    scenario.require(type(stepped).__module__.startswith("bitsandbytes"), f"the engine steps {type(stepped).__name__}, not bitsandbytes' optimizer")
    tolerance = TOLERANCE
    if optimizer == "adamw8bit":
        states = {state["state1"].dtype for state in stepped.state.values() if "state1" in state}
        scenario.require(states == {torch.uint8}, f"8-bit AdamW's states under {engine} are {states}, not uint8")
        _losses, exact_weights = one_process(under_test, engine, recipes.optimizer_for)
        quantization = max(scenario.relative_error(single_weights[name], exact_weights[name]) for name in single_weights)
        tolerance = max(TOLERANCE, 2 * quantization)
    result = rank_side.assert_matches_one_process(f"{engine} with {optimizer}", losses, single_losses, weights, single_weights, tolerance)
    return {**result, "tolerance": tolerance}


@ENGINES
@WORLD_SIZES
def test_non_reentrant_checkpointing_matches_one_process(ranks, world_size, engine):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])  # built once here, before the ranks read it
    ranks(f"{MODULE}:checkpointed_steps", world_size, engine=engine, gpu_only="its CPU variant reproduces nothing the GPU lane does not",
          sharding=engine)


@pytest.mark.parametrize("optimizer", ["adamw8bit", "paged_adamw"])
@ENGINES
@WORLD_SIZES
def test_bnb_optimizer_matches_one_process(ranks, world_size, engine, optimizer):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])
    ranks(f"{MODULE}:optimizer_steps", world_size, engine=engine, gpu_only="bitsandbytes' optimizers need CUDA", sharding=engine,
          optimizer=optimizer)
