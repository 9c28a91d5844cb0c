"""Device memory along the QLoRA journey: what loading and training hold on the GPU, judged in the exact bytes of
torch's CUDA caching allocator against the NF4 arithmetic and what the model and the optimizer hold.

Properties, on every architecture (GPU lane only: the allocator's statistics are the measure, and the CPU has none
that counts a process's tensors exactly):
- **Loading peaks near the 4-bit model.** `from_pretrained(..., quantization_config=NF4, device_map={"": 0})` holds
  at its peak no more than the loaded model plus the working set of one weight: the largest weight in bf16, twice
  (`LOADER_FACTOR`). A loader that quantizes while loading needs one bf16 weight on the GPU at a time, plus
  bitsandbytes' temporaries for it (the fp32 absmax and, with double quant, its centred copy and 8-bit code: 7% of
  the weight's bf16 bytes), or a fused experts parameter's per-expert sources while it assembles them (1x). Catches
  a loader that moves the bf16 checkpoint to the GPU before quantizing (transformers#43032: OOM under transformers 5
  where 4.48 loaded in ~9 GB; transformers 5.6.2 loads synchronously under on-the-fly quantization, "to avoid worker
  threads loading full-precision tensors to GPU faster than the main thread can quantize them").
- **The loaded model weighs the NF4 arithmetic.** Allocated after the load equals, within `FOOTPRINT_BLOCKS`
  allocator blocks, the NF4 arithmetic of every 4-bit layer from its shape (packed weight n/2 bytes, 8-bit absmax per
  64 values, its fp32 offset, one fp32 absmax per 256 of those) plus the code tables its quant states hold plus every
  other tensor the model holds as stored (the parameters left in bf16, buffers): each allocation rounded up to the
  allocator's 512-byte block. Catches a 4-bit layer that keeps its bf16 weight, a copy the loader leaves alive, a
  config that fitted on one release and OOMs on the next (axolotl#3374). Which weights a 4-bit config must quantize
  is `quantized_experts`' and `load_quantized_layers`' business (a fused expert left in bf16 counts here as stored).
- **A training step frees what it allocates.** Through PEFT's QLoRA recipe (prepare_model_for_kbit_training with
  gradient checkpointing off, reentrant or non-reentrant; a LoRA on the attention projections; AdamW; bf16
  autocast as the Trainer's bf16=True), after each of `STEPS` steps the allocated bytes equal those before the first
  step plus the optimizer's state, exactly: a leak per step shows at every step, a leak bounded after the first step
  (a cache that keeps what it should drop) shows too, which a comparison of step k with step 2 would miss. On a
  mixture of experts the fused experts are quantized the way bitsandbytes offers for them
  (`bitsandbytes.nn.parametrize.replace_parameter_4bit`, bitsandbytes#1849's route, axolotl's too), so the cell
  reaches bitsandbytes' parametrize path: under non-reentrant checkpointing its cache-gate hooks lost their forward
  hook when the recompute stops early, the global parametrization cache was never cleared again and every
  dequantized expert stayed resident (bitsandbytes PR #1999, issue #2005; 0.48 to 0.49.x, fixed in 0.50.0 by
  `always_call=True`). A failure reports the excess over those dequantized bytes (1.0: exactly the dequantized
  experts retained). Measured on the CPU (seed, bitsandbytes 0.49.2, tiny Mixtral, non-reentrant): the cache's
  counter rose by 4 a step (two parametrized weights in each of two layers) and it held 4 tensors, 1572864 bytes:
  every expert dequantized to bf16; the tiny Qwen3-MoE alike (786432 bytes); 0.48.2 and 0.49.0 as 0.49.2, 0.50.0 and
  0.50.2 an empty cache; the tiny Qwen3-Next's early stop falls outside its experts (no leak). Also the class of trl
  PR #5730 (activation offloading keeping bitsandbytes'
  dequantization buffers).

Precondition proven: the model is on the GPU, its 4-bit layers hold nested NF4 quant states; for the load peak, the
bf16 bytes of the weights the load quantized exceed the allowance, so that a loader holding them all is told apart
(measured on the tiny models: 533 to 1792 KiB quantized against allowances of 96 to 256 KiB, Qwen3-Next 903 against
512; not applicable on the tiny Mixtral and Qwen3-MoE, whose fused experts stay in bf16 (`bnb_fused_experts_unquantized`):
192 KiB quantized against 1024 and 512); for the footprint, the tolerance is below half the bf16 bytes of the largest
4-bit weight (16 KiB on the tiny Gemma 4, 32 to 128 KiB on the others), so a layer keeping that weight in bf16 shows;
for the steps, every decoder layer ran under checkpointing (or none, off), every step's loss is finite, the LoRA
weights moved, and on a mixture of experts the parametrized experts ran in every step.

Tolerances, in allocator blocks (512 bytes): the allocator's rounding is computed, not tolerated. On the CPU the same
arithmetic (storages rounded to blocks) equals what the loaded model holds to the byte on all nine tiny models (seed).
`FOOTPRINT_BLOCKS` (8, 4 KiB) leaves room for the one dynamic code table bitsandbytes caches per process at its first
double-quant quantization (1 KiB, held by no model). `STEP_BLOCKS` the same, for nothing known: a step should free
everything. Before the count starts, a matmul forward and backward warms up the cuBLAS workspaces (held per thread
for the process) and one forward without gradients lets the model create what it creates at its first call. Not yet
run on a GPU.
"""

import pytest
import torch

from stackcheck import scenario
from stackcheck.harness import memory
from stackcheck.models.tiny import NotApplicable

pytestmark = pytest.mark.gpu

LOADER_FACTOR = 2
FOOTPRINT_BLOCKS = 8
STEP_BLOCKS = 8
STEPS = 4
CHECKPOINTING = {"off": None, "reentrant": True, "non_reentrant": False}
KIB = 1024


def measured_load(under_test):
    """The user's 4-bit load onto GPU 0, measured: (model, allocated by it, its peak over what it left allocated)."""
    memory.require_gpu(under_test)
    device = under_test.device
    before = memory.settled(device)
    torch.cuda.reset_peak_memory_stats(device)
    model = scenario.load_base(under_test)
    after = memory.settled(device)
    peak = torch.cuda.max_memory_allocated(device)
    placed = {p.device for p in model.parameters()}
    scenario.require(placed == {device}, f"device_map={{'': 0}} put the model on {placed}")
    scenario.first_nested_linear4bit(model)
    return model, after - before, peak - after


def test_loading_peaks_near_the_4bit_model(under_test):
    model, _loaded, excess = measured_load(under_test)
    quantized_bf16, _largest = memory.quantized_weights_bf16_bytes(model)
    largest = memory.largest_weight_bf16_bytes(under_test)
    allowance = LOADER_FACTOR * memory.allocator_bytes(largest)
    if allowance >= quantized_bf16:
        raise NotApplicable(f"the tiny {under_test.arch.name} quantizes {quantized_bf16 // KIB} KiB of bf16 weights, within the "
                            f"allowance for its largest weight ({allowance // KIB} KiB): a loader holding them all is not told apart")
    scenario.assert_within(f"loading held more than the 4-bit model plus {LOADER_FACTOR}x its largest bf16 weight "
                           f"({largest // KIB} KiB): peak over the loaded model, in units of that allowance", excess / allowance, 1.0,
                           judged_by=("the excess over the bf16 bytes of every weight the load quantized:", excess / quantized_bf16))


def test_the_loaded_model_weighs_the_nf4_arithmetic(under_test):
    model, loaded, _excess = measured_load(under_test)
    device = under_test.device
    arithmetic, tables, others = memory.nf4_arithmetic(model, device)
    expected = arithmetic + tables + others
    held = memory.held_bytes(memory.model_tensors(model), device)
    _total, largest = memory.quantized_weights_bf16_bytes(model)
    tolerance = FOOTPRINT_BLOCKS * memory.BLOCK
    scenario.require(tolerance < largest // 2, f"the tolerance ({tolerance} bytes) would hide a bf16 copy of the largest 4-bit "
                                               f"weight ({largest} bytes)")
    print(f"stackcheck measured: allocated by the load {loaded} bytes; NF4 arithmetic {arithmetic}, code tables {tables}, "
          f"other tensors {others}; held by the model {held}")
    scenario.assert_within("the loaded 4-bit model's allocated bytes differ from the NF4 arithmetic: |allocated - arithmetic|, KiB",
                           abs(loaded - expected) / KIB, tolerance / KIB,
                           judged_by=("allocated beyond what the model holds, KiB:", (loaded - held) / KIB))


@pytest.mark.axes(checkpointing=CHECKPOINTING)
def test_a_training_step_frees_what_it_allocates(under_test, checkpointing):
    memory.require_gpu(under_test)
    device = under_test.device
    memory.warm_up_kernels(device)
    model, dequantized = memory.qlora_with_quantized_experts(under_test, checkpointing)
    owners = memory.parametrized_4bit_owners(model)
    scenario.require(bool(owners) == bool(dequantized), f"{len(dequantized)} fused experts quantized, {len(owners)} modules "
                                                        "hold bitsandbytes' parametrized 4-bit weights")
    placed = {p.device for p in model.parameters()}
    scenario.require(placed == {device}, f"the QLoRA model sits on {placed}")
    lora = {name: p for name, p in model.named_parameters() if p.requires_grad}
    scenario.require(lora and all("lora_" in name for name in lora), f"trainable tensors: {sorted(lora)[:4]}")
    initial = {name: p.detach().cpu().clone() for name, p in lora.items()}
    optimizer = torch.optim.AdamW(list(lora.values()), lr=1e-3)
    batch = scenario.training_batch(device, model.config)
    excess, losses = [], []
    with memory.parametrization_cache_kept(), memory.forward_calls(owners) as calls:
        # One forward without gradients first: whatever the model creates at its first call (a rotary table it
        # swaps) is made before the count starts. In eval mode no layer checkpoints, and the parametrization
        # hooks run both halves.
        model.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            model(**batch)
        model.train()
        warm_up_calls = dict(calls)
        seen = scenario.CheckpointingSeen(model)
        before = memory.settled(device)
        for step in range(STEPS):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            del loss
            if step == 0 and checkpointing is None:
                seen.require_none()
            elif step == 0:
                seen.require_all()
            state = memory.held_bytes(memory.optimizer_state_tensors(optimizer), device)
            excess.append(memory.settled(device) - before - state)
    scenario.require(all(torch.isfinite(torch.tensor(losses))), f"losses {losses}")
    scenario.require(any(not torch.equal(initial[name], p.detach().cpu()) for name, p in lora.items()), "the steps moved no LoRA tensor")
    stepped = {name: calls[name] - warm_up_calls[name] for name in owners}
    scenario.require(all(n >= STEPS for n in stepped.values()), f"the parametrized experts did not run in every step: {stepped}")
    print(f"stackcheck measured: allocated between steps beyond the model and the optimizer's state, by step: {excess} bytes")
    if dequantized:
        judged_by = ("the excess over the dequantized bytes of the parametrized experts:",
                     max(excess) / sum(memory.allocator_bytes(n) for n in dequantized.values()))
    else:
        judged_by = ("growth from the first step to the last, KiB:", (excess[-1] - excess[0]) / KIB)
    scenario.assert_within(f"allocated between steps is not what the model held before them plus the optimizer's state "
                           f"({STEPS} steps): largest difference, KiB", max(abs(e) for e in excess) / KIB,
                           STEP_BLOCKS * memory.BLOCK / KIB, judged_by=judged_by)
