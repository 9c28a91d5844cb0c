"""Contract, train: bitsandbytes' 8-bit and paged AdamW track torch's AdamW on a QLoRA run.

The user's journey: the QLoRA paper's optimizer, `optim="paged_adamw_8bit"` in transformers' Trainer (or
`adamw_8bit`, `paged_adamw_32bit`), instead of torch's AdamW, to save the optimizer state's memory. The user expects
the same training, up to the 8-bit state's rounding.

The property, the bugs it catches, preconditions and tolerances: docs/family-notes.md#optimizers_track_adamw.
"""

import functools
import math

import pytest
import torch

from stackcheck.harness import scenario, surfaces

STEPS = 3
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
TOLERANCE = {32: 1e-3, 8: 0.1}
FLOOR_FACTOR = 10
# A uniform scale of every step that the 32-bit cells accept, judged beside it (`Run.step_scale`); SCALE_PROBE is the
# learning-rate change whose run gives the direction such a scale moves the weights in.
STEP_SCALE = 1e-4
SCALE_PROBE = 1e-4
# How far below its tensor's largest an element's gradient scale may be for an 8-bit state to represent it.
DYNAMIC_RANGE = 100.0
# bitsandbytes' default compute dtype: why not bf16, docs/family-notes.md#optimizers_track_adamw.
COMPUTE_DTYPE = torch.float32
# bitsandbytes' AdamW by its constructor's arguments, from the axis model: the state's bits, and paging.
BNB_OPTIM = surfaces.model_axes("bnb_optim", "optim_bits", "is_paged")


class Run:
    """One QLoRA model of an architecture, its LoRA's starting weights, and torch's AdamW run from them (built once per
    architecture and device, the AdamW run when a cell first asks for it: each cell starts its optimizer from the same
    weights)."""

    def __init__(self, under_test):
        self.under_test = under_test
        base = scenario.load_base_in(under_test, COMPUTE_DTYPE)
        scenario.first_nested_linear4bit(base)
        self.model = scenario.kbit_lora_model(under_test, base, use_reentrant=None)
        self.lora = scenario.lora_reached_by_text(self.model)
        self.start = {name: p.detach().clone() for name, p in self.lora.items()}
        self.reference: dict[str, torch.Tensor] = {}
        self.reference_losses: list[float] = []
        self.represented: dict[str, torch.Tensor] = {}
        # Per LoRA tensor: |m| / sqrt(v) of torch's AdamW after the last step, both bias-corrected (1 where the steps'
        # gradients are equal, near 0 where they cancel): how an element's step depends on its gradients' agreement.
        self.agreement: dict[str, torch.Tensor] = {}
        self.floor: float | None = None
        self.scaled: dict[str, torch.Tensor] | None = None

    def train(self, make_optimizer):
        """STEPS steps from the starting weights: the LoRA weights after them, the losses, the optimizer."""
        with torch.no_grad():
            for name, p in self.lora.items():
                p.copy_(self.start[name])
                p.grad = None
        optimizer = make_optimizer(list(self.lora.values()))
        losses = scenario.train_steps(self.under_test, self.model, optimizer, STEPS)
        return {name: p.detach().clone() for name, p in self.lora.items()}, losses, optimizer

    def torch_adamw(self) -> None:
        if not self.reference:
            self.reference, self.reference_losses, optimizer = self.train(lambda params: torch.optim.AdamW(params, **ADAMW))
            self.require_moved()  # a tensor without a gradient has no AdamW state to read below
            # The elements an 8-bit blockwise state represents to within its precision: those whose gradient scale
            # (the square root of AdamW's second moment) is within DYNAMIC_RANGE of the largest in their tensor, so
            # within it of their block's largest too.
            for name, p in self.lora.items():
                scale = optimizer.state[p]["exp_avg_sq"].sqrt()
                self.represented[name] = scale >= scale.max() / DYNAMIC_RANGE
                (beta1, beta2), corrected = ADAMW["betas"], optimizer.state[p]["exp_avg"].abs() / scale.clamp_min(torch.finfo(scale.dtype).tiny)
                self.agreement[name] = corrected * math.sqrt(1 - beta2**STEPS) / (1 - beta1**STEPS)
        self.require_moved()

    def require_moved(self) -> None:
        still = [name for name, p in self.reference.items() if torch.equal(p, self.start[name])]
        scenario.require(not still, f"torch's AdamW did not move {len(still)} of {len(self.lora)} LoRA tensors: {still}")

    def rounding_floor(self) -> float:
        """How far another correct implementation of the same float32 AdamW lands from torch's default on this device
        and model: torch's fused AdamW (one kernel, its own order of operations) against it, worst LoRA tensor over
        every element. Roundings that differ in the last bit change the next forward's gradients, and Adam, which
        normalizes each element's step, carries that into the steps of the elements of small gradients."""
        if self.floor is None:
            self.torch_adamw()
            fused, _losses, _optimizer = self.train(lambda params: torch.optim.AdamW(params, **ADAMW, fused=True))
            self.floor = max(update_errors(self, fused).values())
        return self.floor

    def step_scale(self, weights: dict[str, torch.Tensor]) -> tuple[float, float]:
        """The uniform scale of every step that brings torch's AdamW nearest to `weights`, and the worst LoRA tensor's
        relative error (against the way it moved) left beside it. The direction such a scale moves the weights in is
        torch's own AdamW at lr x (1 + SCALE_PROBE) less its run at lr; the scale is the deviation's projection on it,
        over every LoRA tensor at once (one scale for the whole step)."""
        if self.scaled is None:
            self.torch_adamw()
            self.scaled, _losses, _optimizer = self.train(lambda params: torch.optim.AdamW(params, **{**ADAMW, "lr": ADAMW["lr"] * (1 + SCALE_PROBE)}))
        deviation = {name: (weights[name] - self.reference[name]).double() for name in self.lora}
        direction = {name: (self.scaled[name] - self.reference[name]).double() for name in self.lora}
        along = sum((deviation[name] * direction[name]).sum() for name in self.lora)
        length = sum(direction[name].pow(2).sum() for name in self.lora)
        fitted = (along / length).item() if length > 0 else 0.0
        left = {name: ((deviation[name] - fitted * direction[name]).norm() / (self.reference[name] - self.start[name]).double().norm()).item()
                for name in self.lora}
        return fitted * SCALE_PROBE, max(left.values())


@functools.cache
def torch_adamw_run(under_test) -> Run:
    return Run(under_test)


def update_errors(run: Run, weights: dict[str, torch.Tensor], represented: bool = False) -> dict[str, float]:
    """Per LoRA tensor: the distance from torch's weights, against the distance torch's AdamW moved it; over the
    elements an 8-bit state represents (`represented`) or all of them."""
    errors = {}
    for name in run.lora:
        mask = run.represented[name] if represented else torch.ones_like(run.start[name], dtype=torch.bool)
        error, moved = (weights[name] - run.reference[name])[mask], (run.reference[name] - run.start[name])[mask]
        errors[name] = (error.float().norm() / moved.float().norm()).item()
    return errors


@pytest.mark.axes(**BNB_OPTIM)
@pytest.mark.axes_invalid(*surfaces.model_invalid("bnb_optim", BNB_OPTIM))
def test_bnb_optimizer_tracks_torch_adamw(under_test, optim_bits, is_paged):
    optimizer = scenario.bnb_adamw_name(optim_bits, is_paged)
    run = torch_adamw_run(under_test)
    weights, losses, bnb_optimizer = run.train(lambda params: scenario.bnb_adamw(optimizer, params, **ADAMW))
    run.torch_adamw()

    bits = optim_bits
    expected = torch.uint8 if bits == 8 else torch.float32
    dtypes = scenario.state_dtypes(bnb_optimizer, run.lora)
    other = {name: dtype for name, dtype in dtypes.items() if dtype != expected}
    scenario.require(not other, f"{optimizer} holds no {bits}-bit state for {len(other)} of {len(dtypes)} LoRA tensors: {list(other.items())[:3]}")
    every = update_errors(run, weights)
    errors = update_errors(run, weights, represented=bits == 8)
    name, whole = max(errors, key=errors.get), max(every, key=every.get)
    print(f"stackcheck measured: worst relative error {errors[name]:.2e} ({name}); over every element {every[whole]:.2e} ({whole}); "
          f"losses {[round(x, 5) for x in losses]}, torch's AdamW {[round(x, 5) for x in run.reference_losses]}")
    squared = (weights[name] - run.reference[name]).float().pow(2).flatten()
    worst = int(squared.argmax())
    print(f"stackcheck measured: in {name.split('model.')[-1]}, the worst element carries {(squared[worst] / squared.sum()).item():.2f} of "
          f"the squared error; its |m|/sqrt(v) {run.agreement[name].flatten()[worst].item():.2f}, the tensor's median "
          f"{run.agreement[name].median().item():.2f}")
    floor = run.rounding_floor()
    print(f"stackcheck measured: torch's fused AdamW against its default (the rounding floor) {floor:.2e}")
    judged = "represented elements" if bits == 8 else "elements"
    limit, error, beside = tolerance(bits, floor), errors[name], ""
    if bits == 32 and error > limit:
        scale, left = run.step_scale(weights)
        print(f"stackcheck measured: the uniform step scale nearest to it {scale:+.2e} (accepted up to {STEP_SCALE:.0e}); "
              f"beside it, worst LoRA tensor's relative error {left:.2e}")
        if abs(scale) <= STEP_SCALE:
            error, beside = left, f" beside a uniform step scale of {scale:+.1e}"
    scenario.assert_within(f"bitsandbytes' {optimizer} drifts from torch's AdamW over {STEPS} steps: worst LoRA tensor's relative error"
                           f"{beside} (its {judged})", error, limit)


def tolerance(bits: int, floor: float) -> float:
    """TOLERANCE[bits], or FLOOR_FACTOR times the rounding floor of this device and model where that is more (rounded
    up to 4 decimals): bitsandbytes' kernel is a third implementation of the same arithmetic."""
    return max(TOLERANCE[bits], math.ceil(FLOOR_FACTOR * floor * 1e4) / 1e4)


def test_adamw_8bit_honours_a_per_parameter_32bit_override(under_test):
    """A per-parameter override, as bitsandbytes documents it: `GlobalOptimManager.register_parameters(params)` before
    the optimizer is built, then `override_config(param, "optim_bits", 32)` after it. The overridden LoRA tensor must
    get a 32-bit state (the property: an override dropped leaves it uint8), every other LoRA tensor keeps its 8-bit state,
    and the overridden tensor tracks torch's AdamW within the 8-bit tolerance, not the 32-bit one: its neighbours step
    with 8-bit states, so from the second step its gradients carry their rounding (measured 0.0025 to 0.014 on the tiny
    Llama 3, Gemma 4, Qwen3, multimodal Gemma 3 and Mixtral, bitsandbytes 0.50.2, CPU, where the override is honoured; a
    dropped override, the guard, fails on the state's dtype). bitsandbytes <= 0.49.2 read overrides only at registration, so one made after it was
    silently dropped (PR #1869). The override is taken off the manager (a process-wide singleton) afterwards."""
    import bitsandbytes as bnb

    run = torch_adamw_run(under_test)
    overridden = next(iter(run.lora))
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()

    def with_override(params):
        manager.register_parameters(params)
        optimizer = scenario.bnb_adamw("adamw_8bit", params, **ADAMW)
        manager.override_config(run.lora[overridden], "optim_bits", 32)
        return optimizer

    try:
        weights, losses, bnb_optimizer = run.train(with_override)
    finally:
        manager.initialize()
    run.torch_adamw()

    dtypes = scenario.state_dtypes(bnb_optimizer, run.lora)
    others = {name: dtype for name, dtype in dtypes.items() if name != overridden and dtype != torch.uint8}
    scenario.require(len(run.lora) > 1 and not others, f"AdamW8bit holds no 8-bit state for {len(others)} LoRA tensors not overridden: {list(others.items())[:3]}")
    assert dtypes[overridden] == torch.float32, (f"override_config({overridden}, 'optim_bits', 32) after register_parameters was "
                                                 f"not honoured: its state is {dtypes[overridden]}")
    error = update_errors(run, weights)[overridden]
    print(f"stackcheck measured: the overridden tensor's relative error {error:.2e}; losses {[round(x, 5) for x in losses]}")
    scenario.assert_within(f"the LoRA tensor AdamW8bit runs in 32 bits by override drifts from torch's AdamW over {STEPS} steps: "
                           "relative error", error, TOLERANCE[8])


# One step where AdamW's decoupled weight decay weighs: lr x weight_decay = 0.05.
DECAY_STEP = {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.5}
DECAY_ELEMENTS = 4096


@pytest.mark.axes(**surfaces.model_axes("bnb_optim", "is_paged"))
def test_bnb_adamw_decays_the_weights_as_torch_adamw(device, is_paged):
    """bitsandbytes' AdamW takes torch's AdamW step whatever the hyperparameters, the decoupled weight decay
    included: torch decays the weights before it subtracts the update, p <- p (1 - lr wd) - lr u. One step of 4096
    weights (seeded normal weights and gradients) on the lane's device, at lr 0.1 and weight decay 0.5 (lr x wd 0.05,
    where the order of decay and update changes the step by lr^2 wd u, about 5% of it here); the training cells above
    run at lr x wd 1e-5, where it hides under their tolerance.

    Mechanism, read in bitsandbytes' sources and its sm_90 machine code (0.49.2 and 0.50.2 alike): the CUDA 32-bit
    Adam kernel applies the decay after the update, p <- (p - lr u)(1 - lr wd) (bitsandbytes issue #2010, fix PR #2040
    open at the time); its CPU backend (0.50.0 on) decays first, as torch does. A failure names the share of the
    error that decay-after-update explains (1.0: exactly that). Measured on an H100: relative error of the step 0.0447,
    explained 1.0000, with bitsandbytes 0.49.2 and 0.50.2 (ledger: bnb_adamw32_cuda_decay_after_update).

    Precondition proven: torch's AdamW moved every weight, the bitsandbytes optimizer holds a 32-bit state for it.
    Tolerance: TOLERANCE[32] (1e-3) of the step, relative; torch's fused AdamW against its default, the same step,
    measured 0.0 on the CPU. The 32-bit state, paged or not (the axis model's is_paged: the same kernel)."""
    optimizer = scenario.bnb_adamw_name(32, is_paged)
    generator = torch.Generator().manual_seed(0)
    start, grad = torch.randn(DECAY_ELEMENTS, generator=generator), torch.randn(DECAY_ELEMENTS, generator=generator)

    def one_step(make):
        weight = torch.nn.Parameter(start.clone().to(device))
        stepper = make([weight])
        weight.grad = grad.clone().to(device)
        stepper.step()
        return weight.detach().float().cpu(), stepper, weight

    reference, _torch, _weight = one_step(lambda params: torch.optim.AdamW(params, **DECAY_STEP))
    scenario.require(bool((reference != start).all()), "torch's AdamW left some weight where it was")
    measured, stepper, weight = one_step(lambda params: scenario.bnb_adamw(optimizer, params, **DECAY_STEP))
    state = stepper.state[weight].get("state1")
    scenario.require(state is not None and state.dtype == torch.float32, f"{optimizer} holds no 32-bit state for the weights")
    lr, decay = DECAY_STEP["lr"], DECAY_STEP["weight_decay"]
    update = (start * (1 - lr * decay) - reference) / lr  # torch's u, from its own step
    decay_after = reference + lr * lr * decay * update  # (p - lr u)(1 - lr wd)
    error = scenario.relative_error(measured - start, reference - start)
    explained = scenario.effect_kept(measured, decay_after, reference)
    print(f"stackcheck measured: {optimizer}'s step against torch's AdamW at lr x weight decay {lr * decay}: relative error "
          f"{error:.2e}; the share decay-after-update explains {explained:.4f}")
    scenario.assert_within(f"bitsandbytes' {optimizer} decays the weights otherwise than torch's AdamW (one step, lr x weight "
                           f"decay {lr * decay}): relative error of the step", error, TOLERANCE[32],
                           judged_by=("the share decay-after-update explains", explained))
