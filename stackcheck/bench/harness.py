"""Benchmark harness: the cases and model sizes, loading a case, the timing helper, the memory tracker,
weight sizes, the decode roofline's bytes per token and the QLoRA training step. What it measures lands in
the bench JSON described in stackcheck.bench.compare, which reads and compares it without torch.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from stackcheck.harness import scenario
from stackcheck.models import footprint, tiny
from stackcheck.bench.compare import SYNTHETIC_SLOWDOWN_ENV
from stackcheck.core.versions import UsageError

# HBM bandwidth from NVIDIA's datasheets, by device-name fragment, first match wins ("H100" alone is
# the SXM part, which torch names "NVIDIA H100 80GB HBM3"). Reported beside the measured copy bandwidth.
SPEC_BANDWIDTH = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))


@dataclass(frozen=True)
class Case:
    quantized: bool
    double_quant: bool = False
    # None, "unmerged" (PeftModel on top), "merged" (merge_and_unload) or "trained" (a fresh LoRA through
    # scenario.qlora_model: the case is trained, not decoded)
    adapter: str | None = None
    split: bool = False  # scenario.SEED_SPLIT_DEVICE_MAP: vision and audio towers on the CPU, the rest on GPU 0

    @property
    def training(self) -> bool:
        return self.adapter == "trained"


CASES = {
    "bf16": Case(quantized=False),
    "nf4": Case(quantized=True),
    "nf4_dq": Case(quantized=True, double_quant=True),
    "nf4_dq_lora": Case(quantized=True, double_quant=True, adapter="unmerged"),
    "nf4_dq_merged": Case(quantized=True, double_quant=True, adapter="merged"),
    "bf16_merged": Case(quantized=False, adapter="merged"),
    "split_bf16": Case(quantized=False, split=True),
    "split_nf4_dq": Case(quantized=True, double_quant=True, split=True),
    "qlora_train": Case(quantized=True, double_quant=True, adapter="trained"),
}
REPEAT_CASE = "nf4_dq"  # the seeds' quantization: the case whose decode `--repeat` measures again


def _load_realistic(_under_test, quantized: bool, double_quant: bool, device_map, **kwargs):
    from transformers import Gemma4ForCausalLM

    checkpoint = tiny.realistic_checkpoint() / "base"
    return scenario.load_pretrained(Gemma4ForCausalLM, checkpoint, quantized, double_quant, device_map, **kwargs)


@dataclass(frozen=True)
class Size:
    prepare: Callable[[], object]  # builds (once) the checkpoints the loads need, outside any measurement
    load: Callable  # (the seed's UnderTest, quantized=, double_quant=, device_map=, **from_pretrained kwargs) -> model
    adapter: Callable[[], str | Path]  # what scenario.peft_load takes
    trained_adapter: str  # the adapter fixture whose targets scenario.qlora_model trains (tiny.lora_config: rank 4)
    has_towers: bool  # only a multimodal model has towers for the split map to send to the CPU


TINY_ADAPTER = "language"
# The realistic model trains on the fixture adapter "broad": every attention and MLP projection, the targets of
# its own adapter (fixtures/realistic_gemma4_text.json), at tiny.lora_config's rank 4 where that adapter has 16.
SIZES = {
    "tiny": Size(prepare=lambda: (tiny.base_checkpoint(scenario.seed_model(torch.device("cpu")).arch),
                                  tiny.adapter_checkpoint(scenario.seed_model(torch.device("cpu")).arch, TINY_ADAPTER)),
                 load=scenario.load_base,
                 adapter=lambda: TINY_ADAPTER, trained_adapter=TINY_ADAPTER, has_towers=True),
    "realistic": Size(prepare=tiny.realistic_checkpoint, load=_load_realistic,
                      adapter=lambda: tiny.realistic_checkpoint() / "adapter", trained_adapter="broad", has_towers=False),
}


@dataclass(frozen=True)
class Profile:
    prefill_tokens: int  # the prefill benchmark's prompt
    context_tokens: int  # the decode's: each decode round starts from a prefill of this many tokens
    new_tokens: int  # decode steps per round
    rounds: int  # timed rounds per phase
    warmup: int  # untimed rounds before them


# Eager steps are host-bound: about 3,000 kernel launches per forward of the realistic model keep the GPU
# busy for 8 ms of a 50 to 160 ms step, and the host's speed drifts that much within a minute on the
# device tool's VMs. The realistic prefill is long enough (8,192 tokens) for the GPU's work to outlast the
# launches; decode is timed eager (as generate() runs it) and replayed from a CUDA graph (DecodeGraph).
PROFILES = {
    ("tiny", False): Profile(prefill_tokens=64, context_tokens=64, new_tokens=16, rounds=10, warmup=2),
    ("realistic", False): Profile(prefill_tokens=8192, context_tokens=512, new_tokens=32, rounds=5, warmup=1),
    ("tiny", True): Profile(prefill_tokens=16, context_tokens=16, new_tokens=4, rounds=3, warmup=1),
    ("realistic", True): Profile(prefill_tokens=16, context_tokens=16, new_tokens=4, rounds=3, warmup=1),
}


def cases_for(size: str, device: torch.device) -> list[str]:
    """The split map needs a GPU (on the CPU every module is on the CPU already) and towers to split off."""
    splittable = device.type == "cuda" and SIZES[size].has_towers
    return [name for name, case in CASES.items() if splittable or not case.split]


def bench_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def load_case(size: Size, case: Case, device: torch.device):
    """The case's model on `device`: the seed's architecture (its adapters and LoRA targets) at the size's scale."""
    under_test = scenario.seed_model(device)
    device_map = scenario.SEED_SPLIT_DEVICE_MAP if case.split else {"": scenario.device_key(device)}
    kwargs = {}
    if case.quantized:
        # transformers refuses a 4-bit model with CPU entries in its map unless fp32 CPU offload is on
        kwargs["quantization_config"] = scenario.bnb_config(case.double_quant, fp32_cpu_offload=case.split)
    model = size.load(under_test, quantized=case.quantized, double_quant=case.double_quant, device_map=device_map, **kwargs)
    if case.training:
        return scenario.qlora_model(under_test, model, size.trained_adapter)  # in training mode
    if case.adapter:
        model = scenario.peft_load(under_test, model, size.adapter())
    if case.adapter == "merged":
        model = model.merge_and_unload()
    return model.eval()


# --- timing ---------------------------------------------------------------------------------------


def synthetic_slowdown() -> float:
    """TEST-ONLY switch: STACKCHECK_BENCH_SYNTHETIC_SLOWDOWN=f, 0 < f <= 1, makes every timed call take
    1/f as long (the process sleeps the difference), so a harness test can show a comparison failing.
    Every bench JSON records the factor in effect; never set it for a real run."""
    raw = os.environ.get(SYNTHETIC_SLOWDOWN_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        factor = float(raw)
    except ValueError:
        factor = math.nan
    if not 0 < factor <= 1:
        raise UsageError(f"{SYNTHETIC_SLOWDOWN_ENV}={raw!r}: expected a factor in (0, 1]")
    return factor


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable, device: torch.device) -> Callable:
    """`fn` made fit for a wall-clock timer (pytest-benchmark's): it returns only once the device has
    finished the work `fn` queued, and carries the synthetic slowdown when one is set."""
    factor = synthetic_slowdown()

    def call(*args, **kwargs):
        started = time.perf_counter()
        result = fn(*args, **kwargs)
        synchronize(device)
        if factor < 1:
            time.sleep((time.perf_counter() - started) * (1 / factor - 1))
        return result

    return call


def _elapsed(fn: Callable, device: torch.device) -> float:
    """Seconds `fn` keeps the device busy: CUDA events on a GPU, the wall clock on the CPU."""
    if device.type != "cuda":
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def copy_bandwidth(device: torch.device, rounds: int = 10) -> float:
    """Bytes per second a device-to-device copy moves, each byte read once and written once: the median
    of `rounds` copies of 1 GiB (64 MiB on the CPU) after one warm-up. The practical ceiling for reading
    weights, which the decode roofline divides by."""
    size = (1 << 30) if device.type == "cuda" else (64 << 20)
    source = torch.ones(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    seconds = statistics.median(_elapsed(lambda: target.copy_(source), device) for _ in range(rounds))
    return 2 * size / seconds  # the buffers go back to the allocator's cache, emptied before each case


def spec_bandwidth(device_name: str) -> float | None:
    return next((bandwidth for fragment, bandwidth in SPEC_BANDWIDTH if fragment in device_name), None)


# --- memory ---------------------------------------------------------------------------------------


def _host_rss() -> int:
    import psutil  # a dependency of accelerate, so in every set's environment

    return psutil.Process().memory_info().rss


def _host_peak_rss() -> int | None:
    """Linux's high-water mark of this process's RSS (VmHWM), None where /proc does not have it."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(match.group(1)) * 1024 if match else None


def _reset_host_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # "5" resets VmHWM to the current RSS
    except OSError:
        return False
    return True


def _nvml_device(device: torch.device):
    """The NVML handle of `device`, matched by UUID (NVML numbers GPUs regardless of
    CUDA_VISIBLE_DEVICES); None without a GPU, without nvidia-ml-py, or where NVML does not start."""
    if device.type != "cuda":
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            if uuid in str(pynvml.nvmlDeviceGetUUID(handle)):
                return handle
    except pynvml.NVMLError:
        return None
    return None


def _nvml_used(handle) -> int:
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


@functools.cache
def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream every decode graph warms up on: cuBLAS keeps a workspace per stream for the life of the
    process (32 MiB on an H100), so a new stream per case left 32 MiB more behind each case (measured)."""
    return torch.cuda.Stream(device)


def reserve_cublas_workspaces(device: torch.device) -> None:
    """cuBLAS's workspaces for the default and the warm-up stream, taken once a process before any case starts, so
    that none of them counts in whichever case happens to run first."""
    probe = torch.ones(8, 8, device=device, dtype=torch.bfloat16)
    for stream in (torch.cuda.current_stream(device), warmup_stream(device)):
        with torch.cuda.stream(stream):
            probe @ probe
    torch.cuda.synchronize(device)


class MemoryTracker:
    """The memory of one case from the moment it is created: the torch allocator's peak allocated and
    peak reserved bytes (reset here) above what was allocated and reserved here, the device-level use NVML reports
    (every process and the CUDA context included; the highest sample), and host RSS with its peak since here (Linux).

    Above, not absolute: whatever an earlier case of the process still holds would otherwise count in every later
    case, so a case's peaks would depend on the order the cases ran in. Measured on an H100 (seed, tiny): each case
    left 32 MiB behind, a cuBLAS workspace for the new stream its decode graph warmed up on."""

    def __init__(self, device: torch.device):
        self.device = device
        gc.collect()
        if device.type == "cuda":
            torch.cuda.init()  # the allocator's statistics refuse a device CUDA has not started on
            reserve_cublas_workspaces(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        self.allocated_at_start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.reserved_at_start = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
        self.host_rss_at_start = _host_rss()
        self.host_peak_resets = _reset_host_peak_rss()
        self.nvml = _nvml_device(device)
        self.nvml_used_max = None

    def allocated_since_start(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) - self.allocated_at_start if self.device.type == "cuda" else None

    def sample(self) -> dict:
        """Everything measured so far; a key is absent where this device or host cannot measure it."""
        rss = _host_rss()
        memory = {"host_rss_bytes": rss, "host_rss_delta_bytes": rss - self.host_rss_at_start}
        if self.host_peak_resets:
            memory["host_peak_rss_bytes"] = _host_peak_rss()
        if self.device.type == "cuda":
            memory["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device) - self.allocated_at_start
            memory["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device) - self.reserved_at_start
            memory["held_before_the_case_bytes"] = self.allocated_at_start
        if self.nvml is not None:
            self.nvml_used_max = max(self.nvml_used_max or 0, _nvml_used(self.nvml))
            memory["nvml_used_bytes"] = self.nvml_used_max
        return memory


# --- weight sizes ---------------------------------------------------------------------------------


def expected_param_bytes(param: torch.Tensor) -> int:
    """The weight-size arithmetic (`footprint.nf4_bytes`) for a 4-bit weight; any other parameter (embeddings,
    norms, lm_head, LoRA) is numel x its dtype's size."""
    state = getattr(param, "quant_state", None)
    if state is None:
        return param.numel() * param.element_size()
    return footprint.nf4_bytes(state.shape.numel(), state.blocksize, state.nested, state.state2.blocksize if state.nested else 0)


def stored_bytes(param: torch.Tensor) -> int:
    """What the parameter really holds: its storage plus every tensor of its bitsandbytes quant state."""
    state = getattr(param, "quant_state", None)
    return param.nbytes + sum(t.nbytes for t in (scenario.quant_state_tensors(state) if state is not None else ()))


def logical_parameters(model: torch.nn.Module) -> int:
    """Parameter count with 4-bit weights counted unpacked: the same model counts the same in any case."""
    return sum(p.quant_state.shape.numel() if getattr(p, "quant_state", None) is not None else p.numel() for p in model.parameters())


def weight_bytes(model: torch.nn.Module) -> dict:
    """`expected` (expected_param_bytes over the parameters) and `stored` (stored_bytes, buffers
    included) by device type; `meta` is what accelerate offloaded, its weights held in host memory."""
    expected, stored = Counter(), Counter()
    for param in model.parameters():
        expected[param.device.type] += expected_param_bytes(param)
        stored[param.device.type] += stored_bytes(param)
    for buffer in model.buffers():
        stored[buffer.device.type] += buffer.nbytes
    return {"expected": dict(expected), "stored": dict(stored)}


@torch.inference_mode()
def decode_weight_bytes(model: torch.nn.Module, prompt: torch.Tensor) -> int:
    """Bytes of weights one batch-1 decode step reads: the stored bytes of the parameters of every module
    the step runs, found with forward hooks, except that an embedding table is read one row per token.
    lm_head, tied to the token embedding, runs as a Linear and so reads the whole table."""
    cache = model(input_ids=prompt, use_cache=True, logits_to_keep=1).past_key_values
    ran = []
    handles = [m.register_forward_hook(lambda module, args, output: ran.append(module)) for m in model.modules()]
    try:
        model(input_ids=prompt[:, -1:], past_key_values=cache, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    total = 0
    for module in ran:
        for param in module.parameters(recurse=False):
            total += param.shape[-1] * param.element_size() if isinstance(module, torch.nn.Embedding) else stored_bytes(param)
    return total


# --- one case -------------------------------------------------------------------------------------


class CaseRun:
    """One case, loaded: the model under the memory tracker started before the load, its weight bytes and
    logical parameter count, and what every benchmark of the case records."""

    def __init__(self, size: str, case: str, device: torch.device, profile: Profile):
        self.size, self.case, self.device, self.profile = size, case, device, profile
        SIZES[size].prepare()  # a first build (30 GB of GPU memory for the realistic size) is no part of a case
        self.tracker = MemoryTracker(device)
        self.model = load_case(SIZES[size], CASES[case], device)
        self.weights = {"allocated_after_load": self.tracker.allocated_since_start(), **weight_bytes(self.model)}
        self.parameters = logical_parameters(self.model)

    def case_info(self, phase: str, tokens: int, memory: bool = True) -> dict:
        """What a benchmark of `phase` records beside pytest-benchmark's timing stats; `tokens` is what one
        timed round processes, and `memory` samples the tracker (its peaks since before the load)."""
        info = {"size": self.size, "case": self.case, "phase": phase, "tokens": tokens,
                "parameters": self.parameters, "weights": self.weights}
        if memory:
            info["memory"] = self.tracker.sample()
        return info

    def close(self) -> None:
        del self.model
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class InferenceRun(CaseRun):
    """An inference case: its prompts, and the prefill and decode steps the benchmarks time."""

    def __init__(self, size: str, case: str, device: torch.device, profile: Profile):
        super().__init__(size, case, device, profile)
        vocab = self.model.config.get_text_config().vocab_size
        generator = torch.Generator().manual_seed(tiny.SEED)
        tokens = torch.randint(4, vocab, (1, max(profile.prefill_tokens, profile.context_tokens)), generator=generator)
        self.prefill_prompt = tokens[:, : profile.prefill_tokens].to(device)
        self.context = tokens[:, : profile.context_tokens].to(device)
        self.decode_weight_bytes = decode_weight_bytes(self.model, self.context)

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor | None = None):
        """The prompt's forward as generate() runs it: cache on, logits of the last position only."""
        return self.model(input_ids=self.prefill_prompt if prompt is None else prompt, use_cache=True, logits_to_keep=1)

    def start_decode(self) -> tuple[tuple, dict]:
        """Untimed setup of a decode round: prefill the context; the round starts from its cache and next token."""
        output = self.prefill(self.context)
        token = output.logits[:, -1:].argmax(-1)
        synchronize(self.device)
        return (output.past_key_values, token), {}

    @torch.inference_mode()
    def decode(self, cache, token) -> torch.Tensor:
        """`new_tokens` greedy steps on the cache, one token each, as generate() takes them at batch 1
        (without generate()'s per-step host sync for its stopping check). Returns the tokens, (1, new_tokens)."""
        tokens = []
        for _ in range(self.profile.new_tokens):
            logits = self.model(input_ids=token, past_key_values=cache, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            tokens.append(token)
        return torch.cat(tokens, dim=-1)

    def extra_info(self, phase: str) -> dict:
        """case_info, with the weight bytes one decode step reads. Graph phases leave memory out: the graph's
        private pool is the benchmark's, not the stack's, and the case's peaks stay those of the eager phases
        (graph phases run last)."""
        tokens = self.profile.prefill_tokens if phase == "prefill" else self.profile.new_tokens
        info = self.case_info(phase, tokens, memory=not phase.startswith("decode_graph"))
        if phase != "prefill":
            info["decode_weight_bytes_per_token"] = self.decode_weight_bytes
        return info


class TrainingRun(CaseRun):
    """A training case (Case.training): the QLoRA model load_case built, torch's AdamW (its defaults) over
    the LoRA parameters, and the optimizer step the benchmark times on the families' fixed batch. The
    optimizer's state and the step's activations and gradients are allocated under the case's tracker."""

    def __init__(self, size: str, case: str, device: torch.device, profile: Profile):
        super().__init__(size, case, device, profile)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad])
        self.batch_tokens = scenario.training_batch(device, self.model.config)["input_ids"].numel()

    def train_step(self) -> list[float]:
        """One step of scenario.train_steps: zero_grad, forward and backward on the fixed batch, built on the
        case's device, AdamW's step. Returns [the loss]."""
        return scenario.train_steps(scenario.seed_model(self.device), self.model, self.optimizer, 1)

    def extra_info(self, phase: str) -> dict:
        return self.case_info(phase, self.batch_tokens)

    def close(self) -> None:
        del self.optimizer  # its state: two moments per LoRA parameter
        super().close()


# --- the decode replayed from a CUDA graph --------------------------------------------------------


class GraphNotFaithful(Exception):
    """The captured decode's replays do not give the eager decode's tokens: timing it would not time the stack."""


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor a transformers cache holds directly or in its layers (keys, values, length counters)."""
    holders = [cache, *getattr(cache, "layers", ())]
    return [value for holder in holders for value in vars(holder).values() if isinstance(value, torch.Tensor)]


class DecodeGraph:
    """A decode round (InferenceRun.decode from a prefilled context) captured once as a CUDA graph and replayed.

    The graph holds the very kernels the eager round launches, on the same dynamic cache, with the host's
    work between them taken out: its tokens/s is the device time of the stack's kernels, which the host's
    speed does not move. Capturing needs no code path of its own (no static cache, no torch.compile); what
    the capture proves before any timing is that two replays, each after eager work on the device, give
    exactly the tokens of an eager round from the same context (GraphNotFaithful otherwise).
    """

    def __init__(self, run: InferenceRun):
        if run.device.type != "cuda":
            raise GraphNotFaithful("CUDA graphs need a CUDA device")
        (warm_cache, warm_token), _ = run.start_decode()
        (cache, token), _ = run.start_decode()
        # The graph reads the prefill's cache and first token by address, and the capture replaces the
        # cache's own references to them: held here, their memory is never reused while the graph lives.
        self.inputs = [*cache_tensors(cache), token]
        side = warmup_stream(run.device)
        side.wait_stream(torch.cuda.current_stream(run.device))
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
            run.decode(warm_cache, warm_token)
        torch.cuda.current_stream(run.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph):
                self.tokens = run.decode(cache, token)
        except RuntimeError as exc:  # a host sync or a pageable copy in the step: this stack cannot be captured
            raise GraphNotFaithful(f"capture failed: {str(exc).splitlines()[0]}") from exc
        self._check_faithful(run)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.tokens

    def _check_faithful(self, run: InferenceRun) -> None:
        eager = run.decode(*run.start_decode()[0])
        for attempt in ("first", "second"):
            replayed = self.replay()
            synchronize(run.device)
            if not torch.equal(replayed, eager):
                same = int((replayed == eager).sum())
                raise GraphNotFaithful(f"the {attempt} replay gives {same} of the eager decode's {eager.numel()} tokens")
