"""4-bit weights that do not survive serialization.

Upstream: bitsandbytes#1946 (fix PR #1958, open) for load_state_dict, since 4-bit serialization came in 0.42.0;
bitsandbytes#2078 (fix PR #2083, in no release) for the packed path, which came with PR #1804 (0.49.0). Measured
on the 0.46.1, 0.47.0, 0.48.2, 0.49.0, 0.49.2, 0.50.1 and 0.50.2 wheels (0.45.x: transformers 5.6.2 refuses it).

Symptom, preconditions and tolerances: docs/family-notes.md#quantized_serialization.
"""

import pytest
import torch
from safetensors.torch import load_file

from stackcheck.core import hostinfo
from stackcheck.harness import scenario

LOADED_BACK_TOLERANCE = 1e-6
PACKED_SAVE_TOLERANCE = 0.01
QUANT_STATE_KEY = ".weight.quant_state.bitsandbytes__nf4"


def saved_4bit_state(module: torch.nn.Module) -> list[torch.Tensor]:
    """What serialization must keep of a Linear4bit: its packed weight and every quant-state tensor, on the CPU."""
    return [t.detach().cpu() for t in [module.weight.data, *scenario.quant_state_tensors(module.weight.quant_state)]]


def identical(tensors: list[torch.Tensor], others: list[torch.Tensor]) -> bool:
    return len(tensors) == len(others) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(tensors, others))


def quant_state_keys(checkpoint) -> list[str]:
    return [key for file in sorted(checkpoint.glob("*.safetensors")) for key in load_file(file) if key.endswith(QUANT_STATE_KEY)]


def test_save_pretrained_round_trip_keeps_quant_states_and_logits(under_test, prompt, tmp_path):
    base = scenario.load_base(under_test)
    scenario.first_nested_linear4bit(base)
    saved = {name: saved_4bit_state(m) for name, m in scenario.linear4bit_modules(base).items()}
    expected = scenario.logits(base, prompt)
    base.save_pretrained(tmp_path)
    written = quant_state_keys(tmp_path)
    scenario.require(len(written) == len(saved), f"the checkpoint holds {len(written)} 4-bit quant states, the model {len(saved)} Linear4bit")

    # Not quantized again: the checkpoint's own quantization_config loads its 4-bit weights as they are.
    reloaded = scenario.load_base(under_test, quantized=False, checkpoint=tmp_path)
    modules = scenario.linear4bit_modules(reloaded)
    scenario.require(modules.keys() == saved.keys(), "the reloaded model's Linear4bit modules are not the saved ones")
    changed = [name for name, m in modules.items() if not identical(saved_4bit_state(m), saved[name])]
    assert not changed, f"{len(changed)} of {len(saved)} Linear4bit come back changed by save_pretrained/from_pretrained: {changed[:3]}"
    got = scenario.logits(reloaded, prompt)
    assert torch.equal(got, expected), f"the reloaded model's logits differ: max abs {(got - expected).abs().max().item():.4g}"


def quantized_like(source: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A Linear4bit shaped and configured as `source`, quantized on `device` from other weights of the same scale,
    as a model built anew (`from_pretrained` of a fresh base, say) holds before a state dict is loaded into it."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    state = source.weight.quant_state
    scale = F.dequantize_4bit(source.weight.data, state).float().std().item()
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(source.out_features, source.in_features, generator=generator) * scale).to(torch.bfloat16)
    layer = bnb.nn.Linear4bit(source.in_features, source.out_features, bias=source.bias is not None,
                              compute_dtype=source.compute_dtype, compress_statistics=state.nested,
                              quant_type=state.quant_type, device="meta")
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, blocksize=state.blocksize, compress_statistics=state.nested,
                                     quant_type=state.quant_type).to(device)
    if source.bias is not None:
        layer.bias = torch.nn.Parameter(torch.zeros_like(source.bias), requires_grad=False)
    scenario.pin_portable_cpu_kernel(layer)
    return layer.eval()


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "lenient"])
def test_linear4bit_state_dict_loads_back_with_load_state_dict(under_test, strict):
    name, source = scenario.first_nested_linear4bit(scenario.load_base(under_test))
    target = quantized_like(source, under_test.device)
    scenario.require_nested_linear4bit("the target layer", target)
    scenario.require(not torch.equal(target.weight.quant_state.absmax, source.weight.quant_state.absmax),
                     f"the target layer has {name}'s quant state before loading")
    x = torch.randn(4, source.in_features, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)).to(under_test.device)
    with torch.no_grad():
        expected = source(x)

        target.load_state_dict(source.state_dict(), strict=strict)

        got = target(x)
    scenario.assert_within(f"{name} loaded back with load_state_dict(strict={strict}) computes another output: relative error",
                           scenario.relative_error(got, expected), LOADED_BACK_TOLERANCE)


def require_packed_path_here() -> None:
    import bitsandbytes.functional

    scenario.require(hostinfo.bnb_has_packed_cpu_path(), "this bitsandbytes has no packed CPU path")
    if not bitsandbytes.functional.has_avx512bf16():
        pytest.skip("depends on the CPU: bitsandbytes reports no avx512_bf16 here, so 4-bit layers never take its packed path")


def packable_linear4bit(model) -> tuple[str, torch.nn.Module]:
    """The first Linear4bit whose widths the packed kernel accepts (see `bnb_cpu_packed_width` for the others)
    and whose rows hold more than one quantization block: with one, the packed absmax's transpose is its own
    reshape, and a lost transpose would go unseen."""
    modules = scenario.linear4bit_modules(model)
    packable = [(name, m) for name, m in modules.items() if m.out_features % 32 == 0
                and m.in_features % m.weight.quant_state.blocksize == 0 and m.in_features > m.weight.quant_state.blocksize]
    scenario.require(packable, f"none of the {len(modules)} Linear4bit has packable widths and rows of several blocks")
    return packable[0]


def dequantized_from_state_dict(layer: torch.nn.Module) -> torch.Tensor:
    """The weight a checkpoint of `layer` holds: its `state_dict()`, read back as `from_pretrained` reads it
    (`QuantState.from_dict`), dequantized."""
    import bitsandbytes.functional as F

    saved = layer.state_dict()
    stats = {key.removeprefix("weight."): value for key, value in saved.items() if key.startswith("weight.")}
    return F.dequantize_4bit(saved["weight"], F.QuantState.from_dict(stats, device=saved["weight"].device)).float()


@pytest.mark.cpu
@pytest.mark.parametrize("double_quant", [False, True], ids=["nf4", "nf4_double_quant"])
def test_state_dict_after_packed_cpu_forward_keeps_the_weight(under_test, double_quant):
    """Double quant is the control: its inverse re-quantizes the absmax, so the weight survives but for rounding."""
    if double_quant and not hostinfo.bnb_has_packed_cpu_path():
        # Not "not reached": the family's other bugs are affected on these versions, so that would read as an error.
        pytest.skip("this bitsandbytes has no packed CPU path (before 0.49.0): the double-quant control has nothing to check")
    require_packed_path_here()
    name, layer = packable_linear4bit(scenario.load_base(under_test, double_quant=double_quant))
    scenario.require(layer.weight.quant_state.nested == double_quant, f"{name}'s quant state is not {'nested' if double_quant else 'flat'}")
    before = dequantized_from_state_dict(layer)
    # What from_pretrained leaves on a CPU with avx512_bf16, before load_base pinned the portable kernel.
    layer.support_avx512bf16_for_cpu = True
    with torch.no_grad():
        layer(torch.randn(2, layer.in_features, dtype=torch.bfloat16))
    scenario.require(getattr(layer.weight.quant_state, "packing_format_for_cpu", False), "the forward did not take the packed path")

    after = dequantized_from_state_dict(layer)

    scenario.assert_within(f"{name}'s weight saved after a packed CPU forward dequantizes wrong: relative error",
                           scenario.relative_error(after, before), PACKED_SAVE_TOLERANCE)
