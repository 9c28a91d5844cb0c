"""The launcher: starts a job as a user starts it, waits for it with a timeout, and reaps every process.

`accelerate launch --config_file fixtures/distributed/<engine>.yaml` (or `torchrun`), each rank running
`python -m stackcheck.distributed.rank`, in a session of its own. A hung rank is asked for its stacks, then the
group is killed; once every rank has an outcome, or one failed and the others did not follow within
TEARDOWN_GRACE_SECONDS, the job is reaped without waiting for torch's agent. Details: docs/internals.md,
"distributed/launcher.py"; the wait it cuts: docs/distributed-two-gpu.md.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.distributed import rank as rank_side
from stackcheck.distributed.outcome import RankOutcome, RankState, torn_down

ENGINES_DIR = REPO_ROOT / "fixtures" / "distributed"
# How long a hung rank gets to write its stacks after the signal.
STACKS_GRACE_SECONDS = 2.0
# How long the other ranks get to write their own outcomes once a rank has failed or died (a rank that fails on its
# own does so within the same step; one still waiting in a collective for the failed rank would wait for minutes).
TEARDOWN_GRACE_SECONDS = 10.0
POLL_SECONDS = 0.1


def engine_config(engine: str, options: dict | None = None, outdir: Path | None = None) -> Path:
    """fixtures/distributed/<engine>.yaml (ddp, fsdp1, fsdp2, zero, zero3, zero3-moe); with `options`, a copy in `outdir`
    with those keys changed, as a user edits the file: a key of the file's `fsdp_config` (or `deepspeed_config`) is
    changed there, any other at the top level. The job's command line names the copy."""
    path = ENGINES_DIR / f"{engine}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in ENGINES_DIR.glob("*.yaml")))
        raise ValueError(f"no accelerate config for engine '{engine}' in {ENGINES_DIR} (engines: {known})")
    if not options:
        return path
    import yaml

    config = yaml.safe_load(path.read_text())
    for key, value in options.items():
        section = next((config[name] for name in ("fsdp_config", "deepspeed_config") if key in config.get(name, {})), config)
        section[key] = value
    edited = outdir / f"{engine}.yaml"
    edited.write_text(f"# {path.relative_to(REPO_ROOT)} with {options}\n" + yaml.safe_dump(config, sort_keys=False))
    return edited


def options_environment(engine: str | None, options: dict | None, world_size: int, env: dict, outdir: Path) -> dict | None:
    """What `engine_options` change in the ranks' environment, where that is all they change: the variables (name ->
    value, None where unset) by which `accelerate launch` with the edited config (written to `outdir`, see
    engine_config) gives its ranks another environment than with the engine's own file, while it starts them alike
    (the same arguments for torch's launcher). {} without options; None where they change more than the environment,
    or accelerate cannot tell (then a cell launches with its edited file as a user does).

    accelerate turns an FSDP or DeepSpeed config into variables (FSDP_STATE_DICT_TYPE, FSDP_USE_ORIG_PARAMS,
    ACCELERATE_DEEPSPEED_ZERO3_INIT, ...) that its Accelerator, FSDP and DeepSpeed plugins and transformers' loader read
    when a script builds them, not when the rank starts: so a warm rank (stackcheck.distributed.pool) given these
    variables for a cell runs it as a rank launched with the edited file. Both environments come from accelerate's
    own launcher code (its argument parser, config validation and the launcher's environment), run here in `env`."""
    if not options:
        return {}
    if engine is None:
        return None
    try:
        base = _launch_environment(engine_config(engine), world_size, env)
        edited = _launch_environment(engine_config(engine, options, outdir), world_size, env)
    except Exception:  # noqa: BLE001 - another accelerate, another launcher: the cell launches as a user does
        return None
    if base is None or edited is None or base[1] != edited[1]:
        return None
    return {name: edited[0].get(name) for name in sorted(set(base[0]) | set(edited[0])) if base[0].get(name) != edited[0].get(name)}


def _launch_environment(config: Path, world_size: int, env: dict) -> tuple[dict, tuple] | None:
    """(the ranks' environment, torch launcher's arguments) that `accelerate launch --config_file CONFIG` gives a
    single-node FSDP or DeepSpeed job of `world_size` ranks in `env`, from accelerate's launcher code (its
    `launch_command` up to the start); None for another kind of launch."""
    import torch.distributed.run as torch_run
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config), "--num_processes", str(world_size),
                                               "--main_process_port", str(JOB_PORTS.start), "-m", rank_side.__name__, "--pool", "-"])
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        args, defaults, precision_from_config = _validate_launch_command(args)
        if args.num_machines != 1 or args.cpu:
            return None
        if args.use_deepspeed:
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            args.deepspeed_fields_from_accelerate_config = ",".join(fields + (["mixed_precision"] if precision_from_config else []))
            _cmd, ranks_env = prepare_deepspeed_cmd_env(args)
        elif args.use_fsdp:
            ranks_env = prepare_multi_gpu_env(args)
        else:
            return None
    finally:
        os.environ.clear()
        os.environ.update(saved)
    started = tuple((action.dest, repr(getattr(args, action.dest, None))) for action in torch_run.get_args_parser()._actions
                    if action.dest != "help")
    return ranks_env, started


# Ports for the jobs' rendezvous, below the kernel's ephemeral range: a port the kernel hands out (port 0) is free only
# until the launcher binds it, and every NCCL or gloo connection of a concurrent job takes ephemeral ports too. On a
# two-GPU host under 22 xdist workers, 3 cells' ranks died at the rendezvous with "address already in use".
JOB_PORTS = range(20000, 32000)  # 60 slices
# Each xdist worker (gwN) draws from a slice of its own, so concurrent jobs of one run never pick the same port.
PORTS_PER_WORKER = 200
# How many times a job is started before a lost port is its outcome.
PORT_ATTEMPTS = 3
_next_port = 0


def ephemeral_ports() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


def free_port() -> int:
    """A port for the job's rendezvous: from this worker's slice of JOB_PORTS outside the ephemeral range, the next one
    that binds now (another run on the host may hold some); the kernel's choice where none does."""
    global _next_port
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    slot = int(worker[2:]) if worker[2:].isdigit() else os.getpid() % 50
    slices = len(JOB_PORTS) // PORTS_PER_WORKER
    start = JOB_PORTS.start + (slot % slices) * PORTS_PER_WORKER
    ephemeral = ephemeral_ports()
    for _ in range(PORTS_PER_WORKER):
        port = start + _next_port % PORTS_PER_WORKER
        _next_port += 1
        if port in ephemeral:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def lost_the_port(outcomes: list[RankOutcome]) -> bool:
    """Whether the job never started its function because its rendezvous port was taken: a rank died without an
    outcome of its own saying so, and every other rank died or stopped with it. Nothing of the cell ran, so a new port may be tried."""
    said = [o for o in outcomes if o.state == RankState.DIED and o.failure is not None
            and "address already in use" in o.failure.message.lower()]
    return bool(said) and all(o.state in (RankState.DIED, RankState.STOPPED) for o in outcomes)


def command(target: str, outdir: Path, world_size: int, engine: str | None, port: int,
            engine_options: dict | None = None, rank_args: list[str] | None = None) -> list[str]:
    """The user's launch line: accelerate launch with the engine's config file (its copy with `engine_options` in
    `outdir`), or torchrun; each rank runs the rank side with `rank_args` (default: TARGET OUTDIR)."""
    rank_program = ["-m", rank_side.__name__, *(rank_args or [target, str(outdir)])]
    if engine is None:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}", f"--master_port={port}", *rank_program]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(engine_config(engine, engine_options, outdir)),
            "--num_processes", str(world_size), "--main_process_port", str(port), *rank_program]


def launch(target: str, outdir: Path, world_size: int = 2, engine: str | None = None, lane: str = "cpu",
           timeout: float = 240.0, kwargs: dict | None = None, engine_options: dict | None = None,
           once=None) -> list[RankOutcome]:
    """Run `target` (MODULE:FUNCTION, called with `kwargs`) on `world_size` ranks, launched with the engine's config
    (changed by `engine_options`, see engine_config); every rank's outcome, by rank. Every process of the job is gone
    when this returns. `once`: what runs one attempt (launch_once, or a warm pool's, stackcheck.distributed.pool)."""
    for _attempt in range(PORT_ATTEMPTS - 1):
        found = (once or launch_once)(target, outdir, world_size, engine, lane, timeout, kwargs, engine_options)
        if not lost_the_port(found):
            return found
        for rank in range(world_size):  # a fresh start: the dead job's files would read as this one's
            for path in (rank_side.outcome_path(outdir, rank), rank_side.log_path(outdir, rank), rank_side.stacks_path(outdir, rank)):
                path.unlink(missing_ok=True)
    return (once or launch_once)(target, outdir, world_size, engine, lane, timeout, kwargs, engine_options)


def launch_once(target: str, outdir: Path, world_size: int, engine: str | None, lane: str, timeout: float,
                kwargs: dict | None, engine_options: dict | None) -> list[RankOutcome]:
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "call.json").write_text(json.dumps(kwargs or {}))
    env = job_environment(lane)
    with (outdir / "launcher.log").open("w") as log:
        job = subprocess.Popen(command(target, outdir, world_size, engine, free_port(), engine_options), cwd=REPO_ROOT, env=env,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            hung_after = wait(job, outdir, world_size, timeout)
            if hung_after is not None:
                dump_stacks(outdir, world_size)
        finally:
            reap(job, outdir, world_size)
    return outcomes(outdir, world_size, hung_after, job.returncode)


def job_environment(lane: str) -> dict:
    """The job's environment: the caller's, the repository on the path, the lane named."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               **{rank_side.LANE_ENV: lane})
    if lane == "cpu":  # the CPU lane's ranks see no GPU even on a GPU host, as the CPU lane's tests keep to the CPU
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def wait(job: subprocess.Popen, outdir: Path, world_size: int, timeout: float) -> float | None:
    """Until the job exits, every rank has written its outcome, or a rank failed or died and the others had
    TEARDOWN_GRACE_SECONDS to write theirs; the timeout when it ran out first (the job hung), else None."""
    started = time.monotonic()
    failed_at = None
    while job.poll() is None:
        now = time.monotonic()
        if now - started >= timeout:
            return timeout
        states = written_states(outdir, world_size)
        if len(states) == world_size:
            return None
        if failed_at is None and {RankState.FAILED, RankState.DIED} & set(states.values()):
            failed_at = now
        if failed_at is not None and now - failed_at >= TEARDOWN_GRACE_SECONDS:
            return None
        time.sleep(POLL_SECONDS)
    return None


def written_states(outdir: Path, world_size: int) -> dict[int, RankState]:
    """The state of every rank that has written its outcome (a file replaced atomically, so never half read)."""
    states = {}
    for rank in range(world_size):
        path = rank_side.outcome_path(outdir, rank)
        if path.exists():
            states[rank] = RankState(json.loads(path.read_text())["state"])
    return states


def outcomes(outdir: Path, world_size: int, hung_after: float | None, returncode: int | None) -> list[RankOutcome]:
    """Every rank's outcome. A rank with no outcome of its own (neither it nor its supervisor wrote one: something
    outside killed both) beside a rank that failed or died was torn down with the job after that failure, as torch's
    agent does: stopped, not dead. Alone, it died. A rank that failed only in a collective whose peer was gone is
    stopped too (outcome.torn_down)."""
    written = {rank: rank_side.outcome_path(outdir, rank).exists() for rank in range(world_size)}
    found = [outcome(outdir, rank, hung_after, returncode) for rank in range(world_size)]
    failed_elsewhere = any(written[o.rank] and o.state in (RankState.FAILED, RankState.DIED) for o in found)
    return torn_down([RankOutcome(o.rank, RankState.STOPPED, stacks=o.stacks)
                      if failed_elsewhere and not written[o.rank] and o.state == RankState.DIED else o for o in found])


def dump_stacks(outdir: Path, world_size: int) -> None:
    """Ask every rank that has not finished for its stacks, and give it a moment to write them."""
    asked = []
    for rank in range(world_size):
        pid_file = rank_side.pid_path(outdir, rank)
        if not rank_side.outcome_path(outdir, rank).exists() and pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), rank_side.STACKS_SIGNAL)
                asked.append(rank)
            except (ProcessLookupError, ValueError):
                pass
    deadline = time.monotonic() + STACKS_GRACE_SECONDS
    while asked and time.monotonic() < deadline and not all(rank_side.read_text(rank_side.stacks_path(outdir, r)) for r in asked):
        time.sleep(0.05)


def reap(job: subprocess.Popen, outdir: Path, world_size: int) -> None:
    """Kill the launcher's session (launcher and agent) first, so that nothing starts another rank, then each
    rank's own group (its supervisor, worker and their children), and collect the launcher."""
    groups = [job.pid]
    for rank in range(world_size):
        group = rank_side.read_text(rank_side.group_path(outdir, rank))
        if group and int(group) != job.pid:
            groups.append(int(group))
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait()


def outcome(outdir: Path, rank: int, hung_after: float | None, returncode: int | None) -> RankOutcome:
    """The rank's own outcome file; else hung (the timeout ran out), else died with the launcher's status."""
    path = rank_side.outcome_path(outdir, rank)
    if path.exists():
        return RankOutcome.from_json(json.loads(path.read_text()))
    stacks = rank_side.read_text(rank_side.stacks_path(outdir, rank))
    if hung_after is not None:
        return RankOutcome(rank, RankState.HUNG, seconds=hung_after, stacks=stacks)
    output = rank_side.read_text(rank_side.log_path(outdir, rank)) or rank_side.read_text(outdir / "launcher.log")
    return RankOutcome(rank, RankState.DIED, rank_side.died_failure(rank, returncode, output), stacks=stacks)
