"""A model with a block offloaded by accelerate saves with `save_pretrained` and reloads to the outputs of the same
model never offloaded.

Precondition proven: every parameter of the offloaded block waits on meta behind an accelerate hook.

The journey, upstream and tolerances: docs/family-notes.md#offloaded_save.
"""

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.harness import serialize

QUANTIZATION = {"bf16": "bf16", "nf4_dq": "nf4_dq", "nf4": "nf4", "int8": "int8"}
DEVICE_MAP = {"per_module": False, "with_root": True}


@pytest.mark.axes(quantization=QUANTIZATION, device_map=DEVICE_MAP)
def test_offloaded_model_saves_and_reloads(under_test, quantization, device_map, prompt, offload_dir, tmp_path):
    """Save a model with one block offloaded (to the CPU under a GPU, to disk under the CPU), load the checkpoint
    back on the main device, and get the logits of the same model never offloaded, bit for bit."""
    expected = scenario.logits(serialize.load_quantized(under_test, quantization), prompt)
    model = serialize.load_quantized(under_test, quantization)
    target = serialize.offload_target(model, quantization)
    model = serialize.dispatch_offloaded(under_test, model, offload_dir, target, device_map)
    serialize.require_offloaded(model, target)

    model.save_pretrained(tmp_path / "checkpoint")

    reloaded = serialize.load_saved(under_test, tmp_path / "checkpoint")
    got = scenario.logits(reloaded, prompt)
    assert torch.equal(got, expected), (f"the model saved while offloaded reloads to other logits: relative error "
                                        f"{scenario.relative_error(got, expected):.4g}")
