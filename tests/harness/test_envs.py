"""Per-set environments: the torch they get, and distinct folders for distinct sets."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stackcheck.runner import envs
from stackcheck.core.versions import default_set, resolve


HAS_PIP = importlib.util.find_spec("pip") is not None


@pytest.mark.skipif(HAS_PIP, reason="the running interpreter has pip, so its torch is inherited")
def test_without_pip_the_local_torch_wheel_is_used():
    if not [wheel for folder in envs.LOCAL_WHEEL_DIRS for wheel in Path(folder).glob("torch-*.whl")]:
        pytest.skip("no local torch wheel here (STACKCHECK_WHEEL_DIRS)")
    requirements, inherit = envs.torch_source(default_set())
    assert not inherit
    assert requirements and requirements[0].startswith("torch @ file:")


@pytest.mark.skipif(not HAS_PIP, reason="inheriting needs the running interpreter's pip")
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


def test_the_hosts_site_packages_run_their_pth_files_in_the_inheriting_env(tmp_path, monkeypatch):
    """A `.pth` in the host's site-packages runs in an env that inherits them, as in the host's own interpreter:
    setuptools' distutils shim is one (torch's environment has it; deepspeed < 0.19.8 imports distutils at module
    level), and a bare path line had every such deepspeed release read "unusable" on a GPU host alone."""
    host = tmp_path / "host" / "site-packages"
    host.mkdir(parents=True)
    (host / "shim_probe.pth").write_text("import os; os.environ['STACKCHECK_SHIM_RAN'] = '1'\n")
    (host / "hostonly.py").write_text("VALUE = 7\n")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True)
    python = tmp_path / "env" / "bin" / "python"
    monkeypatch.setattr(envs.sys, "path", [str(host)])

    envs.inherit_host_site_packages(python)

    seen = subprocess.run([str(python), "-c", "import os, hostonly; print(hostonly.VALUE, os.environ.get('STACKCHECK_SHIM_RAN'))"],
                          capture_output=True, text=True, check=True)
    assert seen.stdout.split() == ["7", "1"]


def test_long_set_names_keep_distinct_env_folders():
    clone = "/tmp/" + "a-long-path-to-a-local-clone/" * 3 + "accelerate"
    first, second = (
        resolve(["seed"], [f"accelerate@git+file://{clone}@{sha * 40}"])[0] for sha in ("1", "2")
    )
    assert first.slug != second.slug
    assert len(first.slug) <= 100


def test_a_wheelhouse_manifest_gives_the_exact_wheels_of_a_set_it_holds_whole(tmp_path):
    import json

    (vset,) = resolve(["seed"])
    (tmp_path / envs.WHEELHOUSE_MANIFEST).write_text(json.dumps({"sets": {"seed": {"wheels": ["a.whl", "b.whl"]}}}))
    (tmp_path / "a.whl").write_bytes(b"")
    assert envs.resolved_wheels(vset, [str(tmp_path)]) is None  # b.whl has not arrived: pip resolves instead
    (tmp_path / "b.whl").write_bytes(b"")
    assert envs.resolved_wheels(vset, [str(tmp_path)]) == [tmp_path / "a.whl", tmp_path / "b.whl"]
    assert envs.resolved_wheels(resolve(["latest"])[0], [str(tmp_path)]) is None


def test_without_any_torch_the_package_index_chooses_and_the_note_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(envs, "LOCAL_WHEEL_DIRS", [str(tmp_path)])
    monkeypatch.setattr(envs.importlib.util, "find_spec", lambda name: None)
    requirements, inherit = envs.torch_source(default_set())
    assert requirements == ["torch"] and not inherit
    note = envs.torch_note(default_set())
    assert note.startswith("torch for set seed: the package index's newest") and "UV_TORCH_BACKEND=cpu" in note


def test_a_library_that_does_not_import_makes_the_set_unusable_in_one_line(tmp_path, monkeypatch):
    """deepspeed 0.19.2 on Python 3.12 raises `No module named 'distutils'` at import: a library of the set that does
    not import in its environment is named, with its version, its Python and why (a stand-in package raises the
    same error first on the path, as a deliberately broken environment)."""
    broken = tmp_path / "site" / "deepspeed"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'distutils'\")\n")
    python = Path(sys.executable)
    assert envs._import_problem(python) is None, "scenario not reached: this environment's libraries must import"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    problem = envs._import_problem(python)
    assert problem is not None and problem.startswith("deepspeed ") and problem.endswith(
        f"does not import on Python {sys.version_info.major}.{sys.version_info.minor} (ModuleNotFoundError: No module named 'distutils')"), problem
