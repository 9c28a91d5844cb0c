"""trl's SFTTrainer QLoRA recipe, the one most users copy, trains the adapter and leaves the 4-bit base untouched;
the adapter it saves reloads to the outputs it trained.

Precondition proven: the base is NF4 with nested quant state, the trainer wrapped it with LoRA on 4-bit layers,
training ran its steps (the loss was logged), the trained adapter changes the outputs, and on an image model the
image does (another image gives other logits).

The journey, the property, the bugs it catches and tolerances: docs/family-notes.md#sft_qlora.
"""

import torch

from stackcheck.harness import scenario
from stackcheck.harness import trainers
from stackcheck.harness.trainer import one_device
from stackcheck.models import tiny

STEPS = 4
LEARNING_RATE = 1e-2
ROUND_TRIP_TOLERANCE = 1e-3
RELOAD_TOLERANCE = 0.05
READY_STEPS = 2  # the ready-PeftModel cell: a frozen adapter shows at the first step


def sft_config(output_dir, device):
    from trl import SFTConfig

    # The one-device user's run on the lane's device (with several GPUs visible the Trainer would use nn.DataParallel,
    # which TRL refuses: the one-process multi-GPU scenario is data_parallel_training's).
    return one_device(SFTConfig(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=2, learning_rate=LEARNING_RATE,
                                logging_steps=1, save_strategy="no", report_to="none", max_length=64, seed=0,
                                use_cpu=device.type == "cpu", dataloader_num_workers=0), device)


def dataset(under_test):
    """Four fixed sentences; on an image model whose processor the harness builds (Gemma 3's) each begins with an
    image. The seed's Gemma 4 trains on text here: its processor (image and audio) is not built in memory."""
    from datasets import Dataset

    texts = trainers.sentences(4, 12)
    if not trainers.has_image_processor(under_test.arch):
        return Dataset.from_dict({"text": texts}), trainers.tokenizer(under_test.arch)
    side = under_test.arch.config["vision_config"]["image_size"]
    messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text[:20]}]},
                 {"role": "assistant", "content": [{"type": "text", "text": text[20:]}]}] for text in texts]
    images = [[image] for image in trainers.images(4, side)]
    return Dataset.from_dict({"messages": messages, "images": images}), trainers.processor(under_test.arch)


def frozen_4bit_state(model) -> dict[str, torch.Tensor]:
    state = {}
    for name, layer in scenario.linear4bit_modules(model).items():
        state[f"{name}.weight"] = layer.weight.detach().clone()
        for index, tensor in enumerate(scenario.quant_state_tensors(layer.weight.quant_state)):
            state[f"{name}.quant_state.{index}"] = tensor.detach().clone()
    return state


def adapter_effect(model, batch) -> torch.Tensor:
    with torch.no_grad():
        with_adapter = model(**batch).logits.float()
        with model.disable_adapter():
            without = model(**batch).logits.float()
    return with_adapter - without


def with_dtypes_of(model, trained) -> None:
    """Give `model`'s floating parameters the dtypes of the same-named parameters of `trained` (the norms
    `prepare_model_for_kbit_training` upcast), so that a reload computes as the trained model did."""
    dtypes = {name: p.dtype for name, p in trained.named_parameters()}
    cast = 0
    for name, p in model.named_parameters():
        if p.is_floating_point() and name in dtypes and p.dtype != dtypes[name]:
            p.data = p.data.to(dtypes[name])
            cast += 1
    print(f"stackcheck measured: {cast} parameters of the reload cast to the trained model's dtypes")


def test_sft_qlora_trains_the_adapter_and_it_reloads(under_test, tmp_path):
    from peft import PeftModel
    from trl import SFTTrainer

    base = scenario.load_base(under_test)
    scenario.first_nested_linear4bit(base)
    train_dataset, processing_class = dataset(under_test)
    trainer = SFTTrainer(model=base, args=sft_config(tmp_path / "run", under_test.device), train_dataset=train_dataset,
                         processing_class=processing_class, peft_config=tiny.lora_config(under_test.arch, "language"))
    model = trainer.model
    lora_on_4bit = [name for name in scenario.lora_wrapped(model) if name not in scenario.lora_on_unquantized_weights(model)]
    scenario.require(lora_on_4bit, "the trainer put no LoRA on a 4-bit layer")
    before_lora, before_base = trainers.lora_state(model), frozen_4bit_state(model)

    trainer.train()

    losses = trainers.trained_losses(trainer)
    scenario.require(len(losses) == STEPS, f"training logged {len(losses)} losses, not {STEPS}")
    print(f"stackcheck measured: SFT losses {[round(x, 4) for x in losses]}")
    assert all(torch.isfinite(torch.tensor(losses))), f"SFT loss is not finite: {losses}"
    still = [name for name, p in trainers.lora_state(model).items() if torch.equal(p, before_lora[name])]
    assert not still, f"{len(still)} of {len(before_lora)} LoRA tensors did not move in {STEPS} SFT steps: {still[:3]}"
    changed = [name for name, t in frozen_4bit_state(model).items() if not torch.equal(t, before_base[name])]
    assert not changed, f"SFT changed {len(changed)} frozen 4-bit base tensors: {changed[:3]}"

    batch = {k: v.to(under_test.device) for k, v in trainer.data_collator([trainer.train_dataset[0]]).items() if k != "labels"}
    model.eval()
    trained = adapter_effect(model, batch)
    scenario.require(trained.abs().max() > 0, "the trained adapter does not change the outputs")
    if "pixel_values" in batch:  # the image reaches the outputs (a zero projector would cut it out)
        with torch.no_grad():
            other = model(**{**batch, "pixel_values": batch["pixel_values"].flip(-1)}).logits
            scenario.require(not torch.equal(other, model(**batch).logits), "the image does not change the outputs")
    trainer.save_model(str(tmp_path / "adapter"))
    matched = PeftModel.from_pretrained(scenario.load_base(under_test), tmp_path / "adapter").eval()
    with_dtypes_of(matched, model)
    with trainer.accelerator.autocast():  # the trained model's forward is wrapped in the run's mixed precision
        error = scenario.relative_error(adapter_effect(matched, batch), trained)
    scenario.assert_within("the reloaded SFT adapter's effect differs from the trained one (the trained model's dtypes): "
                           "relative error", error, ROUND_TRIP_TOLERANCE)
    del matched
    reloaded = PeftModel.from_pretrained(scenario.load_base(under_test), tmp_path / "adapter").eval()
    plain = adapter_effect(reloaded, batch)
    kept = scenario.effect_kept(plain, trained, torch.zeros_like(trained))
    print(f"stackcheck measured: the plain reload's effect against the trained one: relative error "
          f"{scenario.relative_error(plain, trained):.4f}")
    scenario.assert_within("the plain reloaded SFT adapter keeps another share of the trained effect: |1 - kept|",
                           abs(1 - kept), RELOAD_TOLERANCE, judged_by=("of the trained effect kept", kept))


def test_sft_trains_a_ready_peft_model_on_a_kbit_base(under_test, tmp_path):
    """The other way in: the user prepares the 4-bit base (`prepare_model_for_kbit_training`), wraps it with
    `get_peft_model`, and hands SFTTrainer the PeftModel with no `peft_config`. SFTTrainer must train that adapter:
    every LoRA tensor trainable and moved, a non-zero gradient norm at every step. trl <= 0.23 ran
    `prepare_model_for_kbit_training` again on the PeftModel, which froze every LoRA tensor (trl#3926): grad norm 0, no
    learning, no error. Only where the 4-bit weights sit on an accelerator: trl 0.23 takes 4-bit weights on the CPU for a
    sharded model and skips that call (and on transformers 5 it finds no `is_loaded_in_4bit`), so the CPU lane passes on
    trl 0.23.0 (measured with transformers 4.57.6 and 5.6.2) and the GPU lane is the test."""
    from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training
    from trl import SFTTrainer

    base = scenario.load_base(under_test)
    scenario.first_nested_linear4bit(base)
    model = get_peft_model(prepare_model_for_kbit_training(base), tiny.lora_config(under_test.arch, "language"))
    asked = [name for name, p in model.named_parameters() if "lora_" in name and p.requires_grad]
    scenario.require(asked, "get_peft_model made no LoRA tensor trainable")
    train_dataset, processing_class = dataset(under_test)
    args = sft_config(tmp_path / "run", under_test.device)
    args.max_steps = READY_STEPS
    trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset, processing_class=processing_class)
    scenario.require(isinstance(trainer.model, PeftModel) and scenario.lora_wrapped(trainer.model),
                     f"SFTTrainer did not keep the PeftModel it was handed ({type(trainer.model).__name__})")
    before = trainers.lora_state(trainer.model)

    trainer.train()

    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    scenario.require(len(norms) == READY_STEPS, f"training logged {len(norms)} gradient norms, not {READY_STEPS}")
    print(f"stackcheck measured: SFT of a ready PeftModel: grad norms {[round(float(n), 4) for n in norms]}")
    frozen = [name for name in asked if not dict(trainer.model.named_parameters())[name].requires_grad]
    assert not frozen, f"SFTTrainer froze {len(frozen)} of the {len(asked)} LoRA tensors of the PeftModel it was handed: {frozen[:3]}"
    assert all(float(n) > 0 for n in norms), f"SFT of a ready PeftModel on a 4-bit base: gradient norms {norms}"
    still = [name for name, p in trainers.lora_state(trainer.model).items() if torch.equal(p, before[name])]
    assert not still, f"{len(still)} of {len(before)} LoRA tensors of the ready PeftModel did not move in {READY_STEPS} SFT steps: {still[:3]}"
