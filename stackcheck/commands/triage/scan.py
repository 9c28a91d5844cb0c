"""`stackcheck scan MODEL [ADAPTER]`: a preflight of a user's model folder and adapter, on the meta device.

The model is built from its `config.json` on meta (no weights are read) and quantized the way `from_pretrained`
would, then read for what breaks the seed user's stack before any download or load, and for the ledger's known bugs
of the installed versions (`doctor`). What it checks: docs/internals.md, "commands/triage/scan.py"; docs/running.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stackcheck import REPO_ROOT
from stackcheck.runner import exitcodes, inputs
from stackcheck.core import hostinfo, protocol
from stackcheck.core.ledger import Ledger
from stackcheck.models import architectures, footprint
from stackcheck.commands.triage import doctor
from stackcheck.core.versions import UsageError, installed_versions

# Set in the scan that `--python` starts in the other interpreter: that one scans in-process.
IN_PYTHON_ENV = protocol.SCAN_IN_ENV

# bitsandbytes' packed AVX512-BF16 CPU path (the bnb_cpu_packed_width family) packs the output rows in
# blocks of 32 and reshapes the absmax per 64-wide input block.
PACKED_OUT_BLOCK, PACKED_IN_BLOCK = 32, 64
PACKED_PATH_BUGS = ("bnb_cpu_packed_out_features", "bnb_cpu_packed_in_features")


@dataclass
class Scan:
    model: str
    architecture: str
    findings: dict[str, list[str]] = field(default_factory=dict)  # problem kind -> one line per problem
    quantization: dict[str, dict[str, int]] = field(default_factory=dict)  # top-level part -> {module type: count}
    lora_targets: dict[str, int] = field(default_factory=dict)  # module type -> target hits
    kv_sharing: dict[str, Any] = field(default_factory=dict)  # {"shared_layers": "A-B", "stored_by": [layer, ...]}
    footprint: dict[str, int] = field(default_factory=dict)  # the weights' bytes: planned in 4-bit, allocated by this stack
    known_bugs: list[str] = field(default_factory=list)

    def add(self, kind: str, problem: str) -> None:
        self.findings.setdefault(kind, []).append(problem)


def read_json_option(option: str, text: str | None):
    """A JSON option given inline or as a path to a .json file; one line and exit 2 when malformed."""
    if text is None:
        return None
    source = Path(text).expanduser()
    if source.suffix == ".json":
        inputs.existing_file(option, source)
    try:
        return json.loads(source.read_text() if source.suffix == ".json" else text)
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise UsageError(f"{option}: not JSON ({exc})") from None


# The device_map strings from_pretrained takes besides a map: accelerate's strategies, and one device for the whole model.
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
ONE_DEVICE = re.compile(r"cpu|disk|meta|mps|(cuda|xpu|npu)(:\d+)?|\d+")


def read_device_map(text: str | None) -> dict | str | None:
    """`--device-map` as from_pretrained takes it: a strategy (`auto`: accelerate's map, made on meta once the model is
    built: `auto_device_map`), one device (`cpu`, `cuda:0`, `0`: the whole model there), or a map as JSON."""
    given = (text or "").strip()
    if given in DEVICE_MAP_STRATEGIES:
        return given
    if ONE_DEVICE.fullmatch(given):
        return {"": int(given) if given.isdigit() else given}
    return read_json_option("--device-map", text)


def auto_device_map(model, strategy: str, max_memory: dict | None) -> dict:
    """The map accelerate makes for `strategy` (as from_pretrained does), on the devices of this host or `max_memory`."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = model._no_split_modules
    if strategy in ("auto", "balanced", "balanced_low_0"):
        max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                         low_zero=strategy == "balanced_low_0")
    try:
        return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
    except ValueError as exc:  # accelerate's own check of the devices and sizes
        raise UsageError(f"--max-memory: accelerate refuses it ({' '.join(str(exc).split())})") from None


def read_folder(option: str, folder: Path, file_name: str) -> dict:
    """The JSON object `file_name` in the folder `option` names."""
    path = inputs.existing_folder(option, folder) / file_name
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{option} {folder}: it has no {file_name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: not a {file_name} (a JSON object)")
    return data


PROGRESS = {"stream": sys.stdout}


def progress(step: str) -> None:
    """What the scan is doing (the libraries' imports and the build on meta take 10 to 30 s), in `== ` lines before
    the report as every command prints them. With --json, whose stdout is the JSON alone, on stderr where a person
    watches it (a terminal), else not at all: a program reading stderr finds only an error there."""
    if PROGRESS["stream"] is not None:
        print(f"== scan: {step}", file=PROGRESS["stream"], flush=True)


def failed(what: str, exc: Exception) -> UsageError:
    """A library refusing what the user gave it (a config it cannot build, sizes whose tensors overflow): one line."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return UsageError(f"{what} ({type(exc).__name__}: {first[:300]})")


def build_on_meta(model_dir: Path, config_data: dict):
    """The model of `model_dir` built from its config on the meta device, with the class its config names."""
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError) as exc:
        raise UsageError(f"{model_dir}/config.json: transformers cannot read it ({exc})") from None
    architecture = (config_data.get("architectures") or [None])[0]
    model_class = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
    try:
        with torch.device("meta"):
            model = model_class(config) if model_class else transformers.AutoModel.from_config(config)
    except Exception as exc:  # its sizes overflow a tensor, a value of the wrong type: the config, not the scan
        raise failed(f"{model_dir}/config.json: transformers cannot build the model on meta", exc) from None
    return model, type(model).__name__


def quantize_on_meta(model, quantization: dict, device_map: dict | None):
    """transformers' bitsandbytes quantizer prepares the meta model as `from_pretrained` would."""
    import inspect

    from transformers import BitsAndBytesConfig
    from transformers.quantizers import AutoHfQuantizer

    # BitsAndBytesConfig takes **kwargs and keeps what it does not know: a misspelt key would quantize nothing.
    known = [name for name, p in inspect.signature(BitsAndBytesConfig).parameters.items() if p.kind is not p.VAR_KEYWORD]
    unknown = [key for key in quantization if key not in known]
    if unknown:
        raise UsageError(f"--quantization: BitsAndBytesConfig has no {', '.join(map(repr, unknown))} (it takes {', '.join(known)})")
    try:
        config = BitsAndBytesConfig(**quantization)
    except (TypeError, ValueError, AttributeError) as exc:  # AttributeError: a compute dtype torch does not have
        raise UsageError(f"--quantization: not a BitsAndBytesConfig ({exc})") from None
    check_bitsandbytes_takes(config)
    try:
        quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
        quantizer.preprocess_model(model, device_map=device_map)
    except Exception as exc:  # the quantizer refusing this config on this model (sizes, skip modules of the wrong type)
        raise failed("--quantization: transformers' quantizer cannot prepare the model with it", exc) from None
    return quantizer


def check_bitsandbytes_takes(config) -> None:
    """bitsandbytes itself quantizes one small weight the way `from_pretrained` will quantize each of the model's
    layers (Linear4bit's Params4bit, moved to a device): BitsAndBytesConfig keeps what it is given, so a 4-bit
    type bitsandbytes does not have (`nf5`) would otherwise show only when the weights load."""
    if not config.load_in_4bit:
        return
    import bitsandbytes as bnb
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its kernels' deprecation notes: not the user's concern
            weight = bnb.nn.Params4bit(torch.zeros(64, 64, dtype=torch.bfloat16), requires_grad=False, quant_type=config.bnb_4bit_quant_type,
                                       compress_statistics=config.bnb_4bit_use_double_quant, quant_storage=config.bnb_4bit_quant_storage)
            weight.to("cpu")
    except Exception as exc:
        raise failed("--quantization: bitsandbytes refuses it", exc) from None


def module_device(name: str, device_map: dict) -> object:
    """The device `device_map` gives module `name`: its longest matching key's."""
    keys = [key for key in device_map if key == "" or name == key or name.startswith(key + ".")]
    return device_map[max(keys, key=len)] if keys else None


def check_device_map(scan: Scan, model, device_map: dict) -> None:
    from stackcheck.harness import scenario

    for key in scenario.missing_device_map_keys(model, {k: v for k, v in device_map.items() if k}):
        scan.add("device_map_key_names_no_module", f"'{key}' names no module of {scan.architecture}: accelerate ignores it")


def check_quantization(scan: Scan, model, quantizer, device_map: dict | None, known_bugs: list[str]) -> None:
    from stackcheck.harness import scenario

    quantized = scenario.linear4bit_modules(model)
    per_part: dict[str, Counter] = {}
    for name, module in model.named_modules():
        if type(module).__name__ in ("Linear", "Linear4bit", "Linear8bitLt"):
            per_part.setdefault(".".join(name.split(".")[:2]), Counter())[type(module).__name__] += 1
    scan.quantization = {part: dict(types) for part, types in per_part.items()}
    for entry in scenario.ineffective_skips(model, list(quantizer.quantization_config.llm_int8_skip_modules or [])):
        scan.add("skip_module_keeps_nothing", f"llm_int8_skip_modules entry '{entry}' keeps nothing unquantized")
    check_footprint(scan, model, quantizer, quantized)
    if not set(PACKED_PATH_BUGS) & set(known_bugs) or device_map is None:
        return
    rejected: dict[tuple[int, int], list[str]] = {}
    for name, module in quantized.items():
        if module_device(name, device_map) == "cpu" and (module.out_features % PACKED_OUT_BLOCK or module.in_features % PACKED_IN_BLOCK):
            rejected.setdefault((module.in_features, module.out_features), []).append(name)
    for (in_features, out_features), names in rejected.items():
        scan.add("cpu_packed_path_rejects_width", f"{len(names)} 4-bit layers {in_features} -> {out_features} on this avx512_bf16 "
                 f"CPU (e.g. {names[0]}): bitsandbytes' packed path needs in % {PACKED_IN_BLOCK} and out % {PACKED_OUT_BLOCK}")


def check_footprint(scan: Scan, model, quantizer, quantized: dict) -> None:
    """The weights' 4-bit footprint the user plans (every weight meant for 4-bit in NF4: `footprint`) against what
    this stack will allocate (the layers the quantizer really replaced in NF4, the rest in bf16), for the full-size
    model. A mixture of experts fused into 3-D parameters is where they part (bitsandbytes#1849)."""
    nested = bool(quantizer.quantization_config.bnb_4bit_use_double_quant)
    meant = footprint.meant_for_4bit(model, list(quantizer.modules_to_not_convert or []))
    quantized_weights = {f"{name}.weight" for name in quantized}
    planned = allocated = 0
    for name, param in model.named_parameters():
        bf16, nf4 = param.numel() * 2, footprint.nf4_bytes(param.numel(), nested=nested)
        planned += nf4 if name in meant else bf16
        allocated += nf4 if name in quantized_weights else bf16
    scan.footprint = {"planned_bytes": planned, "allocated_bytes": allocated}
    experts = footprint.fused_experts(model)
    unquantized = [name for name in experts if name not in quantized_weights]
    if allocated > planned and unquantized:
        expert_values = sum(experts[name].numel() for name in unquantized)
        total = sum(p.numel() for p in model.parameters())
        scan.add("experts_not_quantized", f"{len(unquantized)} fused expert parameters (e.g. {unquantized[0]}), "
                 f"{expert_values / total:.0%} of the weights, stay in bf16 under 4-bit (bitsandbytes#1849; it replaces "
                 f"nn.Linear only): the weights take {allocated / 2**30:.1f} GiB where 4-bit should take "
                 f"{planned / 2**30:.1f} GiB ({allocated / planned:.1f}x)")


def rejected_by_peft(module, lora_config) -> str | None:
    """PEFT's own answer for one module: the error injecting a LoRA into it raises, or None when it takes it. The
    LoRA wraps the module inside a holder of its own, so the scanned model keeps its modules."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    holder = torch.nn.Module()
    holder.target = module
    try:
        inject_adapter_in_model(LoraConfig(r=lora_config.r, target_modules=["target"]), holder)
    except ValueError as exc:  # PEFT prints the whole module in its message: name its type instead
        return " ".join(str(exc).replace(str(module), type(module).__name__).split())[:200]
    return None


def check_adapter_weights(scan: Scan, adapter: Path) -> None:
    """The adapter's weights, under the names PEFT loads them from: a folder with only its config loads nothing."""
    from peft.utils import SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME

    if not any((adapter / name).is_file() for name in (SAFETENSORS_WEIGHTS_NAME, WEIGHTS_NAME)):
        scan.add("adapter_weights_missing", f"{adapter} has no {SAFETENSORS_WEIGHTS_NAME} or {WEIGHTS_NAME}: "
                 "PeftModel.from_pretrained cannot load it (its targets were checked from adapter_config.json alone)")


def check_lora_targets(scan: Scan, model, adapter_config: dict, adapter: Path) -> None:
    import torch
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    fields = {k: v for k, v in adapter_config.items() if k in ("r", "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern")}
    try:  # PEFT keeps values of the wrong type and fails on them only when it matches targets: both are asked here
        lora_config = LoraConfig(**fields)
        hits = {name: module for name, module in model.named_modules() if name and check_target_module_exists(lora_config, name)}
    except Exception as exc:
        raise failed(f"{adapter}/adapter_config.json: PEFT cannot use it", exc) from None
    scan.lora_targets = dict(Counter(type(m).__name__ for m in hits.values()))
    first_of_type: dict[str, tuple[str, Any]] = {}  # module type -> (name, module) of its first hit
    for name, module in hits.items():
        first_of_type.setdefault(type(module).__name__, (name, module))
    for type_name, (name, module) in first_of_type.items():
        reason = rejected_by_peft(module, lora_config)
        if reason is None:
            continue
        inner = isinstance(getattr(module, "linear", None), torch.nn.Module)
        hint = f"; target its inner `.linear` instead (e.g. '{name.split('.')[-1]}.linear')" if inner else ""
        scan.add("lora_target_rejected_by_peft", f"{scan.lora_targets[type_name]} targets are {type_name}: {reason}{hint}")


def check_kv_sharing(scan: Scan, model, device_map: dict | None) -> None:
    """Gemma 4: which layers store the K/V the shared layers read, and whether the map splits them apart."""
    layers = [m for name, m in model.named_modules() if name.endswith("language_model.layers")]
    if not layers:
        return
    names = {id(m): name for name, m in model.named_modules()}
    attention = [(index, layer.self_attn) for index, layer in enumerate(layers[0])]
    stores = [i for i, a in attention if getattr(a, "store_full_length_kv", False)]
    shared = [i for i, a in attention if getattr(a, "is_kv_shared_layer", False)]
    if not shared:
        return
    scan.kv_sharing = {"shared_layers": f"{shared[0]}-{shared[-1]}", "stored_by": stores}
    if device_map:
        devices = {str(module_device(names[id(layers[0][i])], device_map)) for i in stores + shared}
        if len(devices) > 1:
            scan.add("kv_sharing_across_devices", f"the map puts KV-storing layers {stores} and the shared layers "
                     f"{shared[0]}-{shared[-1]} on {', '.join(sorted(devices))}: the shared_kv_redispatch family's scenario")


def run_in(python: str, argv: list[str]) -> int:
    """The same scan in the interpreter at `python` (an environment's, as `doctor --python`), which has the libraries."""
    progress(f"running in {python}, which has the libraries")
    try:
        return subprocess.run([python, "-m", "stackcheck", *argv],
                              env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), **{IN_PYTHON_ENV: python})).returncode
    except OSError as exc:
        raise UsageError(f"--python {python}: cannot run it ({exc.strerror})") from None


def run(args, argv: list[str]) -> int:
    """The `scan` command: 1 when it finds a problem, or a known bug of --fail-on affects the install (default: one
    that an upgrade leaves), 0 otherwise (stackcheck.runner.exitcodes)."""
    config_data = read_folder("MODEL", args.model, "config.json")  # checked here, before another interpreter starts
    fail_on = doctor.fail_on(args, exitcodes.SCAN_FAIL_ON)
    adapter_config = read_folder("ADAPTER", args.adapter, "adapter_config.json") if args.adapter else None
    device_map = read_device_map(args.device_map)
    max_memory = read_json_option("--max-memory", args.max_memory)
    quantization = read_json_option("--quantization", args.quantization)
    for option, value in (("--device-map", device_map), ("--max-memory", max_memory), ("--quantization", quantization)):
        if value is not None and not isinstance(value, dict) and not (option == "--device-map" and isinstance(value, str)):
            raise UsageError(f"{option}: expected a JSON object, got {type(value).__name__}")
    PROGRESS["stream"] = (sys.stderr if sys.stderr.isatty() else None) if args.json else sys.stdout
    if args.python and os.environ.get(IN_PYTHON_ENV) != args.python:
        return run_in(inputs.interpreter("--python", args.python), argv)
    versions, cpu_flags = installed_versions(), hostinfo.cpu_facts()["cpu_flags"]
    doctor.require_stack(versions, args.python, "name the Python of the environment that loads the model with --python")
    progress(f"building {config_data.get('model_type', 'the model')} from {args.model / 'config.json'} on the meta device "
                   f"with transformers {versions['transformers']} (no weights are read)")
    model, architecture = build_on_meta(args.model, config_data)
    # The known bugs this architecture can have: its model type's, and those of families its structures let run.
    arch = (model.config.model_type, architectures.structures(model.config))
    diagnoses = doctor.diagnose(Ledger(), versions, cpu_flags, arch)
    scan = Scan(str(args.model), architecture, known_bugs=[d.bug for d in diagnoses])
    if isinstance(device_map, str) or (device_map is None and max_memory is not None):
        device_map = auto_device_map(model, device_map or "sequential", max_memory)
    if device_map:
        check_device_map(scan, model, device_map)
    if quantization is not None:
        progress("quantizing it on meta as from_pretrained would")
        check_quantization(scan, model, quantize_on_meta(model, quantization, device_map), device_map, scan.known_bugs)
    if adapter_config is not None:
        progress("asking PEFT about the adapter's targets")
        check_adapter_weights(scan, args.adapter)
        check_lora_targets(scan, model, adapter_config, args.adapter)
    check_kv_sharing(scan, model, device_map)
    checked = ["the model", *(["adapter"] if args.adapter else []), *(["options"] if device_map or quantization is not None else [])]
    print(json.dumps(asdict(scan), indent=2) if args.json else render(scan, versions, checked))
    if scan.findings:
        print(f"stackcheck: exit 1: {sum(map(len, scan.findings.values()))} problems found (docs/exit-codes.md)", file=sys.stderr)
        return exitcodes.FAILED
    return doctor.exit_code(diagnoses, fail_on)


def render(scan: Scan, versions: dict[str, str], checked: list[str]) -> str:
    """`checked`: what was given to scan (the model, adapter, options), named in the all-clear."""
    lines = [f"stackcheck scan {scan.model}: {scan.architecture}, built on meta with "
             + ", ".join(f"{k} {v}" for k, v in versions.items()), ""]
    if scan.quantization:
        lines.append("quantization, per part: " + "; ".join(
            f"{part} {', '.join(f'{n} {t}' for t, n in sorted(types.items()))}" for part, types in scan.quantization.items()))
    if scan.lora_targets:
        lines.append("LoRA target hits per module type: " + ", ".join(f"{t} {n}" for t, n in scan.lora_targets.items()))
    if scan.footprint:
        lines.append(f"weights under this quantization: {scan.footprint['allocated_bytes'] / 2**30:.2f} GiB allocated, "
                     f"{scan.footprint['planned_bytes'] / 2**30:.2f} GiB if every weight meant for 4-bit were 4-bit")
    if scan.kv_sharing:
        lines.append(f"KV sharing: layers {scan.kv_sharing['shared_layers']} read the K/V that layers "
                     f"{', '.join(map(str, scan.kv_sharing['stored_by']))} store")
    for kind, problems in scan.findings.items():
        lines.append(f"{kind}:")
        lines += [f"  - {problem}" for problem in problems]
    if not scan.findings:
        lines.append(f"no problems found in {', '.join(checked[:-1])}{' and ' if len(checked) > 1 else ''}{checked[-1]}")
    if scan.known_bugs:
        lines.append(f"{len(scan.known_bugs)} known bugs affect the installed versions (`stackcheck doctor` for the changes "
                     f"that leave them): {', '.join(scan.known_bugs)}")
    return "\n".join(lines)
