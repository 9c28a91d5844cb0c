"""Probe (issue 23, Benchmark): why the bench's CUDA-graph decode of the realistic Gemma 4 replays wrong on `seed`
(transformers 5.6.2) and exactly on `latest` (5.23.0), and whether static-cache + torch.compile users meet it too.

    python docs/probes/graph_decode.py [--models tiny_gemma4,realistic_gemma4,llama3_1b] [--no-compile]

Standalone (no stackcheck import), GPU only; prints one JSON object. Every model is built from a config with
random bf16 weights on the GPU (seed 0), as the bench's checkpoints are, and decodes greedily NEW_TOKENS tokens
after a CONTEXT-token random prompt (the bench's realistic profile: 512 and 32). Per model:
- eager_vs_eager: two eager decodes on a DynamicCache (is eager itself bitwise repeatable?);
- bench_capture: stackcheck.bench.harness.DecodeGraph's procedure re-done here (prefill, side-stream warm-up,
  capture of the whole decode on the prefill's DynamicCache, an eager reference, two replays): tokens agreeing,
  and the largest |logit| difference at the first decode step;
- bench_capture_no_gqa_over_256: the same with transformers' `use_gqa_in_sdpa` refusing head dims over 256, as
  5.23.0's does (5.6.2 passes enable_gqa=True to SDPA for the realistic model's 512-wide full-attention heads);
- bench_capture_sliding_cache: the same on a DynamicCache whose sliding layers are DynamicSlidingWindowLayers
  (5.6.2 builds none for a config with num_kv_shared_layers == 0; model_cache_layer_types says what the model built);
- bench_capture_math_sdpa_only: the same with SDPA held to its math kernel (eager and capture alike);
- generate_static_compiled: `generate(cache_implementation="static")` with `model.forward` compiled
  `mode="reduce-overhead"`, against eager `generate` (dynamic cache): the path users take.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

CONTEXT = 512
NEW_TOKENS = 32
DEVICE = "cuda"  # the probe is for the GPU; a CPU smoke test overrides it
REALISTIC_GEMMA4 = {  # fixtures/realistic_gemma4_text.json's config, the bench's realistic model
    "vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "global_head_dim": 512,
    "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 0,
    "sliding_window": 512,
}
TINY_GEMMA4 = {  # fixtures/tiny_gemma4.json's text_config
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "global_head_dim": 32, "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 2, "sliding_window": 16, "max_position_embeddings": 1024,
    "layer_types": ["sliding_attention", "full_attention"] * 3, "initializer_range": 0.2,
}
LLAMA3_1B = {  # fixtures/architectures/llama3.json (Llama 3.2 1B), head_dim 64, GQA 32/8
    "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
    "rope_theta": 500000.0, "max_position_embeddings": 131072,
}


def build(name: str):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "llama3_1b":
        config, cls = LlamaConfig(**LLAMA3_1B), LlamaForCausalLM
    else:
        config, cls = Gemma4TextConfig(**(REALISTIC_GEMMA4 if name == "realistic_gemma4" else TINY_GEMMA4)), Gemma4ForCausalLM
    config._attn_implementation = "sdpa"
    with torch.device(DEVICE):
        model = cls(config).to(torch.bfloat16).eval()
    return model


SLIDING_CACHE = False  # bench_capture_sliding_cache sets it


def config_cache(model):
    """None (the model builds its own DynamicCache from its config, as in the bench), or with SLIDING_CACHE a
    DynamicCache with one layer per non-shared layer type. transformers 5.6.2's `layer_types[: -num_kv_shared_layers]`
    gives no layers at all when num_kv_shared_layers == 0 (the realistic Gemma 4), so its DynamicCache falls back to
    full-length DynamicLayers for the sliding layers too (and StaticCache raises IndexError: transformers#46235)."""
    if not SLIDING_CACHE:
        return None
    import copy

    from transformers import DynamicCache

    if DynamicCache(config=model.config).layers:  # this transformers builds the layers itself
        return DynamicCache(config=model.config)
    config = copy.deepcopy(model.config)
    # [: -(-n)] keeps all n layer types; set past the config's validation
    object.__setattr__(config, "num_kv_shared_layers", -len(config.layer_types))
    return DynamicCache(config=config)


@torch.inference_mode()
def prefill(model, context):
    out = model(input_ids=context, past_key_values=config_cache(model), use_cache=True, logits_to_keep=1)
    return out.past_key_values, out.logits[:, -1:].argmax(-1)


@torch.inference_mode()
def decode(model, cache, token):
    """The bench's InferenceRun.decode: NEW_TOKENS greedy steps; (tokens, first step's logits)."""
    tokens, first_logits = [], None
    for _ in range(NEW_TOKENS):
        logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
        first_logits = logits[:, -1].float() if first_logits is None else first_logits
        token = logits[:, -1:].argmax(-1)
        tokens.append(token)
    return torch.cat(tokens, dim=-1), first_logits


def cache_tensors(cache):
    holders = [cache, *getattr(cache, "layers", ())]
    return [v for h in holders for v in vars(h).values() if isinstance(v, torch.Tensor)]


def agreement(a, b) -> dict:
    a, b = a.flatten(), b.flatten()
    differ = (a != b).nonzero()
    return {"agree": int((a == b).sum()), "of": a.numel(), "first_divergence": int(differ[0]) if len(differ) else None}


def top2_margin(logits) -> float:
    top = logits.topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def bench_capture(model, context) -> dict:
    """DecodeGraph's procedure: what the bench proves before it times a graph decode."""
    warm_cache, warm_token = prefill(model, context)
    cache, token = prefill(model, context)
    inputs = [*cache_tensors(cache), token]  # held, as the harness holds them
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode(model, warm_cache, warm_token)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            tokens, logits = decode(model, cache, token)
    except RuntimeError as exc:
        return {"capture_failed": str(exc).splitlines()[0]}
    eager_tokens, eager_logits = decode(model, *prefill(model, context))
    result = {"eager_first_step_top2_margin": top2_margin(eager_logits)}
    for attempt in ("first_replay", "second_replay"):
        graph.replay()
        torch.cuda.synchronize()
        result[attempt] = {**agreement(tokens, eager_tokens),
                           "first_step_max_abs_logit_diff": float((logits - eager_logits).abs().max())}
    del graph, inputs
    return result


def generate_static_compiled(model, context) -> dict:
    eager = model.generate(context, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                           disable_compile=True)[:, context.shape[1]:]
    original_forward = model.forward
    model.forward = torch.compile(model.forward, mode="reduce-overhead")
    try:
        runs = [model.generate(context, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                               cache_implementation="static")[:, context.shape[1]:] for _ in range(2)]
    finally:
        model.forward = original_forward
    return {f"run{i}": agreement(run, eager) for i, run in enumerate(runs)}


def without_gqa_over_256():
    """Make this transformers refuse SDPA's enable_gqa for head dims over 256, as 5.23.0 does; undo callable."""
    from transformers.integrations import sdpa_attention

    original = sdpa_attention.use_gqa_in_sdpa
    sdpa_attention.use_gqa_in_sdpa = lambda attention_mask, key, *rest: original(attention_mask, key, *rest) and key.shape[-1] <= 256
    return lambda: setattr(sdpa_attention, "use_gqa_in_sdpa", original)


def probe(name: str, compile_too: bool) -> dict:
    started = time.perf_counter()
    model = build(name)
    vocab = model.config.vocab_size
    context = torch.randint(4, vocab, (1, CONTEXT), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    record = {"parameters": sum(p.numel() for p in model.parameters())}
    steps = [("eager_vs_eager", lambda: agreement(decode(model, *prefill(model, context))[0], decode(model, *prefill(model, context))[0])),
             ("bench_capture", lambda: bench_capture(model, context))]
    for step, run in steps:
        try:
            record[step] = run()
        except Exception as exc:  # noqa: BLE001 - each step's failure is a finding
            record[step] = {"raised": f"{type(exc).__name__}: {exc}"[:500], "where": traceback.format_exc(limit=-3)[-800:]}
    undo = without_gqa_over_256()
    try:
        record["bench_capture_no_gqa_over_256"] = bench_capture(model, context)
    except Exception as exc:  # noqa: BLE001
        record["bench_capture_no_gqa_over_256"] = {"raised": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        undo()
    global SLIDING_CACHE
    SLIDING_CACHE = True
    try:
        cache, _ = prefill(model, context)
        record["sliding_cache_layer_types"] = sorted({type(layer).__name__ for layer in cache.layers})
        record["bench_capture_sliding_cache"] = bench_capture(model, context)
    except Exception as exc:  # noqa: BLE001
        record["bench_capture_sliding_cache"] = {"raised": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        SLIDING_CACHE = False
    cache, _ = prefill(model, context)
    record["model_cache_layer_types"] = sorted({type(layer).__name__ for layer in cache.layers})
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:  # one SDPA kernel for eager and capture alike: does a kernel choice that differs under capture explain it?
        with sdpa_kernel([SDPBackend.MATH]):
            record["bench_capture_math_sdpa_only"] = bench_capture(model, context)
    except Exception as exc:  # noqa: BLE001
        record["bench_capture_math_sdpa_only"] = {"raised": f"{type(exc).__name__}: {exc}"[:500]}
    if compile_too:
        try:
            record["generate_static_compiled"] = generate_static_compiled(model, context)
        except Exception as exc:  # noqa: BLE001
            record["generate_static_compiled"] = {"raised": f"{type(exc).__name__}: {exc}"[:500], "where": traceback.format_exc(limit=-3)[-800:]}
    record["seconds"] = round(time.perf_counter() - started, 1)
    del model
    torch.cuda.empty_cache()
    return record


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny_gemma4,realistic_gemma4,llama3_1b")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    result = {"probe": "graph_decode", "torch": torch.__version__, "transformers": transformers.__version__,
              "device": torch.cuda.get_device_name(0), "context": CONTEXT, "new_tokens": NEW_TOKENS,
              "sdpa_backends_enabled": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                        "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                        "math": torch.backends.cuda.math_sdp_enabled()}}
    for name in args.models.split(","):
        result[name] = probe(name, not args.no_compile)
        print(json.dumps({name: result[name]}), flush=True)  # progress, in case a later model runs out of time
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
