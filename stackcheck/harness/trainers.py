"""Trainers: what users run over the libraries, trl's SFTTrainer, DPOTrainer and GRPOTrainer, on the tiny models with no
network: a word-level tokenizer built in memory over the tiny vocabulary (and, for an image model, its processor),
datasets built with `datasets.Dataset.from_dict`, each trainer's QLoRA recipe in the precision asked as the installed
trl release takes it (`qlora_trainer`), what a step of it used and changed (`StepsSeen`), and the weight sync that GRPO
runs before each generation with vLLM."""

from __future__ import annotations

import copy
from functools import cache

import torch

from stackcheck.harness.proof import require_api
from stackcheck.models import architectures

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
# The special tokens an image model's processor needs (Gemma 3's names), at the ids the tiny config gives them.
IMAGE_TOKENS = {"image_token": ("<image_soft_token>", "image_token_index"), "boi_token": ("<start_of_image>", "boi_token_index"),
                "eoi_token": ("<end_of_image>", "eoi_token_index")}
FIRST_WORD = 4  # word ids start after pad, eos, bos and unk


def word(token_id: int) -> str:
    return f"w{token_id}"


@cache
def tokenizer(arch):
    """A word-level fast tokenizer over the tiny vocabulary: `w<id>` is token <id>, whitespace separates words; pad,
    eos, bos and unk take ids 0 to 3, and an image model's image tokens the ids its tiny config names."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = {0: PAD, 1: EOS, 2: BOS, 3: UNK}
    extra = {}
    for attribute, (token, key) in IMAGE_TOKENS.items():
        if key in arch.config:
            names[arch.config[key]] = token
            extra[attribute] = token
    vocab = {names.get(i, word(i)): i for i in range(architectures.VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=UNK,
                                   **({"extra_special_tokens": extra} if extra else {}))  # transformers 4 refuses None
    fast.add_special_tokens({"additional_special_tokens": list(extra.values())}) if extra else None
    return fast


# A chat template of the shape of Gemma 3's: each turn's text, each image as the image placeholder the processor expands.
CHAT_TEMPLATE = ("{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }} {% else %}"
                 "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }} "
                 "{% elif item['type'] == 'text' %}{{ item['text'] }} {% endif %}{% endfor %}{% endif %}{% endfor %}")


def has_image_processor(arch) -> bool:
    """Whether `processor` can build the architecture's processor: an image model with Gemma 3's pooled image tokens."""
    return isinstance(arch.config.get("vision_config"), dict) and "mm_tokens_per_image" in arch.config


def processor(arch):
    """The processor of an image model (Gemma 3's): its image processor at the tiny tower's image size and the
    tokenizer, expanding each image to the tiny config's `mm_tokens_per_image` soft tokens; a Gemma-3-shaped chat
    template."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    side = arch.config["vision_config"]["image_size"]
    image_processor = Gemma3ImageProcessor(size={"height": side, "width": side})
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer(arch), chat_template=CHAT_TEMPLATE,
                           image_seq_length=arch.config["mm_tokens_per_image"])


def sentences(count: int, length: int, seed: int = 3) -> list[str]:
    """`count` fixed sentences of `length` words: the tiny SFT dataset's texts."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_WORD, architectures.VOCAB - 8, (count, length), generator=generator)
    return [" ".join(word(int(i)) for i in row) for row in ids]


def images(count: int, side: int, seed: int = 4):
    """`count` fixed random RGB images (PIL, as a dataset's `images` column holds them)."""
    import numpy as np
    from PIL import Image

    generator = np.random.default_rng(seed)
    return [Image.fromarray(generator.integers(8, 248, (side, side, 3), dtype=np.uint8)) for _ in range(count)]


def lora_state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def trained_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def vllm_name(module_name: str) -> str:
    """A LoRA layer's base weight under the name vLLM receives it by (trl's renaming of PEFT's names)."""
    return module_name.removeprefix("base_model.model.").replace(".base_layer", "") + ".weight"


def _backend(on_cpu: bool):
    """trl's backend over an `Accelerator` of the model's device, built for the test that asks (accelerate's state is
    reset after every test, stackcheck.process.isolation: a backend kept from an earlier test would hold an emptied state)."""
    from accelerate import Accelerator
    from trl.distributed import DistributedBackend

    return DistributedBackend(Accelerator(cpu=on_cpu))


def vllm_sync(model, keep=None) -> tuple[dict[str, torch.Tensor | None], dict[str, object]]:
    """The weights GRPO pushes to vLLM, as trl's own `VLLMGeneration._iter_named_params` yields them: PEFT's
    `merge_adapter`, the merged parameters under vLLM's names, `unmerge_adapter` (the generator is trl's; only the
    receiving engine is absent). Returns every pushed name with a copy of its tensor (of the names in `keep` only, when
    given; None for the others), and for a 4-bit base the quant state each merged 4-bit weight had while it was pushed
    (the packed codes alone cannot be read without it)."""
    from trl.generation.vllm_generation import VLLMGeneration

    from stackcheck.harness.load import linear4bit_modules

    generation = VLLMGeneration.__new__(VLLMGeneration)  # its __init__ starts vLLM; the sync reads only these two
    generation.model = model
    generation._dist = _backend(next(model.parameters()).device.type == "cpu")
    pushed, states = {}, None
    for name, tensor in generation._iter_named_params():
        if states is None:  # the first tensor comes once every layer is merged: its 4-bit states are the pushed ones
            states = {vllm_name(layer): copy.deepcopy(module.weight.quant_state) for layer, module in linear4bit_modules(model).items()
                      if keep is None or vllm_name(layer) in keep}
        pushed[name] = tensor.detach().clone() if keep is None or name in keep else None
    return pushed, states or {}


def require_trl_sync():
    """trl's VLLMGeneration weight sync, or ApiAbsent on a trl that predates it (0.24.0's GRPOTrainer pushes from its
    own _move_model_to_vllm, straight into a vLLM client: no generator to read the pushed weights from)."""
    require_api("trl", "trl.generation.vllm_generation", "VLLMGeneration._iter_named_params", "GRPO's VLLMGeneration weight sync")


# --- One QLoRA step of each trainer, as the installed trl release takes it (docs/family-notes.md#trl_step) ---------

TRAINERS = {"sft": ("SFTTrainer", "SFTConfig"), "dpo": ("DPOTrainer", "DPOConfig"), "grpo": ("GRPOTrainer", "GRPOConfig")}
GENERATIONS = 2  # GRPO's group: completions per prompt, the per-device batch (one prompt a step)
COMPLETION_TOKENS = 8  # GRPO's max_completion_length: in-process generate() on the tiny model


def require_trainer(kind: str):
    """trl's trainer class of `kind` (a key of TRAINERS), or ApiAbsent on a trl release without it."""
    trainer, _config = TRAINERS[kind]
    return require_api("trl", "trl", trainer, f"trl's {trainer}")


def preference_pairs(count: int, length: int, seed: int = 5) -> dict[str, list[str]]:
    """`count` fixed preference examples in trl's standard (not conversational) form: a prompt of `length` words and a
    chosen and a rejected completion of `length // 2` words each. trl joins prompt and completion as strings, so each
    completion begins with the space that separates it from the prompt's last word (as in trl's own datasets)."""
    prompts, chosen, rejected = (sentences(count, n, seed + i) for i, n in enumerate((length, length // 2, length // 2)))
    return {"prompt": prompts, "chosen": [" " + text for text in chosen], "rejected": [" " + text for text in rejected]}


def completion_reward(completion_ids, **kwargs) -> list[float]:
    """A GRPO reward function of the completions' token ids alone (their mean id over the vocabulary; 0 for an empty
    completion): it tells the sampled completions of a group apart, so their advantages are not all zero."""
    return [sum(ids) / len(ids) / architectures.VOCAB if len(ids) else 0.0 for ids in completion_ids]


def _config(kind: str, output_dir, device: torch.device, dtype: torch.dtype, steps: int):
    """The trainer's config class of the installed release, as the one-device QLoRA user sets it: `bf16` or `fp16`
    (trl defaults `bf16` to True unless `fp16` is set: both are given), `steps` steps, a loss logged at each, lr 1e-2,
    no save, the rest at the release's defaults (gradient checkpointing on: trl's own default). Only fields that every
    release from 0.24.0 to 1.16.0 has are set (read in the 0.24.0, 0.28.0, 0.29.x and 1.16.0 wheels): SFT's and DPO's
    `max_length`, GRPO's `num_generations`, `max_completion_length` and `use_vllm` (False: generation is the trainer's
    in-process `generate()`). What the releases differ in: docs/family-notes.md#trl_step."""
    import trl

    from stackcheck.harness.trainer import one_device

    fields = dict(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                  save_strategy="no", report_to="none", seed=0, use_cpu=device.type == "cpu", dataloader_num_workers=0,
                  bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    if kind in ("sft", "dpo"):
        fields["max_length"] = 64
    else:
        fields.update(num_generations=GENERATIONS, max_completion_length=COMPLETION_TOKENS, use_vllm=False)
    return one_device(getattr(trl, TRAINERS[kind][1])(**fields), device)


def qlora_trainer(kind: str, under_test, base, dtype: torch.dtype, output_dir, steps: int):
    """trl's trainer `kind` over the 4-bit `base` with the LoRA of the architecture's language targets (`peft_config`:
    the trainer wraps the model itself, as trl's QLoRA recipes do), on a fixed tiny dataset: SFT four sentences, DPO
    four preference pairs (the reference is the base with the adapter disabled: no `ref_model`), GRPO two prompts and
    `completion_reward`."""
    import trl
    from datasets import Dataset

    from stackcheck.models import tiny

    trainer_class = getattr(trl, TRAINERS[kind][0])
    args = _config(kind, output_dir, under_test.device, dtype, steps)
    common = dict(model=base, args=args, processing_class=tokenizer(under_test.arch), peft_config=tiny.lora_config(under_test.arch, "language"))
    if kind == "sft":
        return trainer_class(train_dataset=Dataset.from_dict({"text": sentences(4, 12)}), **common)
    if kind == "dpo":
        return trainer_class(train_dataset=Dataset.from_dict(preference_pairs(4, 8)), **common)
    return trainer_class(reward_funcs=[completion_reward], train_dataset=Dataset.from_dict({"prompt": sentences(2, 6, seed=6)}), **common)


class StepsSeen:
    """What the training steps of a Trainer used and changed, read as they ran: at each forward with gradients of a
    LoRA layer on a 4-bit weight, whether autocast was on and in which dtype, and the dtypes its LoRA branch computed
    and its 4-bit base layer returned; at each optimizer step, a copy of every LoRA gradient (unscaled and clipped, as
    the optimizer takes them) and whether accelerate skipped the step (fp16's scaler on inf/NaN gradients)."""

    def __init__(self, trainer, layers: dict[str, torch.nn.Module]):
        from transformers import TrainerCallback

        self.trainer = trainer
        self.device_type = next(trainer.model.parameters()).device.type
        self.forwards: list[tuple[bool, torch.dtype, torch.dtype, torch.dtype]] = []
        self.grads: list[dict[str, torch.Tensor | None]] = []
        self.skipped: list[bool] = []
        self.handles = []
        for layer in layers.values():
            self.handles.append(layer.lora_B["default"].register_forward_hook(self._lora_forward))
            self.handles.append(layer.get_base_layer().register_forward_hook(self._base_forward))
        seen = self

        class Recorder(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                seen.grads.append({name: None if p.grad is None else p.grad.detach().float().clone()
                                   for name, p in seen.trainer.model.named_parameters() if "lora_" in name})

            def on_optimizer_step(self, args, state, control, **kwargs):
                seen.skipped.append(bool(seen.trainer.accelerator.optimizer_step_was_skipped))

        trainer.add_callback(Recorder())
        self._base_dtype: torch.dtype | None = None

    def _base_forward(self, module, args, output) -> None:
        if torch.is_grad_enabled():
            self._base_dtype = output.dtype

    def _lora_forward(self, module, args, output) -> None:
        if torch.is_grad_enabled() and module.training:
            self.forwards.append((torch.is_autocast_enabled(self.device_type), torch.get_autocast_dtype(self.device_type),
                                  output.dtype, self._base_dtype))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    @property
    def taken(self) -> int:
        return sum(not skipped for skipped in self.skipped)
