"""Train, as users train: one step's LoRA gradients under a gradient-checkpointing mode, and the first step of
`transformers.Trainer` with the update it made and the loss it reported. Free of pytest fixtures, so the
distributed families can reuse them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from stackcheck.harness.adapt import LEFT_OUT
from stackcheck.harness.load import first_nested_linear4bit, linear4bit_modules, load_base
from stackcheck.harness.proof import require
from stackcheck.harness.subject import UnderTest
from stackcheck.harness.train import TRAINING_IDS, CheckpointingSeen, training_batch
from stackcheck.models import tiny

LORA_SEED = 0


def one_device(args, device: torch.device):
    """`args` (transformers' TrainingArguments, or TRL's configs built on them) as the one-device user's Trainer runs
    them on `device`, the lane's: as on a one-GPU host, or with CUDA_VISIBLE_DEVICES of one GPU. A process that sees
    several GPUs without a distributed launcher makes the Trainer count them all (`n_gpu`) and wrap the model in
    `nn.DataParallel`, multiplying the batch and gathering one loss per GPU (TRL's trainers refuse it), which is the
    one-process multi-GPU scenario of the distributed families (data_parallel_training), not the one-device user's.
    The Trainer narrows the count the same way itself for a model split by a device map (`args._n_gpu = 1`). Proves
    the Trainer counts at most one GPU; returns `args`."""
    if device.type == "cuda":
        _ = args.device  # sets the devices up (and _n_gpu to every GPU the process sees) before the count is narrowed
        args._n_gpu = 1
    require(args.n_gpu <= 1, f"the Trainer sees {args.n_gpu} GPUs")
    return args


def lora_model(under_test: UnderTest, quantized: bool = True, checkpointing: bool | dict | str | None = None, **lora):
    """PEFT's QLoRA recipe on a fresh base (NF4 with double quant, or bf16): `prepare_model_for_kbit_training` with
    gradient checkpointing off (`checkpointing` None) or on (True: reentrant, False: non-reentrant; or the
    `gradient_checkpointing_kwargs` themselves, LEFT_OUT passing none: the libraries' default), then a LoRA of the
    architecture's language targets whose B is random too (`init_lora_weights=False`, so that every LoRA tensor gets a
    gradient at the first step), seeded, in training mode."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    base = load_base(under_test, quantized=quantized)
    if quantized:
        first_nested_linear4bit(base)
    else:
        require(not linear4bit_modules(base), "the bf16 base is quantized")
    kwargs = {"use_reentrant": checkpointing} if isinstance(checkpointing, bool) else None if checkpointing == LEFT_OUT else checkpointing
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=checkpointing is not None, gradient_checkpointing_kwargs=kwargs)
    if checkpointing is not None and not quantized:  # PEFT's recipe checkpoints quantized bases only: as bf16 LoRA users do
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    torch.manual_seed(LORA_SEED)
    model = get_peft_model(base, tiny.lora_config(under_test.arch, "language", **{"init_lora_weights": False, **lora}))
    model.train()
    return model


@dataclass
class Gradients:
    loss: float
    gradients: dict[str, torch.Tensor]  # every LoRA tensor's gradient (zeros where it got none)
    all_layers_checkpointed: bool


def lora_gradients(under_test: UnderTest, quantized: bool = True, checkpointing: bool | dict | str | None = None) -> Gradients:
    """One forward and backward of the fixed training batch: the loss and every LoRA tensor's gradient."""
    model = lora_model(under_test, quantized, checkpointing)
    seen = CheckpointingSeen(model)
    loss = model(**training_batch(under_test.device, model.config)).loss
    loss.backward()
    lora = {name: p for name, p in model.named_parameters() if "lora_" in name}
    require(lora, "the model has no LoRA tensor")
    gradients = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu() for name, p in lora.items()}
    return Gradients(loss.item(), gradients, seen.all())


# Two copies of the training sequence, labelled unevenly: all of it, and only its last four tokens. Their label
# tokens (after the shift that next-token prediction makes) are 11 and 3, so a per-micro-batch mean differs from
# the batch's mean by a factor that no rounding explains.
UNEVEN_LABELS = [list(TRAINING_IDS[0]), [-100] * 8 + list(TRAINING_IDS[0][8:])]


@dataclass
class FirstStep:
    updates: dict[str, torch.Tensor]  # every LoRA tensor's change over the step
    reported_loss: float  # what the Trainer logged for the step
    recomputed_loss: float  # cross entropy of the model before the step, over every label token of the batch
    label_tokens: list[int]  # per sequence, after the shift
    counted_label_tokens: bool  # whether the Trainer counted the batch's label tokens for the loss (num_items_in_batch)


def shifted_label_tokens(labels: list[int]) -> int:
    return sum(label != -100 for label in labels[1:])


def trainer_first_step(under_test: UnderTest, output_dir: Path, batch_size: int, accumulation: int) -> FirstStep:
    """One optimizer step of `transformers.Trainer` on the two unevenly labelled sequences, as `batch_size`
    sequences per micro-batch and `accumulation` micro-batches. Plain SGD at a constant rate, with no clipping and
    no weight decay, so the update is the gradient scaled."""
    from transformers import Trainer, TrainingArguments

    model = lora_model(under_test)
    ids = torch.tensor([TRAINING_IDS[0]] * 2, device=under_test.device)
    labels = torch.tensor(UNEVEN_LABELS, device=under_test.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    per_token = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")
    recomputed = per_token.item() / sum(shifted_label_tokens(row) for row in UNEVEN_LABELS)
    lora = {name: p for name, p in model.named_parameters() if "lora_" in name}
    start = {name: p.detach().clone() for name, p in lora.items()}
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=1, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
        learning_rate=1e-2, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=under_test.device.type == "cpu",
    )
    one_device(args, under_test.device)
    dataset = [{"input_ids": list(TRAINING_IDS[0]), "labels": row} for row in UNEVEN_LABELS]
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    require(trainer.state.global_step == 1, f"the Trainer made {trainer.state.global_step} optimizer steps, not 1")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    require(len(losses) == 1, f"the Trainer logged {len(losses)} step losses, not 1")
    updates = {name: (p.detach() - start[name]).float().cpu() for name, p in lora.items()}
    counted = bool(trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None)
    return FirstStep(updates, losses[0], recomputed, [shifted_label_tokens(row) for row in UNEVEN_LABELS], counted)


def batching_floor(under_test: UnderTest) -> float:
    """What the batch's shape alone does to the LoRA gradient on the lane's device: the largest relative difference
    (over the LoRA tensors) between the gradient of the two unevenly labelled sequences as one batch and as two
    micro-batches of one, both by hand (no Trainer) with the right denominator (every label token of the batch). In
    exact arithmetic it is 0, and on a CPU nearly so (its kernels compute each row alike whatever the batch); a GPU
    picks its matrix-product kernels (tiles, split reductions in bf16) by shape, so the same sums round otherwise.
    The Trainer's accumulation runs these same shapes, so this is how far it may be from one batch without a bug."""
    model = lora_model(under_test)
    lora = {name: p for name, p in model.named_parameters() if "lora_" in name}
    ids = torch.tensor([TRAINING_IDS[0]] * 2, device=under_test.device)
    labels = torch.tensor(UNEVEN_LABELS, device=under_test.device)
    total = sum(shifted_label_tokens(row) for row in UNEVEN_LABELS)

    def backward(rows: slice) -> None:
        logits = model(input_ids=ids[rows]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[rows, 1:].flatten(), ignore_index=-100, reduction="sum")
        (loss / total).backward()

    def gradients() -> dict[str, torch.Tensor]:
        return {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu().clone() for name, p in lora.items()}

    backward(slice(0, 2))
    one_batch = gradients()
    model.zero_grad(set_to_none=True)
    backward(slice(0, 1))
    backward(slice(1, 2))
    accumulated = gradients()
    require(any(g.any() for g in one_batch.values()), "no LoRA tensor got a gradient by hand")
    return max(((accumulated[name] - g).norm() / g.norm()).item() for name, g in one_batch.items() if g.any())
