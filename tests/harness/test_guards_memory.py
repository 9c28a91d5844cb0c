"""Guards of the device_memory contract family: a deliberately broken loader, model or training step makes the REAL
family test fail with the family's message, so none of its properties passes vacuously. GPU only, as the family:
the allocator's statistics are the measure (skipped on a host with no GPU, CI included). They run on the tiny
Llama 3, the cheapest architecture."""

import importlib

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.harness import memory
from stackcheck.models import architectures

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the device_memory family reads CUDA's allocator")


def family():
    return importlib.import_module("tests.contract.train.test_device_memory")


def llama3():
    return scenario.UnderTest(architectures.builtin()["llama3"], torch.device("cuda", 0))


def test_loading_everything_in_bf16_first_fails_the_load_peak(monkeypatch):
    """transformers#43032's mechanism: every checkpoint tensor materialized on the GPU in bf16 before the first one
    is quantized (transformers' loader made eager)."""
    from transformers import core_model_loading

    original = core_model_loading.spawn_materialize

    def eager(thread_pool, *args, **kwargs):
        job = original(None, *args, **kwargs)
        value = job() if callable(job) else job
        return lambda: value

    monkeypatch.setattr(core_model_loading, "spawn_materialize", eager)
    with pytest.raises(AssertionError, match=r"loading held more than the 4-bit model"):
        family().test_loading_peaks_near_the_4bit_model(llama3())


def test_a_bf16_copy_beside_a_4bit_weight_fails_the_footprint(monkeypatch):
    """A loader that leaves a layer's bf16 weight alive beside the packed one (here: hung on the layer)."""
    load = scenario.load_base

    def keeping_a_copy(*args, **kwargs):
        model = load(*args, **kwargs)
        _name, layer = scenario.first_nested_linear4bit(model)
        layer.kept_bf16 = torch.zeros(layer.out_features, layer.in_features, dtype=torch.bfloat16, device=layer.weight.device)
        return model

    monkeypatch.setattr(scenario, "load_base", keeping_a_copy)
    with pytest.raises(AssertionError, match=r"differ from the NF4 arithmetic"):
        family().test_the_loaded_model_weighs_the_nf4_arithmetic(llama3())


def test_a_step_that_keeps_activations_fails_the_steps_property(monkeypatch):
    """A training step that keeps what it should drop: the first decoder layer's output, every step (the class of
    trl PR #5730's offloading buffers, and of bitsandbytes PR #1999's cache)."""
    build = memory.qlora_with_quantized_experts
    kept = []

    def leaking(*args, **kwargs):
        model, dequantized = build(*args, **kwargs)
        layer = scenario.decoder_layers(model)[0]
        layer.register_forward_hook(lambda module, args, output: kept.append((output[0] if isinstance(output, tuple) else output).detach()))
        return model, dequantized

    monkeypatch.setattr(memory, "qlora_with_quantized_experts", leaking)
    with pytest.raises(AssertionError, match=r"allocated between steps is not what the model held before them"):
        family().test_a_training_step_frees_what_it_allocates(llama3(), False)
    assert kept


def test_offloading_that_keeps_a_steps_stale_state_fails_the_steps_property(monkeypatch):
    """trl PR #5730's mechanism: trl's activation offloading entered again without clearing what the previous step
    left (trl before 1.5.0: `saved_tensors_hooks`' own `__enter__`). On the tiny Gemma 4, one of whose saved tensors
    no backward unpacks, its tracker then keeps one more tensor every step."""
    pytest.importorskip("trl.models.activation_offloading")
    from torch.autograd.graph import saved_tensors_hooks
    from trl.models import activation_offloading

    monkeypatch.setattr(activation_offloading.OffloadActivations, "__enter__", saved_tensors_hooks.__enter__)
    gemma4 = scenario.UnderTest(architectures.builtin()["gemma4"], torch.device("cuda", 0))
    with pytest.raises(AssertionError, match=r"still tracked after a backward accumulate|allocated between steps is not what"):
        family().test_a_training_step_frees_what_it_allocates(gemma4, family().TRL_OFFLOADING)
