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

SETS_FILE = Path(__file__).parents[1] / "sets.toml"
LIBRARIES = ("transformers", "peft", "accelerate", "bitsandbytes")
# The distributed lane's ZeRO-3 engine: a set may pin it; otherwise pyproject's `dist` extra does.
ENGINES = ("deepspeed",)
# What users run beside the libraries: trl's trainers (SFTTrainer, GRPOTrainer) over them. A set may pin it;
# otherwise pyproject's `trl` extra does.
TRAINERS = ("trl",)
PACKAGES = ("torch",) + LIBRARIES + ENGINES + TRAINERS
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
        text = self.version or self.url
        assert text, f"{self.package}: a pin has a version or a URL (parse_pin makes one of them)"
        return text


@dataclass(frozen=True)
class VersionSet:
    name: str
    pins: dict[str, Pin]
    description: str = ""
    opt_in: bool = False  # run only when named (`--sets t4,latest`), never as one of "every set"

    def requirements(self) -> list[str]:
        return [pin.requirement() for pin in self.pins.values()]

    @property
    def slug(self) -> str:
        return slug(self.name)

    def to_dict(self) -> dict:
        """Plain data (JSON): how the set crosses from the command side to the pytest child (protocol.SET_RECORD_ENV)."""
        return {"name": self.name, "pins": {package: {"version": pin.version, "url": pin.url} for package, pin in self.pins.items()},
                "description": self.description, "opt_in": self.opt_in}

    @classmethod
    def from_dict(cls, data: dict) -> VersionSet:
        """The set `to_dict` wrote: VersionSet.from_dict(s.to_dict()) == s."""
        pins = {package: Pin(package, pin["version"], pin["url"]) for package, pin in data["pins"].items()}
        return cls(data["name"], pins, data["description"], data["opt_in"])


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


# NAME, then how it is pinned: `==` a release, `@` a URL, `=` a path; the other comparisons name ranges, never one release.
PIN = re.compile(r"\s*(?P<package>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?P<operator>===|==|~=|!=|<=|>=|<|>|=|@)\s*(?P<rest>.*?)\s*")
RANGE_OPERATORS = ("===", "~=", "!=", "<=", ">=", "<", ">")


def parse_pin(token: str) -> Pin:
    """Parse one override token; see PIN_HELP. The package is checked first, whatever follows it."""
    match = PIN.fullmatch(token)
    if not match or not match["rest"]:
        bare = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*", token)
        example = f"{bare[1]}==VERSION" if bare else "peft==0.19.1"
        raise UsageError(f"bad pin '{token}': expected {PIN_HELP}, e.g. {example}")
    package, operator, rest = _check_package(match["package"], token), match["operator"], match["rest"]
    if operator in RANGE_OPERATORS:
        meant = f" ({package}=={rest} pins that release)" if operator in (">=", "~=", "===") and _is_version(rest) else ""
        raise UsageError(f"bad pin '{token}': a pin names one release, {package}==VERSION, not a range or an exclusion{meant}")
    if operator == "==":
        if not _is_version(rest):
            raise UsageError(f"bad pin '{token}': '{rest}' is not a valid version")
        return Pin(package, version=rest)
    if operator == "@":
        if not re.match(r"^(git\+)?(https?|file|ssh)://", rest):
            raise UsageError(f"bad pin '{token}': expected a URL such as git+https://github.com/org/repo@ref")
        return Pin(package, url=rest)
    location = Path(rest).expanduser().resolve()
    if not location.exists():
        meant = f" (a release is {package}=={rest})" if _is_version(rest) else ""
        raise UsageError(f"bad pin '{token}': NAME=PATH names a file or folder, and {location} does not exist{meant}; "
                         f"a pin is {PIN_HELP}")
    return Pin(package, url=location.as_uri())


def canonical_pin(token: str) -> str:
    """A pin as one spelling (`peft==0.20.0`, whatever spaces or capitals it was given with), so that one pin names one
    set and one environment: `--with 'peft==0.20.0 '` is `--with peft==0.20.0`. A wrong pin is a UsageError."""
    pin = parse_pin(token)
    if pin.version:
        return f"{pin.package}=={pin.version}"
    match = PIN.fullmatch(token)
    assert match is not None, "parse_pin accepted the token, so PIN matches it"
    return f"{pin.package}{match['operator']}{match['rest']}"


def _is_version(text: str) -> bool:
    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


# What a set's table may hold beside its pins (PACKAGES); `opt_in` (true: the set runs only when named) is the one
# that is no string.
SET_KEYS = ("description", "refreshed", "opt_in")


def load_sets(path: Path = SETS_FILE) -> tuple[dict[str, VersionSet], str]:
    """The sets of sets.toml and its default set. A file that is no TOML, a duplicate table, a key that is no
    package, a version that is no string or no version, or a default that names no set: one line (UsageError)."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}") from None
    if not isinstance(data.get("sets"), dict) or not data["sets"]:
        raise UsageError(f"{path} has no [sets.NAME] table")
    sets: dict[str, VersionSet] = {}
    for name, entry in data["sets"].items():
        where = f"{path}: [sets.{name}]"
        if not isinstance(entry, dict):
            raise UsageError(f"{where} is not a table of pins")
        unknown = [key for key in entry if key not in (*PACKAGES, *SET_KEYS)]
        if unknown:
            raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)} (a set pins {', '.join(PACKAGES)}; "
                             f"it may have {', '.join(SET_KEYS)})")
        if not isinstance(entry.get("opt_in", False), bool):
            raise UsageError(f"{where}: opt_in must be true or false")
        texts = [key for key, value in entry.items() if key != "opt_in" and not isinstance(value, str)]
        if texts:
            raise UsageError(f"{where}: {', '.join(texts)} must be a string, as in {texts[0]} = \"1.0.0\"")
        try:
            pins = {pkg: parse_pin(f"{pkg}=={entry[pkg]}") for pkg in PACKAGES if pkg in entry}
        except UsageError as exc:
            raise UsageError(f"{where}: {exc}") from None
        missing = [lib for lib in LIBRARIES if lib not in pins]
        if missing:
            raise UsageError(f"set '{name}' in {path.name} does not pin {', '.join(missing)}")
        sets[name] = VersionSet(name, pins, entry.get("description", ""), entry.get("opt_in", False))
    default = data.get("default")
    if default not in sets:
        raise UsageError(f"{path}: default = {default!r} names no set (its sets: {', '.join(sets)})")
    assert isinstance(default, str), "a key of sets"
    return sets, default


def resolve(names: list[str] | None = None, overrides: list[str] | None = None) -> list[VersionSet]:
    """The sets to run: named ones (when none are named, every set but the opt-in ones), each with the overrides applied."""
    known, _default = load_sets()
    chosen = []
    for name in names or every_set(known):
        if name == CURRENT_SET:
            chosen.append(current_set())
        elif name not in known:
            raise UsageError(f"unknown set '{name}' (valid sets: {', '.join([*known, CURRENT_SET])})")
        else:
            chosen.append(known[name])
    tokens = [canonical_pin(token) for token in overrides or []]
    pins = [parse_pin(token) for token in tokens]
    for package in {pin.package for pin in pins}:
        given = [token for token, pin in zip(tokens, pins) if pin.package == package]
        if len(given) > 1:
            raise UsageError(f"--with pins {package} {len(given)} times ({', '.join(given)}): keep one")
    if not pins:
        return chosen
    return [
        replace(
            vset,
            name=vset.name + "+" + "+".join(tokens),
            pins={**vset.pins, **{pin.package: pin for pin in pins}},
        )
        for vset in chosen
    ]


def every_set(known: dict[str, VersionSet] | None = None) -> list[str]:
    """The sets a run that names none runs (the matrix, one CI job each): every set of sets.toml but the opt-in ones."""
    return [name for name, vset in (known or load_sets()[0]).items() if not vset.opt_in]


def cross_release_writer(path: Path = SETS_FILE) -> VersionSet | None:
    """The set whose quantized checkpoints every matrix run's sets also read (sets.toml's `cross_release`); None
    where it names none."""
    known, _default = load_sets(path)
    name = tomllib.loads(path.read_text()).get("cross_release")
    if name is not None and name not in known:
        raise UsageError(f"{path}: cross_release = {name!r} names no set (its sets: {', '.join(known)})")
    return known[name] if name is not None else None


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
