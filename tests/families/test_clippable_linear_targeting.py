"""`ValueError: Target module Gemma4ClippableLinear(...) is not supported` for the usual LoRA targets.

Symptom (seed 001/002): a LoRA config with `q_proj`, `k_proj`, `v_proj`, `o_proj`, ... matches Gemma 4's
vision and audio projections, which are `Gemma4ClippableLinear` wrappers (an `nn.Module` holding
`.linear`), and PEFT's `_create_new_module` rejects them. The documented workaround targets the inner
`.linear` modules of the towers.

Upstream: peft#3129 (open), transformers#45388 (subclass nn.Linear; closed unmerged).

Precondition proven: `Gemma4ClippableLinear` modules exist and match the broad targets; for the
workaround, LoRA really wraps tower and language projections and changes their outputs.
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.models import tiny

pytestmark = pytest.mark.needs("clippable_linear")


def test_broad_targets_apply_to_gemma4_towers(under_test):
    base = scenario.load_base(under_test)
    broad = tiny.adapter_spec(under_test.arch, "broad")["target_modules"]
    clippable = scenario.clippable_linears(base)
    scenario.require(clippable, "the model has no Gemma4ClippableLinear modules")
    matched = [name for name in clippable if name.rsplit(".", 1)[-1] in broad]
    scenario.require(matched, "no Gemma4ClippableLinear module matches the broad targets")

    model = scenario.peft_load(under_test, base, "broad")

    wrapped = scenario.lora_wrapped(model)
    for tower in ("vision_tower", "audio_tower", "language_model"):
        assert any(tower in name for name in wrapped), f"no LoRA layer in {tower}"


def test_inner_linear_targets_change_tower_and_language_outputs(under_test, prompt):
    model = scenario.peft_load(under_test, scenario.load_base(under_test), "inner_linear")
    wrapped = scenario.lora_wrapped(model)
    modules = dict(model.named_modules())

    for tower in ("vision_tower", "audio_tower"):
        inner = next((name for name in wrapped if tower in name and name.endswith(".linear")), None)
        scenario.require(inner, f"the inner .linear targets matched nothing in {tower}")
        projection = modules[inner.removesuffix(".linear")]
        scenario.require(type(projection).__name__ == "Gemma4ClippableLinear", f"{inner} is not inside a Gemma4ClippableLinear")
        x = torch.randn(2, modules[inner].in_features, dtype=torch.bfloat16, device=under_test.device)
        with torch.no_grad():
            adapted = projection(x)
            with model.disable_adapter():
                plain = projection(x)
        assert not torch.equal(adapted, plain), f"the adapter does not change {tower} outputs"

    adapted_logits = scenario.logits(model, prompt)
    with model.disable_adapter():
        plain_logits = scenario.logits(model, prompt)
    assert not torch.equal(adapted_logits, plain_logits), "the adapter does not change language model logits"
