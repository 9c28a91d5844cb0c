"""Device memory, counted in the bytes torch's CUDA caching allocator hands out: what a model holds, the NF4
arithmetic of a 4-bit layer, and readings taken once unreachable garbage is collected. The building blocks of
the memory contract (tests/contract/train/test_device_memory.py).

Exact bytes can be predicted: `torch.cuda.memory_allocated` rounds each allocation up to 512-byte blocks, so a model
holds the sum of its distinct storages so rounded (`allocator_bytes`), and a 4-bit layer's share follows from its
shape (`nf4_allocations`). Why: docs/internals.md, "harness/memory.py".
"""

from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager

import torch

from stackcheck.harness.load import linear4bit_modules, quant_state_tensors
from stackcheck.harness.proof import require
from stackcheck.harness.subject import UnderTest

BLOCK = 512  # the CUDA caching allocator's smallest block and its rounding unit (c10 kMinBlockSize)


def allocator_bytes(nbytes: int) -> int:
    """What one allocation of `nbytes` adds to `torch.cuda.memory_allocated`: whole 512-byte blocks, at least one."""
    return BLOCK * max(1, math.ceil(nbytes / BLOCK))


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device)


def require_gpu(under_test: UnderTest) -> None:
    require(under_test.device.type == "cuda" and torch.cuda.is_available(), f"{under_test.device} is no CUDA device: no allocator to read")


# How long a reading must stay the same to count as settled, and how many times it is taken again at most.
QUIET_SECONDS = 0.3
QUIET_TRIES = 4


def settled(device: torch.device, deferred_frees: bool = False) -> int:
    """Allocated bytes on `device` once the unreachable cycles the test made are collected (ones a step leaves):
    what live objects hold. A test that reads this is marked `reads_device_memory` (stackcheck.child.gc_freeze.MEMORY_MARK):
    the test before it ended with everything collected, frozen objects too, and CUDA's cache emptied, so what earlier
    tests left is gone before its first reading, and each reading collects only what the collector has not frozen
    (collecting everything at every reading cost device_memory's workers 212 to 251 CPU-seconds a set on one H100,
    24 to 51 since: docs/speed.md, session 18). `deferred_frees`: also let the allocator
    return the blocks of dead tensors that another stream used (`record_stream`, as trl's activation offloading
    does for a tensor it brought back on its copy stream): such a block stays counted until the allocator
    processes its stream's events, at a later allocation or at `empty_cache`, which does (and releases cached
    blocks, which `memory_allocated` does not count). A live tensor stays counted either way.

    Settled means it stays so for QUIET_SECONDS (taken again without another collection, at most QUIET_TRIES
    times, while it falls): on one H100 under 16 xdist workers, a device_memory reading fell by 537 KiB (549888
    bytes; twice that once) within 0.3 s while the test's thread only slept, 9 times in 2592 readings over six runs
    (no Python-visible CUDA tensor alive at a reading died during the 4-bit load after it, in 108 loads; a backward
    of empty tensors before the reading, to let autograd's worker thread finish, changed nothing in 1296 readings).
    Such a drop during the next 4-bit load read as a load holding less than its model, or peaking far above it: a
    false failure. What frees it is not found (docs/speed.md, session 17).
    A leak does not fall, so waiting for the count to stop falling hides none."""
    gc.collect()
    reading = None
    for _ in range(QUIET_TRIES):
        torch.cuda.synchronize(device)
        if deferred_frees:
            torch.cuda.empty_cache()
        previous, reading = reading, allocated(device)
        if previous is not None and reading == previous:
            break
        time.sleep(QUIET_SECONDS)
    return reading


def tensor_storages(tensors, device: torch.device) -> dict[int, int]:
    """Distinct storages (by address) of `tensors` that live on `device`, with their sizes in bytes."""
    storages = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device == device and tensor.untyped_storage().nbytes():
            storage = tensor.untyped_storage()  # an empty one allocates nothing
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a model declares: parameters, buffers, the quant states of its 4-bit layers and of bitsandbytes'
    parametrized weights. Not a tensor kept as a plain attribute (none on any tiny model, transformers 5.6.2 and 5.23.0): a copy a
    library hangs on a module is what the footprint must see."""
    tensors = []
    for module in model.modules():
        tensors += [t for t in module._parameters.values() if t is not None]
        tensors += [t for t in module._buffers.values() if t is not None]
        state = getattr(module._parameters.get("weight"), "quant_state", None)  # not getattr(module, "weight"): a parametrized one dequantizes
        if state is not None:
            tensors += quant_state_tensors(state)
        if hasattr(module, "quant_state") and module.quant_state is not None and hasattr(module.quant_state, "absmax"):
            tensors += quant_state_tensors(module.quant_state)  # bitsandbytes' Bnb4bitParametrization
    return tensors


def held_bytes(tensors, device: torch.device) -> int:
    """What `tensors` occupy in the allocator on `device`: each distinct storage rounded up to whole blocks."""
    return sum(allocator_bytes(n) for n in tensor_storages(tensors, device).values())


def nf4_allocations(values: int, blocksize: int = 64, nested: bool = True, nested_blocksize: int = 256) -> list[int]:
    """The allocations bitsandbytes' `quantize_4bit` leaves for a weight of `values` elements (the code tables
    apart): the packed weight, two 4-bit values a byte; one absmax per block, fp32 or, with double quant, 8-bit
    plus its fp32 offset and one fp32 absmax per `nested_blocksize` of them. The arithmetic of
    `stackcheck.models.footprint.nf4_bytes`, allocation by allocation."""
    blocks = math.ceil(values / blocksize)
    if not nested:
        return [math.ceil(values / 2), 4 * blocks]
    return [math.ceil(values / 2), blocks, 4, 4 * math.ceil(blocks / nested_blocksize)]


def nf4_arithmetic(model: torch.nn.Module, device: torch.device) -> tuple[int, int, int]:
    """(the NF4 arithmetic of every 4-bit layer, from its shape; the code tables its quant states hold; every other
    tensor the model holds, as stored), in allocator bytes on `device`. The first counts nothing the layer
    holds: a layer that keeps its weight in 16 bits, or a copy beside the packed one, is off by that copy."""
    layers = linear4bit_modules(model)
    arithmetic = 0
    for layer in layers.values():
        state = layer.weight.quant_state
        require(state is not None, "a 4-bit layer holds no quant state")
        arithmetic += sum(allocator_bytes(n) for n in nf4_allocations(layer.in_features * layer.out_features, state.blocksize, bool(state.nested)))
    tables = [t for layer in layers.values() for t in (layer.weight.quant_state.code,
                                                       *((layer.weight.quant_state.state2.code,) if layer.weight.quant_state.nested else ()))]
    quantized = {id(t) for layer in layers.values() for t in (layer.weight, *quant_state_tensors(layer.weight.quant_state))}
    others = [t for t in model_tensors(model) if id(t) not in quantized]
    table_storages = tensor_storages(tables, device)
    other_storages = {ptr: n for ptr, n in tensor_storages(others, device).items() if ptr not in table_storages}
    return (arithmetic, sum(allocator_bytes(n) for n in table_storages.values()),
            sum(allocator_bytes(n) for n in other_storages.values()))


def largest_weight_bf16_bytes(under_test: UnderTest) -> int:
    """The bytes of the model's largest weight in bf16 (built on meta): the most one tensor the loader converts or
    quantizes weighs before it is quantized, a fused experts parameter (assembled from its per-expert tensors)
    included."""
    from stackcheck.models import tiny

    with torch.device("meta"):
        skeleton = tiny.model_class(under_test.arch)(tiny.tiny_config(under_test.arch))
    return max(p.numel() * 2 for p in skeleton.parameters())


def quantized_weights_bf16_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(the bf16 bytes of every weight the load quantized, of the largest one): what a loader that held the whole
    bf16 model on the GPU before quantizing would hold beyond the 4-bit model, and what a 4-bit layer keeping its
    largest weight in bf16 beside the packed one would add."""
    sizes = [layer.in_features * layer.out_features * 2 for layer in linear4bit_modules(model).values()]
    require(sizes, "the model has no bnb Linear4bit")
    return sum(sizes), max(sizes)


# --- bitsandbytes' parametrized 4-bit weights: how a user quantizes the fused experts bnb's Linear4bit skips ---------


def quantize_fused_experts(model: torch.nn.Module) -> dict[str, int]:
    """Quantize every fused experts parameter of a mixture of experts to NF4 with double quant through
    `bitsandbytes.nn.parametrize.replace_parameter_4bit`: the way bitsandbytes offers for weights outside an
    nn.Linear (bitsandbytes#1849: transformers 5 fuses the experts into 3-D parameters that load_in_4bit leaves in
    bf16), which axolotl's MoE quantization takes too. Each access dequantizes the weight; hooks on the owning module
    keep the dequantized copy in torch's parametrization cache for one forward. Returns the parametrized weights'
    dequantized (bf16) bytes, by name; empty for a model without fused experts."""
    from bitsandbytes.nn.parametrize import replace_parameter_4bit

    from stackcheck.models.footprint import fused_experts

    modules = dict(model.named_modules())
    dequantized = {}
    for name, param in fused_experts(model).items():
        owner, _, attr = name.rpartition(".")
        dequantized[name] = param.numel() * param.element_size()
        replace_parameter_4bit(modules[owner], attr, compress_statistics=True, quant_type="nf4")
    return dequantized


def parametrized_4bit_owners(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules holding a weight that bitsandbytes' `Bnb4bitParametrization` dequantizes, by name."""
    from torch.nn.utils import parametrize

    owners = {}
    for name, module in model.named_modules():
        if parametrize.is_parametrized(module):
            kinds = {type(p).__name__ for plist in module.parametrizations.values() for p in plist}
            if "Bnb4bitParametrization" in kinds:
                owners[name] = module
    return owners


def attention_targets(model: torch.nn.Module) -> list[str]:
    """The full names of the 4-bit linear layers inside the decoder layers' attention (softmax or linear): LoRA
    targets every architecture has, away from the experts (PEFT rewrites targets it takes for expert projections on
    a mixture of experts, bugs of their own that the adapt contract reads)."""
    from stackcheck.harness.place import decoder_layers, module_name

    layers = [module_name(model, layer) for layer in decoder_layers(model)]
    targets = [name for name in linear4bit_modules(model)
               if any(name.startswith(layer + ".") for layer in layers) and any(part.endswith(("attn", "attention")) for part in name.split("."))]
    require(targets, "the decoder layers hold no 4-bit attention projection to put a LoRA on")
    return targets


# --- Training steps, measured between them ----------------------------------------------------------------------------


def warm_up_kernels(device: torch.device) -> None:
    """Run a matmul forward and backward, fp32 and under bf16 autocast, with and without a bias, once: cuBLAS and
    cuBLASLt keep a workspace per (handle, stream), allocated from the caching allocator at a thread's first matmul
    and held for the process, and autograd runs the backward on a thread of its own. Without this, the first step's
    backward adds that workspace (megabytes) to the count once, a constant no model holds."""
    x = torch.randn(64, 64, device=device, requires_grad=True)
    for autocast in (False, True):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            y = torch.nn.functional.linear(x, x, x[0]) + torch.nn.functional.linear(x, x)
        y.float().sum().backward()
    del x, y


def qlora_with_quantized_experts(under_test: UnderTest, use_reentrant: bool | None, lora_seed: int = 0):
    """PEFT's QLoRA recipe on the 4-bit base, with the fused experts of a mixture of experts quantized too
    (`quantize_fused_experts`): `prepare_model_for_kbit_training` with gradient checkpointing off (None) or on
    (`use_reentrant` True or False, as users pass it in gradient_checkpointing_kwargs), then a LoRA on the attention
    projections (`attention_targets`), B random too so that every LoRA tensor trains from the first step. Returns the
    model in training mode and the parametrized weights' dequantized bytes, by name."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    from stackcheck.harness.load import first_nested_linear4bit, load_base
    from stackcheck.models import tiny

    base = load_base(under_test)
    first_nested_linear4bit(base)
    dequantized = quantize_fused_experts(base)
    targets = attention_targets(base)
    kwargs = {"use_reentrant": use_reentrant} if use_reentrant is not None else None
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=use_reentrant is not None, gradient_checkpointing_kwargs=kwargs)
    torch.manual_seed(lora_seed)
    model = get_peft_model(base, tiny.lora_config(under_test.arch, "language", target_modules=targets, init_lora_weights=False))
    model.train()
    return model, dequantized


@contextmanager
def forward_calls(modules: dict[str, torch.nn.Module]):
    """Counts the forwards of `modules` inside the block: {name: calls}, filled as they run."""
    calls = dict.fromkeys(modules, 0)
    handles = [module.register_forward_pre_hook(lambda m, args, name=name: calls.__setitem__(name, calls[name] + 1))
               for name, module in modules.items()]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


@contextmanager
def parametrization_cache_kept():
    """Leaves torch's global parametrization cache as the block found it: a bitsandbytes whose cache-gate hooks
    leak the counter (bitsandbytes PR #1999) would otherwise keep the cache on for every later test of the process,
    serving stale values to any parametrized weight (PEFT's LoRA on fused experts is one). Restored after the
    measurement, never during it."""
    from torch.nn.utils import parametrize

    enabled = parametrize._cache_enabled
    try:
        yield
    finally:
        parametrize._cache_enabled = enabled
        if not enabled:
            parametrize._cache = {}


# --- trl's activation offloading, as SFTTrainer(activation_offloading=True) applies it ---------------------------------


def trl_activation_offloading(model: torch.nn.Module):
    """trl's activation offloading context for `model`, built as SFTTrainer builds it once at its start
    (`get_act_offloading_ctx_manager(model=self.model)`, on the PeftModel, defaults: pinned memory, a copy stream,
    tensors of 1024 bytes or more) and entered around each step's forward and backward (its `training_step`; the
    optimizer steps outside it). trl is imported here, not at the module's import: `require_trl_offloading` first."""
    from accelerate import PartialState
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    # SFTTrainer has built its Accelerator by then, and trl logs through accelerate's logger, which needs that state
    # (a process whose first trl call is this one raises 'You must initialize the accelerate state').
    PartialState()

    return get_act_offloading_ctx_manager(model=model)


def offloaded_to_cpu(context) -> tuple[int, int]:
    """(tensors, bytes) that trl's offloading context holds on the CPU for the backward, read from its tracker
    between a forward and its backward: each entry's first item is the tensor it will hand back, its second whether
    the tensor was offloaded (trl 1.16.0 adds strides and shapes after them; its earlier releases kept the pair)."""
    moved = [entry[0] for entry in context.tracker.values() if entry[1]]
    on_cpu = [t for t in moved if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    return len(on_cpu), sum(t.numel() * t.element_size() for t in on_cpu)


def require_trl_offloading() -> None:
    """NotApplicable where trl, or its activation offloading, is not installed: no SFTTrainer to apply it."""
    from stackcheck.models.tiny import NotApplicable

    try:
        import trl.models.activation_offloading  # noqa: F401
    except ImportError as exc:
        raise NotApplicable(f"trl's activation offloading is not installed ({exc})") from exc


def still_tracked(context, device: torch.device) -> tuple[int, int]:
    """(saved tensors, allocator bytes of those on `device`) that trl's offloading context still tracks: read
    after a backward, the saved tensors no backward unpacked (their node never ran), which trl keeps until the
    next step enters the context (1.5.0 and later clear its state there, trl PR #5730) or for good (earlier)."""
    kept = [entry[0] for entry in context.tracker.values()]
    return len(kept), held_bytes(kept, device)
