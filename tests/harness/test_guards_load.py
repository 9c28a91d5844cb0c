"""The load contract's families fail, with their own messages, when a library is broken on purpose in the way the
bugs they are meant to catch break it: a layer left unquantized, a skip list ignored, a checkpoint key not loaded, a
weight transposed on its way in, a device map sized in bf16 or from undercounted sizes."""

import importlib

import pytest
import torch

from stackcheck.harness import scenario
from stackcheck.harness import load
from stackcheck.models import architectures
from stackcheck.models.tiny import NotApplicable
from stackcheck.harness.scenario import ToleranceExceeded

LLAMA3 = scenario.UnderTest(architectures.builtin()["llama3"], torch.device("cpu"))
NF4 = scenario.Quantization("nf4", True, torch.bfloat16)
BUDGET = {factor: form for form, factor in load.AUTO_BUDGETS.items()}  # load_auto_device_map's max_memory values


def family(name):
    return importlib.import_module(f"tests.contract.load.test_{name}")


@pytest.fixture(autouse=True)
def fresh_loads(monkeypatch):
    """Every guard loads under its own break, never a model another test loaded."""
    monkeypatch.setattr(load, "SHARED_LOADS", {})


def break_loader(monkeypatch, edit):
    """transformers' loader, with `edit(state_dict)` applied to the checkpoint's tensors before it converts and loads them."""
    import transformers.modeling_utils as modeling_utils

    convert_and_load = modeling_utils.convert_and_load_state_dict_in_model

    def broken(model, state_dict, *args, **kwargs):
        edit(state_dict)
        return convert_and_load(model, state_dict, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "convert_and_load_state_dict_in_model", broken)


def test_quantized_layers_fails_on_a_linear_bitsandbytes_did_not_replace(monkeypatch):
    import transformers.integrations as integrations

    replace = integrations.replace_with_bnb_linear

    def replace_all_but_one(model, *args, **kwargs):
        model = replace(model, *args, **kwargs)
        mlp = model.model.layers[1].mlp
        mlp.down_proj = torch.nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False, device="meta")
        return model

    monkeypatch.setattr(integrations, "replace_with_bnb_linear", replace_all_but_one)
    with pytest.raises(AssertionError, match=r"^1 weights meant for load_in_4bit stay in torch\.bfloat16: model\.layers\.\*\.mlp\.down_proj(\n|$)"):
        family("load_quantized_layers").test_every_weight_meant_for_quantization_is_quantized(LLAMA3, False, "nf4", True, "bfloat16", "<default>", None)


def test_quantized_layers_fails_when_the_skip_list_is_ignored(monkeypatch):
    from transformers.quantizers.base import HfQuantizer

    defaults_only = HfQuantizer.get_modules_to_not_convert

    def ignoring_the_user(model, skip_modules=None, keep_in_fp32_modules=None, add_default_skips=False):
        return defaults_only(model, None, keep_in_fp32_modules, add_default_skips)

    monkeypatch.setattr(HfQuantizer, "get_modules_to_not_convert", staticmethod(ignoring_the_user))
    with pytest.raises(AssertionError, match=r"^llm_int8_skip_modules entries whose modules are quantized anyway: model\.layers\.0\.self_attn(\n|$)"):
        family("load_quantized_layers").test_every_weight_meant_for_quantization_is_quantized(LLAMA3, False, "nf4", True, "bfloat16", "attention0", None)
    int8, skips = scenario.Quantization("int8"), load.skip_list(LLAMA3, "inner")
    with pytest.raises(AssertionError, match=r"^4 LoRA layers do not wrap what the skip list asked \(load_in_8bit, skipped: model\.layers\.\*\.self_attn\.q_proj \(2\), "):
        family("load_quantized_layers").peft_wraps_what_the_list_kept(LLAMA3, scenario.load_quantized(LLAMA3, int8, skip_modules=skips), int8, skips,
                                                                      scenario.prompt(torch.device("cpu")))


def test_quantized_outputs_fails_on_a_weight_transposed_while_loading(monkeypatch, prompt):
    def transpose(state_dict):
        key = "model.layers.0.self_attn.q_proj.weight"
        state_dict[key] = state_dict[key][:].T.contiguous()

    break_loader(monkeypatch, transpose)
    with pytest.raises(ToleranceExceeded, match=r"^1 quantized layers hold weights off the nf4 grid of the checkpoint "
                                                r"\(model\.layers\.\*\.self_attn\.q_proj\): worst error in half code steps"):
        family("load_quantized_outputs").test_quantized_model_reproduces_the_checkpoint(LLAMA3, False, "nf4", True, "bfloat16", "<default>", prompt)


def test_quantized_outputs_fails_on_a_quantized_layer_left_at_its_initialisation(monkeypatch, prompt):
    break_loader(monkeypatch, lambda state_dict: state_dict.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ToleranceExceeded, match=r"^1 quantized layers hold weights off the int8 grid of the checkpoint \(model\.layers\.\*\.mlp\.up_proj\)"):
        family("load_quantized_outputs").test_quantized_model_reproduces_the_checkpoint(LLAMA3, True, "fp4", False, "float16", "<default>", prompt)


def test_quantized_outputs_fails_on_an_unquantized_weight_not_loaded(monkeypatch, prompt):
    break_loader(monkeypatch, lambda state_dict: state_dict.pop("model.embed_tokens.weight"))
    with pytest.raises(AssertionError, match=r"^\d+ weights bitsandbytes leaves unquantized differ from the checkpoint: model\.embed_tokens"):
        family("load_quantized_outputs").test_quantized_model_reproduces_the_checkpoint(LLAMA3, False, "fp4", False, "float32", "<default>", prompt)


def test_auto_device_map_fails_when_the_map_is_sized_in_bf16(monkeypatch, tmp_path, prompt):
    """axolotl PR #3512's class: the map planned at the weights' bf16 size spills a model that fits in 4-bit."""
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    monkeypatch.setattr(Bnb4BitHfQuantizer, "param_element_size", lambda self, model, name, param: param.element_size())
    with pytest.raises(AssertionError, match=r"^device_map='auto' spills a model that fits max_memory \(1\.5x its footprint\) off cpu: "):
        family("load_auto_device_map").test_auto_device_map_honours_max_memory(LLAMA3, False, BUDGET[1.5], tmp_path / "offload", prompt)


def test_auto_device_map_fails_when_module_sizes_are_undercounted(monkeypatch, tmp_path, prompt):
    """transformers PR #42290's class: sizes that leave out part of the weights give a map over the budget."""
    import transformers.integrations.accelerate as hf_accelerate

    sizes = hf_accelerate.compute_module_sizes

    def halved(*args, **kwargs):
        all_sizes, leaves = sizes(*args, **kwargs)
        return type(all_sizes)(int, {name: size // 2 for name, size in all_sizes.items()}), leaves

    monkeypatch.setattr(hf_accelerate, "compute_module_sizes", halved)
    with pytest.raises(ToleranceExceeded, match=r"^device_map='auto' places more on cpu than max_memory allows: bytes placed / budget"):
        family("load_auto_device_map").test_auto_device_map_honours_max_memory(LLAMA3, False, BUDGET[0.9], tmp_path / "offload", prompt)


def test_auto_device_map_fails_when_the_budget_drifts_between_calls(monkeypatch, tmp_path, prompt):
    """transformers PR #44565's class: memory counted differently on a later call gives the same model another map."""
    import transformers.integrations.accelerate as hf_accelerate

    balanced, calls = hf_accelerate.get_balanced_memory, []

    def drifting(*args, **kwargs):
        calls.append(1)
        memory = balanced(*args, **kwargs)
        return memory if len(calls) == 1 else {device: (size // 2 if device != "disk" else size) for device, size in memory.items()}

    monkeypatch.setattr(hf_accelerate, "get_balanced_memory", drifting)
    with pytest.raises(AssertionError, match=r"^device_map='auto' with the same model and max_memory gives another map on the second call: "):
        family("load_auto_device_map").test_auto_device_map_honours_max_memory(LLAMA3, False, BUDGET[0.9], tmp_path / "offload", prompt)


def test_skip_list_names_every_attention_kind_of_a_hybrid_model():
    """Qwen3-Next's Gated DeltaNet layers have `linear_attn`, no `self_attn`: the user's list names the first attention
    of each kind, and a layer whose attention cannot be told apart is an unreached scenario, never a guess."""
    qwen3next = scenario.UnderTest(architectures.builtin()["qwen3next"], torch.device("cpu"))
    assert load.skip_list(qwen3next, "attention0") == ["lm_head", "model.layers.0.linear_attn", "model.layers.3.self_attn"]
    assert load.skip_list(LLAMA3, "attention0") == ["lm_head", "model.layers.0.self_attn"]
    assert load.skip_list(LLAMA3, "inner") == ["lm_head", "q_proj", "v_proj"]
    assert load.skip_list(qwen3next, "sibling") == ["lm_head", "model.layers.0.mlp.shared_expert"]
    with pytest.raises(NotApplicable, match="prefix of a sibling"):
        load.skip_list(LLAMA3, "sibling")
    from stackcheck.harness.place import layer_attention

    layer = torch.nn.Module()
    layer.mlp = torch.nn.Linear(2, 2)
    with pytest.raises(scenario.ScenarioNotReached, match="holds 0 attention modules"):
        layer_attention(layer)


def test_reference_proof_reads_renamed_checkpoint_keys(monkeypatch):
    """The tiny Gemma 3 multimodal checkpoint stores every tensor under a legacy name (`language_model.model.*`) that
    transformers' conversion mapping renames while loading: the proof compares them all, and catches one that differs."""
    from stackcheck.models import tiny

    gemma3mm = architectures.builtin()["gemma3mm"]
    model = tiny._new_base_model(gemma3mm).to(torch.bfloat16)
    monkeypatch.setattr(load, "_CHECKPOINTS_PROVEN", set())
    load.require_reference_is_checkpoint(gemma3mm, model)
    with torch.no_grad():
        model.model.language_model.norm.weight.add_(1)
    monkeypatch.setattr(load, "_CHECKPOINTS_PROVEN", set())
    with pytest.raises(scenario.ScenarioNotReached, match=r"1 of 103 tensors differ, first \['language_model\.model\.norm\.weight'\]"):
        load.require_reference_is_checkpoint(gemma3mm, model)


def test_quantized_outputs_fails_on_a_router_that_routes_by_other_scores(monkeypatch, prompt):
    """A loaded model whose routers choose experts from scores other than their layer's (here: their input negated, a
    hook of the loader's that hands them another tensor): the references follow the model's routing only where
    rounding can break a tie, so the routing itself is held to the checkpoint's (measured: 17 to 4171 units on the
    Mixtral, Qwen3-MoE and Qwen3-Next cells)."""
    from transformers import PreTrainedModel

    from_pretrained = PreTrainedModel.from_pretrained.__func__

    def broken(cls, *args, **kwargs):
        model = from_pretrained(cls, *args, **kwargs)
        for router in load.routers(model).values():
            router.register_forward_pre_hook(lambda module, inputs: (-inputs[0], *inputs[1:]))
        return model

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(broken))
    qwen3moe = scenario.UnderTest(architectures.builtin()["qwen3moe"], torch.device("cpu"))
    with pytest.raises(ToleranceExceeded, match=r"^largest scores gap of a routing decision the model took otherwise than the fp32 checkpoint"):
        family("load_quantized_outputs").test_quantized_model_reproduces_the_checkpoint(qwen3moe, False, "nf4", True, "bfloat16", "<default>", prompt)
