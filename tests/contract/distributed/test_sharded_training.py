"""Switches a sharded QLoRA job takes from one-process training must not change its steps: non-reentrant gradient
checkpointing, and bitsandbytes' optimizers.

Properties, preconditions, tolerances, measurements, known bugs met and the lanes:
docs/family-notes.md#sharded_training.
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.distributed import rank as rank_side, recipes
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import architectures, tiny

MODULE = "tests.contract.distributed.test_sharded_training"
ARCHITECTURE = "llama3"
ENGINES = pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
OPTIMIZER_ENGINES = pytest.mark.parametrize("engine", ["fsdp1", "fsdp2", "zero3"])
STEPS = 3
TOLERANCE = 2e-3
CPU_COSTLY = "its CPU variant reproduces nothing the GPU lane does not"


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


def sharded(under_test, engine: str, make_optimizer, use_reentrant: bool | None = None, with_layout: bool = False):
    """(losses, LoRA weights, the plain model, the optimizer the engine steps, with `with_layout` ZeRO-3's layout of the
    LoRA in the optimizer's flat partitions, else None) of STEPS steps under the launch."""
    accelerator = recipes.engine_accelerator(engine)
    model = recipes.engine_model(under_test, engine, use_reentrant)
    batch = scenario.training_batch(under_test.device, model.config)
    model, optimizer, plain = recipes.prepare(accelerator, engine, model, make_optimizer(model), batch)
    wrapped = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper, or DeepSpeed's stage-3 optimizer
    layout = zero3_layout(wrapped, plain) if with_layout and engine == "zero3" else None
    losses = recipes.sharded_steps(accelerator, model, optimizer, batch, STEPS)
    inner = getattr(wrapped, "optimizer", wrapped)
    return losses, recipes.lora_weights(model if engine == "fsdp2" else plain, engine), plain, inner, layout


def zero3_layout(stage3, plain) -> list[list[tuple[str, int, int, int]]]:
    """How DeepSpeed's stage-3 optimizer lays the trained parameters out in the flat fp32 partitions it hands the
    client optimizer, for every rank: one flat tensor per rank and sub-group, the list of its slices (parameter name,
    first element, elements, elements with padding: `partition_numel()`, rank r's slice being elements
    [r x partition_numel, ...) of the flattened parameter). Proven on this rank before the first step: the rank's own
    flat tensors built from the gathered weights equal the engine's `fp32_partitioned_groups_flat`, bit for bit."""
    from stackcheck.distributed.memory import plain_name

    names = {id(p): plain_name(name) for name, p in plain.named_parameters()}
    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    layout = [[(names[id(p)], r * p.partition_numel(), max(0, min(p.partition_numel(), p.ds_numel - r * p.partition_numel())),
                p.partition_numel()) for p in group] for group in stage3.fp16_groups for r in range(world_size)]
    weights = recipes.lora_weights(plain, "zero3")
    mine = [flat_of(weights, slices) for slices in layout[rank::world_size]]
    real = [flat.detach().float().cpu() for flat in stage3.fp32_partitioned_groups_flat]
    scenario.require(len(mine) == len(real) and all(torch.equal(a, b) for a, b in zip(mine, real)),
                     "the engine's flat fp32 partitions are not the LoRA laid out as zero3_layout says")
    return layout


def flat_of(tensors: dict[str, torch.Tensor], slices) -> torch.Tensor:
    """One flat tensor of the layout: each slice of its parameter, flattened and padded with zeros."""
    return torch.cat([torch.nn.functional.pad(tensors[name].flatten()[start:start + count].float(), (0, padded - count))
                      for name, start, count, padded in slices])


def same_blocks_one_process(under_test, engine: str, optimizer_name: str, layout) -> tuple[list[float], dict]:
    """bitsandbytes' optimizer `optimizer_name` in one process over the engine's blocks: the trained parameters laid
    out as `layout` says (every rank's flat tensors, each its own tensor to the optimizer, as on its rank), stepped
    with the one-process gradient of the batch, and written back into the model after every step."""
    model = recipes.engine_model(under_test, engine)
    from stackcheck.distributed.memory import plain_name

    params = {plain_name(name): p for name, p in model.named_parameters() if p.requires_grad}
    device = next(iter(params.values())).device
    flats = [flat_of({n: p.detach() for n, p in params.items()}, slices).to(device).requires_grad_() for slices in layout]
    optimizer = bnb_optimizer_of(optimizer_name, flats)
    batch = scenario.training_batch(under_test.device, model.config)
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        for flat, slices in zip(flats, layout):
            flat.grad = flat_of({n: p.grad for n, p in params.items()}, slices).to(device)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for flat, slices in zip(flats, layout):
                offset = 0
                for name, start, count, padded in slices:
                    params[name].view(-1)[start:start + count].copy_(flat[offset:offset + count])
                    offset += padded
        model.zero_grad(set_to_none=True)
    return losses, recipes.lora_weights(model, "one_process")


def checkpointed_steps(sharding: str) -> dict:
    """On every rank: STEPS AdamW steps with non-reentrant checkpointing in one process, then under the engine."""
    engine = sharding
    under_test = subject()
    if under_test.device.type == "cuda":
        torch.cuda.set_device(under_test.device)
    single_losses, single_weights = one_process(under_test, engine, recipes.optimizer_for, use_reentrant=False)
    losses, weights, plain, _optimizer, _layout = sharded(under_test, engine, recipes.optimizer_for, use_reentrant=False)
    require_non_reentrant(plain)
    return rank_side.assert_matches_one_process(engine, losses, single_losses, weights, single_weights, TOLERANCE)


def bnb_optimizer_of(name: str, tensors):
    """bitsandbytes' optimizer `name` over `tensors`."""
    import bitsandbytes as bnb

    if name == "adamw8bit":
        return bnb.optim.AdamW8bit(tensors, lr=recipes.LEARNING_RATE, min_8bit_size=1)
    return bnb.optim.PagedAdamW(tensors, lr=recipes.LEARNING_RATE)


def bnb_optimizer(name: str):
    """bitsandbytes' optimizer `name` over a model's trainable parameters."""
    return lambda model: bnb_optimizer_of(name, [p for p in model.parameters() if p.requires_grad])


def require_8bit_states(stepped, engine: str) -> list[int]:
    """The job stepped 8-bit states, proven across the ranks: some rank holds uint8 states, and every tensor a rank
    holds elements of has them. A rank may hold no trained element at all: FSDP1 shards a unit's flat parameter, frozen
    4-bit weights and LoRA factors together, so at world size 2 the LoRA factors of a layer (its attention's, first in
    the unit) can all lie in rank 0's half; rank 1's optimizer then holds only empty views, never stepped and without
    state (the first two-GPU run: rank 1 read "set(), not uint8" while rank 0 passed). Such a rank proves nothing
    about the states by itself, and is not the failure of its scenario either: the job's is. Every rank's count of
    tensors with uint8 states, by rank (a collective: every rank calls this). The tensors are those of the optimizer's
    groups and those it holds state for: DeepSpeed's stage 3 puts its flat fp32 partitions into the groups only during
    a step and empties them again (the two-GPU rerun read "no rank holds uint8 states" on ZeRO-3 from the empty groups): recipes.stepped_tensors."""
    _inner, held = recipes.stepped_tensors(stepped)
    dtypes = {str(stepped.state[p]["state1"].dtype) if "state1" in stepped.state.get(p, {}) else "none" for p in held}
    mine = sum(1 for p in held if "state1" in stepped.state.get(p, {}) and stepped.state[p]["state1"].dtype == torch.uint8)
    counts = [0] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(counts, mine)
    scenario.require(sum(counts) > 0, f"no rank's 8-bit AdamW under {engine} holds uint8 states (tensors with uint8 states by rank: {counts})")
    scenario.require(dtypes <= {"torch.uint8"}, f"8-bit AdamW's states of the {len(held)} tensors this rank holds under {engine} are {dtypes}, not uint8")
    return counts


def optimizer_steps(sharding: str, optimizer: str) -> dict:
    """On every rank: STEPS steps of bitsandbytes' optimizer in one process, then under the engine (ZeRO-3's 8-bit
    AdamW against one process over the engine's blocks)."""
    engine = sharding
    under_test = subject()
    if under_test.device.type == "cuda":
        torch.cuda.set_device(under_test.device)
    make = bnb_optimizer(optimizer)
    single_losses, single_weights = one_process(under_test, engine, make)
    losses, weights, _plain, stepped, layout = sharded(under_test, engine, make, with_layout=optimizer == "adamw8bit")
    scenario.require(type(stepped).__module__.startswith("bitsandbytes"), f"the engine steps {type(stepped).__name__}, not bitsandbytes' optimizer")
    tolerance, measured = TOLERANCE, {}
    if optimizer == "adamw8bit":
        measured["uint8_state_tensors_by_rank"] = require_8bit_states(stepped, engine)
        _losses, exact_weights = one_process(under_test, engine, recipes.optimizer_for)
        effect = lambda run: max(scenario.relative_error(run[name], exact_weights[name]) for name in run)  # noqa: E731
        measured["one_process_quantization_effect"] = effect(single_weights)
        if engine == "zero3":
            plain_difference = max(scenario.relative_error(weights[name], single_weights[name]) for name in weights)
            single_losses, single_weights = same_blocks_one_process(under_test, engine, optimizer, layout)
            measured.update(same_blocks_quantization_effect=effect(single_weights), against_one_process_8bit=plain_difference,
                            straddling_blocks=straddling_blocks(layout))
            tolerance = max(TOLERANCE, measured["same_blocks_quantization_effect"])
        else:
            tolerance = max(TOLERANCE, 2 * measured["one_process_quantization_effect"])
    what = f"{engine} with {optimizer}" + (" (reference: one process over the engine's blocks)" if layout and optimizer == "adamw8bit" else "")
    result = rank_side.assert_matches_one_process(what, losses, single_losses, weights, single_weights, tolerance)
    return {**result, **measured, "tolerance": tolerance}


def straddling_blocks(layout, blocksize: int = 256) -> int:
    """How many of bitsandbytes' blocks (256 values) in the layout's flat tensors hold values of two parameters."""
    count = 0
    for slices in layout:
        bounds = [0]
        for *_rest, padded in slices:
            bounds.append(bounds[-1] + padded)
        count += sum(1 for start in range(0, bounds[-1], blocksize)
                     if any(start < bound < start + blocksize for bound in bounds[1:-1]))
    return count


@ENGINES
@WORLD_SIZES
def test_non_reentrant_checkpointing_matches_one_process(ranks, world_size, engine):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])  # built once here, before the ranks read it
    ranks(f"{MODULE}:checkpointed_steps", world_size, engine=engine, cpu_costly=CPU_COSTLY, sharding=engine)


UPDATE_OPS = {"adamw8bit": "bitsandbytes::optimizer_update_8bit_blockwise", "paged_adamw": "bitsandbytes::optimizer_update_32bit"}


def no_cpu_kernel(optimizer: str) -> str | None:
    """Why the optimizer cannot step on the CPU: bitsandbytes registers no CPU (or device-independent) kernel for its
    update op (0.49 has none for the 8-bit update); None where it can."""
    import bitsandbytes

    op = UPDATE_OPS[optimizer]
    if any(torch._C._dispatch_has_kernel_for_dispatch_key(op, key) for key in ("CPU", "CompositeExplicitAutograd")):
        return None
    return f"bitsandbytes {bitsandbytes.__version__} has no CPU kernel for {op}"


@pytest.mark.parametrize("optimizer", ["adamw8bit", "paged_adamw"])
@OPTIMIZER_ENGINES
@WORLD_SIZES
def test_bnb_optimizer_matches_one_process(ranks, world_size, engine, optimizer):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])
    ranks(f"{MODULE}:optimizer_steps", world_size, engine=engine, gpu_only=no_cpu_kernel(optimizer) if ranks.lane == "cpu" else None,
          cpu_costly=CPU_COSTLY, sharding=engine, optimizer=optimizer)
