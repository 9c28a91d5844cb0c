"""Per-set environments: the torch they get, and distinct folders for distinct sets."""

import sys

import pytest
import torch

from stackcheck import envs
from stackcheck.versions import default_set, resolve


def test_a_torch_only_in_the_running_venv_is_not_inherited():
    """--system-site-packages shows the base interpreter's packages: a torch installed only in the venv
    running the harness would be missing from a new env, and uv would fetch another torch."""
    if sys.prefix == sys.base_prefix or not torch.__file__.startswith(sys.prefix):
        pytest.skip("torch is not confined to a venv here")
    requirements, inherit = envs.torch_source(default_set())
    assert not inherit
    assert requirements and requirements[0].startswith("torch @ file:")


def test_long_set_names_keep_distinct_env_folders():
    clone = "/tmp/" + "a-long-path-to-a-local-clone/" * 3 + "accelerate"
    first, second = (
        resolve(["seed"], [f"accelerate@git+file://{clone}@{sha * 40}"])[0] for sha in ("1", "2")
    )
    assert first.slug != second.slug
    assert len(first.slug) <= 100
