"""Tied embeddings: the head (or embedding) a user trained as a full copy is lost after the merge.

Precondition proven: the base loads with its head and input embedding as one tensor and the config says tied;
training moved every trained copy off the base weights; after the merge the head differs from the embedding
(without `ensure_weight_tying`).

Symptom, upstream and tolerances: docs/family-notes.md#tied_head.
"""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from stackcheck.harness import scenario
from stackcheck.models import tiny

pytestmark = pytest.mark.needs("tied_embeddings")

MERGE_TOLERANCE = 0.05
ROUND_TRIP_TOLERANCE = 0.01
TRAINING_STEPS = 3
LORA_SEED = 0
# Tokens a user adds after the merge (a chat template's specials, say): resize_token_embeddings then re-ties.
ADDED_TOKENS = 8
# Which of the tied pair gets a full trainable copy (modules_to_save).
TRAINED = pytest.mark.parametrize("trained", [("head",), ("embeddings",), ("head", "embeddings")],
                                  ids=["lm_head", "embed_tokens", "both"])


def tied_pair(model) -> dict[str, torch.nn.Module]:
    return {"head": model.get_output_embeddings(), "embeddings": model.get_input_embeddings()}


def require_tied_base(base) -> None:
    pair = tied_pair(base)
    scenario.require(pair["head"].weight is pair["embeddings"].weight, "the base's head and input embedding are not one tensor")
    scenario.require(base.config.get_text_config().tie_word_embeddings, "the base's config does not say tie_word_embeddings")


def train_copies(under_test, trained: tuple[str, ...], **lora_options):
    """A bf16 base with LoRA on its fixture targets and full copies of `trained` (named as users name them, by their
    last component), after a few training steps; with the base's weights of the pair, before training."""
    base = scenario.load_base(under_test, quantized=False)
    require_tied_base(base)
    untrained = {role: module.weight.detach().clone() for role, module in tied_pair(base).items()}
    names = {role: scenario.module_name(base, module).rpartition(".")[2] for role, module in tied_pair(base).items()}
    config = tiny.lora_config(under_test.arch, "language", modules_to_save=[names[role] for role in trained], **lora_options)
    torch.manual_seed(LORA_SEED)  # LoRA's A matrices are drawn at random: the same numbers on every run
    model = get_peft_model(base, config)
    trainable = [p for p in model.parameters() if p.requires_grad]
    scenario.train_steps(under_test, model.train(), torch.optim.AdamW(trainable, lr=1e-2), TRAINING_STEPS)
    return model.eval(), untrained


def merge(model, prompt, trained, untrained):
    """merge_and_unload, proven to have put the trained copies in place, and its logits."""
    trained_logits = scenario.logits(model, prompt)
    merged = model.merge_and_unload()
    pair = tied_pair(merged)
    for role in trained:
        scenario.require(not torch.equal(pair[role].weight, untrained[role]), f"training left the {role} copy at the base weights")
    merged_logits = scenario.logits(merged, prompt)
    scenario.assert_within("the merge diverges from the trained model: relative logit error",
                           scenario.relative_error(merged_logits, trained_logits), MERGE_TOLERANCE)
    return merged, merged_logits


@TRAINED
def test_merged_trained_copy_survives_save_reload_and_resize(under_test, prompt, tmp_path, trained):
    model, untrained = train_copies(under_test, trained)
    merged, merged_logits = merge(model, prompt, trained, untrained)
    pair = tied_pair(merged)
    scenario.require(not torch.equal(pair["head"].weight, pair["embeddings"].weight), "after the merge the head equals the embedding")
    merged.save_pretrained(tmp_path)

    reloaded = tiny.model_class(under_test.arch).from_pretrained(tmp_path, dtype=torch.bfloat16).to(under_test.device).eval()
    scenario.assert_within("the reloaded merged model diverges from the merged one: relative logit error",
                           scenario.relative_error(scenario.logits(reloaded, prompt), merged_logits), ROUND_TRIP_TOLERANCE)
    vocab = reloaded.get_input_embeddings().weight.shape[0]
    reloaded.resize_token_embeddings(vocab + ADDED_TOKENS)

    resized_logits = scenario.logits(reloaded, prompt)[..., :vocab]
    pair = tied_pair(reloaded)
    retied = pair["head"].weight is pair["embeddings"].weight
    scenario.assert_within("after resize_token_embeddings the merged model diverges: relative logit error",
                           scenario.relative_error(resized_logits, merged_logits), ROUND_TRIP_TOLERANCE,
                           judged_by=("the head and the embedding one tensor again:", float(retied)))


@TRAINED
def test_ensure_weight_tying_keeps_the_pair_one_tensor(under_test, prompt, trained):
    scenario.require("ensure_weight_tying" in LoraConfig.__dataclass_fields__, "this PEFT has no ensure_weight_tying")
    model, untrained = train_copies(under_test, trained, ensure_weight_tying=True)
    merged, _ = merge(model, prompt, ("head", "embeddings"), untrained)

    head, embeddings = (module.weight for module in tied_pair(merged).values())
    drift = scenario.relative_error(head, embeddings)
    assert torch.equal(head, embeddings), f"ensure_weight_tying=True: the trained head and embedding drifted apart (relative difference {drift:.4f})"
