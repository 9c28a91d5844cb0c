"""Per-set environments: the torch they get, and distinct folders for distinct sets."""

import subprocess
import sys

import torch

from stackcheck import envs
from stackcheck.versions import default_set, resolve


def test_a_torch_in_the_running_venv_is_inherited_through_a_pth(tmp_path):
    """The GPU machine's CUDA torch lives in a venv, which `venv --system-site-packages` would not reach: the
    new env must import the running interpreter's torch, from the running interpreter's site-packages."""
    requirements, inherit = envs.torch_source(default_set())
    assert inherit and requirements == []
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True)
    python = tmp_path / "env" / "bin" / "python"

    envs.inherit_host_site_packages(python)

    seen = subprocess.run([str(python), "-c", "import torch; print(torch.__file__)"], capture_output=True, text=True, check=True)
    assert seen.stdout.strip() == torch.__file__


def test_long_set_names_keep_distinct_env_folders():
    clone = "/tmp/" + "a-long-path-to-a-local-clone/" * 3 + "accelerate"
    first, second = (
        resolve(["seed"], [f"accelerate@git+file://{clone}@{sha * 40}"])[0] for sha in ("1", "2")
    )
    assert first.slug != second.slug
    assert len(first.slug) <= 100
