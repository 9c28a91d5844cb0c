"""Verdicts from the ledger, each rule shown on a real traceback raised through real library code (or the
real family code), never on hand-made frame strings. The versions handed to `judge` are data: it is a
pure function of the test, the versions and the failure."""

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from stackcheck import REPO_ROOT
from stackcheck.harness import scenario
from stackcheck.models import architectures
from stackcheck.core.ledger import ERROR, FIXED, KNOWN_BUG, LEDGER_FILE, NEW_FAILURE, NOT_AFFECTED, PASS, Failure, Ledger, LedgerError, Verdict, bound_key, family_modules
from stackcheck.core.versions import installed_versions
from stackcheck.harness.scenario import ScenarioNotReached

GEMMA4 = scenario.seed_model(torch.device("cpu"))
LLAMA3 = scenario.UnderTest(architectures.builtin()["llama3"], torch.device("cpu"))  # no KV-shared layers

KV_TEST = "test_generate_after_peft_redispatch_matches_undispatched[cpu-bf16]"


@pytest.fixture(scope="module")
def ledger():
    return Ledger()


@pytest.fixture(scope="module")
def versions():
    return installed_versions()


def caught(call, *args, **kwargs) -> Failure:
    """The Failure of what `call` raised, as the plugin sees it."""
    with pytest.raises(Exception) as excinfo:
        call(*args, **kwargs)
    return Failure.from_exception(excinfo.value, not_reached=isinstance(excinfo.value, ScenarioNotReached))


def family_module(family: str):
    return importlib.import_module(f"tests.families.test_{family}")


def meta_quant_state_failure() -> Failure:
    """bitsandbytes' own `QuantState.as_dict` on a double-quant state whose offset is on meta: the
    meta_quant_state bug, reached without accelerate (which, on seed, fails earlier on params4bit_kwargs)."""
    _name, module = scenario.first_nested_linear4bit(scenario.load_base(GEMMA4))
    module.weight.quant_state.offset = module.weight.quant_state.offset.to("meta")
    return caught(module.state_dict)


def test_the_frame_that_raised_decides_not_any_frame_on_the_stack(ledger, versions):
    """A `KeyError: 0` raised below Gemma 4's forward, by code that is not Gemma 4's, is not the shared-KV bug
    (before: any frame ending in modeling_gemma4.py:forward matched, so it read known_bug)."""
    model = scenario.load_base(GEMMA4, quantized=False)

    def lookup_that_misses(module, args):
        return {}[0]

    model.model.language_model.layers[0].mlp.register_forward_pre_hook(lookup_that_misses)
    failure = caught(scenario.logits, model, scenario.prompt(GEMMA4.device))
    assert "transformers/models/gemma4/modeling_gemma4.py:forward" in failure.frames
    assert failure.raising_frame == "tests/harness/test_ledger.py:lookup_that_misses"

    judgement = ledger.judge("shared_kv_redispatch", KV_TEST, versions, failure)
    assert (judgement.verdict, judgement.bug) == (NEW_FAILURE, None)


def test_standard_library_frames_below_the_library_call_do_not_hide_it():
    """transformers 5.9 to 5.22 keep shared_kv_states in a collections.UserDict, whose __getitem__ raises the
    KeyError: the raising frame is the code that looked the key up, named the same on every interpreter."""
    from collections import UserDict

    def forward(states):
        return states["sliding_attention"]

    failure = caught(forward, UserDict())
    assert failure.frames[-1] == "stdlib/collections/__init__.py:__getitem__"
    assert failure.raising_frame == "tests/harness/test_ledger.py:forward"


def test_torch_frames_below_the_library_call_do_not_hide_it(versions, ledger):
    """`Tensor.item()` on meta raises inside torch; the raising frame is bitsandbytes' as_dict that called it."""
    failure = meta_quant_state_failure()
    assert failure.raising_frame == "bitsandbytes/functional.py:as_dict"
    judgement = ledger.judge("meta_quant_state", "test_state_dict_after_accelerate_offload_to_meta[cpu]", versions, failure)
    assert (judgement.verdict, judgement.bug) == (KNOWN_BUG, "meta_quant_state")


def test_a_comprehension_is_named_by_its_function_on_every_python():
    """Python 3.11 gives a comprehension its own frame (`<listcomp>`), 3.12 inlines it: the raising frame is the
    function around it either way, so a bug raised inside one (bitsandbytes' `is_on_gpu`) has one signature."""

    def checks_every_tensor(tensors):
        return [t.shape for t in tensors]

    failure = caught(checks_every_tensor, [torch.zeros(1), None])
    assert failure.raising_frame == "tests/harness/test_ledger.py:checks_every_tensor"


def test_a_deprecation_shim_below_the_library_call_does_not_hide_it():
    """torch 2.13 deprecates `torch.distributed.all_gather_into_tensor` with typing_extensions' `deprecated`, whose
    wrapper frame sits between torch's frames: a refusal raised below it (gloo's dtype check under DeepSpeed's ZeRO-3
    gather) is named by the library that called the collective, not by the shim, on every torch release."""
    from functools import partial

    from typing_extensions import deprecated

    shimmed = deprecated("deprecated here", category=FutureWarning)(partial(torch.ones))  # no Python frame below

    def gathers(shape):
        return shimmed(shape)

    with pytest.warns(FutureWarning):
        failure = caught(gathers, "not a shape")
    assert failure.frames[-1] == "typing_extensions.py:wrapper"
    assert failure.raising_frame == "tests/harness/test_ledger.py:gathers"


def test_message_must_match_whole_not_be_searched(ledger, versions, monkeypatch):
    """The preflight names the seed's stray key; a longer list of unknown keys is another failure."""
    family = family_module("seed_scenario")
    test = "test_seed_device_map_names_existing_modules[cpu]"
    known = caught(family.test_seed_device_map_names_existing_modules, GEMMA4)
    assert ledger.judge("seed_scenario", test, versions, known).verdict == KNOWN_BUG

    monkeypatch.setitem(scenario.SEED_USER_DEVICE_MAP, "model.vision_projector", "cpu")
    longer = caught(family.test_seed_device_map_names_existing_modules, GEMMA4)
    assert longer.message.endswith("model.multi_modal_projector, model.vision_projector")
    judgement = ledger.judge("seed_scenario", test, versions, longer)
    assert (judgement.verdict, judgement.bug) == (NEW_FAILURE, "seed_map_unknown_module")
    assert "new signature" in judgement.note


@pytest.mark.parametrize("kept, verdict", [(0.94, KNOWN_BUG), (0.0, NEW_FAILURE), (2.0, NEW_FAILURE), (float("nan"), NEW_FAILURE)])
def test_numeric_known_bug_is_judged_by_its_mechanism(ledger, versions, kept, verdict):
    """The real merge comparison of the family, on real logits of the tiny model: the merge keeps a chosen share of
    the adapter's change (the family reports the share of the weight change the merged weights carry), beside
    re-quantization-like noise of half the effect. Only a merge that keeps the change is the known re-quantization
    loss; one that drops the adapter is another bug, whatever the error."""
    family = family_module("merge_parity")
    model = scenario.load_base(GEMMA4, quantized=False)
    prompt = scenario.prompt(GEMMA4.device)
    merged = scenario.logits(model, prompt).float()
    effect = torch.ones_like(merged)
    noise = 0.5 * torch.ones_like(merged)
    noise[..., 1::2] *= -1  # orthogonal to the effect: it changes the error, not the fraction kept
    base = merged - kept * effect - noise
    failure = caught(family.assert_merge_parity, "4-bit", model, kept, prompt, base, base + effect, [])
    assert failure.raising_frame == "tests/families/test_merge_parity.py:assert_merge_parity"
    assert kept != kept or failure.measured == pytest.approx(kept, abs=1e-4)

    judgement = ledger.judge("merge_parity", "test_merge_into_4bit_base_reproduces_adapter_outputs[cpu]", versions, failure)
    assert judgement.verdict == verdict
    assert judgement.bug == "merge_4bit_divergence"
    if verdict == NEW_FAILURE:
        assert "outside the band" in judgement.note and "nearest known bug merge_4bit_divergence" in judgement.note


def test_known_bug_outside_its_affected_range_is_a_new_failure(ledger, versions):
    """A regression of a fixed bug (here: a bitsandbytes older than the release that introduced it) turns red."""
    failure = meta_quant_state_failure()
    test = "test_state_dict_after_accelerate_offload_to_meta[cpu]"
    judgement = ledger.judge("meta_quant_state", test, dict(versions, bitsandbytes="0.41.1"), failure)
    assert (judgement.verdict, judgement.bug) == (NEW_FAILURE, "meta_quant_state")
    assert "known bug outside its affected range" in judgement.note


def test_scenario_not_reached_before_a_bugs_introduction_is_not_affected(ledger, versions):
    """transformers 5.5.0 and 5.5.1 pass no shared_kv_states between layers: the shared-KV scenario does not
    exist there (measured: the family test stops at its precondition). Later releases: a bare error."""
    failure = caught(scenario.shared_kv_layers, scenario.load_base(LLAMA3, quantized=False))
    assert failure.not_reached
    before = ledger.judge("shared_kv_redispatch", KV_TEST, dict(versions, transformers="5.5.1"), failure)
    assert before.verdict == NOT_AFFECTED and "shared_kv_redispatch needs transformers" in before.note and ">=5.5.2" in before.note
    assert ledger.judge("shared_kv_redispatch", KV_TEST, dict(versions, transformers="5.6.2"), failure).verdict == ERROR


def test_pass_where_the_ledger_says_affected_is_fixed(ledger, versions):
    seed = dict(versions, transformers="5.6.2", accelerate="1.13.0", bitsandbytes="0.49.2")
    assert ledger.judge("shared_kv_redispatch", KV_TEST, seed, None).verdict == FIXED
    assert ledger.judge("shared_kv_redispatch", KV_TEST, dict(seed, transformers="5.23.0"), None).verdict == PASS
    test = "test_offload_hook_moves_loaded_param_to_meta[cpu]"
    assert ledger.judge("params4bit_kwargs", test, seed, None).verdict == FIXED
    assert ledger.judge("params4bit_kwargs", test, dict(seed, accelerate="1.14.0"), None).verdict == PASS
    assert ledger.judge("params4bit_kwargs", test, dict(seed, bitsandbytes="0.50.0"), None).verdict == PASS


def test_verdicts_are_a_closed_set():
    assert [str(v) for v in Verdict] == ["new_failure", "error", "fixed", "known_bug", "not_affected", "pass", "skipped", "not_applicable"]
    with pytest.raises(ValueError):
        Verdict("passed")


def test_every_family_module_has_an_entry_and_every_entry_a_module(ledger):
    ledger.check_modules(family_modules())
    with pytest.raises(LedgerError, match="no entry for family module.*test_new_family.py"):
        ledger.check_modules([*family_modules(), "new_family"])
    with pytest.raises(LedgerError, match="no module .* for merge_parity"):
        ledger.check_modules([f for f in family_modules() if f != "merge_parity"])


def test_a_tests_pattern_that_matches_no_collected_test_fails(ledger):
    tests = ["test_merge_into_4bit_base_reproduces_adapter_outputs[cpu]", "test_dequantize_then_merge_reproduces_adapter_outputs[cpu]"]
    ledger.check_patterns("merge_parity", tests)
    with pytest.raises(LedgerError, match="matches no collected test"):
        ledger.check_patterns("merge_parity", tests[:1])


@pytest.mark.parametrize("original, typo, message", [
    ('frame = "bitsandbytes/functional.py:as_dict"', 'frmae = "bitsandbytes/functional.py:as_dict"', "missing frame"),
    ('exception = "KeyError"', 'exception = "KeyError"\nexpected = "x"', "unknown key expected"),
    ('message = "Tensor', 'message = "(Tensor', "does not compile"),
    ('transformers = ">=5.5.2,<5.23.0"', 'transformers = "=>5.5.2"', "not a PEP 440 specifier"),
    ('transformers = ">=5.5.2,<5.23.0"', 'transfomers = ">=5.5.2,<5.23.0"', "unknown key transfomers"),
    ('"meta_quant_state",\n', '"meta_quant_stat",\n', "names unknown bug 'meta_quant_stat'"),
])
def test_a_typo_in_the_ledger_fails_loudly(tmp_path, original, typo, message):
    text = LEDGER_FILE.read_text()
    assert original in text
    path = tmp_path / "ledger.toml"
    path.write_text(text.replace(original, typo, 1))
    with pytest.raises(LedgerError, match=message):
        Ledger(path)


def test_pytest_explanation_is_not_part_of_the_message():
    """The ledger describes a test's own assertion message; pytest's rewriting appends `assert ...`."""
    failure = Failure.from_exception(AssertionError("device_map keys that match no module: x\nassert not ['x']"))
    assert failure.message == "device_map keys that match no module: x"


def test_a_ledger_with_the_wrong_top_level_fails(tmp_path):
    path = tmp_path / "ledger.toml"
    path.write_text(textwrap.dedent("""
        [families.x]
        title = "x"
        bugs = []
    """))
    with pytest.raises(LedgerError, match="missing bugs"):
        Ledger(path)


def fsdp2_tied_embeddings_failure(tmp_path) -> Failure:
    """torch's own FSDP2 check, raised for real: an embedding sharded as a group of its own while the root group
    holds the same (tied) parameter, as accelerate 1.14.0's fsdp2_prepare_model groups a tied model. One gloo rank."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(8, 4)
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.embed_tokens.weight

        def forward(self, ids):
            return self.lm_head(self.embed_tokens(ids))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = Tied()
        fully_shard(model.embed_tokens)
        fully_shard(model)
        return caught(model, torch.tensor([[1, 2]]))
    finally:
        dist.destroy_process_group()


def test_a_library_level_bug_is_known_in_every_family_that_reaches_it(ledger, versions, tmp_path):
    """The same torch refusal reached from two families: fsdp2_params4bit lists the bug, fsdp_end_to_end (the FSDP2
    control on every architecture) does not. Both read known_bug in range, by torch's raising frame, and both a
    new_failure naming it out of range (before: fsdp_end_to_end read new_failure on gemma4, llama3, qwen3 and phi4
    on `seed --with accelerate==1.14.0`)."""
    failure = fsdp2_tied_embeddings_failure(tmp_path)
    assert failure.raising_frame_for("torch/x.py:f") == "torch/distributed/fsdp/_fully_shard/_fsdp_state.py:_validate_no_duplicate_params"
    in_range = dict(versions, accelerate="1.14.0", torch="2.13.0")
    for family, test in (("fsdp2_params4bit", "test_fsdp2_qlora_steps_match_one_process[cpu-ws1]"),
                         ("fsdp_end_to_end", "test_fsdp2_qlora_steps_match_one_process[cpu-llama3-ws1]")):
        judgement = ledger.judge(family, test, in_range, failure, "llama")
        assert (judgement.verdict, judgement.bug) == (KNOWN_BUG, "fsdp2_tied_embeddings_two_groups"), family
        fixed = ledger.judge(family, test, dict(in_range, accelerate="1.15.0"), failure, "llama")
        assert (fixed.verdict, fixed.bug) == (NEW_FAILURE, "fsdp2_tied_embeddings_two_groups"), family
        assert "outside its affected range" in fixed.note
    assert "reached from fsdp_end_to_end" in ledger.judge("fsdp_end_to_end", test, in_range, failure, "llama").note
    # Only the families that list a bug expect it: fsdp_end_to_end passing on accelerate 1.14.0 is no fix.
    assert ledger.judge("fsdp_end_to_end", test, in_range, None, "llama").verdict == PASS


def fsdp1_no_shard_failure(tmp_path) -> Failure:
    """torch's own FSDP1 check, raised for real: one gloo rank (FULL_SHARD becomes NO_SHARD), a tied embedding frozen in
    the root unit beside trainable wrapped layers, as PEFT leaves a model; the second forward asserts."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, hidden):
            return hidden + self.proj(hidden)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(8, 4)
            self.layers = torch.nn.ModuleList([Layer(), Layer()])
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.embed_tokens.weight

        def forward(self, ids):
            hidden = self.embed_tokens(ids)
            for layer in self.layers:
                hidden = layer(hidden)
            return self.lm_head(hidden)

    def steps(model, optimizer):
        for _ in range(2):
            model(torch.tensor([[1, 2, 3]])).pow(2).mean().backward()
            optimizer.step()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        tied = Tied()
        tied.embed_tokens.weight.requires_grad_(False)
        model = FSDP(tied, auto_wrap_policy=ModuleWrapPolicy({Layer}), device_id=torch.device("cpu"), use_orig_params=True,
                     sharding_strategy=ShardingStrategy.FULL_SHARD)
        return caught(steps, model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
    finally:
        dist.destroy_process_group()


def test_fsdp1_no_shard_is_known_wherever_its_forward_comes_from(ledger, versions, tmp_path):
    """FSDP1's world-size-1 assertion, reached from a family's own loop (fsdp1_quant_storage, sharded_training) or below
    the Trainer's compute_loss (sharded_resume): the frame that raised it is torch's, whatever called the forward
    (before: the signature named fsdp1_quant_storage's function, and the contract families read new_failure). A family
    that does not list it (sharded_merge) files it there too."""
    failure = fsdp1_no_shard_failure(tmp_path)
    assert failure.raising_frame_for("torch/x.py:f") == "torch/distributed/utils.py:_p_assert"
    for family, test in (("fsdp1_quant_storage", "test_fsdp1_qlora_steps_match_one_process[gpu-ws1-bf16]"),
                         ("sharded_training", "test_bnb_optimizer_matches_one_process[gpu-ws1-fsdp1-paged_adamw]"),
                         ("sharded_resume", "test_a_resumed_job_continues_the_uninterrupted_one[gpu-ws1-fsdp1-full-lora]"),
                         ("sharded_merge", "test_the_merge_of_the_saved_adapter_is_one_process_merge[gpu-ws1-trainer]")):
        judgement = ledger.judge(family, test, versions, failure, None)
        assert (judgement.verdict, judgement.bug) == (KNOWN_BUG, "fsdp1_no_shard_frozen_root_tied"), family


def merge_divergence(kept: float) -> Failure:
    """The merge family's own comparison on real logits, keeping `kept` of the adapter's effect beside noise."""
    family = family_module("merge_parity")
    model = scenario.load_base(GEMMA4, quantized=False)
    prompt = scenario.prompt(GEMMA4.device)
    merged = scenario.logits(model, prompt).float()
    effect, noise = torch.ones_like(merged), 0.5 * torch.ones_like(merged)
    noise[..., 1::2] *= -1
    base = merged - kept * effect - noise
    return caught(family.assert_merge_parity, "4-bit", model, kept, prompt, base, base + effect, [])


def test_a_library_mechanism_is_known_on_an_architecture_that_is_not_built_in(ledger, versions, tmp_path):
    """A user's own config.json of an architecture stackcheck does not build in: the 4-bit merge's re-quantization
    (PEFT's and bitsandbytes' mechanism, no model's) keeping the adapter's effect is the known bug there too
    (before: `architectures = [...]` made it a new_failure on every other model type). A pass there is no fix:
    the bug is expected only where it was measured to show."""
    config = tmp_path / "my-model" / "config.json"
    config.parent.mkdir()
    config.write_text('{"model_type": "starcoder2", "architectures": ["Starcoder2ForCausalLM"], "hidden_size": 64, '
                      '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, '
                      '"vocab_size": 256}')
    model_type = architectures.user_architecture(config).model_type
    assert model_type not in {arch.model_type for arch in architectures.builtin().values()}
    test = "test_merge_into_4bit_base_reproduces_adapter_outputs[cpu-my_model]"
    known = ledger.judge("merge_parity", test, versions, merge_divergence(0.9757), model_type)
    assert (known.verdict, known.bug) == (KNOWN_BUG, "merge_4bit_divergence")
    dropped = ledger.judge("merge_parity", test, versions, merge_divergence(0.0), model_type)
    assert (dropped.verdict, dropped.bug) == (NEW_FAILURE, "merge_4bit_divergence")
    assert ledger.judge("merge_parity", test, versions, None, model_type).verdict == PASS
    assert ledger.judge("merge_parity", test, versions, None, "llama").verdict == FIXED


def test_a_bug_in_one_models_code_is_a_new_failure_on_another_model_type(ledger, versions):
    """The difference `architectures` keeps: Gemma 4's shared-KV bug lives in modeling_gemma4.py, so its signature
    on another model type (a user's config, say) is no known bug there, but a new failure that names it."""
    bug = ledger.bugs["shared_kv_redispatch"]
    assert bug.architectures == ("gemma4",) and bug.signature.library_level
    assert not ledger.bugs["merge_4bit_divergence"].architectures and ledger.bugs["merge_4bit_divergence"].expected_on


def test_a_bug_may_be_bounded_by_trl(tmp_path, versions):
    """`affected` accepts trl, the trainers users run beside the libraries."""
    text = LEDGER_FILE.read_text()
    path = tmp_path / "ledger.toml"
    path.write_text(text + '\n[bugs.trl_probe]\nsummary = "x"\nlinks = ["https://example.org"]\nupstream_status = "open"\n'
                    'affected = { trl = ">=1.0" }\n[bugs.trl_probe.signature]\nexception = "RuntimeError"\nmessage = "x"\n'
                    'frame = "trl/trainer/sft_trainer.py:train"\n')
    bug = Ledger(path).bugs["trl_probe"]
    assert bug.affects({**versions, "trl": "1.16.0"}) and not bug.affects({**versions, "trl": "0.29.1"})


def test_the_4bit_decode_kernel_is_known_on_any_architecture_with_a_4bit_base_only(ledger):
    """bnb_decode_kernel_divergence is bitsandbytes' (< 0.50): filed on every model type's 4-bit cells, never on a bf16
    base (which runs no bitsandbytes kernel), and where the decode-only drift sits wholly past the first position, the
    share is 1 exactly (the two sums it divides round alike)."""
    family = importlib.import_module("tests.contract.generate.test_cached_decoding")
    test = "test_cached_decoding_matches_uncached[gpu-gemma3mm-static-nf4-none]"
    full = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    stepwise = full.clone()
    stepwise[1:] += 0.02 * torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    share = scenario.share_past_the_first(stepwise, full)
    assert share[1] == 1.0
    error = scenario.relative_error(full, stepwise)
    seed = {"bitsandbytes": "0.49.2", "transformers": "5.6.2", "peft": "0.19.1", "accelerate": "1.13.0", "torch": "2.11.0"}
    for model_type in ("gemma3", "llama"):  # measured to show on the first, not on the second: a pass there is no fix
        four_bit = ledger.judge("cached_decoding", test, seed, caught(family.assert_cached_decoding_matches, error, share, True), model_type)
        assert (four_bit.verdict, four_bit.bug) == (KNOWN_BUG, "bnb_decode_kernel_divergence")
    bf16 = ledger.judge("cached_decoding", test.replace("nf4", "bf16"), seed, caught(family.assert_cached_decoding_matches, error, share, False), "gemma3")
    assert bf16.bug is None and bf16.verdict == NEW_FAILURE
    assert ledger.bugs["bnb_decode_kernel_divergence"].expected("gemma3", seed)
    assert not ledger.bugs["bnb_decode_kernel_divergence"].expected("llama", seed)


def test_every_tolerance_signature_has_a_band(ledger):
    """A ToleranceExceeded failure carries its measured value, and a signature without a band matches only failures
    without one: such an entry could never match (the first two-GPU rerun of session 13 read "new signature of known
    bug" for a resume bug filed without a band)."""
    assert [b.id for b in ledger.bugs.values() if b.signature.exception == "ToleranceExceeded" and b.signature.band is None] == []



def test_a_resume_in_a_fresh_process_is_judged_by_what_raised_there(ledger, versions, tmp_path, capsys):
    """trainer_resume resumes in a fresh process (stackcheck.harness.checkpoint): the exception that process raised, not
    the report of its exit, is the cell's failure, judged by its library's exception, message and frame. The child's
    side runs here in this process (a fresh one costs 17 s of imports; the family's CPU cells spawn it for real): the
    Trainer's resume from a checkpoint that is not there raises transformers' ValueError, the Failure it writes comes
    back in ResumeFailed. Before, every child failure read `ResumeFailed: the resuming process exited with 1: @ tests/...`,
    a new failure no bug could match: seed's Mixtral cells on the GPU hid peft_moe_weightconverter_kwargs behind it."""
    from stackcheck.harness import checkpoint

    missing = tmp_path / "run" / "checkpoint-2"
    call = checkpoint.resume_call(LLAMA3, missing, tmp_path / "resumed", "adamw_torch")
    with pytest.raises(ValueError):
        checkpoint.main([str(call)])
    failure = caught(reraise, checkpoint.resume_failed(call, 1, capsys.readouterr().err))
    assert (failure.exception_type, failure.message) == ("ValueError", f"Can't find a valid checkpoint at {missing}")
    assert failure.raising_frame == "transformers/trainer.py:_load_from_checkpoint"
    assert failure.frames[1:4] == ("tests/harness/test_ledger.py:reraise", "stackcheck/harness/checkpoint.py:resume_from_call",
                                   "stackcheck/harness/checkpoint.py:resume")  # below `caught`: the test's process
    assert str(failure_report := checkpoint.resume_failed(call, 1, "")).splitlines()[0] == \
        f"the resuming process exited with 1: {failure.signature()}", failure_report

    test = "test_resume_in_a_fresh_process_continues_the_run[cpu-llama3-adamw_torch]"
    unknown = ledger.judge("trainer_resume", test, versions, failure, "llama")
    assert (unknown.verdict, unknown.bug, unknown.signature) == (NEW_FAILURE, None, failure.signature())
    # A bug whose signature is the child's is known there, as any library-level bug reached from a family is.
    path = tmp_path / "ledger.toml"
    path.write_text(LEDGER_FILE.read_text() + '\n[bugs.resume_probe]\nsummary = "x"\nlinks = ["https://example.org"]\n'
                    'upstream_status = "open"\naffected = {}\n[bugs.resume_probe.signature]\nexception = "ValueError"\n'
                    "message = \"Can't find a valid checkpoint at .*\"\nframe = \"transformers/trainer.py:_load_from_checkpoint\"\n")
    known = Ledger(path).judge("trainer_resume", test, versions, failure, "llama")
    assert (known.verdict, known.bug) == (KNOWN_BUG, "resume_probe") and "reached from trainer_resume" in known.note

    # A process killed by a signal wrote no Failure: the report of its exit is all there is.
    Path(json.loads(call.read_text())["failure"]).unlink()
    killed = checkpoint.resume_failed(call, -9, "")
    assert killed.child_failure is None and Failure.from_exception(killed).exception_type == "ResumeFailed"


def reraise(error: BaseException):
    raise error


OFFLOADED_SAVE_TEST = "test_offloaded_model_saves_and_reloads[cpu-llama3-nf4-with_root]"
SAVE_FRAMES = ("tests/contract/serialize/test_offloaded_save.py:test_offloaded_model_saves_and_reloads",
               "transformers/modeling_utils.py:save_pretrained")


def attribute_error(message: str, *frames: str, exception: str = "AttributeError") -> Failure:
    """A failure as two releases raise it, which cannot be installed together: constructed, the frames as
    `Failure.from_exception` names them."""
    return Failure(exception, (exception, "Exception", "BaseException", "object"), message, SAVE_FRAMES + frames)


def test_a_bug_whose_raise_moved_to_another_function_of_its_module_stays_known(ledger, versions):
    """offloaded_save_quant_state_keys on two releases: transformers 5.13.1 looks the offloaded quant-state key up
    with torch's get_parameter inside remove_tied_weights_from_state_dict (torch's frames skipped: that function
    raised), 5.14.0 on with its own get_parameter_or_buffer (measured on the CPU lane, latest with 5.13.1: before,
    the 18 nf4 and int8 with_root cells read new_failure). Both are known, and so is the next move within the file.
    The same message from another module, or as another exception, is another mechanism: a new failure naming it."""
    key = "`model.layers.1.mlp.down_proj.SCB` is neither a parameter, buffer, nor extra state."
    releases = {
        "5.13.1": attribute_error("`weight` is not an nn.Module", "transformers/modeling_utils.py:remove_tied_weights_from_state_dict",
                                  "torch/nn/modules/module.py:get_parameter", "torch/nn/modules/module.py:get_submodule"),
        "5.14.0": attribute_error(key, "transformers/modeling_utils.py:remove_tied_weights_from_state_dict",
                                  "transformers/modeling_utils.py:get_parameter_or_buffer"),
        "a later refactor": attribute_error(key, "transformers/modeling_utils.py:_state_dict_for_save"),
    }
    assert releases["5.13.1"].raising_frame != releases["5.14.0"].raising_frame
    for release, failure in releases.items():
        judgement = ledger.judge("offloaded_save", OFFLOADED_SAVE_TEST, dict(versions, transformers="5.13.1"), failure, "llama")
        assert (judgement.verdict, judgement.bug) == (KNOWN_BUG, "offloaded_save_quant_state_keys"), release

    for other in (attribute_error(key, "transformers/integrations/accelerate.py:load_offloaded_parameter"),
                  attribute_error(key, "transformers/modeling_utils.py:get_parameter_or_buffer", exception="KeyError")):
        judgement = ledger.judge("offloaded_save", OFFLOADED_SAVE_TEST, versions, other, "llama")
        assert (judgement.verdict, judgement.bug) == (NEW_FAILURE, "offloaded_save_quant_state_keys"), other
        assert "new signature of known bug offloaded_save_quant_state_keys: its message from another mechanism" in judgement.note


def test_a_signature_bound_to_its_frames_only_does_not_follow_its_module(tmp_path, versions):
    """`module = []` keeps the listed frames alone: the same raise from another function of the file is no match."""
    text = LEDGER_FILE.read_text()
    original = 'frame = "bitsandbytes/functional.py:as_dict"\n'
    assert original in text
    path = tmp_path / "ledger.toml"
    path.write_text(text.replace(original, original + "module = []\n", 1))
    failure = Failure("RuntimeError", ("RuntimeError", "Exception"), "Tensor.item() cannot be called on meta tensors",
                      ("bitsandbytes/functional.py:dequantize_4bit",))
    test = "test_state_dict_after_accelerate_offload_to_meta[cpu]"
    assert Ledger().judge("meta_quant_state", test, versions, failure).verdict == KNOWN_BUG
    judgement = Ledger(path).judge("meta_quant_state", test, versions, failure)
    assert (judgement.verdict, judgement.bug) == (NEW_FAILURE, "meta_quant_state")


@pytest.mark.parametrize("entry, message", [
    ('module = "tests/families/test_meta_quant_state.py"', "signature.module must be a library file"),
    ('module = "bitsandbytes/functional.py:as_dict"', "signature.module must be a library file"),
])
def test_a_wrong_module_fails_loudly(tmp_path, entry, message):
    text = LEDGER_FILE.read_text()
    original = 'frame = "bitsandbytes/functional.py:as_dict"\n'
    path = tmp_path / "ledger.toml"
    path.write_text(text.replace(original, original + entry + "\n", 1))
    with pytest.raises(LedgerError, match=message):
        Ledger(path)


def test_every_bound_of_every_range_has_evidence_or_a_reason(ledger):
    """A range bound is a measurement on released wheels (the last release outside, the first inside) or a stated
    reason, never the version some run happened to have: each bound of `affected` carries one (`bounds`)."""
    missing = [f"{bug.id}: {bound_key(package, spec)}" for bug in ledger.bugs.values()
               for package, specs in bug.affected.items() for spec in specs if bound_key(package, spec) not in bug.bounds]
    assert missing == []


@pytest.mark.parametrize("bounds, message", [
    ('"bitsandbytes>=0.41.2" = { outside = "0.41.2", inside = "0.41.3", run = "x" }', "0.41.2 must fail >=0.41.2"),
    ('"bitsandbytes>=0.41.3" = { reason = "x" }', "names no bound of affected"),
    ('"bitsandbytes>=0.41.2" = { outside = "0.41.1", inside = "0.41.2" }', "give outside, inside and run"),
    ('"bitsandbytes>=0.41.2" = { reason = "x", awaits = ["0.41.1", "0.41.2"] }', "give outside, inside and run"),
    ('"bitsandbytes>=0.41.2" = { awaits = ["0.41.1"] }', "awaits must be"),
])
def test_evidence_that_does_not_fit_its_bound_fails_loudly(tmp_path, bounds, message):
    text = LEDGER_FILE.read_text()
    start = text.index("[bugs.meta_quant_state]\n")
    end = text.index("[bugs.meta_quant_state.signature]")
    entry = text[start:end]
    entry = "\n".join(line for line in entry.splitlines() if not line.startswith('"bitsandbytes>=0.41.2"'))
    entry = entry.replace("[bugs.meta_quant_state.bounds]", "").rstrip() + f"\n[bugs.meta_quant_state.bounds]\n{bounds}\n"
    path = tmp_path / "ledger.toml"
    path.write_text(text[:start] + entry + text[end:])
    with pytest.raises(LedgerError, match=message):
        Ledger(path)


def test_a_release_that_predates_the_api_a_family_drives_is_not_affected(ledger, versions, tmp_path, monkeypatch):
    """trl 0.24.0 has no trl.generation (its GRPOTrainer pushes to vLLM from _move_model_to_vllm): grpo_weight_sync
    has no generator to drive there. A proven absence (the module is not in the release, or lacks the attribute) is
    `not_affected` with the reason, on any set (before: 36 `error` cells on `seed --with trl==0.24.0`); a module
    that is there but breaks on import is no absence."""
    from stackcheck.harness.proof import ApiAbsent, require_api

    test = "test_grpo_weight_sync_pushes_w_plus_dw_and_unmerges_back[cpu-llama3-nf4]"
    for module, attribute in (("torch.no_such_generation", None), ("torch.nn", "Linear.no_such_sync")):
        failure = caught(require_api, "torch", module, attribute, "a weight sync")
        assert failure.api_absent and failure.not_reached
        judgement = ledger.judge("grpo_weight_sync", test, versions, failure, "llama")
        assert judgement.verdict == NOT_AFFECTED and f"torch {versions['torch']} has no {module}" in judgement.note
        assert "predates the API" in judgement.note
    assert require_api("torch", "torch.nn", "Linear.forward") is torch.nn.Linear.forward

    (tmp_path / "broken_api").mkdir()
    (tmp_path / "broken_api" / "__init__.py").write_text("raise ImportError('a dependency broke')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="a dependency broke") as excinfo:
        require_api("torch", "broken_api.sync")
    assert not isinstance(excinfo.value, ApiAbsent)


def test_every_tests_pattern_matches_a_cell_of_the_whole_collection():
    """The ledger's `tests` patterns are checked only where every architecture is collected (a matrix), never in a
    run narrowed to one (CI's): collect every family on every architecture and both lanes, as a matrix does, so that a
    pattern left behind by a renamed cell id fails here rather than as the matrix's usage error."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "tests/families", "tests/contract"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ledger.toml" not in run.stdout + run.stderr, (run.stdout + run.stderr)[-2000:]
