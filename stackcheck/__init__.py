"""stackcheck: conformance and regression suite for the Hugging Face QLoRA stack."""

import importlib.util
import logging
import platform
import sys
from pathlib import Path

if sys.version_info < (3, 11):  # noqa: UP036 - pyproject's requires-python: tomllib. Before any import fails with a traceback.
    print(f"stackcheck: needs Python >= 3.11; {sys.executable} is {platform.python_version()}", file=sys.stderr)
    raise SystemExit(2)

if importlib.util.find_spec("packaging") is None:  # pyproject's one dependency, which every command imports
    print(f"stackcheck: needs the `packaging` package, which this Python ({sys.executable}) lacks: pip install packaging "
          "(where pip refuses to install outside a virtual environment: python3 -m venv .venv && .venv/bin/pip install packaging)",
          file=sys.stderr)
    raise SystemExit(2)

REPO_ROOT = Path(__file__).resolve().parents[1]

# bitsandbytes (0.49 on, on an avx512_bf16 CPU) tries at import to fetch an optional CPU kernel from the Hub through
# the `kernels` package, and warns when it cannot. stackcheck runs offline on bitsandbytes' own kernels, so the
# warning is expected and says nothing about the run (docs/running.md, "Where torch comes from").
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward from kernels-community"))
