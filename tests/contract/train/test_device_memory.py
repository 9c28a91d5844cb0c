"""Device memory along the QLoRA journey: what loading and training hold on the GPU, judged in the exact bytes of
torch's CUDA caching allocator against the NF4 arithmetic and what the model and the optimizer hold.

Properties, preconditions, tolerances and measurements: docs/family-notes.md#device_memory.
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
