"""Guards of the train and checkpoint contract families: a deliberately broken library or fixture makes the REAL
family test fail with the family's message (so none of them can pass on a version that has the bug class), and the
known bug a family meets is filed under it by the ledger. They run on the tiny Llama 3, the cheapest architecture."""

import importlib

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.harness import checkpoint
from stackcheck.core.ledger import KNOWN_BUG, Failure, Ledger
from stackcheck.models import architectures
from stackcheck.core.versions import installed_versions

LLAMA3 = scenario.UnderTest(architectures.builtin()["llama3"], torch.device("cpu"))


def contract(phase: str, name: str):
    return importlib.import_module(f"tests.contract.{phase}.test_{name}")


def test_lora_gradients_fail_when_reentrant_checkpointing_cuts_the_gradient(monkeypatch):
    """The bug class of transformers#42489 and trl#3089: under reentrant checkpointing the gradient stops at the
    checkpointed layers, so the LoRA of every layer but the last learns nothing. Reproduced by detaching each
    checkpointed layer's hidden states on their way in (still requiring grad, as `enable_input_require_grads` makes
    the first layer's)."""
    from transformers import modeling_utils

    original = modeling_utils.checkpoint

    def detaching(function, hidden_states, *args, **kwargs):
        return original(function, hidden_states.detach().requires_grad_(), *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "checkpoint", detaching)
    with pytest.raises(AssertionError, match=r"4 of 8 LoRA tensors got no finite non-zero gradient"):
        contract("train", "lora_gradients").test_every_lora_tensor_gets_the_gradient_and_learns(LLAMA3, "reentrant", torch.bfloat16, "nf4")


def test_lora_gradients_fail_when_get_peft_model_freezes_the_adapter(monkeypatch):
    """The bug class of trl#4029 (a second prepare_model_for_kbit_training froze every LoRA tensor): fp16, with the
    GradScaler in the loop, on an int8 base."""
    family = contract("train", "lora_gradients")
    build = scenario.kbit_lora_model

    def frozen(*args, **kwargs):
        model = build(*args, **kwargs)
        for param in scenario.lora_parameters(model).values():
            param.requires_grad_(False)
        return model

    monkeypatch.setattr(scenario, "kbit_lora_model", frozen)
    with pytest.raises(AssertionError, match="8 of 8 LoRA tensors got no finite non-zero gradient"):
        family.test_every_lora_tensor_gets_the_gradient_and_learns(LLAMA3, "non_reentrant", torch.float16, "int8")


def test_checkpointing_divergence_reads_as_the_known_gemma4_bug_in_the_contract_family():
    """The family's divergence message, raised from its own frame, is what the ledger knows of Gemma 4's reentrant
    checkpointing (in range on every set that has transformers >= 5.5.2)."""
    family = contract("train", "lora_gradients")
    reference = {"a": torch.ones(4), "b": torch.ones(4)}
    with pytest.raises(AssertionError) as raised:
        family.assert_checkpointing_keeps_gradients(reference, {"a": torch.ones(4), "b": torch.full((4,), 0.3)})
    judgement = Ledger().judge("lora_gradients", "test_every_lora_tensor_gets_the_gradient_and_learns[cpu-gemma4-reentrant-bf16]",
                               {"transformers": "5.23.0"}, Failure.from_exception(raised.value), model_type="gemma4")
    assert (judgement.verdict, judgement.bug) == (KNOWN_BUG, "gemma4_reentrant_checkpointing_kv_sharing"), judgement


def test_optimizers_fail_when_the_bnb_step_counter_does_not_advance(monkeypatch):
    """A bitsandbytes optimizer whose state forgets its step (bias correction of step 1 at every step) drifts from
    torch's AdamW past the 32-bit tolerance."""
    import bitsandbytes as bnb
    from packaging.version import Version

    if Version(installed_versions()["bitsandbytes"]) < Version("0.50.0"):
        pytest.skip("bitsandbytes < 0.50 has no CPU optimizer kernels (bnb_optimizers_cpu): the family cannot run here")
    update_step = bnb.optim.optimizer.Optimizer2State.update_step

    def forgetful(self, group, p, gindex, pindex):
        self.state[p]["step"] = 0
        return update_step(self, group, p, gindex, pindex)

    monkeypatch.setattr(bnb.optim.optimizer.Optimizer2State, "update_step", forgetful)
    with pytest.raises(AssertionError, match="bitsandbytes' paged_adamw_32bit drifts from torch's AdamW over 3 steps"):
        contract("train", "optimizers_track_adamw").test_bnb_optimizer_tracks_torch_adamw(LLAMA3, 32, True)


def test_optimizers_fail_when_every_step_is_scaled_past_float32s_rounding(monkeypatch):
    """A uniform scale of every step is accepted up to STEP_SCALE (the rounding of AdamW's scalars in float32), judged
    beside it; a larger one (here bitsandbytes at lr x (1 + 2e-3)) fails on the error itself."""
    import bitsandbytes as bnb
    from packaging.version import Version

    if Version(installed_versions()["bitsandbytes"]) < Version("0.50.0"):
        pytest.skip("bitsandbytes < 0.50 has no CPU optimizer kernels (bnb_optimizers_cpu): the family cannot run here")
    update_step = bnb.optim.optimizer.Optimizer2State.update_step

    def faster(self, group, p, gindex, pindex):
        lr = group["lr"]
        group["lr"] = lr * (1 + 2e-3)
        try:
            return update_step(self, group, p, gindex, pindex)
        finally:
            group["lr"] = lr

    monkeypatch.setattr(bnb.optim.optimizer.Optimizer2State, "update_step", faster)
    with pytest.raises(AssertionError, match=r"drifts from torch's AdamW over 3 steps: worst LoRA tensor's relative error \(its elements\) 0\.00[2-3]"):
        contract("train", "optimizers_track_adamw").test_bnb_optimizer_tracks_torch_adamw(LLAMA3, 32, True)


def test_the_uniform_step_scale_is_found_where_it_is_the_whole_difference():
    """`Run.step_scale` on torch's own AdamW at lr x (1 + 5e-5): the scale it finds is that one, and nothing is left
    beside it."""
    family = contract("train", "optimizers_track_adamw")
    run = family.Run(LLAMA3)
    run.torch_adamw()
    weights, _losses, _optimizer = run.train(lambda params: torch.optim.AdamW(params, **{**family.ADAMW, "lr": family.ADAMW["lr"] * (1 + 5e-5)}))
    scale, left = run.step_scale(weights)
    assert scale == pytest.approx(5e-5, rel=0.05) and left < 1e-5, (scale, left)


def test_optimizers_fail_when_the_weight_decay_follows_the_update(monkeypatch):
    """bitsandbytes issue #2010's mechanism, on the CPU kernel: the update first, then the decay, p <- (p - lr u)(1 - lr
    wd). The family fails, and names the share decay-after-update explains: all of it."""
    import bitsandbytes as bnb
    from packaging.version import Version

    if Version(installed_versions()["bitsandbytes"]) < Version("0.50.0"):
        pytest.skip("bitsandbytes < 0.50 has no CPU optimizer kernels (bnb_optimizers_cpu): the family cannot run here")
    update_step = bnb.optim.optimizer.Optimizer2State.update_step

    def decay_after(self, group, p, gindex, pindex):
        decay = group["weight_decay"]
        group["weight_decay"] = 0.0
        try:
            update_step(self, group, p, gindex, pindex)
        finally:
            group["weight_decay"] = decay
        p.data.mul_(1 - group["lr"] * decay)

    monkeypatch.setattr(bnb.optim.optimizer.Optimizer2State, "update_step", decay_after)
    with pytest.raises(AssertionError, match=r"decays the weights otherwise than torch's AdamW .* \(the share decay-after-update explains (0\.99\d\d|1\.00\d\d)\)"):
        contract("train", "optimizers_track_adamw").test_bnb_adamw_decays_the_weights_as_torch_adamw(torch.device("cpu"), True)


def test_optimizers_fail_when_a_per_parameter_override_is_dropped(monkeypatch):
    """bitsandbytes PR #1869's class: an `override_config` made after `register_parameters` that the optimizer never
    reads leaves the tensor's state in 8 bits."""
    import bitsandbytes as bnb
    from packaging.version import Version

    if Version(installed_versions()["bitsandbytes"]) < Version("0.50.0"):
        pytest.skip("bitsandbytes < 0.50 has no CPU optimizer kernels (bnb_optimizers_cpu): the family cannot run here")
    monkeypatch.setattr(bnb.optim.GlobalOptimManager, "override_config", lambda self, *args, **kwargs: None)
    with pytest.raises(AssertionError, match=r"^override_config\(.+, 'optim_bits', 32\) after register_parameters was not honoured: its state is torch\.uint8"):
        contract("train", "optimizers_track_adamw").test_adamw_8bit_honours_a_per_parameter_32bit_override(LLAMA3)


def test_resume_fails_when_the_checkpoint_holds_a_fresh_optimizer_state(monkeypatch, tmp_path):
    """The bug class of DeepSpeed PR #7786 (optimizer state neither saved nor loaded): the checkpoint's optimizer.pt
    holds an optimizer that never stepped, so the fresh process resumes with Adam's moments at zero."""
    from transformers import Trainer

    family = contract("checkpoint", "trainer_resume")
    save = Trainer._save_optimizer_and_scheduler

    def save_a_fresh_optimizer(self, output_dir):
        save(self, output_dir)
        fresh = self.optimizer.state_dict() | {"state": {}}  # its parameter groups, none of its moments
        torch.save(fresh, f"{output_dir}/{checkpoint.CHECKPOINT_FILES['optimizer']}")

    monkeypatch.setattr(Trainer, "_save_optimizer_and_scheduler", save_a_fresh_optimizer)
    with pytest.raises(AssertionError, match="the resumed run began with an empty optimizer state: it was not loaded"):
        family.test_resume_in_a_fresh_process_continues_the_run(LLAMA3, "adamw_torch", tmp_path)
