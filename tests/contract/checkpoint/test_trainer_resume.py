"""Contract, checkpoint: a QLoRA run that transformers' Trainer resumes from its checkpoint in a fresh process
continues exactly as the run that was never interrupted.

Precondition proven: the base is NF4 with nested quant state; the Trainer saved `checkpoint-2` at step 2 (its trainer
state says so); with `paged_adamw_8bit`, the optimizer's state is 8-bit (uint8) for some LoRA tensors.

The journey, the property, the bugs it catches, axes and the judgement: docs/family-notes.md#trainer_resume.
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.harness import checkpoint
from stackcheck.models import architectures

TOLERANCE = 1e-3
OPTIMS = {"adamw_torch": "adamw_torch", "paged_adamw_8bit": "paged_adamw_8bit"}
# The CPU lane's cells (architecture, optim) among the built-in architectures: the fresh process costs seconds each.
# An architecture that is not built in (a user's config.json) runs with torch's AdamW.
# The seed's Gemma 4 takes the 8-bit optimizer: on the default set (CI's) its cell stops at the first step, bitsandbytes
# < 0.50 having no CPU optimizer, and the guard resumes the tiny Llama 3 in CI instead.
CPU_CELLS = {("llama3", "adamw_torch"), ("gemma4", "paged_adamw_8bit"), ("qwen3moe", "adamw_torch")}


def relative_error(measured, reference) -> float:
    if isinstance(reference, torch.Tensor):
        if reference.dtype.is_floating_point or reference.dtype == torch.uint8:
            measured, reference = measured.double(), reference.double()
            norm = reference.norm().item()
            return (measured - reference).norm().item() / (norm or 1.0)
        return 0.0 if torch.equal(measured, reference) else 1.0
    return 0.0 if measured == reference else abs(measured - reference) / (abs(reference) or 1.0)


def flat_state(state_dict: dict) -> dict[str, object]:
    """An optimizer state_dict's per-parameter state, flattened to "index.key" (bitsandbytes 0.50 nests its tensors
    under `__bnb_optimizer_quant_state__`)."""
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        else:
            flat[prefix] = value

    for index, state in state_dict.get("state", {}).items():
        walk(str(index), state)
    return flat


def state_errors(measured: dict, reference: dict) -> dict[str, float]:
    """Per tensor (or number) of an optimizer's state_dict: the relative error of `measured` against `reference`."""
    measured, reference = flat_state(measured), flat_state(reference)
    return {key: relative_error(measured[key], value) if key in measured else float("inf") for key, value in reference.items()}


def movement_errors(resumed: dict, reference: dict, saved: dict) -> dict[str, float]:
    """Per LoRA tensor: the distance of the resumed run's weights from the uninterrupted run's, against the distance
    the uninterrupted run moved them after the checkpoint (a resume that loses part of the state is off by a good part
    of that movement; two runs of the same kernels by none of it)."""
    return {name: ((t.double() - reference[name].double()).norm() / ((reference[name].double() - saved[name].double()).norm() or 1.0)).item()
            for name, t in resumed.items()}


def worst(errors: dict[str, float]) -> tuple[str, float]:
    return max(errors.items(), key=lambda item: item[1]) if errors else ("nothing", float("inf"))


def cpu_cell_picked(name: str, optim: str) -> bool:
    return (name, optim) in CPU_CELLS if name in architectures.builtin() else optim == "adamw_torch"


def resumes(params: dict) -> bool:
    """Whether the cell of these parameters resumes (the CPU lane's pick and every GPU cell): the cells that share a
    warm resume process (stackcheck.process.resume)."""
    return params["lane"] != "cpu" or cpu_cell_picked(params["arch"].name, params["optim"])


def require_cpu_cell(under_test, optim) -> None:
    if under_test.device.type != "cpu":
        return
    if not cpu_cell_picked(under_test.arch.name, optim):
        pytest.skip(f"CPU lane: the fresh-process resume runs on {', '.join('-'.join(cell) for cell in sorted(CPU_CELLS))} "
                    "(and with adamw_torch on an architecture that is not built in)")


@pytest.mark.axes(optim=OPTIMS)
@pytest.mark.resume_process.with_args(resumes)
def test_resume_in_a_fresh_process_continues_the_run(under_test, optim, tmp_path):
    require_cpu_cell(under_test, optim)
    reference = checkpoint.run_uninterrupted(under_test, tmp_path / "run", optim)
    saved = checkpoint.checkpoint_dir(tmp_path / "run")
    scenario.require(checkpoint.saved_step(saved) == checkpoint.SAVE_STEPS,
                     f"the Trainer saved no checkpoint at step {checkpoint.SAVE_STEPS} ({saved.name}: step {checkpoint.saved_step(saved)})")
    if "8bit" in optim:
        dtypes = {value.dtype for key, value in flat_state(reference.end_optimizer).items() if key.endswith(".state1")}
        scenario.require(torch.uint8 in dtypes, f"{optim} kept no 8-bit state (state dtypes {sorted(map(str, dtypes))})")
    missing = checkpoint.missing_checkpoint_files(saved)
    assert not missing, f"the Trainer's checkpoint lacks the {', '.join(missing)}"

    resumed = checkpoint.resume_in_fresh_process(under_test, saved, tmp_path / "resumed", optim)

    steps = sorted(resumed.losses)
    assert resumed.begin_step == checkpoint.SAVE_STEPS and steps == list(range(checkpoint.SAVE_STEPS + 1, checkpoint.MAX_STEPS + 1)), (
        f"the resumed run began at step {resumed.begin_step} and trained steps {steps}, not the steps after the checkpoint's {checkpoint.SAVE_STEPS}")
    name, error = worst({n: relative_error(t, reference.adapters[checkpoint.SAVE_STEPS][n]) for n, t in resumed.begin_adapter.items()})
    assert error <= TOLERANCE, f"the resumed run began with an adapter that is not the checkpoint's: {name} relative error {error:.3g}"
    loaded = [value for value in flat_state(resumed.begin_optimizer).values()
              if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 1]
    assert loaded and any(value.any() for value in loaded), "the resumed run began with an empty optimizer state: it was not loaded"

    losses = {f"step {s} loss": relative_error(resumed.losses[s], reference.losses[s]) for s in steps}
    adapter = movement_errors(resumed.adapters[checkpoint.MAX_STEPS], reference.adapters[checkpoint.MAX_STEPS],
                              reference.adapters[checkpoint.SAVE_STEPS])
    optimizer = state_errors(resumed.end_optimizer, reference.end_optimizer)
    print(f"stackcheck measured: losses {[resumed.losses[s] for s in steps]} resumed, {[reference.losses[s] for s in steps]} uninterrupted; "
          f"worst adapter error {worst(adapter)[1]:.3g}, worst optimizer state error {worst(optimizer)[1]:.3g}")
    for what, errors in (("loss", losses), ("adapter tensor (of its movement after the checkpoint)", adapter), ("optimizer state", optimizer)):
        name, error = worst(errors)
        scenario.assert_within(f"the resumed run's {what} differs from the uninterrupted run's ({name}): relative error", error, TOLERANCE)
