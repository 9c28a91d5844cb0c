"""A quantized checkpoint reloads as the model that was saved: in the set that wrote it, bit for bit; in a later set
(an upgrade, transformers 4 to 5 included), reproducing the writer's logits.

Precondition proven: the loaded model is quantized as the cell says (every bitsandbytes layer of that kind, quant
type and nesting); the checkpoint is sharded with its index, says it is quantized and holds quantized weights.

The journey, the upgrade, upstream and tolerances: docs/family-notes.md#quantized_checkpoint.
"""

import pytest
import torch
from packaging.version import Version

from stackcheck.child import keys
from stackcheck.harness import scenario
from stackcheck.child.exchange import ExportMissing
from stackcheck.harness import serialize
from stackcheck.models import tiny

QUANTIZATION = {quantization: quantization for quantization in serialize.QUANTIZATIONS}
ACROSS_SETS_TOLERANCE = 0.05


def export_name(lane: str, quantization: str) -> str:
    """The exchange's name of a cell's checkpoint: one per lane and quantization."""
    return f"{lane}-{quantization}"


def assert_same_quantized_layers(model, saved: list[str], what: str) -> None:
    held = sorted(serialize.quantized_layers(model))
    assert held == sorted(saved), (f"{what} holds {len(held)} bitsandbytes layers, the saved model {len(saved)}: "
                                   f"not quantized here {sorted(set(saved) - set(held))[:3]}, quantized only here {sorted(set(held) - set(saved))[:3]}")


def assert_held_as_written(model, written: dict, what: str) -> list[str]:
    """Every tensor the checkpoint holds is held by `model` bit for bit under its name; returns the written keys it
    holds under other names (a reader that converts keys, as transformers 5 fuses a 4.x mixture of experts)."""
    changed, elsewhere = serialize.held_otherwise(model, written)
    assert not changed, f"{what}: {len(changed)} of {len(written)} saved tensors are held with other values: {changed[:3]}"
    return elsewhere


@pytest.mark.axes(quantization=QUANTIZATION)
def test_saved_checkpoint_reloads_bit_exact(under_test, quantization, lane, prompt, tmp_path, base_exchange, request):
    """Within one set: save the quantized model, load the checkpoint back, get the same model (every saved tensor
    held bit for bit under its name, the same bitsandbytes layers) and the same logits, bit for bit. The set leaves
    the checkpoint in the exchange for the sets after it."""
    versions, name = request.config.stash[keys.VERSIONS], export_name(lane, quantization)
    try:
        model = serialize.load_quantized(under_test, quantization)
    except tiny.FixtureError as exc:
        base_exchange.refuse(name, versions, str(exc))
        raise
    saved = sorted(serialize.require_quantized(model, quantization, "the loaded model"))
    expected = scenario.logits(model, prompt)
    folder = serialize.save(model, tmp_path / "checkpoint")
    written = serialize.require_checkpoint_written(folder, quantization)
    base_exchange.export(name, folder, versions, tiny.base_checkpoint(under_test.arch), {"logits": expected},
                         {"quantized_layers": saved})
    del model

    reloaded = serialize.load_saved(under_test, folder)

    assert_same_quantized_layers(reloaded, saved, "the reloaded model")
    assert_held_as_written(reloaded, written, "the reloaded model")
    got = scenario.logits(reloaded, prompt)
    assert torch.equal(got, expected), f"the reloaded model's logits differ from the saved model's: relative error {scenario.relative_error(got, expected):.4g}"


def baseline_export(exchange, name: str, versions: dict[str, str], absent: str):
    """The export `name` of the set `exchange` reads from; skipped (`absent` says why) where the run names none."""
    try:
        export = exchange.baseline_export(name)
    except ExportMissing as exc:
        raise scenario.ScenarioNotReached(str(exc)) from None
    if export is None:
        pytest.skip(absent)
    if export.refused:
        raise tiny.NotApplicable(f"set '{export.set_name}' could not build this model ({export.refused})")
    written, here = Version(export.versions["transformers"]).major, Version(versions["transformers"]).major
    if written > here:
        raise tiny.NotApplicable(f"set '{export.set_name}' saved with transformers {written}.x, this set reads with {here}.x: "
                                 "no release promises to read a newer major's checkpoints")
    return export


def reload_written(under_test, quantization, prompt, export) -> None:
    """Load the checkpoint another set saved: it holds what was written and reproduces the logits the writer's saved
    model gave."""
    written = serialize.require_checkpoint_written(export.checkpoint, quantization)

    model = serialize.load_saved(under_test, export.checkpoint)

    # This set's own quantization of the bf16 weights the writer quantized: what this set's kernels alone make of them.
    own = scenario.logits(serialize.load_quantized(under_test, quantization, checkpoint=export.source_checkpoint), prompt)
    logits, reference = scenario.logits(model, prompt), export.outputs["logits"]
    held = serialize.quantized_layers(model)
    print(f"stackcheck measured: set '{export.set_name}' saved {len(export.facts['quantized_layers'])} bitsandbytes layers, "
          f"this set holds {len(held)}; this set's own quantization is off the writer's logits by "
          f"{scenario.relative_error(own, reference):.4f} and off the loaded checkpoint's by {scenario.relative_error(logits, own):.4f}")
    elsewhere = assert_held_as_written(model, written, f"the checkpoint set '{export.set_name}' saved")
    print(f"stackcheck measured: {len(elsewhere)} of {len(written)} saved tensors held under other names")
    scenario.assert_within(f"the checkpoint set '{export.set_name}' saved computes otherwise here: relative error",
                           scenario.relative_error(logits, reference), ACROSS_SETS_TOLERANCE)


# CPU lane only: on a GPU the sets' 4-bit kernels differ by more than on the CPU (see adapter_round_trip).
@pytest.mark.cpu
@pytest.mark.axes(quantization=QUANTIZATION)
def test_checkpoint_saved_by_the_baseline_set_reloads(under_test, quantization, lane, prompt, base_exchange, request):
    """The upgrade: the quantized checkpoint the baseline set saved (the test above, run by it), loaded by this
    set, holds what was written and reproduces the logits the baseline's saved model gave."""
    versions = request.config.stash[keys.VERSIONS]
    reload_written(under_test, quantization, prompt, baseline_export(
        base_exchange, export_name(lane, quantization), versions,
        "no baseline set in this run: the gate's candidate and a matrix's later sets load the checkpoints their baseline saved"))


@pytest.mark.cpu
@pytest.mark.axes(quantization=QUANTIZATION)
def test_checkpoint_saved_by_transformers_4_reloads(under_test, quantization, lane, prompt, writer_exchange, request):
    """The 4 to 5 upgrade in every run: the quantized checkpoint the cross-release writer (sets.toml's `cross_release`,
    transformers 4.57) saved, written once per machine into the cache by the test above, loaded by this set as the
    baseline's is."""
    versions = request.config.stash[keys.VERSIONS]
    reload_written(under_test, quantization, prompt, baseline_export(
        writer_exchange, export_name(lane, quantization), versions,
        "no cross-release checkpoints in this run for this architecture: matrix and gpu-matrix pass the built-in architectures' unless --no-cross-release, or the writer set is one of the run's sets"))
