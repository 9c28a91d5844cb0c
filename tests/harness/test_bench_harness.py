"""The bench harness on the CPU, as CI runs it: the smoke bench writes a complete pytest-benchmark JSON for
both sizes, `compare` passes a run against itself and fails one slowed through the test-only switch, the
weight arithmetic matches what bitsandbytes stores, the timed decode does generate()'s work, the timed
training step trains, the report renders, and the default test run leaves the benchmarks out."""

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stackcheck import REPO_ROOT, cli
from stackcheck.commands import gate
from stackcheck.harness import scenario
from stackcheck.bench import harness as bench
from stackcheck.bench import compare as bench_compare, report as bench_report
from stackcheck.core.locking import folder_locked
from stackcheck.models import tiny
from stackcheck.core.versions import UsageError

GEMMA4 = scenario.seed_model(torch.device("cpu"))

pytest.importorskip("pytest_benchmark", reason="the bench needs the `bench` extra (`nox -s tests` installs it)")

INFERENCE_CASES = {"bf16", "nf4", "nf4_dq", "nf4_dq_lora", "nf4_dq_merged", "bf16_merged"}  # no split map on the CPU
TRAINING_CASE = "qlora_train"
# The realistic model's shape, shrunk so that the harness builds and runs it on the CPU in seconds.
SHRUNK_REALISTIC = {
    "config": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "global_head_dim": 64,
               "vocab_size_per_layer_input": 512, "hidden_size_per_layer_input": 16, "sliding_window": 16},
    "adapter": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
}


def run_bench(out: Path, *arguments: str, env: dict | None = None) -> dict:
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "benchmark", "--stackcheck-bench-smoke",
         f"--benchmark-json={out}", *arguments],
        # A run of its own, not one of this run's xdist workers (whose variables would tell the child it is one).
        cwd=REPO_ROOT, env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}, **(env or {})},
        capture_output=True, text=True, check=False,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    return bench_compare.load(out)  # also proves a real run passes the shape check


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    """One smoke run of both sizes with two decode repeats, the realistic model shrunk: once per test run, shared on
    disk by the xdist workers whose tests ask for it (the parent of a worker's temporary folder is the run's)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "bench-smoke"
    out = shared / "smoke.json"
    with folder_locked(shared):
        if out.exists():
            return bench_compare.load(out)
        fixtures = shared / "fixtures"
        fixtures.mkdir(exist_ok=True)  # a failed run's, of the same files
        for name in ("tiny_gemma4.json", "adapters.json"):  # copied as they are, so the tiny cache still hits
            (fixtures / name).write_bytes((tiny.FIXTURES_DIR / name).read_bytes())
        (fixtures / tiny.REALISTIC_FIXTURE).write_text(json.dumps(SHRUNK_REALISTIC))
        ran = run_bench(shared / "run.json", "tests/benchmarks", "--stackcheck-bench-size=all", "--stackcheck-bench-repeat=2",
                        env={"STACKCHECK_FIXTURES": str(fixtures)})
        os.replace(shared / "run.json", out)  # only a run that passed is shared
        return ran


def test_smoke_bench_records_every_case_and_metric(smoke):
    meta = smoke["stackcheck"]
    assert meta["mode"] == "smoke" and meta["synthetic_slowdown"] == 1.0 and meta["cpu_threads"] == 1
    assert meta["bandwidth"]["measured_bytes_per_s"] > 0 and meta["versions"]["transformers"]
    summary = bench_compare.summarize(smoke)
    assert set(summary) == {f"{size}/{case}" for size in ("tiny", "realistic") for case in {*INFERENCE_CASES, TRAINING_CASE}}
    for key, row in summary.items():
        assert row["host_rss_bytes"] > 0 and row["host_peak_rss_bytes"] >= row["host_rss_bytes"], key
        assert row["weights"]["expected"]["cpu"] > 0, key
        if row["case"] == TRAINING_CASE:
            assert row["train_tokens_per_s"] > 0 and "prefill_tokens_per_s" not in row and "decode_tokens_per_s" not in row, key
        else:
            assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0, key
            assert row["decode_weight_bytes_per_token"] > 0, key
    train = [entry["extra_info"] for entry in smoke["benchmarks"] if entry["extra_info"]["phase"] == "train"]
    assert len(train) == 2 and all(info["tokens"] == len(scenario.TRAINING_IDS[0]) for info in train)
    for size in ("tiny", "realistic"):
        assert len(summary[f"{size}/nf4_dq"]["decode_repeat_tokens_per_s"]) == 2
        # 4-bit weights: about a quarter of bf16's; the adapter adds parameters, merging keeps the count
        assert summary[f"{size}/nf4_dq"]["weights"]["expected"]["cpu"] < summary[f"{size}/bf16"]["weights"]["expected"]["cpu"] / 2
        assert summary[f"{size}/nf4_dq_lora"]["parameters"] > summary[f"{size}/nf4_dq"]["parameters"]
        assert summary[f"{size}/nf4_dq_merged"]["parameters"] == summary[f"{size}/bf16"]["parameters"]
        # the trained LoRA has the inference adapter's targets and rank (4; the shrunk realistic adapter's too)
        assert summary[f"{size}/{TRAINING_CASE}"]["parameters"] == summary[f"{size}/nf4_dq_lora"]["parameters"]


def test_smoke_bench_records_the_distributed_case_on_two_gloo_ranks(smoke):
    cells = {(c["engine"], c["world_size"]): c for c in smoke["stackcheck"]["distributed"] if c["size"] == "tiny"}
    assert all("not_measured" in cells[engine, 1] for engine in ("fsdp2", "zero3"))  # the CPU lane runs 2 ranks
    for engine in ("fsdp2", "zero3"):
        ranks = cells[engine, 2]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1], engine
        # what each rank's parameters hold is what the sharding arithmetic says, shard by shard
        assert all(r["job_tokens_per_s"] > 0 and r["expected_on_rank_bytes"] == r["held_bytes"] for r in ranks), engine
        # the user's arithmetic shards every parameter: never more than the engine's
        assert all(sum(r["held_by_part"].values()) == r["held_bytes"] for r in ranks), engine
        assert all(r["users_expected_on_rank_bytes"] <= r["expected_on_rank_bytes"] for r in ranks), engine


def test_compare_passes_a_run_against_itself(smoke):
    assert bench_compare.compare(smoke, smoke) == []


def test_synthetic_slowdown_fails_the_comparison(smoke, tmp_path):
    """The test-only switch slows the timed calls 10x; the comparison must fail on every tokens/s ratio
    (inference and training), name the switch, and miss the cases the slowed run left out; the gate reports
    the decode drop as a regression."""
    tests = [f"tests/benchmarks/test_bench.py::test_{phase}[tiny-bf16]" for phase in ("prefill", "decode")]
    tests.append(f"tests/benchmarks/test_bench.py::test_train_step[tiny-{TRAINING_CASE}]")
    slowed = run_bench(tmp_path / "slowed.json", *tests, env={bench_compare.SYNTHETIC_SLOWDOWN_ENV: "0.1"})
    assert slowed["stackcheck"]["synthetic_slowdown"] == 0.1
    problems = bench_compare.compare(slowed, smoke)
    assert any(p.startswith("candidate was measured with the test-only synthetic slowdown 0.1") for p in problems)
    assert any(p.startswith("tiny/bf16: decode_tokens_per_s ratio") for p in problems), problems
    assert any(p.startswith("tiny/bf16: prefill_tokens_per_s ratio") for p in problems), problems
    assert any(p.startswith(f"tiny/{TRAINING_CASE}: train_tokens_per_s ratio") for p in problems), problems
    assert any(p.startswith("tiny/nf4: in the baseline, missing from the candidate") for p in problems), problems

    sets = {"sets": {}, "cells": []}
    findings = gate.compare(dict(sets, bench=smoke), dict(sets, bench=slowed))
    decode = [f for f in findings if f.check == "bench" and "decode_tokens_per_s ratio" in f.detail]
    assert decode and all(f.status == gate.REGRESSION for f in decode)


def test_compare_fails_vram_growth_past_the_threshold(smoke):
    """VRAM is not measured on the CPU, so both runs get the same peaks, the candidate's 20% higher."""
    baseline, candidate = copy.deepcopy(smoke), copy.deepcopy(smoke)
    for run, peak in ((baseline, 1000), (candidate, 1200)):
        for entry in run["benchmarks"]:
            entry["extra_info"]["memory"]["peak_allocated_bytes"] = peak
    problems = bench_compare.compare(candidate, baseline)
    assert problems and all("peak_allocated_bytes ratio 1.200 > 1.1" in p for p in problems)


@pytest.mark.parametrize("double_quant", [False, True])
def test_weight_arithmetic_matches_what_bitsandbytes_stores(double_quant):
    """Per 4-bit layer, the arithmetic is exactly the packed weight plus its absmax (with double quant
    the 8-bit absmax plus the second-level fp32 one); the rest of the quant state is the known gap."""
    model = scenario.load_base(GEMMA4, double_quant=double_quant)
    layers = scenario.linear4bit_modules(model)
    assert layers
    for name, module in layers.items():
        state = module.weight.quant_state
        data = module.weight.nbytes + state.absmax.nbytes + (state.state2.absmax.nbytes if double_quant else 0)
        assert bench.expected_param_bytes(module.weight) == data, name
        assert bench.stored_bytes(module.weight) > data, name
    norm = next(p for n, p in model.named_parameters() if n.endswith("norm.weight"))
    assert bench.expected_param_bytes(norm) == bench.stored_bytes(norm) == norm.numel() * 2


def test_timed_decode_produces_the_tokens_generate_does():
    run = bench.InferenceRun("tiny", "nf4_dq", torch.device("cpu"), bench.PROFILES["tiny", True])
    args, _ = run.start_decode()
    first = args[1]
    decoded = run.decode(*args)
    generated = run.model.generate(input_ids=run.context, max_new_tokens=run.profile.new_tokens + 1,
                                   min_new_tokens=run.profile.new_tokens + 1, do_sample=False)
    context = run.context.shape[1]
    assert generated[0, context].item() == first.item()
    assert torch.equal(generated[:, context + 1:], decoded)


def test_timed_training_step_is_the_families_qlora_step():
    """The benchmark's step is the QLoRA recipe: the 4-bit NF4 double-quant base prepared with PEFT's defaults
    (gradient checkpointing on), the tiny adapter's LoRA the only trainable parameters, AdamW holding its state
    for each of them after a step, and the loss falling step after step."""
    run = bench.TrainingRun("tiny", TRAINING_CASE, torch.device("cpu"), bench.PROFILES["tiny", True])
    assert run.model.training and run.model.is_gradient_checkpointing
    scenario.first_nested_linear4bit(run.model)
    trainable = [name for name, p in run.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in name for name in trainable)
    assert len(trainable) == len(scenario.lora_tensors(run.model))
    losses = [loss for _ in range(3) for loss in run.train_step()]
    assert losses[0] > losses[1] > losses[2], losses
    assert all(run.optimizer.state[p] for group in run.optimizer.param_groups for p in group["params"])
    assert run.extra_info("train")["tokens"] == run.batch_tokens == len(scenario.TRAINING_IDS[0])
    run.close()


def test_compare_gates_the_training_step_on_a_gpu_by_its_vram_only():
    """On a GPU the fixed batch's step is host-bound: half the speed passes, 20% more peak VRAM fails."""
    def with_training(seconds: float, peak: int) -> dict:
        run = gpu_run(100.0)
        run["benchmarks"].append({"stats": {"median": seconds, "iqr": 0.0}, "extra_info": {
            "size": "realistic", "case": TRAINING_CASE, "phase": "train", "tokens": 12, "parameters": 6, "weights": {},
            "memory": {"peak_allocated_bytes": peak}}})
        return run

    baseline = with_training(1.0, 1000)
    assert bench_compare.compare(with_training(2.0, 1000), baseline) == []
    assert bench_compare.compare(with_training(1.0, 1200), baseline) == [
        f"realistic/{TRAINING_CASE}: peak_allocated_bytes ratio 1.200 > 1.1 (1200 vs baseline 1000)"]


def test_decode_graph_is_refused_without_a_gpu():
    run = bench.InferenceRun("tiny", "bf16", torch.device("cpu"), bench.PROFILES["tiny", True])
    with pytest.raises(bench.GraphNotFaithful, match="CUDA graphs need a CUDA device"):
        bench.DecodeGraph(run)


def test_cache_tensors_hold_every_tensor_of_the_prefilled_cache():
    """DecodeGraph keeps these alive for the graph's life: keys and values of every layer that holds them
    (transformers 5.23 gives the KV-shared layers a DummyLayer, keys and values None)."""
    run = bench.InferenceRun("tiny", "bf16", torch.device("cpu"), bench.PROFILES["tiny", True])
    (cache, _), _ = run.start_decode()
    held = {id(t) for t in bench.cache_tensors(cache)}
    holding = [layer for layer in cache.layers if layer.keys is not None]
    assert holding and all(id(layer.keys) in held and id(layer.values) in held for layer in holding)


def gpu_run(graph_tokens_per_s: float | None, not_measured: str | None = None) -> dict:
    """A minimal GPU bench JSON of one realistic case: `compare` is pure, so its rules are shown on data."""
    entries = [{"stats": {"median": 1.0, "iqr": 0.0}, "extra_info": {"size": "realistic", "case": "nf4_dq", "phase": phase,
                "tokens": tokens, "parameters": 5, "weights": {}, "memory": {}}}
               for phase, tokens in (("prefill", 8192), ("decode", 10), ("decode_graph", graph_tokens_per_s)) if tokens]
    skipped = [{"size": "realistic", "case": "nf4_dq", "phase": "decode_graph", "reason": not_measured}] if not_measured else []
    return {"benchmarks": entries, "stackcheck": {"mode": "full", "device": "NVIDIA H100 80GB HBM3", "not_measured": skipped}}


def test_compare_gates_the_graph_decode_on_a_gpu_and_not_the_eager_one():
    baseline = gpu_run(100.0)
    slower_eager = copy.deepcopy(baseline)
    slower_eager["benchmarks"][1]["stats"]["median"] = 2.0  # eager decode at half speed: host noise on a GPU run
    assert bench_compare.compare(slower_eager, baseline) == []
    problems = bench_compare.compare(gpu_run(85.0), baseline)
    assert problems == ["realistic/nf4_dq: decode_graph_tokens_per_s ratio 0.850 < 0.9 (85 vs baseline 100)"]
    problems = bench_compare.compare(gpu_run(None, not_measured="the first replay gives 1 of 32 tokens"), baseline)
    assert problems == ["realistic/nf4_dq: decode_graph_tokens_per_s measured in the baseline, not in the candidate: "
                        "the first replay gives 1 of 32 tokens"]


def test_report_renders_ratios_gate_and_plots(smoke, tmp_path):
    slower = copy.deepcopy(smoke)
    for entry in slower["benchmarks"]:
        entry["stats"]["median"] *= 2
    notes = bench_report.render({"base": smoke, "candidate": slower}, "base", tmp_path / "bench.md", tmp_path / "bench")
    markdown = (tmp_path / "bench.md").read_text()
    assert "- **candidate** against base: **fail**" in markdown
    assert "(×0.500)" in markdown
    for section in ("## Decode tokens/s", "## Prefill tokens/s", "## QLoRA training tokens/s", "## Decode roofline",
                    "## Weights: expected and measured", "## Repeatability of the 4-bit decode", "## Host peak RSS"):
        assert section in markdown
    # a tokens/s table lists the cases that have its phase: the training case trains, the others prefill and decode
    decode, training = (markdown.split(title)[1].split("\n## ")[0] for title in ("## Decode tokens/s, eager", "## QLoRA training tokens/s"))
    assert "| tiny/nf4_dq |" in decode and TRAINING_CASE not in decode
    assert f"| tiny/{TRAINING_CASE} |" in training and "| tiny/nf4_dq |" not in training
    if importlib.util.find_spec("matplotlib") is None:
        assert any("matplotlib is not installed" in note for note in notes)
    else:
        assert (tmp_path / "bench" / "decode_tokens_per_s.png").stat().st_size > 0
        assert "![Decode tokens/s, eager as generate() runs it (batch 1, host-bound)](bench/decode_tokens_per_s.png)" in markdown


def test_plain_runs_leave_the_benchmarks_out():
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/benchmarks", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "not gpu"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=False,
    ).stdout
    assert "no tests collected" in collected and "deselected" in collected, collected


def test_synthetic_slowdown_must_be_a_factor(monkeypatch):
    monkeypatch.setenv(bench_compare.SYNTHETIC_SLOWDOWN_ENV, "2")
    with pytest.raises(UsageError, match=r"expected a factor in \(0, 1\]"):
        bench.synthetic_slowdown()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--sets", "seed", "--baseline", "latest"], "stackcheck: --baseline 'latest' is not among the sets run (seed)"),
        (["bench", "--sets", "seed", "--repeat", "1"], "stackcheck: --repeat 1: a coefficient of variation needs N >= 2 measurements"),
    ],
)
def test_bench_user_errors_print_one_line_and_exit_2(argv, message, capsys):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_full_bench_without_a_gpu_is_refused_in_one_line(capsys):
    assert cli.main(["bench", "--sets", "seed"]) == 2
    assert capsys.readouterr().err.strip().startswith("stackcheck: no GPU: ")


def test_report_lists_what_the_baseline_could_not_measure():
    gate_lines = bench_report._gate({"base": gpu_run(None, not_measured="capture failed"), "cand": gpu_run(100.0)}, "base")
    assert "- **cand** against base: pass" in gate_lines
    assert "- realistic/nf4_dq decode_graph: capture failed" in gate_lines


def test_a_failed_distributed_job_is_named_where_its_numbers_would_be():
    failed = {"size": "realistic", "engine": "fsdp2", "world_size": 1, "lane": "gpu", "failed": True,
              "not_measured": "the job failed: rank 0 failed: RuntimeError: only Tensors of floating point dtype can require gradients @ x"}
    base, cand = gpu_run(100.0), gpu_run(100.0)
    base["stackcheck"]["distributed"] = [failed]
    gate_lines = bench_report._gate({"base": base, "cand": cand}, "base")
    assert f"- distributed realistic/fsdp2/ws1: {failed['not_measured']}" in gate_lines
    assert bench_compare.compare(cand, base) == ["realistic/fsdp2/ws1: in the baseline, missing from the candidate (its benchmark failed or did not run)"]


def distributed_record(engine: str, world_size: int, half_ratio: float, held_weights: int) -> dict:
    """A distributed cell as train_rank records it: one rank, 4-bit weights of 1000 bytes held `held_weights`."""
    users = {"4-bit weights": {"whole_bytes": 1000, "sharded_bytes": 1000, "on_rank_bytes": 1000 / world_size}}
    rank = {"rank": 0, "job_tokens_per_s": 100.0 * world_size, "step_seconds": [1.0, 1.0, 1.0], "half_batch_time_ratio": half_ratio,
            "arithmetic": users, "expected_on_rank_bytes": 1000 / world_size, "users_arithmetic": users,
            "users_expected_on_rank_bytes": 1000 / world_size, "held_by_part": {"4-bit weights": held_weights}, "held_bytes": held_weights}
    return {"size": "tiny", "engine": engine, "world_size": world_size, "lane": "gpu", "model": "m", "rows": 1, "sequence": 1,
            "steps": 3, "ranks": [rank]}


def test_the_report_says_host_bound_instead_of_an_efficiency_and_flags_a_rank_over_the_users_arithmetic():
    run = gpu_run(100.0)
    run["stackcheck"]["distributed"] = [distributed_record("fsdp2", 1, 0.95, 1000), distributed_record("fsdp2", 2, 0.97, 1000),
                                        distributed_record("zero3", 1, 0.5, 1000), distributed_record("zero3", 2, 0.52, 500)]
    lines = bench_report._distributed({"base": run}, "base")
    speed = {line.split(" | ")[2]: line for line in lines if line.startswith("| base | tiny |") and "tokens a rank" in line}
    assert speed["fsdp2"].endswith("| host-bound |") and speed["zero3"].endswith("| 100.0% |")
    memory = [line for line in lines if line.startswith("| base | tiny |") and " | 2 | 0 | " in line]
    assert any("fsdp2" in line and "2.00: **4-bit weights over the user's arithmetic**" in line for line in memory)
    assert any("zero3" in line and "| 1.00 |" in line for line in memory)
