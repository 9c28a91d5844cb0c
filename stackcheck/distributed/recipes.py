"""The QLoRA recipes the distributed families judge and the bench's distributed case times: one home, so that what
the bench measures is what the families check. Each rank and the one-process reference build the same model: a
fresh 4-bit base, `scenario.qlora_model`'s recipe, its LoRA initialised from one seed, AdamW over the trainables."""

from __future__ import annotations

import torch

from stackcheck.harness import scenario
from stackcheck.distributed import rank as rank_side
from stackcheck.models import tiny

LEARNING_RATE = 1e-3
# The LoRA's initialisation seed, the same on every rank and in one process.
LORA_SEED = 0


def optimizer_for(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)


# The adapter with a module trained whole beside the LoRA (PEFT's `modules_to_save`): the final norm, a float module
# of the root that no LoRA targets and no weight is tied to (a tied lm_head is another matter than a checkpoint's).
MODULES_TO_SAVE = {"modules_to_save": ["model.norm"]}


def lora_on(under_test, base, use_reentrant: bool | None = None, lora: dict | None = None):
    """The QLoRA recipe on `base` (`scenario.qlora_model`), its LoRA from LORA_SEED; with `use_reentrant`, the
    gradient checkpointing `prepare_model_for_kbit_training` turns on is asked for in that mode; `lora`: LoraConfig
    arguments beside the fixture's (MODULES_TO_SAVE)."""
    torch.manual_seed(LORA_SEED)
    if use_reentrant is None and not lora:
        return scenario.qlora_model(under_test, base)
    from peft import get_peft_model, prepare_model_for_kbit_training

    checkpointing = {} if use_reentrant is None else {"gradient_checkpointing_kwargs": {"use_reentrant": use_reentrant}}
    prepared = prepare_model_for_kbit_training(base, **checkpointing)
    return get_peft_model(prepared, tiny.lora_config(under_test.arch, "language", **(lora or {}))).train()


def quantization_config(quant_storage: torch.dtype = torch.uint8):
    """NF4 with double quant, the 4-bit weights packed into `quant_storage` (bitsandbytes' default uint8)."""
    config = scenario.bnb_config()
    config.bnb_4bit_quant_storage = quant_storage
    return config


def fsdp_qlora_model(under_test, base=None, quant_storage: torch.dtype = torch.uint8, use_reentrant: bool | None = None,
                     lora: dict | None = None):
    """The FSDP-QLoRA recipe: NF4 with double quant in `quant_storage` (bitsandbytes' default uint8; bf16 is the
    storage FSDP can shard with the rest), on the rank's device (`base` when the caller loaded it, to prove something
    of it first)."""
    if base is None:
        base = scenario.load_base(under_test, quantization_config=quantization_config(quant_storage))
    return lora_on(under_test, base, use_reentrant, lora)


def zero3_qlora_model(under_test, quant_storage: torch.dtype = torch.bfloat16, use_reentrant: bool | None = None,
                      lora: dict | None = None):
    """The ZeRO-3 QLoRA recipe of the PEFT guide: the 4-bit weights stored as bf16, so ZeRO-3 can flatten them with the
    rest. No device map: transformers refuses one under ZeRO-3, and a quantized load without one goes to the current
    CUDA device (`{"": torch.cuda.current_device()}`), which is the rank's once accelerate (or the Trainer's
    arguments) has set it, as in the users' order. The one-process reference is built before the Accelerator, so the
    rank's device is made current here: without it, rank 1 loaded onto cuda:0 and its batch on cuda:1 failed the
    first forward (`Expected all tensors to be on the same device, but got index is on cuda:1, different from other
    tensors on cuda:0`, the two-GPU run of latest), ours, not a library's."""
    if under_test.device.type == "cuda":
        torch.cuda.set_device(under_test.device)
    config = quantization_config(quant_storage)
    arch = under_test.arch
    return lora_on(under_test, scenario.load_pretrained(tiny.model_class(arch), tiny.base_checkpoint(arch), True, True, None,
                                                        quantization_config=config), use_reentrant, lora)


def deepspeed_stage3_accelerator():
    """The launch's Accelerator, proven to be DeepSpeed at ZeRO stage 3 (create it before loading: under ZeRO-3 the
    rank's device is made current there)."""
    accelerator = rank_side.accelerator()
    plugin = accelerator.state.deepspeed_plugin
    scenario.require(plugin is not None and plugin.zero_stage == 3,
                     f"accelerate's state is {accelerator.distributed_type}, not DeepSpeed ZeRO-3")
    return accelerator


# --- the engines' shared steps (the contract families of tests/contract/distributed) --------------------------------

ENGINES = ("fsdp1", "fsdp2", "zero3")
STORAGES = {"uint8": torch.uint8, "bf16": torch.bfloat16, "fp32": torch.float32}


def engine_accelerator(engine: str):
    """The launch's Accelerator, on the rank's device (ZeRO-3 proven at stage 3)."""
    if engine == "zero3":
        return deepspeed_stage3_accelerator()
    accelerator = rank_side.accelerator()
    if accelerator.device.type == "cuda":
        torch.cuda.set_device(accelerator.device)
    return accelerator


def engine_model(under_test, engine: str, use_reentrant: bool | None = None, lora: dict | None = None):
    """The engine's QLoRA recipe in the storage it shards: bf16 (FSDP1 with every float parameter in bf16 too: see
    storage_model)."""
    if engine == "zero3":
        return zero3_qlora_model(under_test, use_reentrant=use_reentrant, lora=lora)
    if engine == "fsdp1":
        return storage_model(under_test, engine, torch.bfloat16, use_reentrant, lora)
    return fsdp_qlora_model(under_test, quant_storage=torch.bfloat16, use_reentrant=use_reentrant, lora=lora)


def storage_model(under_test, engine: str, quant_storage: torch.dtype, use_reentrant: bool | None = None, lora: dict | None = None):
    """The engine's QLoRA recipe with the 4-bit weights in `quant_storage`. FSDP1 flattens a unit into one dtype, so
    with a float storage every float parameter beside the 4-bit weights is cast to it (fsdp1_quant_storage's control;
    fp32 storage is then the QLoRA recipe as it is, its trainables being fp32 already)."""
    if engine == "zero3":
        return zero3_qlora_model(under_test, quant_storage, use_reentrant, lora)
    model = fsdp_qlora_model(under_test, quant_storage=quant_storage, use_reentrant=use_reentrant, lora=lora)
    if engine == "fsdp1" and quant_storage.is_floating_point:
        for param in model.parameters():
            if type(param).__name__ != "Params4bit" and param.is_floating_point():
                param.data = param.data.to(quant_storage)
    return model


def batch_loader(batch: dict[str, torch.Tensor]):
    """The training batch as a DataLoader: accelerate fills ZeRO's "auto" batch sizes from the one it prepares."""
    return torch.utils.data.DataLoader([{k: v[0] for k, v in batch.items()}], batch_size=1)


def prepare(accelerator, engine: str, model, optimizer, batch: dict[str, torch.Tensor]):
    """`accelerator.prepare` as users call it for the engine (ZeRO-3 with a DataLoader), proven sharded: an FSDP1
    module, an FSDP2 module, or DeepSpeed's engine at stage 3. (model, optimizer, the plain model inside)."""
    if engine == "zero3":
        model, optimizer, _ = accelerator.prepare(model, optimizer, batch_loader(batch))
        scenario.require(model.zero_optimization_stage() == 3, "DeepSpeed's engine is not at ZeRO stage 3")
        return model, optimizer, model.module
    model, optimizer = accelerator.prepare(model, optimizer)
    if engine == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        scenario.require(isinstance(model, FSDP), f"prepare gave {type(model).__name__}, not an FSDP1 module")
    else:
        from torch.distributed.fsdp import FSDPModule

        scenario.require(isinstance(model, FSDPModule), f"prepare gave {type(model).__name__}, not an FSDP2 module")
    return model, optimizer, model


def sharded_steps(accelerator, model, optimizer, batch: dict[str, torch.Tensor], steps: int) -> list[float]:
    """`steps` optimizer steps as users write them under accelerate (its backward, which is ZeRO-3's own)."""
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def local_numel(tensor: torch.Tensor) -> int:
    """How many elements of `tensor` this rank holds (a DTensor's local shard)."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).numel()


def stepped_tensors(optimizer) -> tuple:
    """(the torch optimizer that steps this rank's tensors, the tensors it steps that hold elements on this rank), one
    home for every engine: `optimizer` may be accelerate's wrapper, DeepSpeed's stage-3 optimizer or a torch optimizer.
    DeepSpeed's stage 3 puts its flat fp32 partitions into its torch optimizer's groups only during a step and empties
    them again (`_optimizer_step`), so they are read from the engine (`fp32_partitioned_groups_flat`) and from the
    tensors the torch optimizer holds state for; FSDP's views with no element on this rank are left out."""
    tensors = []
    while hasattr(optimizer, "optimizer"):
        tensors += list(getattr(optimizer, "fp32_partitioned_groups_flat", []))
        optimizer = optimizer.optimizer
    tensors += [p for group in optimizer.param_groups for p in group["params"]]
    tensors += [p for p in optimizer.state if torch.is_tensor(p)]
    return optimizer, list({id(p): p for p in tensors if local_numel(p) > 0}.values())


def is_adapter_weight(name: str) -> bool:
    """A weight the adapter trains: a LoRA factor, or a module PEFT trains whole (`modules_to_save`)."""
    return "lora_" in name or ".modules_to_save." in name


def lora_weights(model, engine: str) -> dict[str, torch.Tensor]:
    """Every weight the adapter trains (`is_adapter_weight`) in full, by its plain name, gathered from the ranks where
    the engine shards it."""
    from stackcheck.distributed.memory import plain_name

    named = {name: p for name, p in model.named_parameters() if is_adapter_weight(name)}
    if engine == "zero3" and any(hasattr(p, "ds_tensor") for p in named.values()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(named.values())):
            return {plain_name(name): p.detach().float().cpu().clone() for name, p in named.items()}
    if engine == "fsdp1" and any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            return {plain_name(name): p.detach().float().cpu().clone() for name, p in model.named_parameters() if is_adapter_weight(name)}
    return {plain_name(name): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
            for name, p in named.items()}


def distinct_rows(count: int) -> list[list[int]]:
    """`count` training sequences of one length, each its own (the training ids rotated), every token a label: the
    mean over a batch of them is the mean of their per-sequence means, however the ranks split them."""
    ids = scenario.TRAINING_IDS[0]
    return [ids[row:] + ids[:row] for row in range(count)]


def labelled(row: list[int]) -> dict[str, torch.Tensor]:
    """One training example: its ids, and its labels with the first one -100. A causal LM's loss never predicts the
    first token (the labels are shifted by one), so this changes no loss; it makes the Trainer's count of label tokens
    the same whether it counts before the shift (transformers 5.6.2 to 5.10: one too many per sequence, which scales
    the Trainer's loss by (L-1)/L, the train_equivalences family's `trainer_num_items_unshifted`) or after it
    (5.23.0), so that the distributed families judge their own property on every release."""
    ids = torch.tensor(row)
    return {"input_ids": ids, "labels": torch.cat([torch.tensor([-100]), ids[1:]])}


def rows_batch(rows: list[list[int]], device) -> dict[str, torch.Tensor]:
    examples = [labelled(row) for row in rows]
    return {key: torch.stack([example[key] for example in examples]).to(device) for key in ("input_ids", "labels")}


def rows_dataset(rows: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """The rows as the Trainer's dataset (see `labelled`)."""
    return [labelled(row) for row in rows]


def one_process_sgd(model, batch: dict[str, torch.Tensor], steps: int, learning_rate: float,
                    per_sequence: bool = False) -> dict[str, torch.Tensor]:
    """The reference of a data-parallel job: `steps` plain SGD steps in one process on the whole global batch; the
    change of every LoRA weight, by plain name. With `per_sequence`, each step's gradient is the mean of the
    sequences' own gradients, each sequence a forward of its own (its loss over the batch size, accumulated): the same
    mean over the batch, computed in the shapes the ranks of a data-parallel job compute it (one sequence each)."""
    before = lora_weights(model, "one_process")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=learning_rate)
    rows = len(batch["input_ids"])
    for _ in range(steps):
        optimizer.zero_grad()
        if per_sequence:
            for row in range(rows):
                (model(**{key: value[row:row + 1] for key, value in batch.items()}).loss / rows).backward()
        else:
            model(**batch).loss.backward()
        optimizer.step()
    after = lora_weights(model, "one_process")
    return {name: after[name] - before[name] for name in before}


def update_scale(update: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """How many times the reference's update `update` is along it (the projection over every LoRA weight): 1 when the
    steps agree, the factor when a loss was scaled (a world size, a GPU count), 0 when nothing moved along it."""
    along = sum(float((update[name].double() * delta.double()).sum()) for name, delta in reference.items())
    return along / sum(float(delta.double().square().sum()) for delta in reference.values())


def assert_same_update(what: str, update: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], tolerance: float,
                       scale_over: tuple[str, int] | None = None) -> float:
    """Every LoRA weight moved as in the reference (relative error of the change, over the weights the reference
    moved); the worst relative error. The message says how many times the reference's update it is (`update_scale`),
    which names a scaled loss by its factor; with `scale_over` (a name, a count), a failure is judged by that scale over
    the count (the ledger's band of a loss scaled by exactly that count is about 1)."""
    scenario.require(update.keys() == reference.keys(), f"{what}: other LoRA weights than one process's")
    moved = [name for name, delta in reference.items() if delta.any()]
    scenario.require(moved, "one process's step moved no LoRA weight")
    worst = max(scenario.relative_error(update[name], reference[name]) for name in moved)
    scale = update_scale(update, reference)
    judged_by = None if scale_over is None else (f"the update's scale over {scale_over[0]}", scale / scale_over[1])
    scenario.assert_within(f"{what}: the LoRA update is {scale:.2f} times one process's on the whole batch, worst relative error",
                           worst, tolerance, judged_by=judged_by)
    return worst
