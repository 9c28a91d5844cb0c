"""Offline installs: every wheel the named sets need on a target Python and platform, in one folder.

`gpu-matrix --find-links DIR --no-index` then installs from that folder on an air-gapped host: torch is the target's
own, what the target already has (`--host-freeze`) is left out, bitsandbytes keeps one CUDA binary (`--cuda`), and
a sweep's releases (`--sweep`) come in batches that each fit one transfer (`--batch-mib`). uv resolves for the
target; pip downloads. How each works: docs/internals.md, "runner/wheelhouse.py"; offline hosts: docs/running.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import NotRequired, TypedDict

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from stackcheck.runner.envs import BENCH_GROUPS, EnvBuildError, test_requirements
from stackcheck.runner.envs import WHEELHOUSE_MANIFEST as MANIFEST
from stackcheck.core.versions import UsageError, VersionSet

UV_PLATFORM = "x86_64-manylinux_2_28"  # the GPU hosts' glibc; uv's name for the wheel tags pip gets from MANYLINUX_X86_64
MANYLINUX_X86_64 = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
PROVIDED_BY_TARGET = {"torch"}  # the platform: the target's own (CUDA) build, never downloaded


class SetWheels(TypedDict):
    """A set's entry in the manifest: its wheels' file names, and their size."""

    wheels: list[str]
    mib: float


class Batch(TypedDict):
    """One transfer (`--batch-mib`): its folder, size and wheels, and the sets it completes."""

    folder: str
    mib: float
    wheels: list[str]
    completes: list[str]


class Manifest(TypedDict):
    """The wheelhouse's MANIFEST (JSON), as `build` writes it."""

    python_version: str
    platforms: list[str]
    cuda: str | None
    host_freeze: str | None
    sets: dict[str, SetWheels]
    mib: NotRequired[float]  # the whole folder's, once every set is in
    batches: NotRequired[list[Batch]]  # with --batch-mib only


def read_freeze(path: Path) -> dict[str, Version]:
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not text: expected the target's `pip list --format=freeze`") from None
    versions: dict[str, Version] = {}
    for number, line in enumerate(text.splitlines(), 1):
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
        if match:
            try:
                versions[canonicalize_name(match.group(1))] = Version(match.group(2))
            except InvalidVersion:
                raise UsageError(f"{path}, line {number}: '{line.strip()}': '{match.group(2)}' is not a valid version") from None
    return versions


def require_uv() -> None:
    if not shutil.which("uv"):
        raise UsageError("the wheelhouse needs uv on PATH (its resolver picks the target's versions): pip install uv")


def keep_one_cuda_binary(wheel: Path, cuda: str) -> list[str]:
    """Rewrite a bitsandbytes wheel without the GPU binaries other than CUDA `cuda` (and RECORD's lines for
    them); return the dropped names. The version stays the same, so pins still match."""
    kept_binary = f"libbitsandbytes_cuda{cuda}.so"
    with zipfile.ZipFile(wheel) as source:
        names = source.namelist()
        dropped = [n for n in names if re.search(r"libbitsandbytes_(cuda|rocm|xpu)[^/]*\.(so|dll|dylib)$", n) and not n.endswith(kept_binary)]
        if not any(n.endswith(kept_binary) for n in names):
            raise UsageError(f"{wheel.name} has no {kept_binary}; its CUDA binaries: {', '.join(dropped) or 'none'}")
        stripped = wheel.with_suffix(".stripping")
        with zipfile.ZipFile(stripped, "w", zipfile.ZIP_DEFLATED) as target:
            for info in source.infolist():
                if info.filename in dropped:
                    continue
                data = source.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = "".join(
                        line for line in data.decode().splitlines(keepends=True) if line.split(",", 1)[0] not in dropped
                    ).encode()
                target.writestr(info, data)
    stripped.replace(wheel)
    return dropped


class Downloader:
    """`pip download --no-deps` of one requirement for the target's tags, into the wheelhouse."""

    def __init__(self, dest: Path, python_version: str, platforms: list[str]):
        self.dest = dest
        self.tag_args = ["--python-version", python_version, "--implementation", "cp"]
        self.tag_args += [arg for platform in platforms for arg in ("--platform", platform)]

    def __call__(self, name: str, specifier: SpecifierSet) -> Path:
        with tempfile.TemporaryDirectory() as scratch:
            print(f"  downloading {name}{specifier}", flush=True)  # pip says nothing while it downloads
            command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                       "--only-binary=:all:", *self.tag_args, "-d", scratch, f"{name}{specifier}"]
            completed = subprocess.run(command, capture_output=True, text=True)
            if completed.returncode != 0:
                detail = completed.stderr.strip().splitlines()[-1] if completed.stderr.strip() else ""
                wheel = pure_wheel_from_sdist(name, specifier, Path(scratch))
                if wheel is None:
                    raise EnvBuildError(f"no wheel of {name}{specifier} for the target: {detail}")
            else:
                (wheel,) = Path(scratch).glob("*.whl")
            target = self.dest / wheel.name
            if not target.exists():
                shutil.move(wheel, target)
            return target


def pure_wheel_from_sdist(name: str, specifier: SpecifierSet, scratch: Path) -> Path | None:
    """A release published as an sdist only (deepspeed) built here into a wheel, when that wheel is pure Python and
    so installs on any target; None otherwise (the target would have to build it)."""
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--no-binary", name, "-w", str(scratch), f"{name}{specifier}"]
    if subprocess.run(command, capture_output=True, text=True).returncode != 0:
        return None
    (wheel,) = scratch.glob("*.whl")
    tags = parse_wheel_filename(wheel.name)[3]
    return wheel if all(tag.abi == "none" and tag.platform == "any" for tag in tags) else None


def compile_pins(requirements: list[str], python_version: str, host: dict[str, Version], index_args=()) -> dict[str, Version]:
    """uv's resolution of `requirements` for the target. torch is a constraint at the target's version; the
    target's other packages are preferences: uv prefers the versions of an existing output file."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        (folder / "requirements.in").write_text("".join(f"{r}\n" for r in requirements))
        (folder / "constraints.txt").write_text("".join(f"{n}=={host[n]}\n" for n in sorted(PROVIDED_BY_TARGET) if n in host))
        (folder / "pins.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(host.items())))
        command = ["uv", "pip", "compile", "requirements.in", "--output-file", "pins.txt", "--constraint", "constraints.txt",
                   "--python-version", python_version, "--python-platform", UV_PLATFORM, "--no-header", "--no-annotate",
                   "--quiet", "--no-python-downloads", *index_args]
        completed = subprocess.run(command, cwd=folder, capture_output=True, text=True)
        if completed.returncode != 0:
            detail = " ".join(completed.stderr.split())[-400:]
            raise EnvBuildError(f"uv cannot resolve the requirements for the target: {detail}")
        return read_freeze(folder / "pins.txt")


def wheels_for_set(vset: VersionSet, download, python_version: str, host: dict[str, Version], cuda: str | None,
                   index_args=()) -> list[Path]:
    """The wheels the target lacks for the set's pins, the extras every family environment installs (FAMILY_EXTRAS)
    and the bench's (BENCH_GROUPS), in the versions uv resolves for it."""
    if any(pin.url for pin in vset.pins.values()):
        raise UsageError(f"set '{vset.name}': the wheelhouse takes released versions only; pin a built wheel with NAME=PATH and copy it in")
    print(f"== wheelhouse: set {vset.name}: resolving its requirements for Python {python_version} (uv)", flush=True)
    pins = compile_pins(vset.requirements() + test_requirements(vset, BENCH_GROUPS), python_version, host, index_args)
    wheels = [download(name, SpecifierSet(f"=={version}")) for name, version in pins.items()
              if name not in PROVIDED_BY_TARGET and host.get(name) != version]
    if cuda:
        for wheel in wheels:
            if canonicalize_name(parse_wheel_filename(wheel.name)[0]) == "bitsandbytes":
                with zipfile.ZipFile(wheel) as archive:
                    bundled = [n for n in archive.namelist() if "libbitsandbytes_cuda" in n]
                if len(bundled) > 1:
                    keep_one_cuda_binary(wheel, cuda)
    return sorted(wheels)


def batches(sets: Mapping[str, SetWheels], sizes: dict[str, int], limit: int) -> list[dict]:
    """Split the sets' wheels into transfers of at most `limit` bytes, in set order, each set's new wheels
    together; each batch lists the wheels it carries and the sets it completes."""
    shipped: set[str] = set()
    found: list[dict] = []
    for name, entry in sets.items():
        new = [w for w in entry["wheels"] if w not in shipped]
        size = sum(sizes[w] for w in new)
        if size > limit:
            raise UsageError(f"set '{name}' needs {size / 2**20:.1f} MiB of new wheels, more than one {limit / 2**20:.0f} MiB batch")
        if not found or found[-1]["bytes"] + size > limit:
            found.append({"wheels": [], "bytes": 0, "completes": []})
        found[-1]["wheels"] += new
        found[-1]["bytes"] += size
        found[-1]["completes"].append(name)
        shipped.update(new)
    return found


def build(sets: list[VersionSet], dest: Path, python_version: str, platforms: list[str], cuda: str | None,
          host_freeze: Path | None, batch_mib: int | None = None) -> Manifest:
    """Fill `dest` for every set; write and return the manifest (wheels and their size per set)."""
    if host_freeze and not host_freeze.is_file():
        raise UsageError(f"no such host freeze file: {host_freeze}")
    host = read_freeze(host_freeze) if host_freeze else {}
    dest.mkdir(parents=True, exist_ok=True)
    download = Downloader(dest, python_version, platforms)
    manifest: Manifest = {"python_version": python_version, "platforms": platforms, "cuda": cuda,
                          "host_freeze": str(host_freeze) if host_freeze else None, "sets": {}}
    for vset in sets:
        wheels = wheels_for_set(vset, download, python_version, host, cuda)
        manifest["sets"][vset.name] = {
            "wheels": [w.name for w in wheels],
            "mib": round(sum(w.stat().st_size for w in wheels) / 2**20, 1),
        }
    manifest["mib"] = round(sum(w.stat().st_size for w in dest.glob("*.whl")) / 2**20, 1)
    if batch_mib:
        sizes = {w.name: w.stat().st_size for w in dest.glob("*.whl")}
        manifest["batches"] = []
        for number, batch in enumerate(batches(manifest["sets"], sizes, batch_mib * 2**20), 1):
            folder = dest / f"batch-{number:02d}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            for wheel in batch["wheels"]:
                os.link(dest / wheel, folder / wheel)
            manifest["batches"].append({"folder": folder.name, "mib": round(batch["bytes"] / 2**20, 1),
                                        "wheels": batch["wheels"], "completes": batch["completes"]})
    text = json.dumps(manifest, indent=2) + "\n"
    (dest / MANIFEST).write_text(text)
    for carried in manifest.get("batches", []):  # each batch carries the manifest: the folder they arrive in has it
        (dest / carried["folder"] / MANIFEST).write_text(text)
    return manifest
