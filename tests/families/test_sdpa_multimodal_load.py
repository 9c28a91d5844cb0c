"""`ValueError: Gemma4AudioModel does not support an attention implementation through ... scaled_dot_product_attention`.

Upstream: 5.20.0 made Gemma4AudioModel eager-only alongside the eager mask fix of transformers#48818; no
issue about the load error found (transformers#28005 is the generic tracker the message links to).

Precondition proven: the fixture really has an audio tower (and vision tower) whose attention the
requested implementation would have to cover.

Symptom: docs/family-notes.md#sdpa_multimodal_load.
"""

import pytest

from stackcheck.harness import scenario
from stackcheck.models import tiny

pytestmark = pytest.mark.needs("vision_tower", "audio_tower")


def test_seed_load_kwargs_with_sdpa_load_and_generate(under_test, prompt):
    config = tiny.tiny_config(under_test.arch)
    scenario.require(config.audio_config is not None and config.vision_config is not None, "the fixture has no audio/vision tower")

    model = scenario.load_base(under_test, attn_implementation="sdpa")

    assert model.config.text_config._attn_implementation == "sdpa"
    assert len(scenario.greedy(model, prompt)) > 0
