"""What a rank holds at rest against the arithmetic, for the distributed families and the bench's distributed case.

A QLoRA model's parameters fall in parts (`weight_parts`); two arithmetics say what a rank should hold, the user's
(`users_arithmetic`: every parameter sharded) and the engine's (`expected_on_rank`: what it really sharded), and
`held_by_part` reads what it holds from the prepared model. The parts and the rules: docs/internals.md,
"distributed/memory.py".
"""

from __future__ import annotations

WEIGHTS, QUANT_STATES, FROZEN, LORA = "4-bit weights", "4-bit quant states", "other frozen parameters", "LoRA"
PARTS = (WEIGHTS, QUANT_STATES, FROZEN, LORA)
# Name prefixes of wrappers, so that a prepared model's parameter names are the plain model's.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def weight_parts(model) -> dict[str, dict[str, int]]:
    """Bytes of each parameter, whole, by part, keyed by parameter name (of the model before `prepare`). AdamW's
    moments, gradients, activations and the layers an engine gathers for a step are left out: those are what the
    peaks add to the arithmetic."""
    from stackcheck.harness import scenario

    parts = {part: {} for part in PARTS}
    for name, param in model.named_parameters():
        state = getattr(param, "quant_state", None)
        if state is not None:
            parts[WEIGHTS][name] = param.nbytes
            parts[QUANT_STATES][name] = sum(tensor.nbytes for tensor in scenario.quant_state_tensors(state))
        elif param.requires_grad:
            parts[LORA][name] = param.nbytes
        else:
            parts[FROZEN][name] = param.nbytes
    return parts


def expected_on_rank(parts: dict[str, dict[str, int]], sharded: set[str], world_size: int) -> dict[str, dict]:
    """Per part: its whole bytes, the bytes of it sharded, and what the rank should hold at rest (the sharded bytes /
    world size + the rest whole). Quant states are never sharded: they are no parameters."""
    expected = {}
    for part, by_name in parts.items():
        whole = sum(by_name.values())
        sharded_bytes = 0 if part == QUANT_STATES else sum(size for name, size in by_name.items() if name in sharded)
        expected[part] = {"whole_bytes": whole, "sharded_bytes": sharded_bytes,
                          "on_rank_bytes": sharded_bytes / world_size + (whole - sharded_bytes)}
    return expected


def users_arithmetic(parts: dict[str, dict[str, int]], world_size: int) -> dict[str, dict]:
    """The user's arithmetic: every parameter sharded over the ranks, the quant states whole."""
    return expected_on_rank(parts, {name for by_name in parts.values() for name in by_name}, world_size)


def local_bytes(param) -> int:
    """The bytes of `param` this rank holds: its ZeRO-3 partition, its DTensor shard, else the tensor itself."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor.nbytes
    if hasattr(param, "to_local"):
        return param.to_local().nbytes
    return param.nbytes


def is_sharded(param) -> bool:
    """Whether the engine shards `param`: a ZeRO-3 parameter or a DTensor (FSDP2)."""
    if hasattr(param, "ds_tensor"):
        return True
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def held_by_part(model, parts: dict[str, dict[str, int]]) -> dict[str, int]:
    """What the rank's parameters hold at rest, by part (the quant states whole: they are never sharded). A parameter
    that no part names (an engine's own) is counted under the part "other"."""
    part_of = {name: part for part, by_name in parts.items() if part != QUANT_STATES for name in by_name}
    held = {part: 0 for part in PARTS}
    held[QUANT_STATES] = sum(parts[QUANT_STATES].values())
    for name, param in model.named_parameters():
        part = part_of.get(plain_name(name), "other")
        held[part] = held.get(part, 0) + local_bytes(param)
    return held


def held_bytes(model, parts: dict[str, dict[str, int]]) -> int:
    return sum(held_by_part(model, parts).values())


PARAMETERS = "parameters"


def merged(held: dict[str, int], expected: dict[str, dict]) -> tuple[dict[str, int], dict[str, dict]]:
    """The parameters' parts as one (the quant states apart): FSDP1 shards a unit's flat parameter in contiguous slices,
    so one rank may hold all of a unit's LoRA weights and the other more of its 4-bit weights; only the sum is the
    rank's share."""
    names = [part for part in expected if part != QUANT_STATES]
    total = {key: sum(expected[part][key] for part in names) for key in ("whole_bytes", "sharded_bytes", "on_rank_bytes")}
    return ({PARAMETERS: sum(held.get(part, 0) for part in [*names, "other"]), QUANT_STATES: held.get(QUANT_STATES, 0)},
            {PARAMETERS: total, QUANT_STATES: expected[QUANT_STATES]})


def over_arithmetic(held: dict[str, int], expected: dict[str, dict], slack: float) -> dict[str, tuple[int, float]]:
    """The parts a rank holds more of than the arithmetic allows (its on-rank bytes x (1 + slack)): part -> (held,
    expected)."""
    return {part: (held.get(part, 0), want["on_rank_bytes"]) for part, want in expected.items()
            if held.get(part, 0) > want["on_rank_bytes"] * (1 + slack)}
