"""Version sets: named pins from sets.toml, plus ad-hoc overrides from the command line."""

from __future__ import annotations

import datetime
import hashlib
import platform
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

from packaging.version import InvalidVersion, Version

SETS_FILE = Path(__file__).with_name("sets.toml")
LIBRARIES = ("transformers", "peft", "accelerate", "bitsandbytes")
# The distributed lane's ZeRO-3 engine: a set may pin it; otherwise pyproject's `dist` extra does.
ENGINES = ("deepspeed",)
PACKAGES = ("torch",) + LIBRARIES + ENGINES
CURRENT_SET = "current"  # not in sets.toml: the libraries this interpreter has installed
PIN_HELP = "NAME==VERSION, NAME@git+URL[@REF] or NAME=PATH (a wheel, sdist or source tree)"


def installed_versions() -> dict[str, str]:
    """Python's version and each package's, as the running interpreter has them ("absent" when missing)."""
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "absent"
    return versions


class UsageError(Exception):
    """A user mistake: reported as one line with exit code 2, never as a traceback."""


@dataclass(frozen=True)
class Pin:
    package: str
    version: str | None = None  # exact release
    url: str | None = None  # git+https://...@ref, or file:// for a local wheel or tree

    def requirement(self) -> str:
        return f"{self.package}=={self.version}" if self.version else f"{self.package} @ {self.url}"

    def __str__(self) -> str:
        return self.version or self.url


@dataclass(frozen=True)
class VersionSet:
    name: str
    pins: dict[str, Pin]
    description: str = ""

    def requirements(self) -> list[str]:
        return [pin.requirement() for pin in self.pins.values()]

    @property
    def slug(self) -> str:
        return slug(self.name)


def slug(set_name: str) -> str:
    """A set's name as a file name."""
    text = re.sub(r"[^A-Za-z0-9_.+-]+", "_", set_name)
    if len(text) <= 100:
        return text
    # Long names (git pins) differ at the end: keep them apart with a digest of the whole name.
    return text[:87] + "-" + hashlib.sha256(set_name.encode()).hexdigest()[:12]


def _check_package(package: str, token: str) -> str:
    name = package.strip().lower()
    if name not in PACKAGES:
        raise UsageError(f"bad pin '{token}': unknown package '{package}' (known: {', '.join(PACKAGES)})")
    return name


def parse_pin(token: str) -> Pin:
    """Parse one override token; see PIN_HELP."""
    if "==" in token:
        package, version = token.split("==", 1)
        try:
            Version(version)
        except InvalidVersion:
            raise UsageError(f"bad pin '{token}': '{version}' is not a valid version") from None
        return Pin(_check_package(package, token), version=version)
    if "@" in token and "=" not in token.split("@", 1)[0]:
        package, url = (part.strip() for part in token.split("@", 1))
        if not re.match(r"^(git\+)?(https?|file|ssh)://", url):
            raise UsageError(f"bad pin '{token}': expected a URL such as git+https://github.com/org/repo@ref")
        return Pin(_check_package(package, token), url=url)
    if "=" in token:
        package, path = token.split("=", 1)
        location = Path(path).expanduser().resolve()
        if not location.exists():
            meant = f" (a release is {package}=={path})" if _is_version(path) else ""
            raise UsageError(f"bad pin '{token}': NAME=PATH names a file or folder, and {location} does not exist{meant}; "
                             f"a pin is {PIN_HELP}")
        return Pin(_check_package(package, token), url=location.as_uri())
    raise UsageError(f"bad pin '{token}': expected {PIN_HELP}")


def _is_version(text: str) -> bool:
    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def load_sets(path: Path = SETS_FILE) -> tuple[dict[str, VersionSet], str]:
    data = tomllib.loads(path.read_text())
    sets = {}
    for name, entry in data["sets"].items():
        pins = {pkg: parse_pin(f"{pkg}=={entry[pkg]}") for pkg in PACKAGES if pkg in entry}
        missing = [lib for lib in LIBRARIES if lib not in pins]
        if missing:
            raise UsageError(f"set '{name}' in {path.name} does not pin {', '.join(missing)}")
        sets[name] = VersionSet(name, pins, entry.get("description", ""))
    return sets, data["default"]


def resolve(names: list[str] | None = None, overrides: list[str] | None = None) -> list[VersionSet]:
    """The sets to run: named ones (all when none are named), each with the overrides applied."""
    known, _default = load_sets()
    chosen = []
    for name in names or list(known):
        if name == CURRENT_SET:
            chosen.append(current_set())
        elif name not in known:
            raise UsageError(f"unknown set '{name}' (valid sets: {', '.join([*known, CURRENT_SET])})")
        else:
            chosen.append(known[name])
    pins = [parse_pin(token) for token in overrides or []]
    for package in {pin.package for pin in pins}:
        given = [token for token, pin in zip(overrides, pins) if pin.package == package]
        if len(given) > 1:
            raise UsageError(f"--with pins {package} {len(given)} times ({', '.join(given)}): keep one")
    if not pins:
        return chosen
    return [
        replace(
            vset,
            name=vset.name + "+" + "+".join(overrides),
            pins={**vset.pins, **{pin.package: pin for pin in pins}},
        )
        for vset in chosen
    ]


def current_set() -> VersionSet:
    """The libraries installed in this interpreter, pinned: `doctor`'s claims verified on the user's own stack."""
    installed = installed_versions()
    missing = [lib for lib in LIBRARIES if installed[lib] == "absent"]
    if missing:
        raise UsageError(f"set '{CURRENT_SET}': this Python ({sys.executable}) has no {', '.join(missing)} installed")
    pins = {lib: parse_pin(f"{lib}=={installed[lib]}") for lib in LIBRARIES}
    return VersionSet(CURRENT_SET, pins, f"the libraries installed in {sys.executable}")


def default_set() -> VersionSet:
    known, default = load_sets()
    return known[default]


def index_versions(package: str, pre: bool = False) -> list[Version]:
    """The package's releases on the package index pip is configured for, oldest first."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", package, *(["--pre"] if pre else [])],
        capture_output=True, text=True,
    )
    listed = re.search(r"^Available versions: (.+)$", out.stdout, re.M)
    if out.returncode != 0 or not listed:
        why = (out.stderr.strip().splitlines() or ["pip printed no versions"])[-1]
        raise UsageError(f"no releases of '{package}' on the package index ({why})")
    return sorted(Version(v) for v in listed.group(1).split(", "))


def refresh_latest(path: Path = SETS_FILE) -> dict[str, str]:
    """Rewrite the `latest` pins with the newest releases the package index offers."""
    text = path.read_text()
    if "[sets.latest]" not in text:  # checked before the package index is asked anything
        raise UsageError(f"{path} has no [sets.latest] table to refresh")
    newest = {package: str(index_versions(package)[-1]) for package in LIBRARIES}
    head, latest = text.split("[sets.latest]", 1)
    for package, version in newest.items():
        latest = re.sub(rf'^{package} = ".*"$', f'{package} = "{version}"', latest, count=1, flags=re.M)
    latest = re.sub(r'^refreshed = ".*"$', f'refreshed = "{datetime.date.today()}"', latest, count=1, flags=re.M)
    path.write_text(head + "[sets.latest]" + latest)
    return newest
