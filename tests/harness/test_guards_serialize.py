"""Each serialize and generate contract family fails, with its own message, when a library or harness piece is broken
on purpose in the way of the bugs it is there for: a quant state read back wrong, a checkpoint that reaches a later
set otherwise than its writer saved it, an offloaded weight saved wrong, a cache that corrupts decoding."""

import importlib
import types

import pytest
import torch

from stackcheck.child import keys
from stackcheck.child import exchange
from stackcheck.harness import scenario
from stackcheck.harness import serialize
from stackcheck.models import architectures
from stackcheck.harness.scenario import ToleranceExceeded
from stackcheck.core.versions import installed_versions

LLAMA3 = scenario.UnderTest(architectures.builtin()["llama3"], torch.device("cpu"))
PROMPT = scenario.prompt(torch.device("cpu"))
checkpoint_family = importlib.import_module("tests.contract.serialize.test_quantized_checkpoint")
offload_family = importlib.import_module("tests.contract.serialize.test_offloaded_save")
decoding_family = importlib.import_module("tests.contract.generate.test_cached_decoding")


def request_for(versions: dict[str, str]):
    return types.SimpleNamespace(config=types.SimpleNamespace(stash={keys.VERSIONS: versions}))


def test_quantized_checkpoint_fails_when_a_quant_state_is_read_back_otherwise(tmp_path, monkeypatch):
    """A loader that reads the absmax back scaled (a dtype or layout slip): the reloaded model holds other values."""
    import bitsandbytes.functional as F

    from_dict = F.QuantState.from_dict.__func__

    def skewed(cls, qs_dict, device):
        state = from_dict(cls, qs_dict, device)
        state.absmax = state.absmax * 2 if not state.nested else state.absmax
        return state

    monkeypatch.setattr(F.QuantState, "from_dict", classmethod(skewed))
    with pytest.raises(AssertionError, match="the reloaded model: .* saved tensors are held with other values"):
        checkpoint_family.test_saved_checkpoint_reloads_bit_exact(LLAMA3, "nf4", "cpu", PROMPT, tmp_path,
                                                                 exchange.BaseExchange(None, "seed", None), request_for(installed_versions()))


def test_quantized_checkpoint_fails_when_a_later_set_reads_a_weight_otherwise(tmp_path):
    """The writer's checkpoint, one layer's packed weight scrambled on the way (as a converter that reorders bytes
    would): the later set holds what the file says, and its logits leave the writer's."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "exchange"
    writer = exchange.BaseExchange(folder, "writer", None)
    checkpoint_family.test_saved_checkpoint_reloads_bit_exact(LLAMA3, "int8", "cpu", PROMPT, tmp_path / "w", writer,
                                                             request_for(installed_versions()))
    saved = folder / "writer" / "cpu-int8" / "checkpoint"
    for file in serialize.checkpoint_files(saved):
        tensors = load_file(file)
        key = next((k for k in tensors if k.endswith("mlp.down_proj.weight")), None)
        if key:
            tensors[key] = tensors[key].flip(0).contiguous()
            save_file(tensors, file, metadata={"format": "pt"})
    reader = exchange.BaseExchange(folder, "reader", "writer")
    with pytest.raises(ToleranceExceeded, match="the checkpoint set 'writer' saved computes otherwise here"):
        checkpoint_family.test_checkpoint_saved_by_the_baseline_set_reloads(LLAMA3, "int8", "cpu", PROMPT, reader,
                                                                           request_for(installed_versions()))


def test_offloaded_save_fails_when_an_offloaded_weight_is_saved_wrong(tmp_path, monkeypatch):
    """transformers loads each offloaded weight back from the offload to save it: a loader that returns zeros."""
    import transformers.modeling_utils as modeling_utils

    real = modeling_utils.load_offloaded_parameter
    monkeypatch.setattr(modeling_utils, "load_offloaded_parameter", lambda model, name: torch.zeros_like(real(model, name)))
    with pytest.raises(AssertionError, match="the model saved while offloaded reloads to other logits"):
        offload_family.test_offloaded_model_saves_and_reloads(LLAMA3, "bf16", False, PROMPT, tmp_path / "offload", tmp_path)


def test_cached_decoding_fails_when_the_cache_corrupts_decoding(monkeypatch):
    """A cache whose keys come back scaled once it holds the prompt: every decode step reads them."""
    from transformers import cache_utils

    update = cache_utils.DynamicLayer.update

    def scaled(self, key_states, value_states, *args, **kwargs):
        decoding = self.is_initialized and key_states.shape[-2] == 1
        keys, values = update(self, key_states, value_states, *args, **kwargs)
        return (keys * 1.5, values) if decoding else (keys, values)

    monkeypatch.setattr(cache_utils.DynamicLayer, "update", scaled)
    with pytest.raises(ToleranceExceeded, match="generate's cached logits diverge from a full forward"):
        decoding_family.test_cached_decoding_matches_uncached(LLAMA3, None, False, False, PROMPT)
    # cache_parity's bf16 cell through the same cache: past its tolerance, its fp32 twin decodes as wrongly, so the
    # cell is judged at 0.01 and not by bf16's rounding (scenario.bf16_rounding_bound).
    parity_family = importlib.import_module("tests.families.test_cache_parity")
    with pytest.raises(ToleranceExceeded, match=r"\(bf16 base\): relative error \S+ > 0\.01 "):
        parity_family.test_generate_cached_logits_match_full_forward(LLAMA3, False, PROMPT)
