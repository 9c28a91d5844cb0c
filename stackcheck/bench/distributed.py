"""The bench's distributed training case: QLoRA optimizer steps under FSDP2 and DeepSpeed ZeRO-3 at world sizes 1 and
2, launched as users launch them (stackcheck.distributed.launcher), on Llama 3.2 1B, measured on every rank: tokens/s
of the job, peak and resting memory, and what each rank holds beside the user's and the engine's arithmetic
(stackcheck.distributed.memory). The recipes are the distributed families' (stackcheck.distributed.recipes).

Why this model, batch and measure: docs/internals.md, "bench/distributed.py"; the results: docs/bench.md.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.distributed.memory import expected_on_rank, held_by_part, is_sharded, users_arithmetic, weight_parts

# The cases: (launch config, bnb_4bit_quant_storage). FSDP2 in bitsandbytes' default uint8 storage (the FSDP-QLoRA
# recipe as most users first write it), FSDP2 in bf16 storage (the memory recipe: accelerate >= 1.14 leaves uint8 4-bit
# weights out of FSDP2's sharding, accelerate#3987, and bf16 storage lets it shard them), ZeRO-3 in bf16 (the PEFT guide).
CASES = {"fsdp2": ("fsdp2", "uint8"), "fsdp2_bf16": ("fsdp2", "bfloat16"), "zero3": ("zero3", "bfloat16")}
ENGINES = tuple(CASES)
# The smoke run (CI, two gloo ranks on 2 cores, about 30 s a job) launches one job per engine, not per case.
SMOKE_ENGINES = ("fsdp2", "zero3")
WORLD_SIZES = (1, 2)
# The bench's model comes from the repository's own fixture, not stackcheck.models.tiny.FIXTURES_DIR: a harness test
# points that at a folder holding only the seed's fixtures to run the bench's smoke mode on a shrunk realistic model.
ARCHITECTURE_FILE = REPO_ROOT / "fixtures" / "architectures" / "llama3.json"
REALISTIC_NAME = "llama3-1b"
MODELS = {"tiny": "tiny Llama 3 (llama3.json shrunk)", "realistic": "Llama 3.2 1B (llama3.json)"}
# Seconds a launched job may run before its ranks count as hung: a realistic job loads and quantizes 1.2B parameters
# on every rank and takes a few dozen steps of hundreds of milliseconds.
TIMEOUTS = {"tiny": 180.0, "realistic": 600.0}
# What a cell's test may take beyond its job (pytest's `timeout` is 300 s): a first build of the realistic checkpoint,
# random init of 1.2B parameters on the GPU and 2.5 GB of safetensors written.
BUILD_SECONDS = 300.0
RANK_FUNCTION = f"{__name__}:train_rank"


@dataclass(frozen=True)
class Profile:
    rows: int  # sequences in each rank's micro batch
    sequence: int  # tokens per sequence
    warmup: int  # untimed steps
    steps: int  # timed steps


PROFILES = {
    ("tiny", False): Profile(rows=4, sequence=256, warmup=2, steps=10),
    ("realistic", False): Profile(rows=4, sequence=2048, warmup=3, steps=10),
    # The smoke run exercises the launch and the recording, on the CPU in CI: about the families' 12 tokens.
    ("tiny", True): Profile(rows=2, sequence=8, warmup=1, steps=2),
}


def sizes(bench_sizes: list[str], smoke: bool) -> list[str]:
    """The sizes the distributed case runs: the bench's, and in smoke mode only the tiny one (a 1.2B model over gloo
    on a CI machine's cores is no smoke test)."""
    return [size for size in bench_sizes if (size, smoke) in PROFILES]


def architecture(size: str):
    """The Llama 3.2 1B fixture: shrunk as the built-in `llama3` (the same Architecture, so the same tiny checkpoint)
    for the tiny size, whole for the realistic one."""
    from stackcheck.models import architectures

    written = json.loads(ARCHITECTURE_FILE.read_text())
    source = str(ARCHITECTURE_FILE.relative_to(REPO_ROOT))
    declared = written.get("_structures", ())
    if size == "tiny":
        return architectures.Architecture("llama3", source, architectures.shrink(written, ARCHITECTURE_FILE.name), declared)
    full = {key: value for key, value in written.items() if not key.startswith("_")}
    return architectures.Architecture(REALISTIC_NAME, source, full, declared)


def build_checkpoint(size: str, device) -> Path:
    """The size's bf16 checkpoint, built once (tiny.base_checkpoint's cache) with its random init on `device`, before
    any rank reads it; the build's memory goes back to the device."""
    import torch

    from stackcheck.models import tiny

    with torch.device(device):
        checkpoint = tiny.base_checkpoint(architecture(size))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return checkpoint


def not_measured_reason(world_size: int, lane: str, gpus: int) -> str | None:
    """Why a world size cannot run here: the CPU lane runs its gloo ranks only, the GPU lane needs a GPU a rank."""
    from stackcheck.distributed.cells import CPU_WORLD_SIZE

    if lane == "cpu" and world_size != CPU_WORLD_SIZE:
        return f"the CPU lane runs {CPU_WORLD_SIZE} ranks over gloo"
    if lane == "gpu" and gpus < world_size:
        return f"{gpus} GPU{'s' if gpus != 1 else ''}"
    return None


def measure(size: str, engine: str, world_size: int, smoke: bool, device, workdir: Path) -> dict:
    """One cell of the case: the job launched on `world_size` ranks of the lane `device` names, every rank's numbers;
    or why it was not measured: the world size cannot run on this host, or the job failed (`failed`, with every
    failing rank's signature, so that the report and the gate say which failure left the cell empty)."""
    import torch

    from stackcheck.distributed import launcher
    from stackcheck.distributed.outcome import RankState, RanksFailed

    lane = "gpu" if device.type == "cuda" else "cpu"
    record = {"size": size, "engine": engine, "world_size": world_size, "lane": lane}
    reason = not_measured_reason(world_size, lane, torch.cuda.device_count())
    if reason:
        return {**record, "not_measured": reason}
    build_checkpoint(size, device)
    profile = PROFILES[size, smoke]
    outcomes = launcher.launch(RANK_FUNCTION, workdir, world_size, CASES[engine][0], lane, TIMEOUTS[size],
                               {"size": size, "engine": engine, **asdict(profile)})
    if any(outcome.state != RankState.PASSED for outcome in outcomes):
        return {**record, "not_measured": f"the job failed: {RanksFailed(outcomes)}", "failed": True}
    return {**record, "model": MODELS[size], **asdict(profile),
            "ranks": [outcome.result for outcome in outcomes]}


# --- the rank's side --------------------------------------------------------------------------------


def train_rank(size: str, engine: str, rows: int, sequence: int, warmup: int, steps: int) -> dict:
    """On every rank: the engine's QLoRA recipe loaded and prepared, `warmup` steps, then `steps` timed ones."""
    import torch

    from stackcheck.harness import scenario
    from stackcheck.bench.harness import synchronize
    from stackcheck.distributed import rank as rank_side

    device = rank_side.device()
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.set_device(device)  # the allocator's statistics exist once the rank's device is current
        torch.cuda.reset_peak_memory_stats(device)
    under_test = scenario.UnderTest(architecture(size), device)
    accelerator, model, optimizer, parts = _prepared(engine, under_test, rows)
    # The process group's, not accelerate's: on the CPU, accelerate counts one process under DeepSpeed (zero3.yaml).
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    memory = {}
    if on_gpu:
        memory = {"allocated_after_prepare_bytes": torch.cuda.memory_allocated(device),
                  "peak_allocated_load_prepare_bytes": torch.cuda.max_memory_allocated(device)}

    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, _unwrapped(model, engine).config.vocab_size, (rows, sequence), generator=generator).to(device)
    batch = {"input_ids": ids, "labels": ids}

    half = {key: value[: rows // 2] for key, value in batch.items()}
    losses = []

    def step(inputs: dict) -> None:
        optimizer.zero_grad()
        loss = model(**inputs).loss
        accelerator.backward(loss)  # ZeRO-3: the engine's backward and step; the optimizer's wrapper steps nothing
        optimizer.step()
        losses.append(loss.detach())

    def timed(inputs: dict, untimed: int) -> list[float]:
        for _ in range(untimed):
            step(inputs)
        synchronize(device)
        torch.distributed.barrier()
        seconds = []
        for _ in range(steps):
            started = time.perf_counter()
            step(inputs)
            synchronize(device)
            seconds.append(time.perf_counter() - started)
        return seconds

    for _ in range(warmup):
        step(batch)
    synchronize(device)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(batch, 0)
    if on_gpu:
        memory["peak_allocated_steps_bytes"] = torch.cuda.max_memory_allocated(device)
    # The check that the GPU, not the host, sets the speed: half the batch, the same kernels launched. A GPU-bound
    # step takes about half as long (ratio 0.5), a host-bound one about as long (ratio 1).
    half_seconds = timed(half, 1)

    sharded = {name for name, param in _unwrapped(model, engine).named_parameters() if is_sharded(param)}
    expected = expected_on_rank(parts, sharded, world_size)
    users = users_arithmetic(parts, world_size)
    held = held_by_part(_unwrapped(model, engine), parts)
    return {"rank": rank, "world_size": world_size, "device": str(device),
            "tokens_per_step": rows * sequence, "step_seconds": seconds,
            "job_tokens_per_s": rows * sequence * world_size / statistics.median(seconds),
            "half_batch_step_seconds": half_seconds,
            "half_batch_time_ratio": statistics.median(half_seconds) / statistics.median(seconds),
            "losses": [float(loss) for loss in losses], **memory,
            "arithmetic": expected, "expected_on_rank_bytes": sum(part["on_rank_bytes"] for part in expected.values()),
            "users_arithmetic": users, "users_expected_on_rank_bytes": sum(part["on_rank_bytes"] for part in users.values()),
            "held_by_part": held, "held_bytes": sum(held.values())}


def _prepared(engine: str, under_test, rows: int):
    """(accelerator, model, optimizer, weight_parts before sharding) of the engine's family recipe, prepared, with the
    family's precondition proven: an FSDP2 module, or accelerate's state at DeepSpeed stage 3."""
    import torch

    from stackcheck.harness import scenario
    from stackcheck.distributed import rank as rank_side, recipes

    if CASES[engine][0] == "fsdp2":
        from torch.distributed.fsdp import FSDPModule

        accelerator = rank_side.accelerator()
        model = recipes.fsdp_qlora_model(under_test, quant_storage=getattr(torch, CASES[engine][1]))
        optimizer = recipes.optimizer_for(model)
        parts = weight_parts(model)
        model, optimizer = accelerator.prepare(model, optimizer)
        scenario.require(isinstance(model, FSDPModule), f"prepare gave {type(model).__name__}, not an FSDP2 module")
        return accelerator, model, optimizer, parts
    accelerator = recipes.deepspeed_stage3_accelerator()  # before the load: bitsandbytes loads onto the rank's GPU
    model = recipes.zero3_qlora_model(under_test)
    parts = weight_parts(model)
    # One micro batch of `rows` sequences: what ZeRO's "auto" micro batch size is filled from.
    loader = torch.utils.data.DataLoader([{"input_ids": torch.zeros(1, dtype=torch.long)}] * rows, batch_size=rows)
    model, optimizer, _ = accelerator.prepare(model, recipes.optimizer_for(model), loader)
    return accelerator, model, optimizer, parts


def _unwrapped(model, engine: str):
    """The model whose parameter names are weight_parts's: ZeRO-3's engine wraps it, FSDP2 shards it in place."""
    return model.module if CASES[engine][0] == "zero3" else model
