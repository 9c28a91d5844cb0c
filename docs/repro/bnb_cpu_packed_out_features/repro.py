"""Reproduces stackcheck cell tests/families/test_bnb_cpu_packed_width.py::test_linear4bit_cpu_inference_matches_the_portable_kernel[cpu-siglip_so400m_fc1] on set latest (known_bug: bnb_cpu_packed_out_features).

Expected failure: AssertionError: N must be divisible by block_n
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"  # no network: every model is built from its config
import torch
import copy
import pytest

def bnb_has_packed_cpu_path() -> bool:
    """Whether this bitsandbytes has the packed AVX512-BF16 CPU path for 4-bit layers (0.49.0 on)."""
    import bitsandbytes.functional

    return hasattr(bitsandbytes.functional, "_convert_weight_packed_for_cpu")


_lane_device = torch.device("cpu")


class ScenarioNotReached(Exception):
    """The test could not prove its bug's precondition, so its outcome says nothing about the bug."""

    def __init__(self, what: str):
        super().__init__(f"scenario not reached: {what}")


def require(condition: object, what: str) -> None:
    if not condition:
        raise ScenarioNotReached(what)


class ToleranceExceeded(AssertionError):
    """A measured value past its tolerance. The ledger files it under a numeric known bug only when
    `measured` is finite and inside the band that bug was measured at."""

    def __init__(self, what: str, measured: float, tolerance: float):
        self.measured = measured
        super().__init__(f"{what} {measured:.4f} > {tolerance}")


def assert_within(what: str, measured: float, tolerance: float) -> None:
    # Captured by pytest: shown for a failure, and for a pass with `-rP`, so passing margins can be reported too.
    print(f"stackcheck measured: {what} {measured:.4f} (tolerance {tolerance})")
    if not measured <= tolerance:  # written so that NaN fails too
        raise ToleranceExceeded(what, measured, tolerance)


def relative_error(measured: torch.Tensor, reference: torch.Tensor) -> float:
    """||measured - reference|| / ||reference||, in fp32."""
    measured, reference = measured.float(), reference.float()
    return ((measured - reference).norm() / reference.norm()).item()


def use_lane(lane: str) -> None:
    """Point `main_device()` at the lane's device. The CPU lane stays on the CPU even on a GPU host, so its
    verdicts mean the same on every machine."""
    global _lane_device
    _lane_device = torch.device("cuda", 0) if lane == "gpu" else torch.device("cpu")


def pin_portable_cpu_kernel(model: torch.nn.Module) -> None:
    """Run every 4-bit layer of `model` on bitsandbytes' portable CPU kernel, on every CPU.

    On a CPU with avx512_bf16, bitsandbytes' CPU build repacks a Linear4bit's weight at its first eval
    forward without grad (`support_avx512bf16_for_cpu`, set from `has_avx512bf16()` when the layer is
    built), un-nesting its quant state and rejecting widths that are not multiples of 32. The families
    that share this loader test offload and PEFT bugs, so their verdicts must not depend on the CPU;
    the packed path is tested on its own by the `bnb_cpu_packed_width` family. A bitsandbytes that has the
    packed path but not the switch stops the scenario rather than silently choosing per machine."""
    if not bnb_has_packed_cpu_path():
        return
    for name, layer in linear4bit_modules(model).items():
        require(hasattr(layer, "support_avx512bf16_for_cpu"), f"{name}: this bitsandbytes packs CPU weights with no per-layer switch")
        layer.support_avx512bf16_for_cpu = False


def linear4bit_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    import bitsandbytes as bnb

    return {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def require_nested_linear4bit(name: str, module: torch.nn.Module) -> None:
    import bitsandbytes as bnb

    require(isinstance(module, bnb.nn.Linear4bit), f"{name} is {type(module).__name__}, not a bnb Linear4bit")
    weight = module.weight
    require(isinstance(weight, bnb.nn.Params4bit), f"{name}.weight is {type(weight).__name__}, not Params4bit")
    state = weight.quant_state
    require(state is not None and state.nested, f"{name} has no nested (double-quant) quant state")


hostinfo = SimpleNamespace(bnb_has_packed_cpu_path=bnb_has_packed_cpu_path)  # stackcheck's hostinfo helpers, as the test calls them


scenario = SimpleNamespace(assert_within=assert_within, pin_portable_cpu_kernel=pin_portable_cpu_kernel, relative_error=relative_error, require=require, require_nested_linear4bit=require_nested_linear4bit)  # stackcheck's scenario helpers, as the test calls them


PACKED_TOLERANCE = 0.02


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


def test_linear4bit_cpu_inference_matches_the_portable_kernel(shape):
    """A fix may pack these widths or fall back to the portable kernel: either way the output must match."""
    _layer, error = outputs_with_the_packed_path_enabled(shape)
    scenario.assert_within("packed 4-bit CPU output differs from the portable kernel's: relative error", error, PACKED_TOLERANCE)


def main():
    use_lane('cpu')
    test_linear4bit_cpu_inference_matches_the_portable_kernel(shape=(1152, 4304))


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        traceback.print_exc()
        first_line = (str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)).strip().splitlines()
        print(f"REPRODUCED {type(exc).__name__}: {first_line[0] if first_line else ''}")
        sys.exit(1)
    print("NOT REPRODUCED: the test passed")
