"""`stackcheck doctor`: which known bugs affect an installed stack, read from the ledger alone.

No model is built and no library is imported: the installed versions come from package metadata (of this
interpreter, or of `--python`'s), the CPU facts from /proc/cpuinfo, so it answers in well under a second,
offline. For each bug whose `affected` range holds, it names the changes of one package that leave the range
(the ledger's bounds: an upgrade past an upper bound, a downgrade below a lower bound), and says what each
upgrade brings in from the rest of the ledger. `diagnose` is a pure function of the ledger and the versions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

from packaging.specifiers import Specifier

from stackcheck import REPO_ROOT
from stackcheck.runner import exitcodes, inputs
from stackcheck.core import hostinfo
from stackcheck.core.ledger import Bug, Ledger
from stackcheck.models import architectures
from stackcheck.core.versions import CURRENT_SET, LIBRARIES, UsageError, installed_versions



@dataclass(frozen=True)
class Remedy:
    package: str
    requirement: str  # a PEP 440 specifier that leaves the bug's range, e.g. ">=1.14.0"
    upgrade: bool
    brings_in: tuple[str, ...] = ()  # bugs the boundary release of an upgrade has that this install has not

    def __str__(self) -> str:
        change = f"{'upgrade' if self.upgrade else 'downgrade'} {self.package} to {self.requirement}"
        return change + (f" (brings in {', '.join(self.brings_in)})" if self.brings_in else "")


@dataclass(frozen=True)
class Diagnosis:
    bug: str
    summary: str
    families: tuple[str, ...]
    links: tuple[str, ...]
    affected: str
    remedies: tuple[Remedy, ...]
    cpu_flag: str | None
    silent: bool  # nothing raises (Bug.silent)
    workaround: str | None

    @property
    def on_this_cpu(self) -> str:
        return f", on a CPU with {self.cpu_flag} such as this one" if self.cpu_flag else ""

    @property
    def fixed_in_a_release(self) -> bool:
        return any(remedy.upgrade for remedy in self.remedies)

    @property
    def outcomes(self) -> set[str]:
        """What the bug counts as for `--fail-on` (stackcheck.runner.exitcodes)."""
        return {exitcodes.KNOWN_BUG} | ({exitcodes.FIXABLE} if self.fixed_in_a_release else set())


def _leaving(spec: Specifier) -> tuple[str, bool] | None:
    """The specifier that leaves `spec`'s side of the range, and whether that is an upgrade."""
    flipped = {"<": (">=", True), "<=": (">", True), ">=": ("<", False), ">": ("<=", False)}
    if spec.operator not in flipped:
        return None
    operator, upgrade = flipped[spec.operator]
    return f"{operator}{spec.version}", upgrade


def remedies(bug: Bug, versions: dict[str, str], ledger: Ledger) -> list[Remedy]:
    """Each single-package change that takes the install out of `bug`'s affected range, upgrades first."""
    found = []
    for package, specifiers in bug.affected.items():
        for spec in specifiers:
            if (leaving := _leaving(spec)) is None:
                continue
            requirement, upgrade = leaving
            brings_in: tuple[str, ...] = ()
            if upgrade and requirement.startswith(">="):
                upgraded = {**versions, package: requirement.removeprefix(">=")}
                brings_in = tuple(sorted(b.id for b in ledger.bugs.values() if b.affects(upgraded) and not b.affects(versions)))
            found.append(Remedy(package, requirement, upgrade, brings_in))
    return sorted(found, key=lambda r: (not r.upgrade, r.package))


def diagnose(ledger: Ledger, versions: dict[str, str], cpu_flags: str,
             arch: tuple[str, frozenset[str]] | None = None) -> list[Diagnosis]:
    """The ledger's bugs that affect `versions` on a CPU with `cpu_flags`, each with its families and remedies;
    with `arch` (model type, structures), only those that can live on that architecture."""
    diagnoses = []
    for bug in ledger.bugs.values():
        if not bug.affects(versions) or (bug.cpu_flag and bug.cpu_flag not in cpu_flags.split()):
            continue
        if arch and not ledger.lives_on(bug, *arch):
            continue
        families = tuple(family.id for family in ledger.families.values() if any(b.id == bug.id for b, _ in family.bugs))
        diagnoses.append(Diagnosis(bug.id, bug.summary, families, bug.links, bug.describe_range(),
                                   tuple(remedies(bug, versions, ledger)), bug.cpu_flag, bug.silent, bug.workaround))
    return diagnoses


def versions_of(python: str | None) -> dict[str, str]:
    """The installed versions of this interpreter, or of the interpreter at `python`."""
    if python is None:
        return installed_versions()
    inputs.interpreter("--python", python)
    code = "import json; from stackcheck.core.versions import installed_versions; print(json.dumps(installed_versions()))"
    try:
        completed = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30,
                                   env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    except OSError as exc:
        raise UsageError(f"--python {python}: cannot run it ({exc.strerror})") from None
    if completed.returncode != 0:
        raise UsageError(f"--python {python}: it cannot report its packages ({(completed.stderr.strip().splitlines() or ['?'])[-1]})")
    try:
        return json.loads(completed.stdout)
    except json.JSONDecodeError:
        raise UsageError(f"--python {python}: it printed no package report; name a Python interpreter") from None


def require_stack(versions: dict[str, str], python: str | None, remedy: str) -> None:
    """The libraries must be there: a bug of "every version" says nothing about a Python without them."""
    missing = [lib for lib in LIBRARIES if versions.get(lib, "absent") == "absent"]
    if missing:
        raise UsageError(f"{python or 'this Python'} has no {', '.join(missing)} installed: {remedy}")


def verify_command(versions: dict[str, str], other_interpreter: bool) -> str:
    """The matrix run that checks the claims for real: on the `current` set, or with another interpreter's pins."""
    if not other_interpreter:
        return f"python -m stackcheck matrix --sets {CURRENT_SET}"
    pins = " ".join(f"--with {p}=={versions[p]}" for p in LIBRARIES if versions.get(p, "absent") != "absent")
    return f"python -m stackcheck matrix --sets seed {pins}"


def report(versions: dict[str, str], facts: dict[str, str], diagnoses: list[Diagnosis], verify: str) -> dict:
    return {"versions": versions, "platform": facts, "verify": verify,
            "bugs": [dict(asdict(d), fixed_in_a_release=d.fixed_in_a_release) for d in diagnoses]}


def render(versions: dict[str, str], facts: dict[str, str], diagnoses: list[Diagnosis], verify: str) -> str:
    lines = ["stackcheck doctor: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
             "platform: " + ", ".join(f"{k} {v}" for k, v in facts.items()), ""]
    if not diagnoses:
        lines.append("No known bug of the ledger affects this install.")
    else:
        lines += ["Each bug: its id [the families whose tests show it]: the versions it affects; then the changes of one",
                  "package that leave it, what to do meanwhile where the ledger knows, and the upstream report.", ""]
        silent = [d.bug for d in diagnoses if d.silent]
        if silent:
            lines += [f"{len(silent)} of them are silent: nothing raises, the weights, the memory or the numbers are wrong "
                      f"(marked SILENT): {', '.join(silent)}", ""]
    groups = {"and an upgrade leaves them": [d for d in diagnoses if d.fixed_in_a_release],
              "and no release fixes them yet; a downgrade leaves them": [d for d in diagnoses if not d.fixed_in_a_release and d.remedies],
              "and no release leaves them": [d for d in diagnoses if not d.remedies]}
    for leaving, group in groups.items():
        if not group:
            continue
        lines.append(f"{len(group)} known bugs affect this install, {leaving}:")
        for d in group:
            lines.append(f"- {'SILENT ' if d.silent else ''}{d.bug} [{', '.join(d.families)}]: affects {d.affected}{d.on_this_cpu}")
            lines += [f"    {remedy}" for remedy in d.remedies]
            if d.workaround:
                lines.append(f"    meanwhile: {d.workaround}")
            lines.append(f"    {d.links[0]}")
        lines.append("")
    lines.append(f"Verify these claims on this install: {verify}")
    return "\n".join(lines)


def builtin_arch(name: str) -> tuple[str, frozenset[str]]:
    """(model type, structures) of a built-in architecture, from its config file: no library imported."""
    chosen = architectures.builtin().get(name)
    if chosen is None:
        raise UsageError(f"--arch: unknown architecture '{name}' (built in: {', '.join(architectures.builtin())})")
    assert chosen.declared is not None, "a built-in architecture declares its structures (architectures._declared)"
    return chosen.model_type, chosen.declared


def fail_on(args, default: tuple[str, ...] = exitcodes.INSTALL_FAIL_ON) -> tuple[str, ...]:
    """The outcomes that fail `doctor` (and `scan`, with its default): `--fail-on`, else `default` (stackcheck.runner.exitcodes)."""
    return exitcodes.parse_fail_on(args.fail_on) if getattr(args, "fail_on", None) is not None else default


def exit_code(diagnoses: list[Diagnosis], fail_on: tuple[str, ...]) -> int:
    """1 when a bug affecting the install is one of `fail_on` (by default: one that an upgrade leaves), saying which."""
    failing = [d.bug for d in diagnoses if d.outcomes & set(fail_on)]
    if failing:
        print(f"stackcheck: exit 1: {len(failing)} known bugs of --fail-on {','.join(fail_on)} affect the install: "
              f"{', '.join(failing)} (docs/exit-codes.md)", file=sys.stderr)
        return exitcodes.FAILED
    return exitcodes.OK


def run(args) -> int:
    """The `doctor` command: 1 when a known bug of --fail-on affects the install (default: one that an upgrade
    leaves), 0 otherwise; an install whose only bugs have no fix passes (stackcheck.runner.exitcodes)."""
    fail_on_outcomes = fail_on(args)
    versions = versions_of(args.python)
    require_stack(versions, args.python, "pass the environment's Python with --python")
    facts = hostinfo.cpu_facts()
    diagnoses = diagnose(Ledger(), versions, facts["cpu_flags"], builtin_arch(args.arch) if args.arch else None)
    verify = verify_command(versions, args.python is not None)
    print(json.dumps(report(versions, facts, diagnoses, verify), indent=2) if args.json else render(versions, facts, diagnoses, verify))
    return exit_code(diagnoses, fail_on_outcomes)
