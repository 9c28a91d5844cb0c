"""Shared fixtures. The stackcheck plugins (verdicts, recording, the garbage collection between tests) are loaded from
pyproject's addopts."""

import os

# No network at run time: any hub access must fail, not download. Set before any HF import.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402


@pytest.fixture
def offload_dir(tmp_path):
    return tmp_path / "offload"


@pytest.fixture
def prompt(device):
    from stackcheck.harness import scenario

    return scenario.prompt(device)
