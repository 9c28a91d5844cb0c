"""`PeftModel.from_pretrained` moves the modules of a dispatched base off the devices the user placed them on.

Upstream: the code is the same in peft 0.19.1, 0.21.2 and main (2026-08): the cpu/disk condition came with
peft 0.3.0, `get_balanced_memory` with 0.1.0. Related: peft#287 ("device_map is not fully respected", closed),
peft#3793 (adapter weights loaded to cuda for a CPU base, open). No report of this exact behaviour found.

Symptom and preconditions: docs/family-notes.md#peft_redispatch_placement.
"""

import pytest

from stackcheck.harness import scenario
from stackcheck.models.tiny import NotApplicable


def placement(model) -> dict[str, str]:
    """Where each base parameter lives: 'cpu', 'cuda:N', or 'offloaded' (on meta, its weight kept by an
    accelerate hook in RAM or on disk). LoRA's wrappers are looked through: `base_layer.` is dropped and the
    adapters' own parameters left out."""
    where = {}
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        name = name.removeprefix("base_model.model.").replace("base_layer.", "")
        where[name] = "offloaded" if param.device.type == "meta" else str(param.device)
    return where


def as_peft_model_keys(base_map: dict) -> dict:
    """The base's map in the names PEFT dispatches by (its documented way to keep a placement)."""
    return {"base_model.model" + (f".{key}" if key else ""): device for key, device in base_map.items()}


def cpu_only_host_default(under_test) -> dict:
    """No placement kwargs, as the seed user loaded. In the CPU lane PEFT is handed the budget it finds by
    itself on a host without a GPU (accelerate's `get_max_memory()`: the free RAM), because on a GPU host it
    would also count the GPUs, and the CPU lane's verdict must not depend on them."""
    if under_test.device.type != "cpu":
        return {}
    from accelerate.utils import get_max_memory

    return {"max_memory": {"cpu": get_max_memory()["cpu"]}}


def redispatched_by_peft(under_test, quantized: bool, offload_dir, keep_base_map: bool = False):
    """(the split base's placement, the model PEFT returned, the base's hf_device_map)."""
    base = scenario.split_base(under_test, offload_dir / "base", quantized=quantized)
    base_map, before = dict(getattr(base, "hf_device_map", {})), placement(base)
    scenario.require(len(set(before.values())) > 1, f"the split base sits in one place: {base_map}")
    placement_kwargs = {"device_map": as_peft_model_keys(base_map)} if keep_base_map else cpu_only_host_default(under_test)

    model = scenario.peft_load(under_test, base, "language", offload_dir=str(offload_dir / "peft"), **placement_kwargs)

    scenario.require(model.__dict__.get("hf_device_map"), "PEFT did not redispatch the split base")
    return before, model, base_map


def assert_none_moved(moved: dict[str, tuple[str, str]], total: int, where: str, base_map: dict) -> None:
    example = ", ".join(f"{name} {old} -> {new}" for name, (old, new) in list(moved.items())[:3])
    assert not moved, f"PEFT's redispatch moved {len(moved)} of {total} base parameters {where} the base's hf_device_map {base_map}: {example}"


@scenario.QUANTIZATION
@pytest.mark.parametrize("keep_base_map", [False, True], ids=["no_placement_kwargs", "prefixed_base_map"])
def test_peft_load_keeps_the_base_placement(under_test, quantized, keep_base_map, offload_dir):
    """Without placement kwargs, as the seed user loaded; and the control, the base's map handed to PEFT in
    its own module names, which must keep it."""
    before, model, base_map = redispatched_by_peft(under_test, quantized, offload_dir, keep_base_map)

    after = placement(model)

    moved = {name: (before[name], after[name]) for name in before if after.get(name) != before[name]}
    assert_none_moved(moved, len(before), "off the placement of", base_map)


@pytest.mark.gpu
@pytest.mark.gpus(2)
@scenario.QUANTIZATION
def test_peft_load_uses_no_gpu_outside_the_base_map(under_test, quantized, offload_dir):
    """Seed 001's second GPU: the base maps nothing to cuda:1, so nothing may land there."""
    before, model, base_map = redispatched_by_peft(under_test, quantized, offload_dir)
    mapped = {f"cuda:{device}" for device in base_map.values() if isinstance(device, int)}

    after = placement(model)

    strays = {name: (before[name], after[name]) for name in before
              if after.get(name, "").startswith("cuda") and after[name] not in mapped}
    if not strays:
        require_a_balanced_map_reaching_other_gpus(model, mapped)
    assert_none_moved(strays, len(before), "onto GPUs outside", base_map)


def balanced_gpus(model) -> set[str]:
    """The GPUs that accelerate's balanced map of `model` over the visible devices' free memory uses: the map PEFT's
    redispatch computes (`get_balanced_memory` + `infer_auto_device_map` with the model's no-split classes, no
    `max_memory` from the user), asked of accelerate itself."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    budget = get_balanced_memory(model, no_split_module_classes=no_split)
    return {f"cuda:{device}" for device in infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split).values()
            if isinstance(device, int)}


def require_a_balanced_map_reaching_other_gpus(model, mapped: set[str]) -> None:
    """A pass says something only where the redispatch PEFT does would have used another GPU: accelerate balances
    the model over the GPUs with a budget of half of it plus 1.25 no-split blocks each, so a small model whose largest
    block is big against the whole fits GPU 0 alone (the tiny Llama 3, Phi-4 and Qwen3 in bf16: everything on GPU 0
    with two GPUs' budget, CPU meta-model check, docs/contract-gpu-run.md), and the bug cannot show there."""
    others = balanced_gpus(model) - mapped
    if not others:
        raise NotApplicable(f"accelerate's balanced map of this model over the visible GPUs keeps it on {sorted(mapped) or 'no GPU'}: "
                            "a redispatch that ignores the base's map would put nothing on another GPU either")
