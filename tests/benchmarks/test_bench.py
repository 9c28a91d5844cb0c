"""VRAM and tokens/s of every bench case (stackcheck.bench.harness.CASES) on the tiny and the realistic model.

Each (size, case) is loaded once, under its memory tracker, and shared by its benchmarks. An inference case
runs, in this order: prefill (the prompt's forward), decode (`new_tokens` greedy eager steps after an
untimed prefill of the context, as generate() runs them), then on a GPU the same decode round replayed from
a CUDA graph (bench.DecodeGraph: the device time of the stack's kernels, free of the host's speed). The
training case (`qlora_train`) runs one benchmark, train: each round one QLoRA optimizer step (the families'
`scenario.qlora_model` and `scenario.train_steps`, torch's AdamW) on the fixed training batch, its tokens/s
the batch's tokens over the step's time, its memory peaks those of the load, the optimizer's state and the
step's activations. pytest-benchmark times each over warm-up and timed rounds through bench.timed, which
returns only once the GPU is done. With --stackcheck-bench-repeat N, the 4-bit decode is measured N more
times in each mode, for its coefficient of variation. Numbers are recorded, never asserted:
stackcheck.bench.compare judges them against a baseline set.
"""

import pytest

from stackcheck.bench import harness as bench
from stackcheck.child.bench import bench_sizes, record_not_measured

pytestmark = pytest.mark.benchmark

REPEATED = ("test_decode_repeat", "test_decode_graph_repeat")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    device = bench.bench_device()
    training = metafunc.definition.originalname == "test_train_step"
    cases = [(size, case) for size in bench_sizes(metafunc.config) for case in bench.cases_for(size, device)
             if bench.CASES[case].training == training]
    if metafunc.definition.originalname in REPEATED:
        cases = [(size, case) for size, case in cases if case == bench.REPEAT_CASE]
        metafunc.parametrize("repeat", range(metafunc.config.getoption("--stackcheck-bench-repeat")))
    metafunc.parametrize("loaded", cases, indirect=True, scope="module", ids="-".join)


@pytest.fixture(scope="module")
def loaded(request, bench_device):
    size, case = request.param
    profile = bench.PROFILES[size, request.config.getoption("--stackcheck-bench-smoke")]
    run = (bench.TrainingRun if bench.CASES[case].training else bench.InferenceRun)(size, case, bench_device, profile)
    yield run
    run.close()


def measure(run: bench.CaseRun, benchmark, phase: str) -> None:
    if phase == "prefill":
        target, setup = run.prefill, lambda: bench.synchronize(run.device)
    elif phase == "train":
        target, setup = run.train_step, lambda: bench.synchronize(run.device)
    else:
        target, setup = run.decode, run.start_decode
    benchmark.pedantic(bench.timed(target, run.device), setup=setup, rounds=run.profile.rounds,
                       warmup_rounds=run.profile.warmup)
    benchmark.extra_info.update(run.extra_info(phase))


def measure_graph(run: bench.InferenceRun, benchmark, request, phase: str) -> None:
    if run.device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA GPU")
    try:
        graph = bench.DecodeGraph(run)
    except bench.GraphNotFaithful as exc:
        record_not_measured(request.config, run.size, run.case, phase, str(exc))
        pytest.skip(f"decode not graphed: {exc}")
    benchmark.pedantic(bench.timed(graph.replay, run.device), rounds=run.profile.rounds, warmup_rounds=run.profile.warmup)
    benchmark.extra_info.update(run.extra_info(phase))


def test_prefill(loaded, benchmark):
    measure(loaded, benchmark, "prefill")


def test_decode(loaded, benchmark):
    measure(loaded, benchmark, "decode")


def test_decode_repeat(loaded, repeat, benchmark):
    measure(loaded, benchmark, "decode_repeat")


def test_decode_graph(loaded, benchmark, request):
    measure_graph(loaded, benchmark, request, "decode_graph")


def test_decode_graph_repeat(loaded, repeat, benchmark, request):
    measure_graph(loaded, benchmark, request, "decode_graph_repeat")


def test_train_step(loaded, benchmark):
    measure(loaded, benchmark, "train")
