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
  0.50.2 an empty cache; the tiny Qwen3-Next's early stop falls outside its experts (no leak).
  **Under trl's activation offloading** (axis value `trl_offloading`, what `SFTConfig(activation_offloading=True)`
  runs: `get_act_offloading_ctx_manager(model=<the PeftModel>)` built once, entered around each step's forward and
  backward as SFTTrainer's `training_step` does, the optimizer stepping outside it; SFTConfig's default checkpointing,
  non-reentrant) what is allocated between steps does not grow from the first step on, and the saved tensors the context still tracks after a backward (those no
  backward node unpacked) do not accumulate from step to step, exactly. trl before 1.5.0 reset its state only once
  every saved tensor was unpacked: one that never is kept its tracker entries and flags from step to step (its
  stashes too before trl PR #5700), a CUDA leak (trl PR #5730, fixed by clearing that state on entering the context; axolotl#3638: Gemma 4 QLoRA, OOM by step
  2). The tiny Gemma 4 reaches it: a 12-byte bool saved tensor is never unpacked. Measured on the CPU with trl's
  accelerator pointed at the CPU (a probe, not this test): trl 1.16.0 tracked 1 saved tensor after each of 4
  backwards, trl 1.4.0 1, 2, 3, 4 (on a GPU one 512-byte block a step, within `STEP_BLOCKS`: hence the exact count); every
  other tiny model 0. Between a forward and its backward trl 1.16.0 held 4 tensors (30720 bytes) on the CPU on the
  tiny Llama 3, Phi-4, Qwen3, Qwen3-MoE and Mixtral, 6 (43008) on Qwen3-Next, 8 on Gemma 3 (55296; 54272 the
  multimodal), 9 (38400) on Gemma 4: the final norm's and the loss's saved tensors, outside the checkpointed layers.
  It hands some tensors it brought back to the compute stream (`record_stream`: 2 a step on the tiny Llama 3), whose
  blocks the allocator counts until it processes their events: this cell reads after `empty_cache`, which does (a
  live tensor stays counted).

Precondition proven: the model is on the GPU, its 4-bit layers hold nested NF4 quant states; for the load peak, the
bf16 bytes of the weights the load quantized exceed the allowance, so that a loader holding them all is told apart
(measured on the tiny models: 533 to 1792 KiB quantized against allowances of 96 to 256 KiB, Qwen3-Next 903 against
512; not applicable on the tiny Mixtral and Qwen3-MoE, whose fused experts stay in bf16 (`bnb_fused_experts_unquantized`):
192 KiB quantized against 1024 and 512); for the footprint, the tolerance is below half the bf16 bytes of the largest
4-bit weight (16 KiB on the tiny Gemma 4, 32 to 128 KiB on the others), so a layer keeping that weight in bf16 shows;
for the steps, every decoder layer ran under checkpointing (or none, off), every step's loss is finite, the LoRA
weights moved, and on a mixture of experts the parametrized experts ran in every step; under trl's offloading,
every step's forward left tensors on the CPU in its tracker (not applicable where trl is not installed).

Tolerances, in allocator blocks (512 bytes): the allocator's rounding is computed, not tolerated. On the CPU the same
arithmetic (storages rounded to blocks) equals what the loaded model holds to the byte on all nine tiny models (seed).
`FOOTPRINT_BLOCKS` (8, 4 KiB) leaves room for the one dynamic code table bitsandbytes caches per process at its first
double-quant quantization (1 KiB, held by no model). `STEP_BLOCKS` the same: a step should free everything; the one
thing known to stay is the tiny Gemma 4's never-unpacked saved tensor under trl 1.16.0's offloading, one block (512
bytes in the CPU probe's arithmetic), held until the next step enters the context and not growing. Before the count
starts, a matmul forward and backward warms up the cuBLAS workspaces (held per thread for the process) and one forward without gradients lets the model create what it creates at its first call.

Measured on an H100 (set seed: bitsandbytes 0.49.2, trl 1.16.0): the load peak, the NF4 footprint and the steps
without offloading pass on all nine tiny models, to the block; the tiny Mixtral and Qwen3-MoE under non-reentrant
checkpointing hold their dequantized experts (`bnb_parametrize_cache_leak_nonreentrant`, its 0.99 to 1.01 band met on
the GPU). Under trl's offloading every model held a constant between steps (-88.5 to +12 KiB; with trl 1.4.0 on
latest, +12 KiB on eight models), which is why that axis judges the growth; trl 1.4.0 on the tiny Gemma 4 tracked
1, 2, 3, 4 saved tensors after the four backwards (512 bytes each), trl 1.16.0 one at every step.
"""

import contextlib

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.harness import memory
from stackcheck.models.tiny import NotApplicable

pytestmark = [pytest.mark.gpu, pytest.mark.reads_device_memory]

LOADER_FACTOR = 2
FOOTPRINT_BLOCKS = 8
STEP_BLOCKS = 8
STEPS = 4
TRL_OFFLOADING = "trl_offloading"
CHECKPOINTING = {"off": None, "reentrant": True, "non_reentrant": False, TRL_OFFLOADING: TRL_OFFLOADING}
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
    offloading = checkpointing == TRL_OFFLOADING
    if offloading:
        memory.require_trl_offloading()
    memory.warm_up_kernels(device)
    # trl's activation offloading rides on SFTConfig's default checkpointing: on, non-reentrant (transformers 5's
    # default, which SFTTrainer keeps; it sets the same for transformers 4).
    model, dequantized = memory.qlora_with_quantized_experts(under_test, False if offloading else checkpointing)
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
    # Built once on the PeftModel, entered around each step's forward and backward: SFTTrainer's way.
    offload = memory.trl_activation_offloading(model) if offloading else None
    excess, losses, offloaded, tracked = [], [], [], []
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
        before = memory.settled(device, deferred_frees=offloading)
        for step in range(STEPS):
            with offload if offloading else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = model(**batch).loss
                if offloading:
                    offloaded.append(memory.offloaded_to_cpu(offload))
                loss.backward()
            if offloading:
                tracked.append(memory.still_tracked(offload, device))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            del loss
            if step == 0 and checkpointing is None:
                seen.require_none()
            elif step == 0:
                seen.require_all()
            state = memory.held_bytes(memory.optimizer_state_tensors(optimizer), device)
            excess.append(memory.settled(device, deferred_frees=offloading) - before - state)
    scenario.require(all(torch.isfinite(torch.tensor(losses))), f"losses {losses}")
    scenario.require(any(not torch.equal(initial[name], p.detach().cpu()) for name, p in lora.items()), "the steps moved no LoRA tensor")
    stepped = {name: calls[name] - warm_up_calls[name] for name in owners}
    scenario.require(all(n >= STEPS for n in stepped.values()), f"the parametrized experts did not run in every step: {stepped}")
    if offloading:
        scenario.require(all(n > 0 for n, _bytes in offloaded), f"trl's activation offloading moved no tensor to the CPU in some "
                                                               f"step: (tensors, bytes) by step {offloaded}")
        print(f"stackcheck measured: trl's offloading held on the CPU between forward and backward (tensors, bytes) by step "
              f"{offloaded}; saved tensors it still tracked after each backward (tensors, bytes on the GPU): {tracked}")
    print(f"stackcheck measured: allocated between steps beyond the model and the optimizer's state, by step: {excess} bytes")
    if offloading:
        # trl's context holds a constant of its own between steps (its streams' blocks): measured on an H100, -88.5 to
        # +12 KiB beyond the model and the optimizer's state, the same at every step, on each tiny model (seed, trl
        # 1.16.0; latest with trl 1.4.0: +12 KiB). So the first step is the reference here and the growth is judged; a
        # cache that keeps what it should drop from the first step on is the non_reentrant cell's to catch.
        scenario.assert_within(f"allocated between steps grows under trl's activation offloading ({STEPS} steps, the first "
                               "the reference): largest growth, KiB", max(abs(e - excess[0]) for e in excess) / KIB,
                               STEP_BLOCKS * memory.BLOCK / KIB,
                               judged_by=("GPU bytes trl's offloading still tracked after the last backward:", tracked[-1][1]))
    else:
        if dequantized:
            judged_by = ("the excess over the dequantized bytes of the parametrized experts:",
                         max(excess) / sum(memory.allocator_bytes(n) for n in dequantized.values()))
        else:
            judged_by = ("growth from the first step to the last, KiB:", (excess[-1] - excess[0]) / KIB)
        scenario.assert_within(f"allocated between steps is not what the model held before them plus the optimizer's state "
                               f"({STEPS} steps): largest difference, KiB", max(abs(e) for e in excess) / KIB,
                               STEP_BLOCKS * memory.BLOCK / KIB, judged_by=judged_by)
    if offloading:
        scenario.assert_within("saved tensors trl's activation offloading still tracked after a backward accumulate across steps: "
                               f"growth from the first step to the last, of {STEPS}", tracked[-1][0] - tracked[0][0], 0,
                               judged_by=("the GPU bytes they hold, growth:", tracked[-1][1] - tracked[0][1]))
