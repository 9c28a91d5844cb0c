"""Reentrant gradient checkpointing drops the gradient Gemma 4's KV-shared layers send to their source layers.

Standalone (transformers and torch only, random weights, CPU, a few seconds). Prints, per parameter tensor
whose gradient differs from the run without checkpointing, its relative error. The loss is the same.
"""

import torch
from transformers import Gemma4TextConfig, Gemma4ForCausalLM

config = Gemma4TextConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, global_head_dim=32, vocab_size_per_layer_input=256,
    hidden_size_per_layer_input=16, num_kv_shared_layers=2, sliding_window=16, max_position_embeddings=256,
    layer_types=["sliding_attention", "full_attention"] * 3,
)
torch.manual_seed(0)
model = Gemma4ForCausalLM(config).train()
ids = torch.tensor([[92, 140, 25, 5, 26, 242, 247, 189, 3, 17, 99, 45]])


def gradients(use_reentrant):
    model.zero_grad()
    if use_reentrant is None:
        model.gradient_checkpointing_disable()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model.enable_input_require_grads()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


import transformers
print("torch", torch.__version__, "transformers", transformers.__version__)
loss, reference = gradients(None)
for use_reentrant in (False, True):
    checkpointed_loss, grads = gradients(use_reentrant)
    wrong = {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in reference.items()
             if n in grads and g.norm() > 0 and not torch.allclose(grads[n], g, rtol=1e-3, atol=1e-6)}
    print(f"use_reentrant={use_reentrant}: loss {checkpointed_loss:.6f} (without checkpointing {loss:.6f}); "
          f"{len(wrong)} of {len(reference)} gradients differ")
    for name, error in list(wrong.items())[:6]:
        print(f"  {name}: relative error {error:.3f}")
