"""Offline installs: every wheel the named sets need on a target Python and platform, in one folder.

`gpu-matrix --find-links DIR --no-index` then installs from that folder on an air-gapped host. torch is the
target's own CUDA build, so neither it nor its dependencies are downloaded. With `--host-freeze` (the
target's `pip list --format=freeze`), whatever the target already has in a version that satisfies every
requirement on it is left out too. bitsandbytes wheels bundle one binary per CUDA version (43 to 61 MB);
`--cuda 130` keeps only that one and the CPU one, so each set fits a 64 MiB transfer.

The walk is a small resolver over the wheels' own `Requires-Dist`: pip picks the newest release that
satisfies every specifier seen so far for a package, for the target's tags (`pip download --no-deps`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from stackcheck.envs import BENCH_GROUPS, EnvBuildError, test_requirements
from stackcheck.versions import UsageError, VersionSet

MANYLINUX_X86_64 = [f"manylinux_2_{minor}_x86_64" for minor in range(17, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
PROVIDED_BY_TARGET = {"torch"}  # the platform: the target's own (CUDA) build, never downloaded
MANIFEST = "wheelhouse.json"


def target_markers(python_version: str) -> dict[str, str]:
    """PEP 508 marker values of a CPython on x86-64 Linux, the GPU hosts this folder is for."""
    return {
        "python_version": python_version, "python_full_version": f"{python_version}.0", "os_name": "posix",
        "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
        "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": "",
    }


def read_freeze(path: Path) -> dict[str, Version]:
    versions = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
        if match:
            try:
                versions[canonicalize_name(match.group(1))] = Version(match.group(2))
            except InvalidVersion:
                raise UsageError(f"{path}, line {number}: '{line.strip()}': '{match.group(2)}' is not a valid version") from None
    return versions


def requires_dist(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(metadata).decode()).get_all("Requires-Dist") or []


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
            command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                       "--only-binary=:all:", *self.tag_args, "-d", scratch, f"{name}{specifier}"]
            completed = subprocess.run(command, capture_output=True, text=True)
            if completed.returncode != 0:
                detail = completed.stderr.strip().splitlines()[-1] if completed.stderr.strip() else ""
                raise EnvBuildError(f"no wheel of {name}{specifier} for the target: {detail}")
            (wheel,) = Path(scratch).glob("*.whl")
            target = self.dest / wheel.name
            if not target.exists():
                shutil.move(wheel, target)
            return target


def wheels_for_set(vset: VersionSet, download, markers: dict, host: dict[str, Version], cuda: str | None) -> list[Path]:
    """Walk the set's requirements (its pins, the test extras and the bench's, which `tests` and `bench`
    install) to the wheels the target lacks."""
    if any(pin.url for pin in vset.pins.values()):
        raise UsageError(f"set '{vset.name}': the wheelhouse takes released versions only; pin a built wheel with NAME=PATH and copy it in")
    wanted: dict[str, SpecifierSet] = {}
    chosen: dict[str, tuple[Version, Path]] = {}
    walked: set[tuple[str, Version, frozenset]] = set()  # (package, version, extras) whose needs are queued
    queue = [Requirement(r) for r in vset.requirements() + test_requirements(BENCH_GROUPS)]
    while queue:
        requirement = queue.pop(0)
        if requirement.marker and not any(
            requirement.marker.evaluate(dict(markers, extra=extra)) for extra in [""] + sorted(requirement.extras)
        ):
            continue
        name = canonicalize_name(requirement.name)
        wanted[name] = wanted.get(name, SpecifierSet()) & requirement.specifier
        if name in PROVIDED_BY_TARGET:
            if name in host and host[name] not in wanted[name]:
                raise UsageError(f"set '{vset.name}' needs {name}{wanted[name]}; the target has {name} {host[name]}")
            continue
        if name in host and host[name] in wanted[name] and name not in chosen:
            continue
        if name not in chosen or chosen[name][0] not in wanted[name]:
            wheel = download(name, wanted[name])
            chosen[name] = (parse_wheel_filename(wheel.name)[1], wheel)
        key = (name, chosen[name][0], frozenset(requirement.extras))
        if key not in walked:
            walked.add(key)
            queue += [Requirement(r) for r in requires_dist(chosen[name][1])]
    wheels = [wheel for _, wheel in chosen.values()]
    if cuda:
        for wheel in wheels:
            if canonicalize_name(parse_wheel_filename(wheel.name)[0]) == "bitsandbytes":
                with zipfile.ZipFile(wheel) as archive:
                    bundled = [n for n in archive.namelist() if "libbitsandbytes_cuda" in n]
                if len(bundled) > 1:
                    keep_one_cuda_binary(wheel, cuda)
    return sorted(wheels)


def build(sets: list[VersionSet], dest: Path, python_version: str, platforms: list[str], cuda: str | None,
          host_freeze: Path | None) -> dict:
    """Fill `dest` for every set; write and return the manifest (wheels and their size per set)."""
    if host_freeze and not host_freeze.is_file():
        raise UsageError(f"no such host freeze file: {host_freeze}")
    host = read_freeze(host_freeze) if host_freeze else {}
    dest.mkdir(parents=True, exist_ok=True)
    download = Downloader(dest, python_version, platforms)
    manifest = {"python_version": python_version, "platforms": platforms, "cuda": cuda,
                "host_freeze": str(host_freeze) if host_freeze else None, "sets": {}}
    for vset in sets:
        wheels = wheels_for_set(vset, download, target_markers(python_version), host, cuda)
        manifest["sets"][vset.name] = {
            "wheels": [w.name for w in wheels],
            "mib": round(sum(w.stat().st_size for w in wheels) / 2**20, 1),
        }
    manifest["mib"] = round(sum(w.stat().st_size for w in dest.glob("*.whl")) / 2**20, 1)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
