"""Checkpoint: a QLoRA run through transformers' Trainer that saves checkpoints, what it did at each step, and its
resumption from a checkpoint in another process (`resume_in_fresh_process`, or a warm resume process,
stackcheck.process.resume); a failure there is judged by what raised there. Both processes build the same run
(`qlora_trainer`), whose `Recorder` copies what a resume must restore. Free of pytest fixtures (the distributed
contract reuses it). The run and what it records: docs/internals.md, "harness/checkpoint.py".
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stackcheck import REPO_ROOT
from stackcheck.core.ledger import Failure
from stackcheck.process import resume as resume_process
from stackcheck.harness.load import first_nested_linear4bit
from stackcheck.harness.subject import UnderTest
from stackcheck.harness.train import TRAINING_IDS, kbit_lora_model, load_base_in, lora_parameters
from stackcheck.harness.trainer import one_device

MAX_STEPS = 4
SAVE_STEPS = 2  # the checkpoint a resume starts from: checkpoint-2
LEARNING_RATE = 1e-2
SEED = 42
# Dropout makes the RNG state part of what a resume restores; not on a mixture of experts, whose fused-expert LoRA
# (PEFT's ParamWrapper) refuses it. With an 8-bit optimizer, rank 64: bitsandbytes keeps the state of tensors of 4096
# elements and more in 8 bits (rank 64 x hidden 128), so the run saves and loads 8-bit state; rank 4 (the adapter
# fixtures') otherwise, which is cheaper.
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1}
LORA_8BIT_STATE = {"r": 64, "lora_alpha": 128}
# What the Trainer writes into a checkpoint of a PEFT model, and what a resume reads back.
CHECKPOINT_FILES = {"adapter": "adapter_model.safetensors", "optimizer": "optimizer.pt", "scheduler": "scheduler.pt",
                    "RNG state": "rng_state.pth", "trainer state": "trainer_state.json"}
RESUME_TIMEOUT = 240.0


def training_samples() -> list[dict[str, list[int]]]:
    """MAX_STEPS distinct samples (rotations of the fixed training sequence, its tokens only), their own labels."""
    ids = TRAINING_IDS[0]
    rotations = [ids[k:] + ids[:k] for k in range(0, MAX_STEPS * 3, 3)]
    return [{"input_ids": r, "labels": r} for r in rotations]


@dataclass
class Record:
    """What a Trainer run did, copied as it ran (tensors on the CPU, in fp32)."""

    begin_step: int = -1
    begin_adapter: dict[str, torch.Tensor] = field(default_factory=dict)
    begin_optimizer: dict = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)  # by the step it trained (1-based)
    adapters: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # after each step
    end_optimizer: dict = field(default_factory=dict)

    def save(self, path: Path) -> None:
        torch.save(dataclasses.asdict(self), path)

    @classmethod
    def load(cls, path: Path) -> Record:
        return cls(**torch.load(path, weights_only=True))


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def adapter_copy(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().cpu().clone() for name, p in lora_parameters(model).items()}


def make_recorder(model, record: Record):
    """A TrainerCallback filling `record`, and a forward hook on `model` for the losses (removed at train end)."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.handle = model.register_forward_hook(self.loss_seen)
            self.step = 0

        def loss_seen(self, module, args, output):
            if module.training and getattr(output, "loss", None) is not None:
                record.losses[self.step + 1] = output.loss.item()

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            record.begin_step = self.step = state.global_step
            record.begin_adapter = adapter_copy(model)
            record.begin_optimizer = _copy(optimizer.state_dict()) if optimizer is not None else {}

        def on_step_end(self, args, state, control, **kwargs):
            self.step = state.global_step
            record.adapters[state.global_step] = adapter_copy(model)

        def on_train_end(self, args, state, control, optimizer=None, **kwargs):
            self.handle.remove()
            record.end_optimizer = _copy(optimizer.state_dict()) if optimizer is not None else {}

    return Recorder()


def qlora_trainer(under_test: UnderTest, output_dir: Path, optim: str):
    """The run: the bf16 4-bit base, PEFT's QLoRA recipe (no checkpointing) with LORA, the Trainer with `optim`
    (its name for the optimizer: `adamw_torch`, `paged_adamw_8bit`), saving every SAVE_STEPS steps. The Trainer and the
    Record its callback fills."""
    from transformers import Trainer, TrainingArguments

    base = load_base_in(under_test, torch.bfloat16)
    first_nested_linear4bit(base)
    lora = LORA | (LORA_8BIT_STATE if "8bit" in optim else {})
    if "experts" in under_test.structures:  # PEFT's LoRA on fused experts (ParamWrapper) refuses dropout
        lora["lora_dropout"] = 0.0
    model = kbit_lora_model(under_test, base, use_reentrant=None, **lora)
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=MAX_STEPS, per_device_train_batch_size=1, learning_rate=LEARNING_RATE,
        optim=optim, logging_steps=1, save_strategy="steps", save_steps=SAVE_STEPS, seed=SEED, report_to="none",
        use_cpu=under_test.device.type == "cpu", dataloader_num_workers=0,
    )
    one_device(args, under_test.device)  # the fresh process too: it sees the GPUs this one sees
    record = Record()
    trainer = Trainer(model=model, args=args, train_dataset=training_samples(), callbacks=[make_recorder(model, record)])
    return trainer, record


def checkpoint_dir(output_dir: Path, step: int = SAVE_STEPS) -> Path:
    return output_dir / f"checkpoint-{step}"


def missing_checkpoint_files(checkpoint: Path) -> list[str]:
    return [what for what, name in CHECKPOINT_FILES.items() if not (checkpoint / name).is_file()]


def saved_step(checkpoint: Path) -> int | None:
    """The global step the checkpoint's trainer state says it was saved at (None without one)."""
    path = checkpoint / CHECKPOINT_FILES["trainer state"]
    return json.loads(path.read_text())["global_step"] if path.is_file() else None


def run_uninterrupted(under_test: UnderTest, output_dir: Path, optim: str) -> Record:
    """MAX_STEPS steps in this process, saving checkpoints on the way."""
    trainer, record = qlora_trainer(under_test, output_dir, optim)
    trainer.train()
    return record


def resume(under_test: UnderTest, checkpoint: Path, output_dir: Path, optim: str) -> Record:
    """`trainer.train(resume_from_checkpoint=...)` on a freshly built run, in this process."""
    trainer, record = qlora_trainer(under_test, output_dir, optim)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return record


class ResumeFailed(RuntimeError):
    """The fresh process did not finish its resume: its output's tail says why, and where it raised, the first line
    names its exception and `child_failure` is the Failure it wrote of it (what the ledger judges the cell by)."""

    def __init__(self, message: str, child_failure: Failure | None = None):
        super().__init__(message)
        self.child_failure = child_failure


def resume_call(under_test: UnderTest, checkpoint: Path, output_dir: Path, optim: str) -> Path:
    """OUTPUT_DIR/resume.json: what the fresh process resumes (the architecture by its fields, a user's config.json
    included), and where it writes its Record, or the Failure of its exception (none left from an earlier call)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    arch = under_test.arch
    fields = dataclasses.asdict(arch) | {"declared": None if arch.declared is None else sorted(arch.declared)}
    call = output_dir / "resume.json"
    (output_dir / "failure.json").unlink(missing_ok=True)
    call.write_text(json.dumps({"architecture": fields, "device": str(under_test.device), "checkpoint": str(checkpoint),
                                "output_dir": str(output_dir), "optim": optim, "record": str(output_dir / "record.pt"),
                                "failure": str(output_dir / "failure.json")}))
    return call


def resume_failed(call: Path, returncode: int, output: str) -> ResumeFailed:
    """The fresh process of `call` ended with `returncode` before its Record: the tail of its output, and where it
    raised (a process killed by a signal writes nothing), its exception's signature and Failure."""
    tail = "\n".join(output.strip().splitlines()[-25:])
    written = Path(json.loads(call.read_text())["failure"])
    failure = Failure.from_json(json.loads(written.read_text())) if written.is_file() else None
    raised = f" {failure.signature()}" if failure is not None else ""
    return ResumeFailed(f"the resuming process exited with {returncode}:{raised}\n{tail}", failure)


def resume_in_fresh_process(under_test: UnderTest, checkpoint: Path, output_dir: Path, optim: str,
                            timeout: float = RESUME_TIMEOUT) -> Record:
    """`resume` in another process of this interpreter (the user's second `python train.py --resume`), which rebuilds
    the architecture from its fields (a user's config.json included): a new one per call, or with the warm processes
    on (the matrix commands), the worker's warm resume process (stackcheck.process.resume), which never trains.
    Its Record."""
    call = resume_call(under_test, checkpoint, output_dir, optim)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    if resume_process.enabled():
        returncode, output = resume_process.resume(f"{__name__}:resume_from_call", call, env, timeout)
    else:
        done = subprocess.run([sys.executable, "-m", __name__, str(call)], cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
        returncode, output = done.returncode, done.stdout + done.stderr
    if returncode != 0:
        raise resume_failed(call, returncode, output)
    return Record.load(output_dir / "record.pt")


def resume_from_call(path: Path) -> None:
    """The resume `path` (resume_call's file) asks for, its Record written where the call says; where it raises, the
    ledger's Failure of its exception written first (for the test's process to be judged by), then raised."""
    from stackcheck.models.architectures import Architecture

    call = json.loads(path.read_text())
    under_test = UnderTest(Architecture(**call["architecture"]), torch.device(call["device"]))
    try:
        record = resume(under_test, Path(call["checkpoint"]), Path(call["output_dir"]), call["optim"])
    except Exception as exc:
        Path(call["failure"]).write_text(json.dumps(Failure.raised_outside_pytest(exc).to_json()))
        raise
    record.save(Path(call["record"]))


def main(argv: list[str]) -> int:
    import warnings

    from stackcheck.process import gpu_wait

    gpu_wait.follow_the_worker()
    warnings.filterwarnings("ignore")
    resume_from_call(Path(argv[0]))  # the traceback of what it raises goes to stderr
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
