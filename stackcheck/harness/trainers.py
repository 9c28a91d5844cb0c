"""Trainers: what users run over the libraries, trl's SFTTrainer and GRPOTrainer, on the tiny models with no network:
a word-level tokenizer built in memory over the tiny vocabulary (and, for an image model, its processor), datasets
built with `datasets.Dataset.from_dict`, and the weight sync that GRPO runs before each generation with vLLM."""

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
