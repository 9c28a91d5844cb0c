"""The adapter a sharded QLoRA job trained, gathered and saved, merges into the base as the same adapter does in one
process.

Precondition proven: `prepare` gave an FSDP2 module (the Trainer trained one), the trained lora_B factors moved away from
their zero initialisation (so a merge of the initial adapter would differ from the base's weights and from this one),
the saved adapter holds every trained LoRA tensor, and the merged model is not the base (some weight changed).

The property, the judgement and the lanes: docs/family-notes.md#sharded_merge.
"""

import os
from pathlib import Path

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.distributed import rank as rank_side, recipes
from stackcheck.distributed.cells import WORLD_SIZES
from stackcheck.models import architectures, tiny

MODULE = "tests.contract.distributed.test_sharded_merge"
ARCHITECTURE = "llama3"
STEPS = 3
GPU_ONLY = {"trainer": "on a CPU host accelerate makes the Trainer's FSDP a DDP job",
            "accelerate": "on the CPU, get_state_dict hands back FSDP2's DTensors with an invalid storage"}


def subject(device=None) -> scenario.UnderTest:
    return scenario.UnderTest(architectures.builtin()[ARCHITECTURE], device or rank_side.device())


def accelerate_save(adapter_dir: str) -> dict[str, torch.Tensor]:
    """STEPS steps of accelerate's loop under FSDP2, then accelerate's save of the adapter; the gathered weights."""
    under_test = subject()
    accelerator = recipes.engine_accelerator("fsdp2")
    model = recipes.engine_model(under_test, "fsdp2")
    batch = scenario.training_batch(under_test.device, model.config)
    model, optimizer, _plain = recipes.prepare(accelerator, "fsdp2", model, recipes.optimizer_for(model), batch)
    recipes.sharded_steps(accelerator, model, optimizer, batch, STEPS)
    state_dict = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(adapter_dir, state_dict=state_dict, is_main_process=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    return recipes.lora_weights(model, "fsdp2")


def trainer_save(adapter_dir: str, output_dir: str) -> dict[str, torch.Tensor]:
    """STEPS steps of the Trainer under the launch's FSDP2, then its save of the adapter in a full state dict."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir, per_device_train_batch_size=1, max_steps=STEPS, learning_rate=recipes.LEARNING_RATE,
                             lr_scheduler_type="constant", report_to="none", save_strategy="no")
    model = recipes.engine_model(subject(), "fsdp2")
    rows = recipes.distinct_rows(STEPS * int(os.environ["WORLD_SIZE"]))  # a sequence of its own for every rank and step
    trainer = Trainer(model=model, args=args, train_dataset=recipes.rows_dataset(rows))
    trainer.train()
    scenario.require(isinstance(trainer.model_wrapped, FSDPModule), f"the Trainer trained a {type(trainer.model_wrapped).__name__}, not an FSDP2 module")
    trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(adapter_dir)
    trainer.accelerator.wait_for_everyone()
    return recipes.lora_weights(trainer.model_wrapped, "fsdp2")


def train_and_save(saver: str, adapter_dir: str, output_dir: str, reference: str) -> dict:
    """On every rank: train and save the adapter the `saver`'s way; rank 0 keeps the weights gathered from the shards."""
    weights = accelerate_save(adapter_dir) if saver == "accelerate" else trainer_save(adapter_dir, output_dir)
    moved = [name for name, weight in weights.items() if "lora_B" in name and weight.any()]
    scenario.require(moved, "no lora_B factor moved from its zero initialisation: a merge would be the base's")
    if torch.distributed.get_rank() == 0:
        torch.save(weights, reference)
    return {"saved": sorted(os.listdir(adapter_dir)), "lora_b_moved": len(moved)}


def merged_from_saved(adapter_dir: Path, merged_dir: Path) -> dict[str, torch.Tensor]:
    """The user's merge: the saved adapter on a fresh bf16 base, merged, saved, and reloaded from its files."""
    from peft import PeftModel
    from safetensors.torch import load_file

    model = PeftModel.from_pretrained(scenario.load_base(subject(torch.device("cpu")), quantized=False), adapter_dir)
    model.merge_and_unload().save_pretrained(merged_dir)
    files = sorted(merged_dir.glob("*.safetensors"))
    scenario.require(files, f"save_pretrained wrote no safetensors in {merged_dir}")
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


def merged_in_one_process(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same adapter merged in one process: the gathered weights set into the recipe's LoRA on a fresh bf16 base."""
    from peft import get_peft_model

    under_test = subject(torch.device("cpu"))
    model = get_peft_model(scenario.load_base(under_test, quantized=False), tiny.lora_config(under_test.arch, "language"))
    params = dict(model.named_parameters())
    scenario.require(weights.keys() <= params.keys(), f"the recipe's LoRA has no {sorted(weights.keys() - params.keys())[:1]}")
    with torch.no_grad():
        for name, weight in weights.items():
            params[name].copy_(weight.to(params[name].dtype))
    return {name: tensor.detach().clone() for name, tensor in model.merge_and_unload().state_dict().items()}


@pytest.mark.parametrize("saver", ["accelerate", "trainer"])
@pytest.mark.ranks_engine("fsdp2")
@WORLD_SIZES
def test_the_merge_of_the_saved_adapter_is_one_process_merge(ranks, world_size, saver, tmp_path):
    tiny.base_checkpoint(architectures.builtin()[ARCHITECTURE])  # built once here, before the ranks read it
    adapter_dir, reference = tmp_path / "adapter", tmp_path / "gathered.pt"
    ranks(f"{MODULE}:train_and_save", world_size, engine="fsdp2", gpu_only=GPU_ONLY[saver], saver=saver, adapter_dir=str(adapter_dir),
          output_dir=str(tmp_path / "trained"), reference=str(reference))
    gathered = torch.load(reference)
    from peft import load_peft_weights

    saved = load_peft_weights(str(adapter_dir), device="cpu")
    expected = {name.replace(".default.", "."): weight for name, weight in gathered.items()}
    missing = sorted(expected.keys() - saved.keys())
    assert not missing, f"the saved adapter lacks {len(missing)} of {len(expected)} trained LoRA tensors (it holds {len(saved)}), e.g. {missing[0]}"
    unequal = [name for name, weight in expected.items() if not torch.equal(saved[name].float(), weight) or saved[name].dtype != weight.dtype]
    assert not unequal, f"{len(unequal)} of {len(expected)} saved LoRA tensors differ from the trained ones (values or dtype), e.g. {unequal[0]}"

    merged = merged_from_saved(adapter_dir, tmp_path / "merged")
    one_process = merged_in_one_process(gathered)
    base = scenario.load_base(subject(torch.device("cpu")), quantized=False).state_dict()
    scenario.require(any(not torch.equal(one_process[name], base[name]) for name in one_process if name in base),
                     "the one-process merge left every base weight as it was")
    scenario.require(merged.keys() <= one_process.keys() and one_process.keys() - merged.keys() <= {"lm_head.weight"},
                     f"the saved merge holds other tensors than the model: {sorted(merged.keys() ^ one_process.keys())[:3]}")
    differing = [name for name, tensor in merged.items() if not torch.equal(tensor, one_process[name])]
    assert not differing, (f"{len(differing)} of {len(merged)} tensors of the merged model saved from the sharded job's adapter differ "
                           f"from one process's merge of the same weights, e.g. {differing[0]}")
