"""Train: the fixed training batch (text, or text with an image and an audio clip) and the optimizer steps."""

from __future__ import annotations

import torch

from stackcheck.harness.generate import PROMPT_IDS
from stackcheck.harness.subject import UnderTest


# One fixed training batch: the prompt and four more tokens, its own labels.
TRAINING_IDS = [PROMPT_IDS[0] + [3, 17, 99, 45]]


def image_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a random image, a grey one, patch positions) as Gemma 4's image processor lays them out: values in
    [0, 1], one row of 3 * patch_size**2 values per patch, (x, y) positions. The tiny tower's patch is 4 pixels:
    a 16 x 16 image is 4 x 4 patches, pooled to 4 soft tokens. Values stay clear of 0 and 1, which a uint8
    cast would not zero."""
    generator = torch.Generator().manual_seed(1)
    image = (0.02 + 0.96 * torch.rand(1, 16, 48, generator=generator)).to(torch.bfloat16)
    grey = torch.full_like(image, 0.5)
    x, y = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy")
    positions = torch.stack([x, y], dim=-1).reshape(1, 16, 2)
    return image.to(device), grey.to(device), positions.to(device)


def audio_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two random log-mel inputs and their mask: 48 frames of 8 bins (the tiny tower's two stride-2
    convolutions need 8), 12 soft tokens each."""
    generator = torch.Generator().manual_seed(2)
    first, second = (torch.randn(1, 48, 8, generator=generator).to(torch.bfloat16) for _ in range(2))
    return first.to(device), second.to(device), torch.ones(1, 48, dtype=torch.bool, device=device)


IMAGE_SOFT_TOKENS, AUDIO_SOFT_TOKENS = 4, 12


def training_batch(device: torch.device, config, multimodal: bool = False) -> dict[str, torch.Tensor]:
    """The fixed training batch as model kwargs. Multimodal: an image and an audio clip between the text
    tokens, their soft-token positions left out of the loss."""
    text = TRAINING_IDS[0]
    if not multimodal:
        ids = torch.tensor([text], device=device)
        return {"input_ids": ids, "labels": ids}
    media = [config.image_token_id] * IMAGE_SOFT_TOKENS + [config.audio_token_id] * AUDIO_SOFT_TOKENS
    ids = torch.tensor([text[:4] + media + text[4:]], device=device)
    labels = ids.masked_fill((ids == config.image_token_id) | (ids == config.audio_token_id), -100)
    image, _grey, positions = image_inputs(device)
    audio, _other, audio_mask = audio_inputs(device)
    return {"input_ids": ids, "labels": labels, "pixel_values": image, "image_position_ids": positions,
            "input_features": audio, "input_features_mask": audio_mask}


def train_steps(under_test: UnderTest, model, optimizer, steps: int, multimodal: bool = False) -> list[float]:
    """`steps` optimizer steps on the fixed training batch (`training_batch`); the loss of each."""
    batch = training_batch(under_test.device, model.config, multimodal)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
