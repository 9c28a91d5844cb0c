"""A model with a block offloaded by accelerate saves with `save_pretrained` and reloads to the outputs of the same
model never offloaded.

The user's journey: a model that does not fit its device is dispatched with a block offloaded (to the CPU under a
GPU, to disk under the CPU: `serialize.dispatch_offloaded`, accelerate's `dispatch_model` as transformers calls it),
then saved (after a merge, say) and loaded back. bf16, NF4 with and without double quant, and int8; two shapes of
device map: the one `device_map="auto"` gives (one entry per module) and the one users write (`{"": main, block:
offload}`). The save is the subject: the offloaded forward is the offload families' (meta_quant_state_forward).

Upstream, measured here (CPU, disk offload): with a `""` key, transformers 5 cannot save at all
(`offloaded_save_sequential_hook`: accelerate chains two hooks on the offloaded layers, transformers reads one);
an offloaded bitsandbytes layer's quant-state keys are looked up as parameters (`offloaded_save_quant_state_keys`);
an offloaded mixture of experts saved in its original layout looks up per-expert names
(`offloaded_save_fused_experts`, fixed by 5.23.0); double quant meets `meta_quant_state` and, before accelerate 1.15
and bitsandbytes 0.50, the dispatch itself meets `params4bit_kwargs` / `int8params_kwargs`. Related:
transformers PR #27412 (save_pretrained of offloaded models, 2023) and PR #46902.

Precondition proven: every parameter of the offloaded block waits on meta behind an accelerate hook.

Tolerance: exact (`torch.equal`): the checkpoint holds the weights the model had, so the reload computes what the
model never offloaded computes. Measured: bf16 with the per-module map saves and reloads bit for bit on every
architecture, seed and latest (transformers 4.57.6 too); every other cell fails on one of the bugs above.
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
