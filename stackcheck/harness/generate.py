"""Generate: the prompt, logits, greedy decoding, and decoding alike where the reference's choice is decisive."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stackcheck.harness.proof import relative_error, require


# Chosen so that every greedy step of the tiny Gemma 4 base and adapter, 4-bit and bf16, wins by at least 0.69
# logits (11 bf16 steps at their scale). The other architectures' tiny models have logits near 0.7, where steps
# can win by one bf16 step (0.0039): their token comparisons skip such near-ties (`Decode`).
PROMPT_IDS = [[92, 140, 25, 5, 26, 242, 247, 189]]


def prompt(device: torch.device) -> torch.Tensor:
    return torch.tensor(PROMPT_IDS, device=device)


@torch.no_grad()
def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids).logits.float().cpu()


@torch.no_grad()
def greedy(model, input_ids: torch.Tensor, new_tokens: int = 6) -> list[int]:
    out = model.generate(input_ids=input_ids, max_new_tokens=new_tokens, do_sample=False, use_cache=True)
    return out[0, input_ids.shape[1] :].tolist()


# A step whose winner leads by fewer bf16 steps (at its logit's scale) than this is a near-tie: rounding alone
# may swap the top two. Measured: a bf16 merge moves a margin by up to 4 steps (Gemma 4; 1 to 2 on the other
# tiny models), and on the tiny Gemma 3 the adapter's first step wins by 1 step (0.0039), which the merge swaps.
DECISIVE_BF16_STEPS = 8


@dataclass(frozen=True)
class Decode:
    """A reference model's greedy decode: its tokens and, per step, whether the winner led decisively."""

    tokens: list[int]
    decisive: list[bool]


def bf16_step(value: float) -> float:
    """The spacing of bf16 numbers at `value` (8 bits of mantissa)."""
    return 2.0 ** (math.floor(math.log2(abs(value) or 1.0)) - 7)


@torch.no_grad()
def decode(model, input_ids: torch.Tensor, new_tokens: int = 6) -> Decode:
    """`greedy`, with each step's lead of the winner over the runner-up."""
    out = model.generate(input_ids=input_ids, min_new_tokens=new_tokens, max_new_tokens=new_tokens, do_sample=False,
                         use_cache=True, output_logits=True, return_dict_in_generate=True)
    decisive = []
    for step in out.logits:
        top = step[0].float().topk(2).values.tolist()
        decisive.append(top[0] - top[1] >= DECISIVE_BF16_STEPS * bf16_step(top[0]))
    return Decode(out.sequences[0, input_ids.shape[1] :].tolist(), decisive)


@torch.no_grad()
def assert_decodes_alike(model, input_ids: torch.Tensor, reference: Decode, what: str, beside_logits: bool = False) -> None:
    """`model` decodes as `reference` did wherever the reference's choice was decisive: its own greedy tokens
    (generate, with the cache) until the reference's first near-tie, and, fed the reference's tokens, the same
    winner at every decisive step. A reference without one decisive step proves nothing: not reached, unless the
    test compares the logits too (`beside_logits`), which then decide alone. Measured: after the round trip's
    training the tiny Mixtral repeats one token at near-ties on this machine (torch 2.13) and decisively on the
    H100 host's CPU (torch 2.11)."""
    if beside_logits and not any(reference.decisive):
        return
    require(any(reference.decisive), f"every step of the reference decode {reference.tokens} is a near-tie")
    tokens = greedy(model, input_ids, len(reference.tokens))
    prefix = reference.decisive.index(False) if False in reference.decisive else len(reference.tokens)
    assert tokens[:prefix] == reference.tokens[:prefix], f"{what}: greedy tokens {tokens} != {reference.tokens}"
    sequence = torch.cat([input_ids, torch.tensor([reference.tokens], device=input_ids.device)], dim=1)
    winners = logits(model, sequence)[0, input_ids.shape[1] - 1 : -1].argmax(-1).tolist()
    differ = [step for step, decisive in enumerate(reference.decisive) if decisive and winners[step] != reference.tokens[step]]
    assert not differ, f"{what}: fed the reference's tokens, steps {differ} choose {[winners[s] for s in differ]}, not {[reference.tokens[s] for s in differ]}"


def base_kind(quantized: bool) -> str:
    """How a message names the base a cell decodes with: a bug of bitsandbytes' 4-bit kernels is filed on "4-bit base"
    cells only (its signature says so), a bf16 base running none of them."""
    return "4-bit base" if quantized else "bf16 base"


def share_past_the_first(compared: torch.Tensor, reference: torch.Tensor) -> tuple[str, float]:
    """Where a divergence of [positions, vocab] logits sits: its share (squared error) past the first position.
    `generate`'s first logits come from the prefill, a multi-token forward like the full one, and every later one from
    a one-token decode: a kernel only decode takes puts all of the divergence past the first (1.0). A bug of the
    forward itself spreads it over every position (about (n - 1) / n)."""
    error = (compared - reference).pow(2).sum(dim=-1).double()
    past = error[1:].sum()
    # past / (past + first), not past / error.sum(): the two sums round differently, and with nothing at the first
    # position (a decode-only kernel) the other form can exceed 1 (past the ledger's band) by a last bit.
    return "of it past the first position:", (past / (past + error[0])).item() if past + error[0] > 0 else 0.0


@torch.no_grad()
def cached_and_full_logits(model, input_ids: torch.Tensor, new_tokens: int, **generate_kwargs) -> tuple[torch.Tensor, torch.Tensor, object]:
    """`generate`'s logits, step by step from its cache, and those of one forward of the same sequence without a cache
    (what uncached decoding computes at each step), as [steps, vocab] on the CPU; and `generate`'s cache."""
    stepwise, full, cache, _sequence = decoded(model, input_ids, new_tokens, **generate_kwargs)
    return stepwise, full, cache


def decoded(model, input_ids: torch.Tensor, new_tokens: int, **generate_kwargs) -> tuple[torch.Tensor, torch.Tensor, object, torch.Tensor]:
    """cached_and_full_logits, and the sequence the full forward read (the prompt and every new token but the last)."""
    out = model.generate(input_ids=input_ids, min_new_tokens=new_tokens, max_new_tokens=new_tokens, do_sample=False,
                         use_cache=True, output_logits=True, return_dict_in_generate=True, **generate_kwargs)
    stepwise = torch.stack(out.logits, dim=1)[0].float().cpu()
    sequence = out.sequences[:, :-1]
    full = model(input_ids=sequence, use_cache=False).logits[0, input_ids.shape[1] - 1 :].float().cpu()
    return stepwise, full, out.past_key_values, sequence


# A bf16 cell's fp32 twin (`bf16_rounding_bound`) must decode from its cache exactly as without it, within this: the
# multimodal Gemma 3 with its adapter measured 6.8e-7 on the CPU (tests/contract/generate/test_cached_decoding.py).
FP32_CACHE_LOGIC = 1e-4


def bf16_rounding_bound(fp32, prompt: torch.Tensor, sequence: torch.Tensor, full: torch.Tensor, new_tokens: int,
                        tolerance: float, **generate_kwargs) -> float:
    """The tolerance of a bf16 cell of cached decoding past `tolerance`, from what bf16's rounding does on this
    machine. `fp32` is the cell's model again, in fp32 (a fresh one: generate keeps a static cache), `sequence` and
    `full` the bf16 cell's (`decoded`). The fp32 model must decode from the cache exactly as without it
    (FP32_CACHE_LOGIC: a cache that is wrong stays wrong in fp32, and the cell is then judged at `tolerance`); then the
    bf16 cell may differ by twice what bf16's rounding alone does to the full forward of its own sequence (the bf16
    full forward against the fp32 one): the cached path rounds as much again, in another order. A cache that is wrong
    only in bf16 (stored in another dtype, overflowing) is off by far more than bf16's own rounding; one off by less
    cannot be told from it."""
    again, reference, _used, _sequence = decoded(fp32, prompt, new_tokens, **generate_kwargs)
    logic = relative_error(reference, again)
    print(f"stackcheck measured: the same cell in fp32 (the cache's logic without bf16's rounding) {logic:.3g}, tolerance {FP32_CACHE_LOGIC}")
    if logic > FP32_CACHE_LOGIC:  # the cache's logic is wrong: the cell is judged at `tolerance`, with its own message
        return tolerance
    with torch.no_grad():
        exact = fp32(input_ids=sequence, use_cache=False).logits[0, prompt.shape[1] - 1 :].float().cpu()
    rounding = relative_error(exact, full)
    print(f"stackcheck measured: bf16's rounding of the full forward {rounding:.3g}")
    return max(tolerance, 2 * rounding)
