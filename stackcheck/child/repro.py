"""pytest plugin for `repro` (stackcheck.commands.triage.repro): its collecting child names one test and
STACKCHECK_REPRO_PARAMS a file, and this writes the test's parameters and fixtures there; without it, nothing."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from pathlib import Path

from stackcheck.core.protocol import REPRO_PARAMS_ENV

PARAMS_ENV = REPRO_PARAMS_ENV


def pytest_collection_finish(session) -> None:
    """As a pytest plugin: write the collected test's parameters (as Python literals) and fixtures."""
    target = os.environ.get(PARAMS_ENV)
    if not target or len(session.items) != 1:
        return
    (item,) = session.items
    # The lane and the architecture become the script's DEVICE and ARCH (repro_script.FIXTURE_VALUES).
    params = {name: repr(value) for name, value in item.callspec.params.items() if name not in ("lane", "arch")} if hasattr(item, "callspec") else {}
    arch = item.callspec.params.get("arch") if hasattr(item, "callspec") else None
    fixtures = [name for name in inspect.signature(item.function).parameters if name not in params]
    Path(target).write_text(json.dumps({"params": params, "fixtures": fixtures,
                                        "arch": dataclasses.asdict(arch) if arch else None}, default=sorted))
