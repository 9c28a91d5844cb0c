"""Tiny random checkpoints of each architecture under test (stackcheck.models.architectures) and their LoRA
adapters, built from config with no network; and for the benchmarks, one realistic-size random Gemma 4 text
checkpoint with its adapter, built the same way.

Config schemas change between transformers releases, so each checkpoint is built by the installed
transformers and cached once per (architecture, transformers version), under a key made of the version and a
hash of the tiny config and the adapter fixtures.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
import time
from functools import cache
from pathlib import Path

from typing import TYPE_CHECKING

from stackcheck import REPO_ROOT
from stackcheck.core import protocol
from stackcheck.core.locking import folder_locked

if TYPE_CHECKING:
    from stackcheck.models.architectures import Architecture

# A harness test points this elsewhere to break a precondition on purpose.
FIXTURES_DIR = Path(os.environ.get(protocol.FIXTURES_ENV, REPO_ROOT / "fixtures"))
SEED = 0
# The fixtures this process built, with their seconds: the "fixture build" share of a run's cost breakdown.
BUILT: list[tuple[str, float]] = []


def _fixture(name: str) -> dict:
    data = json.loads((FIXTURES_DIR / name).read_text())
    data.pop("_comment", None)
    return data


class FixtureError(Exception):
    """A fixture could not be built with the installed libraries: the cell's setup broke, which says
    nothing about the bug under test (the verdict is `error`, never `new_failure`)."""


class NotApplicable(Exception):
    """The test's scenario cannot exist on this architecture (a structure or an adapter it lacks): the cell
    reads `not_applicable`, with the reason, never missing and never a pass."""


# The adapters.json value that stands for PEFT's own default targets for the model type.
PEFT_DEFAULT_TARGETS = "peft-default"


def adapter_spec(arch: Architecture, name: str) -> dict:
    """The adapter fixture `name` of `arch` (fixtures/adapters.json): the seed's Gemma 4 has its own
    hand-written targets; every other architecture takes what users take, PEFT's default targets for the
    model type ("peft-default", "all-linear" where PEFT has none) and "all-linear"."""
    adapters = _fixture("adapters.json")
    specs = adapters.get(arch.name, adapters["*"])
    if name not in specs:
        raise NotApplicable(f"{arch.name} has no '{name}' adapter (its adapters: {', '.join(specs)})")
    spec = dict(specs[name])
    if spec["target_modules"] == PEFT_DEFAULT_TARGETS:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        spec["target_modules"] = defaults.get(arch.model_type, "all-linear")
    return spec


cache_root = protocol.cache_root


def _cache_dir(model: str, texts: tuple[str, ...]) -> Path:
    import transformers

    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
    return cache_root() / f"{model}-transformers-{transformers.__version__}-{digest.hexdigest()[:12]}"


def _arch_cache_dir(arch: Architecture) -> Path:
    """One cache folder per (architecture, transformers version), keyed by its config and the adapters."""
    return _cache_dir(f"tiny-{arch.name}", (arch.digest_text(), json.dumps(_fixture("adapters.json"), sort_keys=True)))


def _predates(arch: Architecture) -> None:
    """Raise NotApplicable when the installed transformers predates `arch`'s model type (its auto-config table does
    not list it): the cell cannot exist on this release, which is no broken setup. A model type the table lists whose
    config or class still fails to build stays a FixtureError."""
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        return
    if arch.model_type not in CONFIG_MAPPING_NAMES:
        raise NotApplicable(f"transformers {transformers.__version__} predates the {arch.model_type} model type "
                            f"({arch.name}'s): no such architecture on this release")


def tiny_config(arch: Architecture):
    """The tiny config of `arch`, built by the installed transformers."""
    _predates(arch)
    try:
        from transformers import AutoConfig

        # A deep copy: transformers fills nested settings in place (5.23 adds rope_type, rope_theta and more to Phi-4's
        # rope_scaling), which would change the architecture's digest, so its cache folder, in mid-run: the ranks of
        # a job then asked for another checkpoint than the one their caller built, and built it themselves.
        settings = copy.deepcopy(arch.config)
        return AutoConfig.for_model(settings.pop("model_type"), **settings)
    except Exception as exc:
        raise FixtureError(f"this transformers cannot build the tiny {arch.name} config: {type(exc).__name__}: {exc}") from exc


def model_class(arch: Architecture):
    """The transformers class `arch`'s config names (`architectures[0]`), as the user's `from_pretrained` uses it."""
    import transformers

    found = getattr(transformers, arch.model_class, None)
    if found is None:
        _predates(arch)
        raise FixtureError(f"this transformers has no {arch.model_class} (the class {arch.name}'s config names)")
    return found


def _build_once(target: Path, build) -> Path:
    """Build into a temp dir and rename it into place, so parallel workers never see half a checkpoint; under the
    cache folder's lock, so that of the workers (xdist's, a distributed job's ranks) asking for one checkpoint at
    once, one builds it and the others wait and load it (once per run, shared on disk)."""
    if target.exists():
        return target
    with folder_locked(target.parent):
        return _build_locked(target, build)


def _build_locked(target: Path, build) -> Path:
    if target.exists():  # another process built it while this one waited
        return target
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    started = time.monotonic()
    try:
        try:
            build(scratch)
        except (FixtureError, NotApplicable):
            raise
        except Exception as exc:
            raise FixtureError(f"fixture {target.name} cannot be built: {type(exc).__name__}: {exc}") from exc
        if not any(scratch.iterdir()):  # never cached: every later cell would load an empty folder
            raise FixtureError(f"fixture {target.name} was built empty (save_pretrained writes on rank 0 alone under a "
                               "process group: a job's ranks must read what their caller built)")
        os.replace(scratch, target)
        BUILT.append((target.name, time.monotonic() - started))
    except OSError:
        if not target.exists():  # lost a race to another worker: theirs is as good as ours
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _new_base_model(arch: Architecture):
    import torch

    torch.manual_seed(SEED)
    cls, config = model_class(arch), tiny_config(arch)
    # Auto classes build through `from_config`; a model class through its constructor.
    model = (cls.from_config(config) if hasattr(cls, "from_config") else cls(config)).eval()
    _fill_zero_matrices(model, getattr(config, "initializer_range", 0.02))
    return model


def _fill_zero_matrices(model, std: float) -> None:
    """A weight matrix that the model's own init leaves all zero gets a random one: a trained checkpoint has none,
    and a zero one cuts what sits before it out of every output and gradient (Gemma 3's multimodal projector,
    `mm_input_projection_weight`, starts at zero: the tiny model's image would change nothing). No other built-in
    architecture has one."""
    import torch

    generator = torch.Generator().manual_seed(SEED + 2)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2 and not parameter.any():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)


@cache
def base_checkpoint(arch: Architecture) -> Path:
    """Directory of the bf16 safetensors checkpoint of `arch`'s tiny model."""
    import torch

    def build(out: Path) -> None:
        _new_base_model(arch).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)

    return _build_once(_arch_cache_dir(arch) / "base", build)


def lora_config(arch: Architecture, name: str, **overrides):
    """The LoRA config of `arch`'s adapter fixture `name`: its targets (`adapter_spec`), rank 4, alpha 8."""
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": adapter_spec(arch, name)["target_modules"], **overrides})


@cache
def adapter_checkpoint(arch: Architecture, name: str) -> Path:
    """Directory of `arch`'s LoRA adapter fixture `name` (see fixtures/adapters.json)."""
    import torch
    from peft import get_peft_model

    spec = adapter_spec(arch, name)

    def build(out: Path) -> None:
        torch.manual_seed(SEED + 1)
        config = lora_config(arch, spec.get("weights_from", name), init_lora_weights=False)
        model = get_peft_model(_new_base_model(arch), config)
        model.save_pretrained(out)
        if "weights_from" in spec:
            # The broad adapter's targets cannot be applied on releases with the clippable bug, so its
            # weights come from another adapter and only the config carries the broad targets.
            config_file = out / "adapter_config.json"
            saved = json.loads(config_file.read_text())
            saved["target_modules"] = spec["target_modules"]
            config_file.write_text(json.dumps(saved, indent=2))

    return _build_once(_arch_cache_dir(arch) / f"adapter-{name}", build)


REALISTIC_FIXTURE = "realistic_gemma4_text.json"


def realistic_config():
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**_fixture(REALISTIC_FIXTURE)["config"])


@cache
def realistic_checkpoint() -> Path:
    """Directory holding `base/`, the bf16 safetensors checkpoint of a random `Gemma4ForCausalLM` of the
    benchmarks' realistic size, and `adapter/`, a LoRA adapter on it (fixtures/realistic_gemma4_text.json).

    Built on the GPU when there is one (seconds there, against minutes of CPU init for ~5B parameters),
    then loaded back through `from_pretrained`, so that bitsandbytes quantizes it on the real loading path.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma4ForCausalLM

    def build(out: Path) -> None:
        torch.manual_seed(SEED)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = Gemma4ForCausalLM(realistic_config()).to(torch.bfloat16).eval()
        model.save_pretrained(out / "base", safe_serialization=True)
        torch.manual_seed(SEED + 1)
        adapter = LoraConfig(init_lora_weights=False, **_fixture(REALISTIC_FIXTURE)["adapter"])
        get_peft_model(model, adapter).save_pretrained(out / "adapter")

    return _build_once(_cache_dir("gemma4-text-realistic", ((FIXTURES_DIR / REALISTIC_FIXTURE).read_text(),)), build)
