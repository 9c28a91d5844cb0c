"""Gemma 4's vision and audio towers under bitsandbytes 4-bit, and the skip list users protect them with.

Upstream: transformers#46932 / PR #46933 (vision cast guarded in 5.13.0), #45672 (audio finfo, fixed in 5.11.0
together with the attention cast), #45674 (a skip list drops the defaults; PR #45734 closed unmerged). All
three casts are in 5.5.0, the first release with Gemma 4 (checked in every released wheel, 5.5.0 to 5.23.0).

Symptom, preconditions and tolerances: docs/family-notes.md#quantized_towers.
"""

import pytest
import torch

from stackcheck.harness import scenario

pytestmark = pytest.mark.needs("vision_tower", "audio_tower")

RESPONSE_TOLERANCE = 0.6
TOWER_SKIPS = {
    "seed_user": ["model.vision_tower", "model.multi_modal_projector", "model.audio_tower", "lm_head"],
    "bare_names": ["vision_tower", "embed_vision", "audio_tower", "embed_audio", "lm_head"],
    "qualified": scenario.TOWER_SKIP_MODULES,  # the working spelling
}


@torch.no_grad()
def vision_response(under_test, model) -> torch.Tensor:
    image, grey, positions = scenario.image_inputs(under_test.device)
    tower = model.model.vision_tower
    return (tower(pixel_values=image, pixel_position_ids=positions).last_hidden_state.float()
            - tower(pixel_values=grey, pixel_position_ids=positions).last_hidden_state.float())


@torch.no_grad()
def audio_response(under_test, model) -> torch.Tensor:
    first, second, mask = scenario.audio_inputs(under_test.device)
    tower = model.model.audio_tower
    return tower(first, mask).last_hidden_state.float() - tower(second, mask).last_hidden_state.float()


def bf16_response(under_test, response) -> torch.Tensor:
    reference = response(under_test, scenario.load_base(under_test, quantized=False))
    scenario.require(reference.norm() > 0, "the bf16 tower does not respond to its input")
    return reference


def test_4bit_vision_tower_sees_the_image(under_test):
    reference = bf16_response(under_test, vision_response)
    model = scenario.load_base(under_test)
    scenario.require_linear4bit_under(model, "model.vision_tower")
    embedder_inputs = []
    model.model.vision_tower.patch_embedder.input_proj.register_forward_hook(
        lambda module, args, output: embedder_inputs.append(args[0])
    )

    response = vision_response(under_test, model)

    scenario.require(embedder_inputs, "the pixels never reached the 4-bit patch embedder")
    error = scenario.relative_error(response, reference)
    scenario.assert_within("the 4-bit vision tower loses the image: relative error of its response", error, RESPONSE_TOLERANCE)


def test_4bit_audio_tower_matches_bf16(under_test):
    reference = bf16_response(under_test, audio_response)
    model = scenario.load_base(under_test)
    scenario.require_linear4bit_under(model, "model.audio_tower")

    response = audio_response(under_test, model)

    error = scenario.relative_error(response, reference)
    scenario.assert_within("the 4-bit audio tower diverges: relative error of its response", error, RESPONSE_TOLERANCE)


@pytest.mark.parametrize("spelling", TOWER_SKIPS)
def test_skip_modules_keep_the_towers_in_bf16(under_test, spelling, prompt):
    """The user's workaround: the towers listed in `llm_int8_skip_modules` stay bf16 and answer exactly as
    the bf16 model's towers do."""
    skips = TOWER_SKIPS[spelling]
    config = scenario.bnb_config()
    config.llm_int8_skip_modules = skips
    model = scenario.load_base(under_test, quantization_config=config)
    scenario.require_linear4bit_under(model, "model.language_model")

    ineffective = scenario.ineffective_skips(model, skips)

    assert not ineffective, f"llm_int8_skip_modules entries that keep nothing unquantized: {', '.join(ineffective)}"
    assert scenario.relative_error(vision_response(under_test, model), bf16_response(under_test, vision_response)) == 0
    assert scenario.relative_error(audio_response(under_test, model), bf16_response(under_test, audio_response)) == 0
    assert len(scenario.greedy(model, prompt)) == 6


def test_skip_modules_without_the_head_keep_text_generation(under_test, prompt):
    """The towers skipped the way that works, the head left out of the list as the defaults had it."""
    config = scenario.bnb_config()
    config.llm_int8_skip_modules = list(scenario.TOWERS)
    model = scenario.load_base(under_test, quantization_config=config)
    scenario.require(not scenario.ineffective_skips(model, list(scenario.TOWERS)), "the towers were not kept in bf16")
    scenario.require(model.config.get_text_config().tie_word_embeddings, "the head is not tied to the embedding")

    assert len(scenario.greedy(model, prompt)) == 6
