"""4-bit inference on the CPU fails for layer widths bitsandbytes' packed AVX512-BF16 kernel cannot pack.

Upstream: the path came with bitsandbytes#1804 (first release 0.49.0; 0.48.2 has none); no issue or fix
reports either error up to bitsandbytes main of 2026-08-19 (0.50.2 is the newest release). Minimal repro:
`bnb.nn.Linear4bit(64, 48, quant_type="nf4")` on such a CPU, `.eval()`, forward under `torch.no_grad()`.

Symptom, preconditions and tolerances: docs/family-notes.md#bnb_cpu_packed_width.
"""

import copy

import pytest
import torch

from stackcheck.core import hostinfo
from stackcheck.harness import scenario

PACKED_TOLERANCE = 0.02
# (in_features, out_features): SigLIP-so400m's MLP, and a control whose widths the packed path accepts.
SIGLIP_FC1, SIGLIP_FC2, CONTROL = (1152, 4304), (4304, 1152), (1152, 1152)


def quantized_linear4bit(in_features: int, out_features: int):
    """A bf16 linear layer quantized to NF4 with double quant on the CPU, as transformers' bitsandbytes
    quantizer builds it: `Params4bit(weight)` moved to the device quantizes it."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    weight = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16).weight.data
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, compute_dtype=torch.bfloat16,
                              compress_statistics=True, quant_type="nf4", device="meta")
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=True, quant_type="nf4").to("cpu")
    scenario.require_nested_linear4bit("the layer", layer)
    return layer.eval()


def require_packed_path_here() -> None:
    import bitsandbytes.functional

    scenario.require(hostinfo.bnb_has_packed_cpu_path(), "this bitsandbytes has no packed CPU path")
    if not bitsandbytes.functional.has_avx512bf16():
        pytest.skip("depends on the CPU: bitsandbytes reports no avx512_bf16 here, so 4-bit layers never take its packed path")


def outputs_with_the_packed_path_enabled(shape) -> tuple[torch.nn.Module, float]:
    """(the layer after one eval forward with its packing switch on, relative error against the portable kernel)."""
    require_packed_path_here()
    layer = quantized_linear4bit(*shape)
    scenario.require(layer.support_avx512bf16_for_cpu, "bitsandbytes turned the layer's packing switch off")
    portable = copy.deepcopy(layer)
    scenario.pin_portable_cpu_kernel(portable)
    x = torch.randn(4, shape[0], dtype=torch.bfloat16)
    with torch.no_grad():
        expected = portable(x)
        scenario.require(not getattr(portable.weight.quant_state, "packing_format_for_cpu", False), "the portable reference was packed")

        packed = layer(x)

    return layer, scenario.relative_error(packed, expected)


@pytest.mark.cpu
@pytest.mark.parametrize("shape", [SIGLIP_FC1, SIGLIP_FC2], ids=["siglip_so400m_fc1", "siglip_so400m_fc2"])
def test_linear4bit_cpu_inference_matches_the_portable_kernel(shape):
    """A fix may pack these widths or fall back to the portable kernel: either way the output must match."""
    _layer, error = outputs_with_the_packed_path_enabled(shape)
    scenario.assert_within("packed 4-bit CPU output differs from the portable kernel's: relative error", error, PACKED_TOLERANCE)


@pytest.mark.cpu
def test_packed_kernel_control_packs_and_matches():
    """Widths the packed path accepts: proves the path runs here, and runs right."""
    layer, error = outputs_with_the_packed_path_enabled(CONTROL)
    scenario.require(layer.weight.quant_state.packing_format_for_cpu, "the forward did not take the packed path")
    scenario.assert_within("packed 4-bit CPU output differs from the portable kernel's: relative error", error, PACKED_TOLERANCE)
