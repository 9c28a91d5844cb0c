"""Probe (issue 23, FSDP1 control cell): where `AssertionError: as_params=True type(prim_param)=<class 'torch.Tensor'>`
comes from, and which variant avoids it.

    python docs/probes/fsdp1_as_params.py            # from the repository root with a set's env; prints one JSON object

The parent starts `torch.distributed.run` (one rank, or two with --world-size 2) on this file; each rank builds a
tiny random Llama (hidden 64, 2 layers, vocab 256) and, for every variant, wraps it in FSDP1 as accelerate's FSDP1
launch does (decoder layers as units, FULL_SHARD requested, use_orig_params) and trains 2 steps, then gathers the
weights with `summon_full_params`. On one rank FSDP1 replaces FULL_SHARD with NO_SHARD; the JSON says which
strategy ran. GPU (NCCL) when CUDA is there, else CPU (gloo).

Variants (each: tied / untied input and output embeddings):
- qlora:      bnb NF4 with bf16 quant storage, prepare_model_for_kbit_training, LoRA, all floats cast to bf16 (the cell);
- bf16_lora:  no quantization, LoRA on a bf16 base (is bitsandbytes needed?);
- bf16_full:  no quantization, no PEFT, every parameter trainable (is PEFT needed?);
- bf16_frozen_embed: bf16_full with the (tied) embedding frozen, as PEFT leaves it;
- bf16_frozen_root: bf16_full with every parameter outside the decoder layers frozen (the root FSDP unit's flat
  parameter then needs no grad, as under PEFT), no PEFT, no bitsandbytes.

Measured on the CPU (torch 2.13.0+cpu, gloo, seed env): one rank: qlora, bf16_lora and bf16_frozen_root raise the
AssertionError at step 1's forward when tied, and finish untied with the embedding no longer an nn.Parameter;
bf16_full and bf16_frozen_embed pass. Two ranks (--world-size 2, FULL_SHARD kept): every variant passes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback

VARIANTS = ["qlora", "bf16_lora", "bf16_full", "bf16_frozen_embed", "bf16_frozen_root"]


def parent(world_size: int) -> int:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}", "--master_port=29533",
               __file__, "--rank-side", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        results = {}
        for name in sorted(n for n in os.listdir(out) if n.endswith(".json")):
            with open(os.path.join(out, name)) as f:
                results[name.removesuffix(".json")] = json.load(f)
    import torch

    print(json.dumps({"probe": "fsdp1_as_params", "torch": torch.__version__, "world_size": world_size,
                      "launcher_rc": proc.returncode, "ranks": results,
                      "launcher_tail": proc.stderr[-4000:] if proc.returncode else ""}, indent=1))
    return 0


def build(variant: str, tied: bool, device, checkpoint_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    path = os.path.join(checkpoint_dir, f"tied{tied}")
    if not os.path.exists(path):
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, tie_word_embeddings=tied)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    kwargs = {}
    if variant == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=torch.bfloat16,
                                                           bnb_4bit_quant_storage=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map={"": device}, **kwargs)
    if variant in ("qlora", "bf16_lora"):
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if variant == "qlora":
            model = prepare_model_for_kbit_training(model)
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        for p in model.parameters():
            if type(p).__name__ != "Params4bit" and p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)
    elif variant == "bf16_frozen_embed":
        model.get_input_embeddings().weight.requires_grad_(False)
    elif variant == "bf16_frozen_root":  # every parameter outside the decoder layers frozen, as under PEFT
        for name, p in model.named_parameters():
            if ".layers." not in name:
                p.requires_grad_(False)
    model.train()
    shared = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    return model, shared


def run_variant(variant: str, tied: bool, device, checkpoint_dir: str) -> dict:
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from functools import partial
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model, shared = build(variant, tied, device, checkpoint_dir)
    record = {"tied": tied, "embedding_is_output_weight": shared, "stage": "wrap"}
    try:
        # What accelerate's FSDP1 plugin builds from fixtures/distributed/fsdp1.yaml.
        model = FSDP(model, auto_wrap_policy=partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
                     sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True, device_id=device)
        record["strategy"] = model.sharding_strategy.name
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0)).to(device)
        losses = []
        for step in range(2):
            record["stage"] = f"step {step} forward"
            loss = model(input_ids=ids, labels=ids).loss
            record["stage"] = f"step {step} backward"
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        # FSDP's pre-forward writeback adopts a plain Tensor left on a module as the parameter itself: untied, the
        # embedding silently stops being an nn.Parameter instead of raising.
        record["input_embedding_is_parameter_after_steps"] = isinstance(model.module.get_input_embeddings().weight, torch.nn.Parameter)
        record["stage"] = "summon_full_params"
        with FSDP.summon_full_params(model):
            pass
        record.update(stage="done", raised=None, losses=losses)
    except Exception as exc:  # noqa: BLE001 - the probe reports what each variant raised
        frames = traceback.extract_tb(exc.__traceback__)
        record.update(raised=f"{type(exc).__name__}: {exc}",
                      inner_frames=[f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in frames[-6:]])
        if isinstance(model, FSDP):
            record["shared_param_infos"] = [
                {"unit": type(h._fully_sharded_module).__name__, "shared": f"{type(info.module).__name__}.{info.param_name}",
                 "primary": f"{type(info.prim_module).__name__}.{info.prim_param_name}",
                 "primary_now": type(getattr(info.prim_module, info.prim_param_name)).__name__}
                for h in (m._handle for m in FSDP.fsdp_modules(model) if m._handle) for info in h.flat_param._shared_param_infos]
    return record


def rank_side(out: str) -> None:
    import torch
    import torch.distributed as dist

    on_gpu = torch.cuda.is_available()
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    checkpoint_dir = os.path.join(out, f"checkpoints-rank{rank}")
    results = {"device": str(device)}
    for variant in VARIANTS:
        for tied in (True, False):
            results[f"{variant}/{'tied' if tied else 'untied'}"] = run_variant(variant, tied, device, checkpoint_dir)
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank-side", metavar="OUTDIR")
    parser.add_argument("--world-size", type=int, default=1)
    args = parser.parse_args()
    if args.rank_side:
        rank_side(args.rank_side)
    else:
        sys.exit(parent(args.world_size))
