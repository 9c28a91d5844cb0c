"""Guards of the trl phase's contract families: a deliberately broken library piece makes the real family test fail
with the family's own message (or stop as scenario not reached), never pass."""

import importlib

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.models import architectures
from stackcheck.harness.scenario import ScenarioNotReached

LLAMA3 = scenario.UnderTest(architectures.builtin()["llama3"], torch.device("cpu"))


def family(name: str):
    return importlib.import_module(f"tests.contract.trl.test_{name}")


def test_sft_fails_when_the_trainer_leaves_lora_tensors_frozen(monkeypatch, tmp_path):
    """The class of bug: a trainer or PEFT release that wraps the model but leaves some LoRA tensors out of training."""
    import trl.trainer.sft_trainer as sft_trainer

    real = sft_trainer.get_peft_model

    def half_frozen(model, config, *args, **kwargs):
        peft_model = real(model, config, *args, **kwargs)
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name and ".layers.0." in name:
                parameter.requires_grad_(False)
        return peft_model

    monkeypatch.setattr(sft_trainer, "get_peft_model", half_frozen)
    with pytest.raises(AssertionError, match=r"\d+ of \d+ LoRA tensors did not move in \d+ SFT steps"):
        family("sft_qlora").test_sft_qlora_trains_the_adapter_and_it_reloads(LLAMA3, tmp_path)


def test_sft_fails_when_the_trainer_freezes_a_ready_peft_model(monkeypatch, tmp_path):
    """trl#3926's class: SFTTrainer handed a ready PeftModel runs `prepare_model_for_kbit_training` on it again, which
    sets every parameter, the LoRA tensors included, to requires_grad=False."""
    from peft import prepare_model_for_kbit_training
    from trl import SFTTrainer

    real = SFTTrainer.__init__

    def preparing_again(self, model=None, *args, **kwargs):
        real(self, prepare_model_for_kbit_training(model, use_gradient_checkpointing=False), *args, **kwargs)

    monkeypatch.setattr(SFTTrainer, "__init__", preparing_again)
    with pytest.raises(AssertionError, match=r"^SFTTrainer froze 8 of the 8 LoRA tensors of the PeftModel it was handed"):
        family("sft_qlora").test_sft_trains_a_ready_peft_model_on_a_kbit_base(LLAMA3, tmp_path)


def test_sft_fails_when_the_saved_adapter_reloads_without_its_weights(monkeypatch, tmp_path):
    """The class of bug: an adapter saved under keys the model no longer has reloads at its initialisation."""
    import peft

    real = peft.PeftModel.from_pretrained

    def renamed(model, path, *args, **kwargs):
        loaded = real(model, path, *args, **kwargs)
        with torch.no_grad():
            for name, parameter in loaded.named_parameters():
                if "lora_B" in name:
                    parameter.zero_()
        return loaded

    monkeypatch.setattr(peft.PeftModel, "from_pretrained", staticmethod(renamed))
    with pytest.raises(AssertionError, match="the reloaded SFT adapter's effect differs from the trained one"):
        family("sft_qlora").test_sft_qlora_trains_the_adapter_and_it_reloads(LLAMA3, tmp_path)


def test_grpo_sync_fails_when_unmerge_leaves_the_delta_in(monkeypatch):
    """The class of bug: an unmerge that forgets to subtract dW (the model stays merged while LoRA is active again)."""
    from peft.tuners.lora import layer

    monkeypatch.setattr(layer.Linear, "unmerge", lambda self: self.merged_adapters.clear())
    with pytest.raises(AssertionError, match="GRPO weight syncs do not give the weights back"):
        family("grpo_weight_sync").test_grpo_weight_sync_pushes_w_plus_dw_and_unmerges_back(LLAMA3, scenario.prompt(LLAMA3.device), False)


def test_grpo_sync_stops_when_a_lora_layer_is_not_pushed(monkeypatch):
    from stackcheck.harness import trainers

    real = trainers.vllm_sync

    def dropping(model, keep=None):
        pushed, states = real(model, keep)
        return {name: t for name, t in pushed.items() if "q_proj" not in name}, states

    monkeypatch.setattr(trainers, "vllm_sync", dropping)
    with pytest.raises(ScenarioNotReached, match="the sync pushed no weight for"):
        family("grpo_weight_sync").test_grpo_weight_sync_pushes_w_plus_dw_and_unmerges_back(LLAMA3, scenario.prompt(LLAMA3.device), False)


# --- trl_step: a QLoRA step of each trainer in the precision asked -------------------------------------------------

def trl_step(kind: str, tmp_path):
    family("trl_step").test_a_qlora_step_trains_the_adapter_in_the_precision_asked(LLAMA3, kind, torch.bfloat16, tmp_path)


def test_trl_step_fails_when_the_trainer_leaves_lora_tensors_frozen(monkeypatch, tmp_path):
    """The class of bug: a trainer that wraps the model with LoRA but leaves some of its tensors out of training (DPO's
    trainer here: the first layer's LoRA frozen once the trainer is built)."""
    from stackcheck.harness import trainers

    real = trainers.qlora_trainer

    def half_frozen(*args, **kwargs):
        trainer = real(*args, **kwargs)
        for name, parameter in trainer.model.named_parameters():
            if "lora_" in name and ".layers.0." in name:
                parameter.requires_grad_(False)
        return trainer

    monkeypatch.setattr(trainers, "qlora_trainer", half_frozen)
    with pytest.raises(AssertionError, match=r"^\d+ of \d+ LoRA tensors got no finite non-zero gradient at sft's last"):
        trl_step("sft", tmp_path)


def test_trl_step_fails_when_grpo_advantages_are_all_zero(monkeypatch, tmp_path):
    """The class of bug: a reward or advantage computation that loses the spread within each group: every advantage is
    zero and GRPO's step carries no gradient (no error, the loss logged as usual)."""
    from stackcheck.harness import trainers

    monkeypatch.setattr(trainers, "completion_reward", lambda completion_ids, **kwargs: [0.5] * len(completion_ids))
    with pytest.raises(AssertionError, match=r"^\d+ of \d+ LoRA tensors got no finite non-zero gradient at grpo's last"):
        trl_step("grpo", tmp_path)


def test_trl_step_fails_when_a_step_writes_into_the_4bit_base(monkeypatch, tmp_path):
    """The class of bug: a training forward that writes into the frozen 4-bit base (here its quant state's scales)."""
    from peft.tuners.lora import bnb as lora_bnb

    real = lora_bnb.Linear4bit.forward

    def writing(self, x, *args, **kwargs):
        if torch.is_grad_enabled():
            state = self.get_base_layer().weight.quant_state
            with torch.no_grad():
                (state.state2.absmax if state.nested else state.absmax).mul_(1.0001)
        return real(self, x, *args, **kwargs)

    monkeypatch.setattr(lora_bnb.Linear4bit, "forward", writing)
    with pytest.raises(AssertionError, match=r"^3 sft bf16 steps changed \d+ frozen base tensors"):
        trl_step("sft", tmp_path)


def test_trl_step_stops_when_the_trainer_runs_without_the_precision_asked(monkeypatch, tmp_path):
    """The class of bug: mixed precision asked for and accepted, the forward run without autocast."""
    import contextlib

    import accelerate.accelerator

    class Off(contextlib.ContextDecorator):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(accelerate.accelerator, "get_mixed_precision_context_manager", lambda *args, **kwargs: Off())
    with pytest.raises(ScenarioNotReached, match=r"sft's training forwards ran under autocast \[\(False, 'torch\.\w+'\)\], not torch\.bfloat16"):
        trl_step("sft", tmp_path)


def test_trl_step_is_skipped_on_the_cpu_for_fp16_where_accelerate_runs_it_without_autocast(tmp_path):
    with pytest.raises(pytest.skip.Exception, match=r"^CPU lane: accelerate \S+ runs fp16 mixed precision on the CPU without autocast"):
        family("trl_step").test_a_qlora_step_trains_the_adapter_in_the_precision_asked(LLAMA3, "sft", torch.float16, tmp_path)
