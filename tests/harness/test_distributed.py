"""The distributed lane's harness on tiny rank functions (no model): real jobs under torchrun and accelerate launch,
two ranks on the CPU, in seconds. A rank that raises, hangs, segfaults or exits; every rank passing over gloo; the
combination of the ranks' verdicts; and a family cell judged rank by rank through the plugin."""

import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path


from stackcheck import REPO_ROOT
from stackcheck.distributed import launcher
from stackcheck.distributed.outcome import RankOutcome, RankState, combine, judge_rank, judge_ranks, torn_down
from stackcheck.core.ledger import ERROR, FIXED, KNOWN_BUG, NEW_FAILURE, PASS, Failure, Judgement

HERE = "tests.harness.test_distributed"
# The hung rank must have started (its stacks are asked of it) and rank 0 finished before the launcher's timeout, which
# runs from the launch: rank 0's outcome came 8.8 s after the launch on 2 cores under a load of 6, 8 to 12 s under a
# load of 8 to 10, and not within 20 s under a load of 17 (rank 0 read `hung`). 30 s: the whole test is the timeout, and
# 60 s made it CI's second longest test for nothing it proves.
HANG_TIMEOUT = 30.0


def this_rank() -> int:
    return int(os.environ["RANK"])


RANK_ZERO_WAIT = 120.0


def after_rank_zero(job: str) -> None:
    """Rank 1 fails only once rank 0 has its outcome on disk: a rank that fails tears the job down (torch's agent
    stops the others), so on a slow machine a rank 1 that fails at once leaves rank 0 `stopped`, not `passed`."""
    deadline = time.monotonic() + RANK_ZERO_WAIT
    while not (Path(job) / "rank-0.json").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 left no outcome in {RANK_ZERO_WAIT:.0f} s")
        time.sleep(0.05)


def job_of(tmp_path) -> dict:
    """The job folder of a test's launch (launcher.launch's outdir), for `after_rank_zero` on its ranks."""
    return {"job": str(tmp_path / "job")}


# The rank functions (run by stackcheck.distributed.rank on every rank).

def rank_all_reduce() -> dict:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([this_rank() + 1])
    dist.all_reduce(total)
    return {"sum": total.item(), "world_size": dist.get_world_size()}


def rank_one_raises(job: str) -> dict:
    if this_rank() == 1:
        after_rank_zero(job)
        raise RuntimeError("rank one's own error")
    return {}


def rank_one_hangs(job: str) -> dict:
    if this_rank() == 1:
        after_rank_zero(job)
        while True:
            time.sleep(0.1)
    return {}


def rank_one_raises_rank_zero_waits() -> dict:
    """Rank 0 as it waits in a collective for a peer that failed: it would wait for minutes."""
    if this_rank() == 1:
        raise RuntimeError("rank one's own error")
    time.sleep(120)
    return {}


def rank_one_raises_rank_zero_in_a_collective() -> dict:
    """Rank 0 waits in a gloo all-reduce for rank 1, which raises first: gloo tells rank 0 its peer is gone."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if this_rank() == 1:
        raise RuntimeError("rank one's own error")
    dist.all_reduce(torch.ones(1))
    return {}


def rank_one_segfaults() -> dict:
    if this_rank() == 1:
        ctypes.string_at(0)
    return {}


def rank_one_exits(job: str) -> dict:
    if this_rank() == 1:
        after_rank_zero(job)
        print("about to leave")
        os._exit(3)
    return {}


def rank_not_reached() -> dict:
    from stackcheck.harness.scenario import require

    require(False, "the precondition")
    return {}


def rank_deepspeed_process_group() -> dict:
    """DeepSpeed's own process group over gloo, as accelerate and the Trainer start it under a DeepSpeed launch."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return {"world_size": deepspeed.comm.get_world_size()}


def no_process_of(outdir, grace: float = 5.0) -> bool:
    """No process still has the job's folder on its command line (ranks, supervisors, the launcher), within `grace`
    seconds: the launcher sends SIGKILL to each rank's group and collects only its own child, so a killed rank, not
    its child, may take a moment to leave the process table on a loaded machine (a CI run read one still there)."""
    deadline = time.monotonic() + grace
    while True:
        found = subprocess.run(["pgrep", "-f", str(outdir)], capture_output=True, text=True)
        if found.stdout.strip() == "" or time.monotonic() > deadline:
            return found.stdout.strip() == ""
        time.sleep(0.1)


# Real jobs.

def test_every_rank_passes_over_gloo_under_torchrun_when_the_first_port_was_taken(tmp_path, monkeypatch):
    """The job's first port is held by another listener (as by a concurrent job on a busy host): the rendezvous
    fails with "address already in use" before any rank runs, and the launcher starts the job again on another."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1], launcher.free_port()]
    monkeypatch.setattr(launcher, "free_port", lambda: ports.pop(0))
    try:
        outcomes = launcher.launch(f"{HERE}:rank_all_reduce", tmp_path / "job", timeout=120)
    finally:
        taken.close()
    assert ports == []  # both were used: the job was started twice
    assert [o.state for o in outcomes] == [RankState.PASSED, RankState.PASSED]
    assert [o.result for o in outcomes] == [{"sum": 3, "world_size": 2}] * 2
    assert no_process_of(tmp_path / "job")


def test_jobs_of_one_worker_get_distinct_ports_outside_the_ephemeral_range(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    ports = [launcher.free_port() for _ in range(5)]
    assert len(set(ports)) == 5
    assert all(port in launcher.JOB_PORTS and port not in launcher.ephemeral_ports() for port in ports)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw4")
    assert not set(ports) & {launcher.free_port() for _ in range(5)}


def test_a_rank_that_raises_carries_its_failure_and_frame(tmp_path):
    outcomes = launcher.launch(f"{HERE}:rank_one_raises", tmp_path / "job", timeout=120 + RANK_ZERO_WAIT, kwargs=job_of(tmp_path))
    assert outcomes[0].state == RankState.PASSED
    failed = outcomes[1]
    assert failed.state == RankState.FAILED
    assert failed.failure.signature() == "RuntimeError: rank one's own error @ tests/harness/test_distributed.py:rank_one_raises"
    assert no_process_of(tmp_path / "job")


def test_once_a_rank_failed_the_job_is_torn_down_without_waiting_for_the_agent(tmp_path):
    started = time.monotonic()
    outcomes = launcher.launch(f"{HERE}:rank_one_raises_rank_zero_waits", tmp_path / "job", timeout=100)
    assert time.monotonic() - started < 60
    assert [o.state for o in outcomes] == [RankState.STOPPED, RankState.FAILED]
    assert no_process_of(tmp_path / "job")


def test_a_rank_that_lost_its_peer_in_a_collective_was_torn_down_with_the_job(tmp_path):
    outcomes = launcher.launch(f"{HERE}:rank_one_raises_rank_zero_in_a_collective", tmp_path / "job", timeout=120)
    assert [o.state for o in outcomes] == [RankState.STOPPED, RankState.FAILED], [o.describe() for o in outcomes]
    judgement, records = judge_ranks(outcomes, lambda failure: Judgement(KNOWN_BUG, bug="the bug", signature=failure.signature()))
    assert (judgement.verdict, judgement.bug) == (KNOWN_BUG, "the bug")
    # rank 0 read gloo's lost peer (its error kept for the record), or was still waiting when the job was reaped
    assert records[0]["verdict"] is None and (records[0]["signature"] is None or "peer" in records[0]["signature"])


def test_lost_peers_alone_keep_their_failures():
    lost = RankOutcome(0, RankState.FAILED, Failure("RuntimeError", ("RuntimeError",), "[pair.cc:553] Connection closed by peer [127.0.0.1]:1", ()))
    assert torn_down([lost, RankOutcome(1, RankState.PASSED)])[0].state == RankState.FAILED
    assert torn_down([lost, failed(1, "its own")])[0].state == RankState.STOPPED


def test_a_hung_rank_is_an_error_with_its_stacks_and_every_process_is_reaped(tmp_path):
    started = time.monotonic()
    outcomes = launcher.launch(f"{HERE}:rank_one_hangs", tmp_path / "job", timeout=HANG_TIMEOUT, kwargs=job_of(tmp_path))
    assert time.monotonic() - started < HANG_TIMEOUT + 10
    assert outcomes[0].state == RankState.PASSED
    hung = outcomes[1]
    assert hung.state == RankState.HUNG and hung.seconds == HANG_TIMEOUT
    assert "rank_one_hangs" in hung.stacks
    asked = []
    judgement, records = judge_ranks(outcomes, judge=lambda failure: asked.append(failure) or Judgement(NEW_FAILURE, signature=failure.signature()))
    assert judgement.verdict == ERROR and judgement.signature == f"rank 1 hung after {HANG_TIMEOUT:.0f} s"  # no known bug's hang
    assert [f.exception_type for f in asked] == ["RankHung"] and asked[0].raising_frame.endswith("test_distributed.py:rank_one_hangs")
    assert "rank_one_hangs" in records[1]["stacks"]
    assert no_process_of(tmp_path / "job")


def test_a_segfaulting_rank_died_by_its_signal_with_its_stacks(tmp_path):
    outcomes = launcher.launch(f"{HERE}:rank_one_segfaults", tmp_path / "job", timeout=120)
    died = outcomes[1]
    assert died.state == RankState.DIED
    assert died.failure.message.startswith("rank 1 killed by signal 11 (SIGSEGV) without an outcome")
    assert "rank_one_segfaults" in died.stacks
    assert no_process_of(tmp_path / "job")


def test_a_rank_that_exits_died_with_its_code_and_output_under_accelerate_launch(tmp_path):
    outcomes = launcher.launch(f"{HERE}:rank_one_exits", tmp_path / "job", engine="fsdp2", timeout=120 + RANK_ZERO_WAIT,
                               kwargs=job_of(tmp_path))
    assert outcomes[0].state == RankState.PASSED
    died = outcomes[1]
    assert died.state == RankState.DIED
    assert died.failure.message.splitlines() == ["rank 1 exited with code 3 without an outcome", "about to leave"]
    assert died.failure.signature() == "RankDied: rank 1 exited with code 3 without an outcome @ ?"
    assert no_process_of(tmp_path / "job")


def test_a_deepspeed_cpu_job_neither_builds_the_shm_op_nor_waits_on_a_stale_build_lock(tmp_path, monkeypatch):
    """A DeepSpeed launch on the CPU lane starts its process group without compiling DeepSpeed's CPU shared-memory op
    (rank.keep_deepspeed_from_building_its_cpu_shm_op): here the op's build folder holds the `lock` a killed build
    leaves, on which DeepSpeed's `init_distributed` would wait forever, and the job must pass well within its timeout."""
    extensions = tmp_path / "torch_extensions"  # torch builds an extension NAME in $TORCH_EXTENSIONS_DIR/NAME
    build = extensions / "deepspeed_shm_comm"
    build.mkdir(parents=True)
    (build / "lock").touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    outcomes = launcher.launch(f"{HERE}:rank_deepspeed_process_group", tmp_path / "job", engine="zero3", timeout=90)
    assert [(o.state, o.result) for o in outcomes] == [(RankState.PASSED, {"world_size": 2})] * 2, [o.describe() for o in outcomes]
    assert [str(p.relative_to(extensions)) for p in extensions.rglob("*")] == ["deepspeed_shm_comm", "deepspeed_shm_comm/lock"]


def test_the_bench_writes_its_json_when_only_the_distributed_case_ran(tmp_path):
    """`-k` selecting the distributed case alone: pytest-benchmark writes no JSON when no benchmark of its own ran, and
    `stackcheck bench` then read "no bench results for the baseline"; tests/benchmarks/conftest.py writes it. On the
    CPU the world size 1 cell is recorded as not measured without a launch, so this costs one pytest start."""
    from stackcheck.bench import compare as bench_compare, report as bench_report

    out = tmp_path / "seed.json"
    completed = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "benchmark", "--stackcheck-bench-smoke",
                                f"--benchmark-json={out}", "tests/benchmarks/test_bench_distributed.py", "-k", "tiny-fsdp2-ws1"],
                               cwd=REPO_ROOT, capture_output=True, text=True)
    assert completed.returncode == 0 and out.exists(), completed.stdout[-3000:] + completed.stderr[-3000:]
    run = bench_compare.load(out)  # the shape `stackcheck bench` reads
    assert run["benchmarks"] == [] and run["stackcheck"]["set"] is not None
    assert [(c["engine"], c["world_size"], "not_measured" in c) for c in run["stackcheck"]["distributed"]] == [("fsdp2", 1, True)]
    bench_report.render({"seed": run}, "seed", tmp_path / "bench.md", tmp_path / "bench")
    assert "fsdp2" in (tmp_path / "bench.md").read_text()


def test_an_unreached_scenario_on_a_rank_is_not_reached(tmp_path):
    outcomes = launcher.launch(f"{HERE}:rank_not_reached", tmp_path / "job", world_size=1, timeout=120)
    assert outcomes[0].state == RankState.FAILED and outcomes[0].failure.not_reached


# The combination (pure).

def failed(rank: int, message: str = "boom") -> RankOutcome:
    return RankOutcome(rank, RankState.FAILED, Failure("RuntimeError", ("RuntimeError", "Exception"), message, ("lib.py:f",)))


def test_a_known_bug_on_one_rank_and_a_pass_on_the_other_is_the_known_bug():
    known = Judgement(KNOWN_BUG, "some_bug", "RuntimeError: boom @ lib.py:f", links=["https://example.org/1"])
    judgement, records = judge_ranks([RankOutcome(0, RankState.PASSED), failed(1)], judge=lambda failure: known)
    assert (judgement.verdict, judgement.bug, judgement.links) == (KNOWN_BUG, "some_bug", ["https://example.org/1"])
    assert [(r["rank"], r["verdict"]) for r in records] == [(0, "pass"), (1, "known_bug")]


def test_the_worst_rank_wins_and_the_lowest_rank_names_it():
    verdicts = {0: Judgement(KNOWN_BUG, "a"), 1: Judgement(NEW_FAILURE, None, "x"), 2: Judgement(NEW_FAILURE, None, "y"), 3: Judgement(ERROR, signature="z")}
    combined = combine(verdicts)
    assert (combined.verdict, combined.signature) == (NEW_FAILURE, "x")
    assert combined.note == "rank 0: known_bug a; rank 1: new_failure; rank 2: new_failure; rank 3: error"


def test_a_passing_rank_beside_a_failing_one_is_a_pass_never_fixed():
    assert judge_rank(RankOutcome(0, RankState.PASSED), judge=lambda failure: Judgement(FIXED)).verdict == PASS


def test_stopped_ranks_have_no_verdict_and_all_stopped_is_an_error():
    assert judge_rank(RankOutcome(1, RankState.STOPPED), judge=lambda failure: Judgement(PASS)) is None
    assert combine({0: Judgement(NEW_FAILURE, signature="s"), 1: None}).verdict == NEW_FAILURE
    assert combine({0: None, 1: None}).verdict == ERROR


def test_an_outcome_survives_its_file(tmp_path):
    outcome = failed(1, "a\nb")
    outcome.write(tmp_path / "rank-1.json")
    assert RankOutcome.from_json(json.loads((tmp_path / "rank-1.json").read_text())) == outcome


def test_a_rank_without_an_outcome_beside_a_failed_one_was_stopped_alone_it_died(tmp_path):
    """torch's agent tears the job down after a rank fails; a rank killed with it writes nothing (seen on the H100
    host: a known bug on rank 0 and rank 1 'dead' read as a new failure)."""
    failed(0, "the known bug").write(tmp_path / "rank-0.json")
    torn_down = launcher.outcomes(tmp_path, 2, hung_after=None, returncode=1)
    assert [o.state for o in torn_down] == [RankState.FAILED, RankState.STOPPED]
    (tmp_path / "rank-0.json").unlink()
    RankOutcome(0, RankState.PASSED).write(tmp_path / "rank-0.json")
    assert [o.state for o in launcher.outcomes(tmp_path, 2, hung_after=None, returncode=1)] == [RankState.PASSED, RankState.DIED]


# Through the plugin: a family cell judged rank by rank, with every rank recorded.

PROBE_MODULE = textwrap.dedent('''
    import os
    import time
    from pathlib import Path

    from stackcheck.distributed.cells import WORLD_SIZES


    def rank_one_meets_the_bug(job):
        if int(os.environ["RANK"]) == 1:
            deadline = time.monotonic() + 120  # rank 1 fails once rank 0 has its outcome (after_rank_zero)
            while not (Path(job) / "rank-0.json").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            raise ValueError("the probe's known bug")
        return {"rank": 0}


    @WORLD_SIZES
    def test_probe(ranks, world_size, tmp_path):
        ranks("tests.families.test_dist_probe:rank_one_meets_the_bug", world_size, timeout=240, job=str(tmp_path / "job"))
''')
PROBE_LEDGER = textwrap.dedent('''
    [families.dist_probe]
    title = "a distributed probe"
    bugs = ["dist_probe_bug"]

    [bugs.dist_probe_bug]
    summary = "the probe's bug"
    links = ["https://example.org/probe"]
    upstream_status = "none"
    affected = {}
    [bugs.dist_probe_bug.signature]
    exception = "ValueError"
    message = "the probe's known bug"
    frame = "tests/families/test_dist_probe.py:rank_one_meets_the_bug"
''')


def test_a_family_cell_combines_its_ranks_through_the_plugin(tmp_path):
    root = tmp_path / "checkout"
    shutil.copytree(REPO_ROOT, root, ignore=shutil.ignore_patterns(".git", ".stackcheck", ".cache", ".nox", "results", "docs", "wheelhouse", "__pycache__"))
    (root / "tests" / "families" / "test_dist_probe.py").write_text(PROBE_MODULE)
    ledger = root / "stackcheck" / "ledger.toml"
    ledger.write_text(ledger.read_text() + PROBE_LEDGER)
    results = tmp_path / "matrix.json"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/families/test_dist_probe.py",
                    "--stackcheck-lanes=cpu", f"--stackcheck-results={results}"], cwd=root, capture_output=True, text=True)
    cells = {c["test"]: c for c in json.loads(results.read_text())["cells"]}
    known = cells["tests/families/test_dist_probe.py::test_probe[cpu-ws2]"]
    assert (known["verdict"], known["bug"]) == ("known_bug", "dist_probe_bug")
    assert [(r["rank"], r["state"], r["verdict"]) for r in known["ranks"]] == [(0, "passed", "pass"), (1, "failed", "known_bug")]
    assert known["ranks"][0]["result"] == {"rank": 0}
    skipped = cells["tests/families/test_dist_probe.py::test_probe[cpu-ws1]"]
    assert (skipped["verdict"], skipped["note"]) == ("skipped", "Skipped: CPU lane: the gloo variant runs 2 ranks")


# A hung rank judged by where it was stuck (pure, the real ledger).

HUNG_IN_PEFT_SAVE = """Thread 0x00007f3062dde6c0 (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 359 in wait

Current thread 0x00007f3363b06140 (most recent call first):
  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/distributed/fsdp/_flat_param.py", line 2494 in flat_param_to
  File "/usr/lib/python3.12/contextlib.py", line 137 in __enter__
  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/nn/modules/module.py", line 2266 in state_dict
  File "/env/lib/python3.12/site-packages/peft/utils/save_and_load.py", line 189 in get_peft_model_state_dict
  File "/opt/torch/.venv/lib/python3.12/site-packages/accelerate/utils/fsdp_utils.py", line 153 in save_fsdp_model
  File "/env/lib/python3.12/site-packages/transformers/trainer.py", line 3556 in _save_optimizer_and_scheduler
"""
RESUME_TEST = "test_a_resumed_job_continues_the_uninterrupted_one[gpu-ws2-fsdp1-full-modules_to_save]"


def judge_hang(stacks: str, test: str = RESUME_TEST, peft: str = "0.21.2") -> Judgement:
    from stackcheck.core.ledger import Ledger

    ledger = Ledger()
    versions = {"torch": "2.11.0", "transformers": "5.23.0", "peft": peft, "accelerate": "1.15.0", "bitsandbytes": "0.50.2"}
    return judge_rank(RankOutcome(0, RankState.HUNG, seconds=180.0, stacks=stacks),
                      judge=lambda failure: ledger.judge("sharded_resume", test, versions, failure))


def test_a_hung_rank_stuck_in_a_known_bugs_frame_is_that_bug():
    """The FSDP1 full-state-dict save of a modules_to_save adapter hung on two H100s, both ranks' main threads under
    PEFT's get_peft_model_state_dict: judged by that frame, the hang is the known bug; stuck anywhere else, or in a
    version the bug does not cover, it stays the harness's error, never a new failure filed under a guess."""
    assert outcome_frames() == ("transformers/trainer.py:_save_optimizer_and_scheduler", "accelerate/utils/fsdp_utils.py:save_fsdp_model",
                                "peft/utils/save_and_load.py:get_peft_model_state_dict", "torch/nn/modules/module.py:state_dict",
                                "stdlib/contextlib.py:__enter__", "torch/distributed/fsdp/_flat_param.py:flat_param_to")
    known = judge_hang(HUNG_IN_PEFT_SAVE)
    assert (known.verdict, known.bug) == (KNOWN_BUG, "peft_fsdp1_full_state_dict_modules_to_save_hang")
    elsewhere = judge_hang(HUNG_IN_PEFT_SAVE.replace("peft/utils/save_and_load.py", "peft/tuners/lora/layer.py"))
    assert (elsewhere.verdict, elsewhere.signature) == (ERROR, "rank 0 hung after 180 s")
    assert "peft/tuners/lora/layer.py:get_peft_model_state_dict" in elsewhere.note
    assert judge_hang(HUNG_IN_PEFT_SAVE, peft="0.18.1").verdict == ERROR  # before the bug's range
    assert judge_hang("no stacks were written").verdict == ERROR


def outcome_frames() -> tuple[str, ...]:
    from stackcheck.distributed.outcome import stuck_frames

    return stuck_frames(HUNG_IN_PEFT_SAVE)
