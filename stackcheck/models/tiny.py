"""Tiny random Gemma 4 checkpoints and LoRA adapters, built from config with no network; and for the
benchmarks, one realistic-size random Gemma 4 text checkpoint with its adapter, built the same way.

Config schemas change between transformers releases, so each checkpoint is built by the installed
transformers and cached under a key made of its version and a hash of the fixture files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from functools import cache
from pathlib import Path

from stackcheck import REPO_ROOT

# A harness test points this elsewhere to break a precondition on purpose.
FIXTURES_DIR = Path(os.environ.get("STACKCHECK_FIXTURES", REPO_ROOT / "fixtures"))
SEED = 0
# The fixtures this process built, with their seconds: the "fixture build" share of a run's cost breakdown.
BUILT: list[tuple[str, float]] = []


def _fixture(name: str) -> dict:
    data = json.loads((FIXTURES_DIR / name).read_text())
    data.pop("_comment", None)
    return data


def adapter_spec(name: str) -> dict:
    return _fixture("adapters.json")[name]


def cache_root() -> Path:
    return Path(os.environ.get("STACKCHECK_CACHE", REPO_ROOT / ".cache"))


def _cache_dir(model: str = "tiny-gemma4", fixtures: tuple[str, ...] = ("tiny_gemma4.json", "adapters.json")) -> Path:
    import transformers

    digest = hashlib.sha256()
    for name in fixtures:
        digest.update((FIXTURES_DIR / name).read_bytes())
    return cache_root() / f"{model}-transformers-{transformers.__version__}-{digest.hexdigest()[:12]}"


class FixtureError(Exception):
    """A fixture could not be built with the installed libraries: the cell's setup broke, which says
    nothing about the bug under test (the verdict is `error`, never `new_failure`)."""


def tiny_config():
    try:
        from transformers import Gemma4Config

        return Gemma4Config(**_fixture("tiny_gemma4.json"))
    except Exception as exc:
        raise FixtureError(f"the tiny Gemma 4 config cannot be built: {type(exc).__name__}: {exc}") from exc


def _build_once(target: Path, build) -> Path:
    """Build into a temp dir and rename it into place, so parallel workers never see half a checkpoint."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    started = time.monotonic()
    try:
        try:
            build(scratch)
        except FixtureError:
            raise
        except Exception as exc:
            raise FixtureError(f"fixture {target.name} cannot be built: {type(exc).__name__}: {exc}") from exc
        os.replace(scratch, target)
        BUILT.append((target.name, time.monotonic() - started))
    except OSError:
        if not target.exists():  # lost a race to another worker: theirs is as good as ours
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _new_base_model():
    import torch
    from transformers import Gemma4ForConditionalGeneration

    torch.manual_seed(SEED)
    return Gemma4ForConditionalGeneration(tiny_config()).eval()


@cache
def base_checkpoint() -> Path:
    """Directory of the bf16 safetensors checkpoint of the tiny model."""
    import torch

    def build(out: Path) -> None:
        _new_base_model().to(torch.bfloat16).save_pretrained(out, safe_serialization=True)

    return _build_once(_cache_dir() / "base", build)


def lora_config(name: str, **overrides):
    """The LoRA config of the adapter fixture `name`: its targets (fixtures/adapters.json), rank 4, alpha 8."""
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": adapter_spec(name)["target_modules"], **overrides})


@cache
def adapter_checkpoint(name: str) -> Path:
    """Directory of the LoRA adapter fixture `name` (see fixtures/adapters.json)."""
    import torch
    from peft import get_peft_model

    spec = adapter_spec(name)

    def build(out: Path) -> None:
        torch.manual_seed(SEED + 1)
        config = lora_config(spec.get("weights_from", name), init_lora_weights=False)
        model = get_peft_model(_new_base_model(), config)
        model.save_pretrained(out)
        if "weights_from" in spec:
            # The broad adapter's targets cannot be applied on releases with the clippable bug, so its
            # weights come from another adapter and only the config carries the broad targets.
            config_file = out / "adapter_config.json"
            saved = json.loads(config_file.read_text())
            saved["target_modules"] = spec["target_modules"]
            config_file.write_text(json.dumps(saved, indent=2))

    return _build_once(_cache_dir() / f"adapter-{name}", build)



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

    return _build_once(_cache_dir("gemma4-text-realistic", (REALISTIC_FIXTURE,)), build)
