"""A trained QLoRA adapter, saved and loaded back onto a freshly loaded 4-bit base, gives the trained model's
outputs.

Precondition proven: training really changed the outputs (the adapter differs from the base); for the expert
adapter, the model has fused 3-D expert parameters and every targeted one carries a LoRA, in training and once
loaded; the baseline's trained adapter changed its outputs.

Symptom, the upgrade, upstream and tolerances: docs/family-notes.md#adapter_round_trip.
"""

from pathlib import Path

import pytest
import torch
from peft import get_peft_model, prepare_model_for_kbit_training
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

from stackcheck.child import keys
from stackcheck.core import results
from stackcheck.harness import scenario
from stackcheck.models import tiny
from stackcheck.child.exchange import ExportMissing
from stackcheck.core.protocol import RESULTS_OPTION

ROUND_TRIP_TOLERANCE = 0.01
# The exchange's names of the two adapters a set trains: its language adapter fixture, and LoRA on the experts.
LANGUAGE, EXPERTS = "language", "experts"
# The experts' down projection: square on the tiny Qwen3-MoE (128 x 128), where an adapter in the other layout
# loads without complaint, and not on the tiny Mixtral (128 x 256), where it cannot load.
EXPERT_TARGET = "experts.down_proj"
# The bug whose range, read on the baseline's versions, says its adapter is in the swapped layout (see below).
SWAPPED_LAYOUT = "peft_moe_param_lora_swapped"


def reload_for_training(under_test, adapter, checkpoint=None):
    """A fresh 4-bit base, prepared as for training (without checkpointing: nothing is trained), with `adapter`."""
    base = prepare_model_for_kbit_training(scenario.load_base(under_test, checkpoint=checkpoint), use_gradient_checkpointing=False)
    return scenario.peft_load(under_test, base, adapter)


def targeted_fused_experts(model) -> dict[str, torch.nn.Parameter]:
    """The mixture of experts' fused expert weights `EXPERT_TARGET`: 3-D parameters, one slice per expert (their
    names as in the base model, without the `base_layer` PEFT's wrappers add)."""
    named = {name.replace(".base_layer", ""): p for name, p in model.named_parameters()}
    return {name: p for name, p in named.items() if p.ndim == 3 and name.endswith(EXPERT_TARGET)}


def require_lora_on_fused_experts(model) -> None:
    """The precondition of the expert adapter: every targeted fused 3-D expert parameter carries a LoRA
    (PEFT's ParamWrapper, `target_parameters`)."""
    targeted = targeted_fused_experts(model)
    scenario.require(targeted, f"the model has no fused 3-D expert parameter '{EXPERT_TARGET}'")
    wrapped = {id(m.get_param()) for m in model.modules() if isinstance(m, BaseTunerLayer) and hasattr(m, "get_param")}
    bare = [name for name, p in targeted.items() if id(p) not in wrapped]
    scenario.require(not bare, f"the expert adapter left {len(bare)} of {len(targeted)} fused expert parameters without LoRA")


def expert_deltas(model) -> dict[str, torch.Tensor]:
    """What the expert adapter adds to each targeted fused expert parameter (PEFT's `get_delta_weight`), in the
    parameter's own (experts, out, in) layout, whatever layout PEFT keeps lora_A and lora_B in."""
    names = {id(p): name for name, p in targeted_fused_experts(model).items()}
    return {names[id(m.get_param())]: m.get_delta_weight(m.active_adapters[0]).float().cpu()
            for m in model.modules() if isinstance(m, BaseTunerLayer) and hasattr(m, "get_param") and id(m.get_param()) in names}


def language_adapter(under_test, base):
    return scenario.qlora_model(under_test, base)


def expert_adapter(under_test, base):
    """The QLoRA recipe with LoRA on the fused expert parameters alone (`target_parameters`; no module targets)."""
    model = get_peft_model(prepare_model_for_kbit_training(base),
                           tiny.lora_config(under_test.arch, LANGUAGE, target_modules=[], target_parameters=[EXPERT_TARGET]))
    require_lora_on_fused_experts(model)
    return model.train()


def train_save_export_reload(under_test, prompt, tmp_path, exchange, versions, name, adapter, measured=lambda model: {}):
    """Train the adapter `adapter(under_test, base)` builds, leave it in the exchange as `name` (with the tensors
    `measured` takes from the trained model), reload it onto a fresh 4-bit base and compare with the trained model."""
    model = adapter(under_test, scenario.load_base(under_test))
    with model.disable_adapter():
        base_logits = scenario.logits(model.eval(), prompt)
    scenario.train_steps(under_test, model.train(), torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2), 5)
    model.eval()
    trained_logits, trained_decode = scenario.logits(model, prompt), scenario.decode(model, prompt)
    scenario.require_adapter_changes(trained_logits, base_logits, "the trained model")
    model.save_pretrained(tmp_path)
    saved, trained, tensors = load_file(tmp_path / "adapter_model.safetensors"), scenario.lora_tensors(model), measured(model)
    del model
    assert len(saved) == len(trained), f"the saved adapter holds {len(saved)} tensors, the trained model {len(trained)}"
    exchange.export(name, tmp_path, versions, tiny.base_checkpoint(under_test.arch), base_logits, trained_logits, trained_decode.tokens,
                    tensors)

    loaded = reload_for_training(under_test, tmp_path)

    logits = scenario.logits(loaded, prompt)
    error = scenario.relative_error(logits, trained_logits)
    scenario.assert_within("the reloaded adapter's logits diverge from the trained model's: relative error", error, ROUND_TRIP_TOLERANCE)
    scenario.assert_decodes_alike(loaded, prompt, trained_decode, "the reloaded adapter decodes otherwise", beside_logits=True)


def test_trained_adapter_reloads_onto_a_fresh_4bit_base(under_test, prompt, tmp_path, adapter_exchange, request):
    train_save_export_reload(under_test, prompt, tmp_path, adapter_exchange, request.config.stash[keys.VERSIONS], LANGUAGE, language_adapter)


@pytest.mark.needs("experts")
def test_trained_expert_adapter_reloads_onto_a_fresh_4bit_base(under_test, prompt, tmp_path, adapter_exchange, request):
    train_save_export_reload(under_test, prompt, tmp_path, adapter_exchange, request.config.stash[keys.VERSIONS], EXPERTS, expert_adapter,
                             expert_deltas)


def baseline_export(adapter_exchange, name, request, exporter: str):
    """The baseline set's export `name`, which its `exporter` test left. Where it left none because that test met a
    known bug before exporting (its cell with this cell's parameters, in the results file both sets record into), this
    cell is not applicable: the baseline has no adapter to upgrade from (seed's MoE training meets
    `peft_moe_all_linear_charset`). Where it left none otherwise, the scenario is not reached."""
    try:
        export = adapter_exchange.baseline_export(name)
    except ExportMissing as exc:
        known = baseline_known_bug(request, adapter_exchange.baseline, exporter)
        if known:
            raise tiny.NotApplicable(f"{exc}: its own cell of {exporter} is the known bug {known}") from None
        raise scenario.ScenarioNotReached(str(exc)) from None
    if export is None:
        pytest.skip("no baseline set in this run: the gate's candidate and a matrix's later sets load the adapter their baseline trained")
    return export


def baseline_known_bug(request, baseline: str, exporter: str) -> str | None:
    """The known bug the baseline set's cell of `exporter` (with this cell's parameters) was judged, as the results
    file records it; None when that cell was judged otherwise or is not recorded."""
    path = request.config.getoption(RESULTS_OPTION)
    if not path:
        return None
    test = request.node.nodeid.replace(f"::{request.node.originalname}[", f"::{exporter}[", 1)
    return next((cell.bug for cell in results.load(Path(path))["cells"]
                 if cell.set_name == baseline and cell.test == test and cell.verdict == "known_bug"), None)


def reload_and_compare_effect(under_test, prompt, export):
    """Load the baseline's adapter onto a fresh 4-bit base from the checkpoint it was trained on, and compare
    its effect (the logits with it minus those without) with the one the baseline measured."""
    loaded = reload_for_training(under_test, export.adapter, export.base_checkpoint)
    with loaded.disable_adapter():
        base_logits = scenario.logits(loaded, prompt)
    saved = load_file(export.adapter / "adapter_model.safetensors")
    dropped = len(saved) - len(scenario.lora_tensors(loaded))

    adapter_effect = scenario.logits(loaded, prompt) - base_logits
    error = scenario.relative_error(adapter_effect, export.trained_logits - export.base_logits)
    print(f"stackcheck measured: the base alone differs from set '{export.set_name}' by "
          f"{scenario.relative_error(base_logits, export.base_logits):.4f}; {dropped} of {len(saved)} saved tensors not loaded")
    scenario.assert_within(f"the adapter trained by set '{export.set_name}' changes the logits otherwise here: relative error",
                           error, ROUND_TRIP_TOLERANCE)


# CPU lane only: module names and the adapter's values do not depend on the device, and on a GPU the sets'
# 4-bit kernels differ: seed's bitsandbytes moves the base by 0.031 against latest's (H100), and the adapter's
# effect by 0.042, more than losing one module does.
@pytest.mark.cpu
def test_adapter_trained_by_the_baseline_set_reloads(under_test, prompt, adapter_exchange, request):
    """The upgrade: the adapter the baseline set trained (the test above, run by it), loaded by this set onto a
    fresh 4-bit base from the checkpoint it was trained on, changes the outputs as it did for the baseline."""
    reload_and_compare_effect(under_test, prompt,
                              baseline_export(adapter_exchange, LANGUAGE, request, "test_trained_adapter_reloads_onto_a_fresh_4bit_base"))


@pytest.mark.cpu
@pytest.mark.needs("experts")
def test_expert_adapter_trained_by_the_baseline_set_reloads(under_test, prompt, adapter_exchange, request):
    """The same with the baseline's LoRA on the fused expert parameters, whose layout PEFT changed: loaded here,
    it adds to each expert parameter what it added in the baseline. Compared on the weights, not the logits: the
    router is not adapted, and the bases of two sets differ enough (0.0028 on the tiny Qwen3-MoE, seed to
    latest) to route a token to another expert, which moved the logits' effect by 0.0061 in one training run
    and 0.0629 in another."""
    export = baseline_export(adapter_exchange, EXPERTS, request, "test_trained_expert_adapter_reloads_onto_a_fresh_4bit_base")
    scenario.require_adapter_changes(export.trained_logits, export.base_logits, f"set '{export.set_name}''s trained model")
    # A verdict reads this set's versions alone: an adapter in the swapped layout loads here as the bug only where
    # this set reads the other layout, so the cell needs one trained outside the swapped range.
    swapped = request.config.stash[keys.LEDGER].bugs[SWAPPED_LAYOUT]
    scenario.require(not swapped.affects(export.versions),
                     f"set '{export.set_name}' trained its expert adapter in the layout of {SWAPPED_LAYOUT} "
                     f"({swapped.describe_range()}): this set's verdict cannot say whether its own PEFT reads it")
    loaded = reload_for_training(under_test, export.adapter, export.base_checkpoint)
    require_lora_on_fused_experts(loaded)
    deltas = expert_deltas(loaded)
    assert deltas.keys() == export.tensors.keys(), f"the expert adapter adapts {sorted(deltas)} here, {sorted(export.tensors)} in set '{export.set_name}'"
    error = scenario.relative_error(torch.cat([deltas[k].flatten() for k in sorted(deltas)]),
                                    torch.cat([export.tensors[k].flatten() for k in sorted(deltas)]))
    scenario.assert_within(f"the expert adapter trained by set '{export.set_name}' adds otherwise to the expert weights here: relative error",
                           error, ROUND_TRIP_TOLERANCE)
