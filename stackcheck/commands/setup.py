"""The commands around the sets: `versions` (each set's pins), `wheelhouse` (the wheels for an offline host),
`refresh-latest` (re-pin `latest`), `merge` (per-job matrix.json files into one)."""

from __future__ import annotations

import re
import sys

from stackcheck.core import results
from stackcheck.core.versions import ENGINES, TRAINERS, UsageError, load_sets, parse_pin, refresh_latest as newest_latest, resolve
from stackcheck.runner import envs, exitcodes, wheelhouse as wheels
from stackcheck.runner.inputs import check_file_option, check_folder_option, selected_sets


def check_with_pins(args) -> None:
    """bisect and history build one environment per release with the --with pins: a pin the package index does not
    have would make every probe an `error` and the answer "untestable"; it is a usage error before the first build."""
    if args.overrides:
        try:
            envs.check_available([parse_pin(token).requirement() for token in args.overrides], args.find_links, args.no_index)
        except envs.EnvBuildError as exc:
            raise UsageError(f"--with {' '.join(args.overrides)}: {exc}") from None


def versions(args) -> int:
    """Each set's pins. A --with pin is what the user typed: printed as given, checked against the package index
    with --check (a command that builds an environment checks it before running anything, exit 2 if it cannot)."""
    sets = selected_sets(args)
    pins = [parse_pin(token) for token in args.overrides] if args.overrides else []
    if args.check:
        check_with_pins(args)
    for vset in sets:
        print(f"{vset.name}: " + ", ".join(f"{k} {v}" for k, v in vset.pins.items()) + extras_pinned(vset))
    if pins and not args.check:
        print(f"stackcheck: the --with pins ({', '.join(args.overrides)}) are not checked against the package index: "
              "--check asks it; matrix, tests, gate and bench check them when they build the environment", file=sys.stderr)
    elif pins:
        print(f"stackcheck: the package index has {', '.join(pin.requirement() for pin in pins)}", file=sys.stderr)
    return exitcodes.OK


def extras_pinned(vset) -> str:
    """What every environment of the set also installs at one release, trl and deepspeed, where the set does not pin
    them itself (pyproject's extras: envs.test_requirements)."""
    from packaging.requirements import Requirement

    pinned = [(Requirement(text).name, next(iter(Requirement(text).specifier)).version)
              for text in envs.test_requirements(vset) if Requirement(text).name in (*TRAINERS, *ENGINES)
              and len(Requirement(text).specifier) == 1]
    return f"; {', '.join(f'{name} {version}' for name, version in pinned)} (pyproject's extras)" if pinned else ""


def wheelhouse(args) -> int:
    wheels.require_uv()
    check_folder_option("--dest", args.dest)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        raise UsageError(f"--python-version {args.python_version}: name the target's Python as MAJOR.MINOR, e.g. 3.12")
    if args.cuda is not None and not re.fullmatch(r"\d{2,3}", args.cuda):
        raise UsageError(f"--cuda {args.cuda}: name the CUDA build as bitsandbytes' binaries do, e.g. 130 for CUDA 13.0")
    platforms = args.platforms or wheels.MANYLINUX_X86_64
    sets = selected_sets(args)
    if args.sweep:
        if not (args.start and args.end):
            raise UsageError("--sweep needs --from and --to")
        from stackcheck.commands.releases import history

        releases = history.releases_in_range(args.sweep, args.start, args.end)
        sets += [resolve([base.name], [f"{args.sweep}=={release}"])[0] for base in sets for release in releases]
    if args.batch_mib is not None and args.batch_mib < 1:
        raise UsageError(f"--batch-mib {args.batch_mib}: a batch must hold at least 1 MiB")
    manifest = wheels.build(sets, args.dest, args.python_version, platforms, args.cuda, args.host_freeze, args.batch_mib)
    for name, entry in manifest["sets"].items():
        print(f"{name}: {len(entry['wheels'])} wheels, {entry['mib']} MiB: {', '.join(entry['wheels'])}")
    for batch in manifest.get("batches", []):
        print(f"{batch['folder']}: {len(batch['wheels'])} wheels, {batch['mib']} MiB, completes {', '.join(batch['completes'])}")
    print(f"wrote {args.dest} ({manifest['mib']} MiB in all) and its {wheels.MANIFEST}")
    return 0


def refresh_latest(args) -> int:
    known = load_sets()[0]
    before = {package: str(pin) for package, pin in known["latest"].pins.items()} if "latest" in known else {}
    newest = newest_latest()
    print("latest: " + ", ".join(f"{package} {version}" + (f" (was {before[package]})" if before.get(package) != version else "")
                                 for package, version in newest.items()))
    return 0


def merge(args) -> int:
    check_file_option("--output", args.output)
    merged = results.merge_files(args.inputs, args.output)
    print(f"merged {len(args.inputs)} files ({len(merged['sets'])} sets, {len(merged['cells'])} cells) "
          f"into {args.output} and {args.output.with_suffix('.md')}")
    return 0
