"""The one switch and the one key of the warm processes: the rank pools (stackcheck.distributed.pool) and the warm
resume process (stackcheck.process.resume) both start once and serve many cells.

The switch is STACKCHECK_RANK_POOL (1 on, 0 off; the matrix commands turn it on, plain pytest and CI keep it off).
A warm process is keyed by what its environment gives that lasts from cell to cell (`lasting_environment`).
What it cuts and what it still misses: docs/speed.md, "A warm rank pool".
"""

from __future__ import annotations

import os

from stackcheck.core.protocol import RANK_POOL_ENV

POOL_ENV = RANK_POOL_ENV
# Variables that change from test to test without changing the job: pytest's, and those torch sets in the caller
# (to the defaults each rank's torch sets itself) once a test there builds a model (a tiny checkpoint: measured, a new
# pool for every architecture's first cell without this).
VOLATILE_ENV = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK")


class SettingError(ValueError):
    """STACKCHECK_RANK_POOL is neither 0 nor 1 (nor unset): a user error, one line."""


def setting(default: bool = False) -> bool:
    """Whether STACKCHECK_RANK_POOL asks for warm processes: 1 yes, 0 no, unset or empty `default`; another value
    raises SettingError."""
    value = os.environ.get(POOL_ENV, "")
    if value not in ("", "0", "1"):
        raise SettingError(f"{POOL_ENV}={value!r}: 1 runs the two-rank cells on warm rank pools and trainer_resume's "
                           "resumes on a warm process, 0 starts a new process for each")
    return default if value == "" else value == "1"


def enabled() -> bool:
    """`setting()` in a pytest process (off unless 1; the matrix commands pass 1 or 0): another value is pytest's usage
    error."""
    try:
        return setting()
    except SettingError as exc:
        import pytest

        raise pytest.UsageError(str(exc)) from None


def lasting_environment(env: dict) -> tuple:
    """`env` without the variables that change from test to test (VOLATILE_ENV): the part of a warm process's key
    (a pool's, the warm resume process's) that its environment gives."""
    return tuple(sorted((name, value) for name, value in env.items() if name not in VOLATILE_ENV))
