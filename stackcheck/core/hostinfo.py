"""The facts of the machine a set ran on that can change a verdict, recorded with every set's results:
the CPU and the instruction-set extensions that choose a library's code path, what bitsandbytes and torch
chose from them, the GPU with its driver and CUDA, and the OS."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# Extensions that send torch or bitsandbytes down another CPU code path (avx512_bf16: bitsandbytes' packed
# 4-bit weights; avx512f / avx2: torch's kernel dispatch).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def _cpuinfo() -> tuple[str, set[str]]:
    """(model, flags) of the first CPU in /proc/cpuinfo; elsewhere what `platform` knows, and no flags."""
    fields: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if not line.strip():
            break  # the end of the first CPU's block
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields.get("model name") or platform.processor() or platform.machine(), set(fields.get("flags", "").split())


def bnb_has_packed_cpu_path() -> bool:
    """Whether this bitsandbytes has the packed AVX512-BF16 CPU path for 4-bit layers (0.49.0 on)."""
    import bitsandbytes.functional

    return hasattr(bitsandbytes.functional, "_convert_weight_packed_for_cpu")


def _bnb_cpu_packed_path() -> str:
    try:
        import bitsandbytes.functional
    except Exception as exc:  # any import failure: the fact is then "unknown", the run goes on
        return f"unknown (bitsandbytes does not import: {type(exc).__name__})"
    if not bnb_has_packed_cpu_path():
        return "absent in this bitsandbytes"
    return "taken" if bitsandbytes.functional.has_avx512bf16() else "not taken (bitsandbytes reports no avx512_bf16)"


# Beside a stackcheck environment (<repo>/.stackcheck/<folder>/<env>, which never changes once built): the packed-path
# fact of each (bitsandbytes release, CPU) it ran on, so that a process that never loads a 4-bit model (a harness
# test's pytest run, an xdist controller) need not import bitsandbytes for it (seconds of CPU: docs/speed.md,
# "Numbers behind constants").
PACKED_PATH_FILE = "stackcheck-bnb-cpu-packed-path.json"


def bnb_cpu_packed_path() -> str:
    """Whether bitsandbytes' CPU build would repack 4-bit weights for its AVX512-BF16 kernel here."""
    prefix = Path(sys.prefix)
    cache = prefix / PACKED_PATH_FILE if prefix.parent.parent.name == ".stackcheck" else None
    try:
        key = json.dumps([metadata.version("bitsandbytes"), *_cpuinfo()[0:1], sorted(_cpuinfo()[1])])
    except metadata.PackageNotFoundError:
        key = None
    try:
        known = json.loads(cache.read_text()) if cache and key else {}
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    fact = _bnb_cpu_packed_path()
    if cache and key and not fact.startswith("unknown"):
        try:
            partial = cache.with_name(f"{cache.name}.{os.getpid()}")
            partial.write_text(json.dumps(dict(known, **{key: fact})))
            os.replace(partial, cache)  # whole or not at all, whoever writes last
        except OSError:
            pass  # a read-only environment: the fact is asked again next time
    return fact


def _nvidia_driver() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # nvidia-ml-py missing or NVML not loadable: ask the command line tool instead
        if shutil.which("nvidia-smi"):
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        return "unknown"


def cpu_facts() -> dict[str, str]:
    """The OS and CPU facts, read without importing any library (`doctor` must answer instantly)."""
    model, flags = _cpuinfo()
    return {
        "os": platform.platform(),
        "cpu": model,
        "cpu_flags": " ".join(flag for flag in CPU_FLAGS if flag in flags) or "none of " + " ".join(CPU_FLAGS),
    }


def platform_facts() -> dict[str, str]:
    import torch

    facts = {
        **cpu_facts(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bnb_cpu_packed_path": bnb_cpu_packed_path(),
    }
    if torch.cuda.is_available():
        # The count is a fact of the GPU lane: PEFT's redispatch, for one, spreads a model over every visible GPU.
        count = torch.cuda.device_count()
        gpu = torch.cuda.get_device_name(0) if count == 1 else f"{count} x {torch.cuda.get_device_name(0)}"
        facts |= {"gpu": gpu, "gpu_driver": _nvidia_driver(), "cuda": str(torch.version.cuda)}
    else:
        facts["gpu"] = "none"
    return facts


def device_name(facts: dict[str, str]) -> str:
    return facts["gpu"] if facts["gpu"] != "none" else f"cpu ({platform.machine()})"
