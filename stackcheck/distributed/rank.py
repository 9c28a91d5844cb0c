"""The rank side: what `accelerate launch` (or torchrun) starts on every rank, and the helpers a rank's function uses.

`python -m stackcheck.distributed.rank MODULE:FUNCTION OUTDIR` is a small supervisor (the standard library only)
that starts the worker, which calls FUNCTION(**OUTDIR/call.json) and writes OUTDIR/rank-N.json; a worker that leaves
no outcome gets one from its exit status and output. `--pool FOLDER` is a warm pool's rank (stackcheck.distributed.pool).
The files, signals and outcomes: docs/internals.md, "distributed/rank.py".
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from stackcheck.process import gpu_wait
from stackcheck.core import protocol
from stackcheck.distributed.outcome import RankOutcome, RankState
from stackcheck.process.isolation import leave_the_cell
from stackcheck.core.ledger import Failure

STACKS_SIGNAL = signal.SIGUSR1
LANE_ENV = protocol.DIST_LANE_ENV
OUTPUT_TAIL_LINES = 20


def rank_index() -> int:
    return int(os.environ.get("RANK", "0"))


def outcome_path(outdir: Path, rank: int) -> Path:
    return outdir / f"rank-{rank}.json"


def pid_path(outdir: Path, rank: int) -> Path:
    return outdir / f"rank-{rank}.pid"


def group_path(outdir: Path, rank: int) -> Path:
    """The rank's process group: torch's elastic agent starts every rank in a session of its own, out of reach
    of a kill of the launcher's."""
    return outdir / f"rank-{rank}.pgid"


def stacks_path(outdir: Path, rank: int) -> Path:
    return outdir / f"rank-{rank}.stacks"


def log_path(outdir: Path, rank: int) -> Path:
    return outdir / f"rank-{rank}.log"


def read_text(path: Path) -> str | None:
    return path.read_text(errors="replace") if path.exists() and path.stat().st_size else None


def tail(text: str | None, lines: int = OUTPUT_TAIL_LINES) -> str:
    return "\n".join((text or "").strip().splitlines()[-lines:])


def died_failure(rank: int, returncode: int, output: str | None) -> Failure:
    """A rank that ended without an outcome, as a Failure the ledger can match: killed by a signal or exited
    with a code, and the tail of its output."""
    if returncode < 0:
        how = f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
    else:
        how = f"exited with code {returncode}"
    message = f"rank {rank} {how} without an outcome\n{tail(output)}".rstrip()
    return Failure("RankDied", ("RankDied",), message, ())


def supervise(target: str, outdir: Path) -> int:
    rank = rank_index()
    group_path(outdir, rank).write_text(str(os.getpgid(0)))
    with log_path(outdir, rank).open("w") as log:
        return _supervise(rank, ["--worker", target, str(outdir)], log, lambda: outdir)


def supervise_pool(folder: Path) -> int:
    """A warm pool's rank (stackcheck.distributed.pool): the same supervision as `supervise`, of a worker that runs
    many cells in turn; a worker that dies or is stopped leaves its outcome in the cell it was running."""
    rank = rank_index()
    group_path(folder, rank).write_text(str(os.getpgid(0)))

    def cell() -> Path | None:
        current = read_text(current_path(folder, rank))
        return Path(current) if current else None

    with log_path(folder, rank).open("w") as log:
        # The worker's command line says --worker, as a launched cell's does (a guard's sitecustomize patches only there).
        return _supervise(rank, ["--worker", "--pool", str(folder)], log, cell, owner=int((folder / OWNER_FILE).read_text()))


def _supervise(rank: int, worker_args: list[str], log, cell, owner: int | None = None) -> int:
    """Start the worker (output to `log`) and wait for it; `cell()` is the folder of the cell it runs (None: none yet).
    With `owner` (a pool's), the worker is killed once that process is gone, even in the middle of a cell."""
    worker = subprocess.Popen([sys.executable, "-m", __spec__.name, *worker_args], stdout=log, stderr=subprocess.STDOUT)

    def stop(signum, _frame):  # the launcher ends the job: end the worker, and say so
        worker.send_signal(signum)
        worker.wait()
        outdir = cell()
        if outdir is not None and not outcome_path(outdir, rank).exists():
            RankOutcome(rank, RankState.STOPPED).write(outcome_path(outdir, rank))
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while owner is not None and worker.poll() is None:
        if not alive(owner):
            worker.kill()
        time.sleep(OWNER_POLL_SECONDS)
    returncode = worker.wait()
    outdir = cell()
    if outdir is not None and not outcome_path(outdir, rank).exists():
        failure = died_failure(rank, returncode, read_text(log_path(outdir, rank)))
        RankOutcome(rank, RankState.DIED, failure, stacks=read_text(stacks_path(outdir, rank))).write(outcome_path(outdir, rank))
    return returncode


def work(target: str, outdir: Path) -> int:
    gpu_wait.follow_the_worker()
    rank = rank_index()
    pid_path(outdir, rank).write_text(str(os.getpid()))
    _stacks = watch_for_stacks(outdir, rank)  # noqa: F841 - kept open for faulthandler
    try:
        found = call(target, outdir, rank)
        if found.state == RankState.FAILED:
            found.write(outcome_path(outdir, rank))
    finally:
        _leave_process_group()
    if found.state == RankState.PASSED:
        found.write(outcome_path(outdir, rank))
    return 0 if found.state == RankState.PASSED else 1


def watch_for_stacks(outdir: Path, rank: int):
    """Every thread's stack to OUTDIR/rank-N.stacks on a fatal signal or the launcher's SIGUSR1; the open file."""
    stacks = stacks_path(outdir, rank).open("w")
    faulthandler.enable(file=stacks, all_threads=True)
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)
    return stacks


def call(target: str, outdir: Path, rank: int) -> RankOutcome:
    """FUNCTION(**OUTDIR/call.json): passed with what it returned, or failed with the ledger's Failure of its exception."""
    module_name, _, function_name = target.partition(":")
    kwargs = json.loads((outdir / "call.json").read_text())
    try:
        keep_deepspeed_from_building_its_cpu_shm_op()
        result = getattr(importlib.import_module(module_name), function_name)(**kwargs)
    except Exception as exc:  # noqa: BLE001 - every exception of the rank's function is its outcome
        return RankOutcome(rank, RankState.FAILED, Failure.raised_outside_pytest(exc))
    return RankOutcome(rank, RankState.PASSED, result=result)


# A warm pool's worker (stackcheck.distributed.pool): the launcher hands it cells as files in the pool's folder.

def current_path(folder: Path, rank: int) -> Path:
    """The folder of the cell the pool's rank runs (or ran last), for its supervisor."""
    return folder / f"rank-{rank}.cell"


def job_path(folder: Path, index: int) -> Path:
    return folder / f"job-{index}.json"


OWNER_FILE = "owner.pid"
JOB_POLL_SECONDS = 0.01
OWNER_POLL_SECONDS = 1.0


def keep_path(folder: Path, index: int) -> Path:
    """Written by the launcher when every rank of the pool's index-th cell failed on its own: the pool stays."""
    return folder / f"keep-{index}"


def fence_path(folder: Path, index: int, rank: int) -> Path:
    """A rank's answer after a kept cell: whether its process group still pairs every rank's collectives."""
    return folder / f"fence-{index}-rank-{rank}.json"


def next_job(folder: Path, index: int) -> dict | None:
    """The pool's index-th cell ({"target", "outdir"}), once the launcher has written it; None once the process that
    owns the pool is gone (a crashed or interrupted pytest), or the pool's folder is."""
    path = job_path(folder, index)
    return json.loads(path.read_text()) if wait_for(path, folder) else None


def wait_for(path: Path, folder: Path) -> bool:
    """Whether `path` appeared before the pool's owner or its folder went."""
    owner = int((folder / OWNER_FILE).read_text())
    checked = time.monotonic()
    while not path.exists():
        if time.monotonic() - checked >= OWNER_POLL_SECONDS:
            checked = time.monotonic()
            if not alive(owner) or not folder.is_dir():
                return False
        time.sleep(JOB_POLL_SECONDS)
    return True


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pool_work(folder: Path) -> int:
    """Run the pool's cells in turn, each as `work` runs one (its call.json, outcome, pid, log and stacks files in the
    cell's folder), keeping the process group and the imported modules between them. After a cell, `leave_the_cell`
    resets what a cell leaves behind. A cell whose function raised here waits for the launcher: where every rank
    raised on its own, it keeps the pool (keep_path) once each rank's `fence` found the process group whole; else it
    ends the pool, as a launched job ends after a failed rank."""
    gpu_wait.follow_the_worker()
    rank = rank_index()
    environ, cwd = dict(os.environ), os.getcwd()
    index = 0
    while (job := next_job(folder, index)) is not None:
        outdir = Path(job["outdir"])
        current_path(folder, rank).write_text(str(outdir))
        sys.stdout.flush(), sys.stderr.flush()
        with log_path(outdir, rank).open("w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        pid_path(outdir, rank).write_text(str(os.getpid()))
        group_path(outdir, rank).write_text(str(os.getpgid(0)))
        _stacks = watch_for_stacks(outdir, rank)  # noqa: F841 - kept open for faulthandler
        for name, value in job.get("environment", {}).items():  # what the cell's engine options change (leave_the_cell restores)
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        found = call(job["target"], outdir, rank)
        if found.state != RankState.PASSED:
            found.write(outcome_path(outdir, rank))
            if not wait_for(keep_path(folder, index), folder):
                _leave_process_group()
                return 1
            leave_the_cell(environ, cwd)
            if not fence(folder, index, rank):
                return 1
            index += 1
            continue
        leave_the_cell(environ, cwd)
        sys.stdout.flush(), sys.stderr.flush()
        found.write(outcome_path(outdir, rank))
        index += 1
    _leave_process_group()
    return 0


def fence(folder: Path, index: int, rank: int) -> bool:
    """After the pool's index-th cell failed on every rank: one collective over the process group the cell left, each
    rank's (rank, index) gathered on every rank. A group whose ranks are out of step (one issued a collective the other
    never matched) gathers something else, raises or hangs (the launcher waits for this answer only so long, then ends
    the pool). Written to fence_path: whether the group gathered exactly every rank's pair. A rank whose cell never
    started a process group has nothing to check."""
    whole, why = True, None
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        import torch

        try:
            cuda = "nccl" in str(distributed.get_backend()) and torch.cuda.is_available()
            place = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
            size = distributed.get_world_size()
            mine = torch.tensor([rank, index], dtype=torch.int64, device=place)
            gathered = [torch.zeros(2, dtype=torch.int64, device=place) for _ in range(size)]
            distributed.all_gather(gathered, mine)
            pairs = [pair.tolist() for pair in gathered]
            whole = pairs == [[each, index] for each in range(size)]
            why = None if whole else f"gathered {pairs}"
        except Exception as exc:  # noqa: BLE001 - any failure of the collective means the group is not whole
            whole, why = False, f"{type(exc).__name__}: {exc}"
    path = fence_path(folder, index, rank)
    scratch = path.with_name(f".{path.name}.tmp")
    scratch.write_text(json.dumps({"whole": whole, "why": why}))
    scratch.replace(path)
    return whole


def _leave_process_group() -> None:
    """Destroy the process group the rank's function joined, if it did: a clean exit, no warning at shutdown."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()


# DeepSpeed's shared-memory all-reduce, the one op its CPU accelerator compiles at `init_distributed`.
DEEPSPEED_CPU_SHM_OP = "deepspeed_shm_comm"


def keep_deepspeed_from_building_its_cpu_shm_op() -> None:
    """On the CPU lane, in a DeepSpeed launch: mark DeepSpeed's CPU shared-memory all-reduce op as not buildable, so
    that its `TorchBackend` (every `init_distributed`: accelerate's, the Trainer's) does not compile it.

    Why: DeepSpeed's CPU accelerator JIT-compiles that op (`build_shm_op`, deepspeed/comm/torch.py; C++ with OpenMP,
    into ~/.cache/torch_extensions) the first time a process group starts, whatever the job. On a loaded 2-core machine
    its shm.cpp alone took 3 min 21 s to compile (the build folder's timestamps), longer than a job's 180 s timeout; and
    a build killed there leaves torch's `lock` file behind, on which every later DeepSpeed CPU job of the machine waits forever (`FileBaton.wait`: every
    ZeRO-3 CPU cell then reads hung). What the op does: `inference_all_reduce`, which only DeepSpeed's inference and
    AutoTP layers call (deepspeed/module_inject/layers.py); ZeRO-3 training never does. DeepSpeed's own switch is the
    dict of buildable ops it reads there (`deepspeed.ops.__compatible_ops__`), probed once per process: `False` makes
    `build_shm_op` return None, the path of a platform without the op. The GPU lane is left alone: the CUDA accelerator
    has no such op, so on a GPU DeepSpeed never builds it (this makes the CPU lane take the GPU's path)."""
    if lane() != "cpu" or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return
    try:
        import deepspeed.ops
    except ImportError:
        return
    deepspeed.ops.__compatible_ops__[DEEPSPEED_CPU_SHM_OP] = False


# The rank's function's side.

def lane() -> str:
    return os.environ.get(LANE_ENV, "cpu")


def device():
    """This rank's device: the CPU on the CPU lane, its own GPU (LOCAL_RANK) on the GPU lane."""
    import torch

    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if lane() == "gpu" else torch.device("cpu")


def accelerator():
    """The `Accelerator` the launch's config file describes (accelerate launch passes it on as ACCELERATE_* and
    FSDP_* variables), on the lane's device.

    On the CPU, accelerate (1.13 to 1.15) turns an FSDP launch into MULTI_CPU, which `prepare` wraps in DDP:
    AcceleratorState sets FSDP only for accelerator devices. So on the CPU lane the rank gives the state what
    accelerate gives it on a GPU host, the FSDP plugin built from the same FSDP_* variables; `prepare` then runs
    accelerate's own FSDP preparation over gloo. Measured: with this, `prepare` gives an FSDPModule on seed and
    latest; without it, DistributedDataParallel. The state's device is the rank's as the model names it (`cpu`,
    not accelerate's `cpu:0`): FSDP1 refuses the pair (`Inconsistent compute device and device_id`)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    on_cpu = lane() == "cpu"
    # DeepSpeed has a CPU accelerator of its own: accelerate keeps a DeepSpeed launch on the CPU unless told `cpu`.
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    accelerator = Accelerator(cpu=on_cpu and not deepspeed)
    if on_cpu and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and accelerator.distributed_type == DistributedType.MULTI_CPU:
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
        accelerator.state.device = device()
    return accelerator


def assert_matches_one_process(engine: str, losses: list[float], single_losses: list[float], weights: dict,
                               single_weights: dict, tolerance: float) -> dict:
    """The end-to-end check of a sharded run: its losses and every LoRA weight (gathered, by name) against the same
    recipe in one process; what the rank returns for the cell."""
    from stackcheck.harness import scenario

    scenario.require(weights.keys() == single_weights.keys(), "the sharded model has other LoRA weights")
    loss_difference = max(abs(a - b) for a, b in zip(losses, single_losses))
    weight_difference = max(scenario.relative_error(weights[name], single_weights[name]) for name in weights)
    scenario.assert_within(f"{engine} losses differ from one process's by", loss_difference, tolerance)
    scenario.assert_within(f"{engine} LoRA weights differ from one process's: worst relative error", weight_difference, tolerance)
    return {"losses": losses, "single_process_losses": single_losses, "worst_lora_relative_error": weight_difference}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--pool"]:
        return supervise_pool(Path(argv[1]))
    if argv[:2] == ["--worker", "--pool"]:
        return pool_work(Path(argv[2]))
    worker = argv[:1] == ["--worker"]
    target, outdir = argv[1:] if worker else argv
    return (work if worker else supervise)(target, Path(outdir))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
