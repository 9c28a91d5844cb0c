"""Issue 24's newcomer path, through the real commands: an old Python, an installed copy without the clone, the
bitsandbytes warning every run printed, and doctor's wording."""

import glob
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from test_wrong_inputs import refused, stackcheck

from stackcheck import REPO_ROOT


def old_python() -> str | None:
    """A Python older than 3.11 that runs: on PATH, or one of pyenv's (its shims answer for versions it does not select)."""
    pyenv = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip() if shutil.which("pyenv") else None
    candidates = [shutil.which("python3.10"), shutil.which("python3.9"), *sorted(glob.glob(f"{pyenv}/versions/3.[0-9].*/bin/python3") if pyenv else []),
                  *sorted(glob.glob(f"{pyenv}/versions/3.10.*/bin/python3") if pyenv else [])]
    return next((c for c in candidates if c and subprocess.run([c, "-c", "pass"], capture_output=True).returncode == 0), None)


def test_an_old_python_is_one_line():
    python = old_python()
    if python is None:
        pytest.skip("no Python older than 3.11 here")
    run = subprocess.run([python, "-m", "stackcheck", "versions"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and re.fullmatch(r"stackcheck: needs Python >= 3\.11; \S+ is 3\.\d+\.\d+\n", run.stderr), run


def test_an_installed_copy_without_the_clone(tmp_path):
    """`pip install .` puts the package (with its .toml data) in site-packages and no tests/: the commands that run
    the families say where to run them; doctor, which reads only the package, still answers."""
    site = tmp_path / "site-packages"
    shutil.copytree(REPO_ROOT / "stackcheck", site / "stackcheck", ignore=shutil.ignore_patterns("__pycache__"))
    env = {"PYTHONPATH": str(site)}
    assert refused("matrix", "--sets", "seed", cwd=tmp_path, env=env) == (
        f"stackcheck: matrix runs the family tests of a stackcheck clone, and {site} is none: run `python -m stackcheck` "
        "in the clone's root, or install the clone editable (pip install -e CLONE)")
    assert stackcheck("doctor", "--python", sys.executable, cwd=tmp_path, env=env).returncode in (0, 1)


def test_the_bitsandbytes_kernels_warning_is_silenced():
    # bitsandbytes warns at import on an avx512_bf16 CPU that the optional `kernels` package is missing.
    run = stackcheck("scan", str(REPO_ROOT / "fixtures" / "gemma4-e2b"))
    assert run.returncode in (0, 1) and "kernels-community" not in run.stderr, run.stderr


def test_doctor_says_what_its_brackets_are_and_heads_downgrades_as_downgrades():
    run = stackcheck("doctor", "--python", sys.executable)
    assert run.returncode in (0, 1), run
    if run.returncode == 1:
        assert "Each bug: its id [the families whose tests show it]: the versions it affects" in run.stdout
    groups = re.split(r"\n(?=\d+ known bugs affect this install, )", run.stdout)
    for group in groups[1:]:
        heading, *lines = group.split("\n")
        changes = [line.split()[0] for line in lines if line.startswith("    ") and not line.strip().startswith(("http", "meanwhile:"))]
        if heading.endswith("an upgrade leaves them:"):
            assert "upgrade" in changes
        elif heading.endswith("a downgrade leaves them:"):
            assert changes and set(changes) == {"downgrade"}, group
        else:
            assert heading.endswith("no release leaves them:") and not changes, group


def test_the_readmes_scan_example_runs_as_written():
    """The example's files are in the repository; its `--python` names the environment this harness runs in."""
    guide = (REPO_ROOT / "docs" / "running.md").read_text()  # the README's sample lives in the guide to running
    example = re.search(r"^    \$ python -m stackcheck (scan .*?)\n(?!          )", guide, re.M | re.S).group(1)
    argv = shlex.split(example.replace("\\\n", " "))
    argv[argv.index("--python") + 1] = sys.executable
    run = stackcheck(*argv)
    assert run.returncode == 1, run  # the seed map's key that names no module, and PEFT's rejected targets
    assert "LoRA target hits per module type: Gemma4ClippableLinear 148, Linear4bit 205" in run.stdout
    assert "'model.multi_modal_projector' names no module of Gemma4ForConditionalGeneration" in run.stdout
