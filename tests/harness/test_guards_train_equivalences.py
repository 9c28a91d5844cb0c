"""The train_equivalences contract family fails on deliberately broken training: each guard reproduces the class of
bug its property exists for (not a known bug's code) and runs the family's real test against it."""

import importlib

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.harness.proof import ScenarioNotReached, ToleranceExceeded
from stackcheck.models import architectures

LLAMA3 = scenario.UnderTest(architectures.builtin()["llama3"], torch.device("cpu"))
family = importlib.import_module("tests.contract.train.test_train_equivalences")


def test_a_recompute_that_differs_from_the_first_forward_fails_the_checkpointing_property(monkeypatch):
    """A LoRA layer whose output changes between the first forward and checkpointing's recompute (state kept by a
    hook on the first pass only, as activated LoRA's offsets were)."""
    from peft.tuners.lora import bnb, layer

    calls: dict[int, int] = {}

    def drifting(forward):
        def patched(self, x, *args, **kwargs):
            calls[id(self)] = calls.get(id(self), 0) + 1  # a recompute is a module's second forward of the step
            return forward(self, x, *args, **kwargs) * (1.0 if calls[id(self)] == 1 else 1.1)
        return patched

    for linear in (layer.Linear, bnb.Linear4bit):
        monkeypatch.setattr(linear, "forward", drifting(linear.forward))
    with pytest.raises(ToleranceExceeded, match="a checkpointed step differs from the plain step"):
        family.test_a_checkpointed_step_equals_the_plain_step(LLAMA3, {"use_reentrant": False}, True)


def test_a_per_micro_batch_mean_fails_the_accumulation_property(monkeypatch, tmp_path):
    """The Trainer dividing each micro-batch by its own label tokens (no `num_items_in_batch`), the accumulation
    loss of transformers#34191."""
    from transformers import Trainer

    original = Trainer.get_batch_samples

    def without_counts(self, *args, **kwargs):
        batches, _count = original(self, *args, **kwargs)
        return batches, None

    monkeypatch.setattr(Trainer, "get_batch_samples", without_counts)
    with pytest.raises(ToleranceExceeded, match=r"unlike one batch: .* \(label tokens counted by the Trainer 1\.0000\)"):
        family.test_accumulated_micro_batches_update_as_one_batch(LLAMA3, tmp_path)


def test_an_ignored_dtype_flag_fails_the_dtype_property(monkeypatch):
    """PEFT leaving the adapter in the base's dtype although the default asks for float32 (the flag ignored)."""
    from peft.tuners import tuners_utils

    monkeypatch.setattr(tuners_utils.BaseTuner, "_cast_adapter_dtype", lambda self, *args, **kwargs: None)
    with pytest.raises(AssertionError, match="autocast_adapter_dtype=True: LoRA tensors in"):
        family.test_the_adapter_has_the_dtype_asked_for(LLAMA3, True)


def test_the_checkpointing_property_is_not_reached_without_checkpointing(monkeypatch):
    from stackcheck.harness import trainer

    monkeypatch.setattr(trainer.CheckpointingSeen, "all", lambda self: False)
    with pytest.raises(ScenarioNotReached, match="gradient checkpointing"):
        family.test_a_checkpointed_step_equals_the_plain_step(LLAMA3, {"use_reentrant": True}, True)
