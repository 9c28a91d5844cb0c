"""One virtual environment per version set: the pinned libraries over the platform's torch.

uv builds them where it is installed (it is, wherever nox came with `nox[uv]`); plain venv + pip is the
fallback for hosts without it. An environment that inherits the host's torch (a GPU machine's CUDA build)
is always built with venv + pip: the host's site-packages are appended through a `.pth` file, which pip
sees as installed packages and uv does not.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from stackcheck import REPO_ROOT
from stackcheck.process import cuda_driver
from stackcheck.core import protocol
from stackcheck.core.locking import folder_locked
from stackcheck.core.versions import PACKAGES, UsageError, VersionSet

ENVS_DIR = REPO_ROOT / ".stackcheck" / "envs"
# pip's find-links directory on this kind of machine holds the CPU torch wheel; uv does not look there.
LOCAL_WHEEL_DIRS = [d for d in os.environ.get(protocol.WHEEL_DIRS_ENV, "/opt/wheels").split(os.pathsep) if d]


# Where the set's processes keep the bytecode of what they import (PYTHONPYCACHEPREFIX): the pytest runs, their xdist
# workers, ranks and fresh processes. Where the environment says PYTHONDONTWRITEBYTECODE=1 (this project's machines
# and the GPU image do), Python reads .pyc files but never writes them, and every interpreter compiled torch,
# transformers and DeepSpeed from source again (the cost: docs/speed.md, session 15; the GPU image's torch has no .pyc
# at all). Here the first process compiles and writes, every later one reads; nothing is
# written beside anyone's sources. A prefix the user set is kept.
PYCACHE_DIR = REPO_ROOT / ".stackcheck" / "pycache"


def bytecode_cache(environ: dict[str, str]) -> dict[str, str]:
    """`environ` for a set's process: bytecode written and read under PYCACHE_DIR (or the user's own prefix)."""
    variables = {name: value for name, value in environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    variables.setdefault("PYTHONPYCACHEPREFIX", str(PYCACHE_DIR))
    return variables


class EnvBuildError(Exception):
    """The set's environment could not be built (a dependency conflict, a missing wheel)."""


# What `stackcheck wheelhouse` writes beside the wheels: per set, the wheels uv resolved for the target.
WHEELHOUSE_MANIFEST = "wheelhouse.json"

# What every environment holds beside the set's pins: the test runner, the distributed families' DeepSpeed, and trl
# (the trainers users run over the libraries).
FAMILY_EXTRAS = ("test", "dist", "trl")
# Groups the `tests` and `bench` environments add: the tests run the bench's CPU smoke mode.
BENCH_GROUPS = ("bench",)
# What the `tests` environment adds to those: the report's page and its browser tests (an offline host's wheelhouse
# does not carry them, so `tests --no-index` leaves them out and those tests skip there).
REPORT_GROUPS = ("report", "browser")


def test_requirements(vset: VersionSet, groups: tuple[str, ...] = ()) -> list[str]:
    """What an environment holds beside the set's pins and torch: pyproject's FAMILY_EXTRAS, plus the
    optional-dependency `groups` named, less the packages the set pins itself (its deepspeed or trl, say)."""
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return [requirement for group in (*FAMILY_EXTRAS, *groups) for requirement in extras[group]
            if canonicalize_name(Requirement(requirement).name) not in vset.pins]


# No torch here and no local wheel: the package index's, as pip would choose it.
INDEX_TORCH = "torch"


def torch_source(vset: VersionSet) -> tuple[list[str], bool]:
    """(requirements, inherit host site-packages). A set's own torch pin wins; otherwise the torch
    already present is used: the host's (a GPU machine's CUDA build), else a local wheel, else the package
    index's. Inheriting needs the host's pip too, which installs the pins over it; a uv-built environment (a
    set's own, running the harness tests) has none, and uv would not see the inherited torch and fetch another."""
    if "torch" in vset.pins:
        return [vset.pins["torch"].requirement()], False
    if all(importlib.util.find_spec(name) is not None for name in ("torch", "pip")):
        return [], True
    wheels = sorted(w for d in LOCAL_WHEEL_DIRS for w in glob.glob(os.path.join(d, "torch-*.whl")))
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = [w for w in wheels if f"-{tag}-" in w]
    return ([f"torch @ {Path(wheels[-1]).as_uri()}"] if wheels else [INDEX_TORCH]), False


def torch_note(vset: VersionSet) -> str:
    """The one line that says where the set's environment takes torch from."""
    torch_requirements, inherit = torch_source(vset)
    if inherit:
        return f"torch for set {vset.name}: the host's ({sys.executable})"
    if torch_requirements != [INDEX_TORCH]:
        return f"torch for set {vset.name}: {torch_requirements[0]}"
    return (f"torch for set {vset.name}: the package index's newest (no torch here, no wheel in STACKCHECK_WHEEL_DIRS); "
            "from PyPI that is a CUDA build of several GB: UV_TORCH_BACKEND=cpu takes the CPU build (docs/running.md)")


_HEADLINE = re.compile(r"^(?:×|error:|ERROR:)\s*", re.IGNORECASE)
_CAUSE = re.compile(r"^(?:[├╰]─▶|cause:|caused by:)\s*", re.IGNORECASE)
REASON_CHARS = 400


_OTHER = re.compile(r"^(?:fatal:|hint:|help:|warning:|---)", re.IGNORECASE)


def failure_reason(output: str) -> str:
    """The one line that says why an installer failed, from its output: uv's headline with its innermost cause
    (git's own `fatal:` line where a git pin failed), or pip's last ERROR line. A message the installer wrapped
    over several lines is one again."""
    lines: list[str] = []  # one entry per message: a line that starts none continues the one before
    for line in (line.strip() for line in output.splitlines()):
        if not line:
            continue
        if lines and not (_HEADLINE.match(line) or _CAUSE.match(line) or _OTHER.match(line)):
            lines[-1] += " " + line
        else:
            lines.append(line)
    headlines = [_HEADLINE.sub("", line) for line in lines if _HEADLINE.match(line)]
    innermost = ([line for line in lines if line.startswith("fatal:")] or [_CAUSE.sub("", line) for line in lines if _CAUSE.match(line)])[-1:]
    if headlines and innermost:
        reason = f"{headlines[0].rstrip(':')}: {innermost[0]}"
    else:
        reason = (headlines or lines or ["no output"])[-1]
    return reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 3] + "..."


# The lines of pip's output that say what it is doing, shown as they come: pip resolves and downloads for a minute or
# more where uv takes seconds, and its --quiet said nothing all that time.
PIP_PROGRESS = re.compile(r"^\s*(Collecting|Downloading|Building wheel|Installing collected packages|Successfully installed)")


def _pip_progress(command: list[str]) -> subprocess.CompletedProcess:
    """pip's step with its progress lines (PIP_PROGRESS) printed as they come, each cut to one screen line."""
    with tempfile.TemporaryFile("w+", errors="replace") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, errors="replace")
        assert process.stdout is not None, "stdout is a pipe"
        for line in process.stdout:
            if PIP_PROGRESS.match(line):
                print("  pip:", line.strip()[:110], flush=True)
        process.wait()
        errors.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, None, errors.read())


def _run(command: list[str], log: Path | None = None, quiet: bool = False) -> None:
    """Run an installer step; its error output is kept (in `log`) and, when it fails, its reason is the error's.
    `quiet`: a check, whose command and output say nothing unless it fails. A `pip install` step shows its progress."""
    if not quiet:
        print("+", " ".join(command), flush=True)
    if not quiet and command[1:4] == ["-m", "pip", "install"]:
        completed = _pip_progress([arg for arg in command if arg != "--quiet"] + ["--progress-bar", "off"])
    else:
        completed = subprocess.run(command, stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.PIPE, text=True,
                                   errors="replace")
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(completed.stderr)
    if completed.returncode != 0:
        where = f" (its whole output: {log})" if log is not None else ""
        raise EnvBuildError(f"{' '.join(Path(command[0]).name.split() + command[1:3])}: {failure_reason(completed.stderr)}{where}")
    if completed.stderr.strip() and not quiet:
        print(completed.stderr.rstrip(), file=sys.stderr, flush=True)  # warnings of a step that worked


def check_available(requirements: list[str], find_links: Sequence[str] = (), no_index: bool = False) -> None:
    """Each requirement can be installed from the package index (or the --find-links folders) on this Python: asks
    the index (uv pip compile --no-deps, else pip install --dry-run --no-deps), builds nothing. EnvBuildError with the
    installer's reason otherwise."""
    index_args = [arg for link in find_links for arg in ("--find-links", link)] + (["--no-index"] if no_index else [])
    uv = shutil.which("uv")
    with tempfile.TemporaryDirectory(prefix="stackcheck-pins-") as scratch:
        listed = Path(scratch) / "requirements.txt"
        listed.write_text("\n".join(requirements) + "\n")
        if uv:
            python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
            _run([uv, "pip", "compile", "--quiet", "--no-deps", "--no-header", "--python-version", python_version,
                  *index_args, str(listed)], quiet=True)
        else:
            _run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps", "--ignore-installed",
                  "--disable-pip-version-check", *index_args, "-r", str(listed)], quiet=True)


def environment_requirements(vset: VersionSet, groups: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    """(what the set's environment installs, whether it inherits the host's torch)."""
    torch_requirements, inherit = torch_source(vset)
    return torch_requirements + vset.requirements() + test_requirements(vset, groups), inherit


def build(vset: VersionSet, find_links: Sequence[str] = (), no_index: bool = False, groups: tuple[str, ...] = ()) -> Path:
    """Create (or reuse, when its requirements are unchanged) the set's environment; return its python.
    `groups` are optional-dependency groups added to the test requirements (BENCH_GROUPS); each
    combination gets its own environment, so commands that need different groups never rebuild each other's."""
    requirements, inherit = environment_requirements(vset, groups)
    print(f"== {torch_note(vset)}", flush=True)
    # Two processes asking for one environment (xdist workers running the harness's real-set tests, two commands at
    # once): the second waits for the first's build and reuses it, never removes it half built.
    with folder_locked(ENVS_DIR):
        return _build(vset, find_links, no_index, groups, requirements, inherit)


def _build(vset: VersionSet, find_links: Sequence[str], no_index: bool, groups: tuple[str, ...], requirements: list[str], inherit: bool) -> Path:
    env = ENVS_DIR / "+".join([vset.slug, *groups])
    python = env / "bin" / "python"
    stamp = env / "stackcheck-requirements.txt"
    wanted = "\n".join(requirements + [f"inherit={inherit}", *find_links, f"no_index={no_index}"]) + "\n"
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    shutil.rmtree(env, ignore_errors=True)
    log = env.with_name(env.name + ".install.log")  # the installer's output, named in an EnvBuildError
    index_args = [arg for link in find_links for arg in ("--find-links", link)] + (["--no-index"] if no_index else [])
    uv = shutil.which("uv")
    resolved = resolved_wheels(vset, find_links) if inherit and no_index and uv else None
    if resolved:
        assert uv, "resolved_wheels is asked only where uv is"
        # The wheelhouse resolved this set for this host (its torch, its other packages): install exactly
        # those wheels, uv's seconds instead of pip resolving again over the inherited packages (docs/history-runs.md).
        _run([sys.executable, "-m", "venv", "--without-pip", str(env)])
        inherit_host_site_packages(python)
        _run([uv, "pip", "install", "--quiet", "--no-deps", "--offline", "--python", str(python), *map(str, resolved)], log=log)
    elif inherit:
        _run([sys.executable, "-m", "venv", "--without-pip", str(env)])
        inherit_host_site_packages(python)
        _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *index_args, *requirements], log=log)
    elif uv:
        _run([uv, "venv", "--quiet", "--python", sys.executable, str(env)])
        _run([uv, "pip", "install", "--quiet", "--python", str(python), *index_args, *requirements], log=log)
    else:
        _run([sys.executable, "-m", "venv", str(env)])
        _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *index_args, *requirements], log=log)
    stamp.write_text(wanted)
    return python


def resolved_wheels(vset: VersionSet, find_links: Sequence[str]) -> list[Path] | None:
    """The set's wheels as a wheelhouse in `find_links` resolved them (its manifest), when one holds them all."""
    for folder in map(Path, find_links):
        manifest = folder / WHEELHOUSE_MANIFEST
        if manifest.is_file():
            entry = json.loads(manifest.read_text())["sets"].get(vset.name)
            wheels = [folder / name for name in entry["wheels"]] if entry else []
            if entry and all(wheel.is_file() for wheel in wheels):
                return wheels
    return None


def inherit_host_site_packages(python: Path) -> None:
    """Append the host's site-packages to the env's path. `venv --system-site-packages` would reach only the
    base interpreter's, and the GPU machine's torch lives in a venv. Entries of a `.pth` come after the env's
    own site-packages, so the set's pins shadow the host's copies; pip runs from the host's copy too."""
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    # sys.path, not site.getsitepackages(): when the running interpreter is itself such an environment (the
    # harness tests on a GPU host), the host's site-packages reach it through its own .pth, which a .pth
    # listing only its site-packages would not follow.
    host = [path for path in sys.path if os.path.isdir(path) and Path(path).name in ("site-packages", "dist-packages")]
    # Each as a site directory (`site.addsitedir`), so that its own .pth files run as they do in the host's
    # interpreter: setuptools' distutils shim among them, which torch's environment has (torch requires setuptools)
    # and deepspeed < 0.19.8 imports at module level; a plain path line left every deepspeed release before it
    # "unusable" on a GPU host alone.
    Path(purelib, "_stackcheck_host.pth").write_text("".join(f"import site; site.addsitedir({path!r})\n" for path in host))


def cuda_device() -> str:
    """The name of GPU 0 as the host's torch, which every set's environment inherits, sees it: read from the CUDA
    driver, which torch counts and names its devices by (stackcheck.process.cuda_driver), without importing torch."""
    if importlib.util.find_spec("torch") is None:
        raise UsageError(f"no GPU: the Python running stackcheck ({sys.executable}) has no torch to share with the set environments")
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:  # a torch built from source without its metadata
        torch_version = "(version unknown)"
    if torch_version.endswith("+cpu"):
        raise UsageError(f"no GPU: torch {torch_version} on this host is built for the CPU alone")
    names = cuda_driver.device_names()
    if not names:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise UsageError(f"no GPU: torch {torch_version} on this host sees no CUDA device"
                         + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""))
    return names[0]


def versions_in(python: Path, vset: VersionSet) -> str:
    """The versions the environment really has, printed first by every session. An environment that cannot
    report them (its torch does not import) is as unusable as one that was not built: EnvBuildError."""
    code = "from stackcheck.core.versions import installed_versions as v; print(', '.join(f'{k} {x}' for k, x in v().items()))"
    completed = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    if completed.returncode != 0:
        why = (completed.stderr.strip().splitlines() or [f"exit code {completed.returncode}"])[-1]
        raise EnvBuildError(f"the environment of set {vset.name} ({python}) cannot report its versions: {why}")
    return completed.stdout.strip()


# Each library of a set imported in its environment, alone, before any cell runs (stackcheck.runner.lane.build_all):
# the script prints, per package, "ok" or the exception's type and first line.
IMPORT_CHECK = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        found[name] = "ok"
    except BaseException as exc:  # an import may raise anything, SystemExit included
        found[name] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
print(json.dumps(found))
"""


def import_problem(python: Path) -> str | None:
    """Why the set cannot run in the environment at `python` (a library that does not import there), in one line;
    None when every library of PACKAGES that is installed imports. Kept beside the environment's requirements stamp,
    so an environment built once is checked once."""
    env = python.parent.parent
    stamp, kept = env / "stackcheck-requirements.txt", env / "stackcheck-imports.json"
    key = stamp.read_text() if stamp.is_file() else None
    if key is not None and kept.is_file():
        cached = json.loads(kept.read_text())
        if cached.get("stamp") == key:
            return cached["problem"]
    problem = _import_problem(python)
    if key is not None:
        kept.write_text(json.dumps({"stamp": key, "problem": problem}))
    return problem


def _import_problem(python: Path) -> str | None:
    completed = subprocess.run([str(python), "-c", IMPORT_CHECK, *PACKAGES], capture_output=True, text=True, cwd=REPO_ROOT,
                               env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        found = json.loads(completed.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        why = (completed.stderr.strip().splitlines() or [f"exit code {completed.returncode}"])[-1]
        return f"its Python cannot import the libraries ({why})"
    broken = {name: why for name, why in found.items() if why != "ok" and not why.startswith("ModuleNotFoundError: No module named '" + name + "'")}
    if not broken:
        return None
    name, why = next(iter(broken.items()))
    version = _installed_version(python, name)
    where = f"Python {_python_version(python)}"
    return f"{name} {version} does not import on {where} ({why})"


def _installed_version(python: Path, package: str) -> str:
    code = f"from importlib import metadata; print(metadata.version({package!r}))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return done.stdout.strip() or "(version unknown)"


def _python_version(python: Path) -> str:
    done = subprocess.run([str(python), "-c", "import platform; print(platform.python_version())"], capture_output=True, text=True)
    return ".".join(done.stdout.strip().split(".")[:2]) or "?"
