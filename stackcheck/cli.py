"""`python -m stackcheck`: the logic behind the nox sessions, runnable where nox is not installed."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from stackcheck import REPO_ROOT
from stackcheck.commands import bench, docgen, gate, matrix, report, setup
from stackcheck.commands.matrix import gpu_device
from stackcheck.commands.releases import backtest, bisect, history, watch
from stackcheck.commands.releases import watch as watch_module
from stackcheck.commands.releases.probes import DEFAULT_STORE
from stackcheck.commands.triage import doctor, repro, scan
from stackcheck.core import results
from stackcheck.core.ledger import LedgerError
from stackcheck.core.protocol import DEFAULT_RESULTS, RESULTS_DIR
from stackcheck.core.versions import PIN_HELP, UsageError, canonical_pin
from stackcheck.models import architectures
from stackcheck.runner import envs, exitcodes, inputs, signals
from stackcheck.runner.inputs import check_file_option, check_folder_option
from stackcheck.runner.lane import ARCH_HELP, arch_options

STORE_HELP = "the probe store that history, bisect and watch share (default: results/probes.json)"
BENCH_RESULTS = RESULTS_DIR / "bench"


def absolute_path(text: str) -> Path:
    """The `type` of every path option: pytest runs from the repository root, so a path relative to the
    caller's directory must be made absolute before it reaches it."""
    return Path(text).expanduser().resolve()


# The commands an installed copy (`pip install .`, which has no tests/) can run: they read only the package.
RUN_ANYWHERE = ("doctor", "scan", "versions")


def check_checkout(command: str) -> None:
    """The other commands run the family tests of a stackcheck clone (REPO_ROOT)."""
    if command not in RUN_ANYWHERE and not (REPO_ROOT / "tests" / "families").is_dir():
        raise UsageError(f"{command} runs the family tests of a stackcheck clone, and {REPO_ROOT} is none: run "
                         "`python -m stackcheck` in the clone's root, or install the clone editable (pip install -e CLONE)")


# The path options a command reads (the others name where it writes: check_file_option, check_folder_option).
READ_PATHS = {"inputs": ("merge input", "file"), "source": ("--from", "file"), "releases": ("--releases", "file"),
              "host_freeze": ("--host-freeze", "file"), "git": ("--git", "folder")}


def check_common_options(args) -> None:
    """The set and install options every command shares, before any set is resolved or built (the rules every
    option follows, empty values and repeated options among them, are stackcheck.runner.inputs')."""
    if getattr(args, "overrides", None):  # one spelling of each pin: one set, one environment (versions.canonical_pin)
        args.overrides = [canonical_pin(token) for token in args.overrides]
    if getattr(args, "no_index", False) and not args.find_links:
        raise UsageError("--no-index installs only from --find-links folders: name one with --find-links DIR")
    if getattr(args, "find_links", None):  # absolute, as every path option: the installers run elsewhere than the caller
        args.find_links = [folder if "://" in folder else str(inputs.existing_folder("--find-links", Path(folder).expanduser()).resolve())
                           for folder in args.find_links]
    for dest, (option, kind) in READ_PATHS.items():
        given = getattr(args, dest, None) or []
        for path in given if isinstance(given, list) else [given]:
            (inputs.existing_file if kind == "file" else inputs.existing_folder)(option, path)
    if getattr(args, "arch", None):
        arch_options(args.arch)  # an unknown name, or a config.json that is no JSON or cannot be shrunk: before any build


def _parser() -> argparse.ArgumentParser:
    parser = inputs.Parser(prog="stackcheck", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    def add_set_option(cmd: argparse.ArgumentParser, many: bool, default: str = "the default set") -> None:
        """`--sets` in every command (`--set`, its older spelling in the commands that run one set, is accepted)."""
        if many:
            cmd.add_argument("--sets", action=inputs.ListOption, help="comma-separated set names, or the option repeated (default: every set in sets.toml)")
            cmd.add_argument("--set", dest="sets", action=inputs.ListOption, help=argparse.SUPPRESS)
        else:
            cmd.add_argument("--sets", dest="sets", action=inputs.OneName, metavar="SET", help=f"the set to run (default: {default})")
            cmd.add_argument("--set", dest="sets", action=inputs.OneName, help=argparse.SUPPRESS)

    def add_set_options(cmd: argparse.ArgumentParser, many: bool) -> None:
        add_set_option(cmd, many)
        cmd.add_argument("--with", dest="overrides", action="append", default=[], metavar="PIN", help=PIN_HELP)
        cmd.add_argument("--find-links", action="append", default=[], metavar="DIR", help="extra wheel folder")
        cmd.add_argument("--no-index", action="store_true", help="install only from --find-links folders")

    for name, what in (("matrix", "the CPU lane of every family"), ("gpu-matrix", "the GPU and CPU lanes of every family")):
        matrix = commands.add_parser(name, help=f"run {what} on each set and write the report; its two-rank cells run on "
                                                "warm rank pools, each pool group on one xdist worker, and trainer_resume's "
                                                "resumes on a warm resume process (STACKCHECK_RANK_POOL=0: a new process for "
                                                "each; docs/speed.md)")
        add_set_options(matrix, many=True)
        matrix.add_argument("--arch", action=inputs.ListOption, help=ARCH_HELP)
        matrix.add_argument("--families", action=inputs.ListOption, help="comma-separated families (default: all)")
        matrix.add_argument("--results", type=absolute_path, default=DEFAULT_RESULTS, help="matrix.json to write")
        matrix.add_argument("--fail-on", metavar="OUTCOMES", help=exitcodes.FAIL_ON_HELP.format(default=",".join(exitcodes.TEST_FAIL_ON)))
        matrix.add_argument("--explore", type=int, metavar="N",
                            help="also N configurations of each contract test's axes beyond its pairwise cover, sampled from "
                                 "--seed (cell ids end in -explored); each one that fails is shrunk to a minimal configuration "
                                 "by running the test again, recorded on its cell and printed with the line that reproduces it")
        matrix.add_argument("--seed", type=int, metavar="S", help="the seed --explore samples from (default: 0)")
        matrix.add_argument("--no-cross-release", action="store_true",
                            help="leave out the cross-release cells: the checkpoints sets.toml's `cross_release` set (transformers "
                                 "4.57) writes once per machine into the cache, which each set reads (docs/running.md)")
        matrix.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --; tests named there (a cell's node "
                                                           "id) run alone, not with their whole families")

    tests = commands.add_parser("tests", help="the harness's own tests plus the CPU lane on one set (one launch per two-rank cell; "
                                                 "STACKCHECK_RANK_POOL=1: warm rank pools and resume process)")
    add_set_options(tests, many=False)
    tests.add_argument("--arch", action=inputs.ListOption,
                       help=ARCH_HELP.replace("Default: every built-in one", f"Default: {architectures.SEED_ARCHITECTURE} alone"))
    tests.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")

    versions = commands.add_parser("versions", help="print the resolved pins of each set")
    add_set_options(versions, many=True)
    versions.add_argument("--check", action="store_true",
                          help="ask the package index (or --find-links) whether each --with pin exists; without it the pins are not checked")

    house = commands.add_parser("wheelhouse", help="download the wheels the sets need, for an offline target")
    add_set_options(house, many=True)
    house.add_argument("--dest", type=absolute_path, default=REPO_ROOT / "wheelhouse", help="folder to fill")
    house.add_argument("--python-version", default="3.12", help="the target's Python (default: 3.12)")
    house.add_argument("--platform", dest="platforms", action="append", help="wheel platform tag (default: manylinux x86-64)")
    house.add_argument("--cuda", help="keep only this CUDA build of the bitsandbytes binaries, e.g. 130 for CUDA 13.0")
    house.add_argument("--host-freeze", type=absolute_path, help="the target's `pip list --format=freeze`: leave out what it has")
    house.add_argument("--sweep", metavar="PACKAGE", help="add one set per release of PACKAGE from --from to --to (a history sweep)")
    house.add_argument("--from", dest="start", metavar="VERSION", help="with --sweep: the oldest release")
    house.add_argument("--to", dest="end", metavar="VERSION", help="with --sweep: the newest release")
    house.add_argument("--batch-mib", type=int, metavar="N", help="also split the wheels into batch-NN folders of at most N MiB")

    bench = commands.add_parser("bench", help="VRAM and tokens/s of each set, as ratios against a baseline set")
    add_set_options(bench, many=True)
    bench.add_argument("--baseline", help="the set the others are compared against (default: the first set)")
    bench.add_argument("--size", choices=("tiny", "realistic", "all"), help="model size (default: all; tiny with --smoke)")
    bench.add_argument("--smoke", action="store_true", help="few tokens and rounds; runs on the CPU when there is no GPU")
    bench.add_argument("--repeat", type=int, default=0, metavar="N",
                       help="measure the 4-bit decode N more times (N >= 2) in each mode, eager and graph, and report its coefficient of variation")
    bench.add_argument("--results", type=absolute_path, default=BENCH_RESULTS,
                       help="folder for <set>.json and the plots; the report is FOLDER.md (default: results/bench)")
    bench.add_argument("--render-only", action="store_true", help="measure nothing: render bench.md from the JSON in --results")
    bench.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")

    commands.add_parser("refresh-latest", help="re-pin the `latest` set to the newest releases")

    bisect = commands.add_parser("bisect", help="first release (or commit) of a package where a family's verdicts flip")
    bisect.add_argument("package", help="the package to bisect; the others stay pinned to --set")
    bisect.add_argument("--good", required=True, help="a release (or, with --git, a commit) giving the good verdicts")
    bisect.add_argument("--bad", required=True, help="a release (or commit) giving the bad verdicts, older or newer")
    what = bisect.add_mutually_exclusive_group(required=True)
    what.add_argument("--family", help="the family whose tests decide")
    what.add_argument("--test", help="one family test id: tests/families/test_<family>.py::<test>")
    add_set_options(bisect, many=False)
    bisect.add_argument("--candidates", action=inputs.ListOption, help="comma-separated releases to search instead of the package index's")
    bisect.add_argument("--pre", action="store_true", help="include pre-releases from the package index")
    bisect.add_argument("--git", type=absolute_path, metavar="CLONE", help="search the commits of a local clone between --good and --bad")
    bisect.add_argument("--output", type=absolute_path, help="json to write (default: results/bisect-<package>-<family>.json)")
    bisect.add_argument("--store", type=absolute_path, help=STORE_HELP)
    bisect.add_argument("--arch", action=inputs.ListOption, help=ARCH_HELP)

    history = commands.add_parser("history", help="every release of a package in a range through every family: the compatibility map")
    history.add_argument("package", help="the package to sweep; the others stay pinned to --set")
    history.add_argument("--from", dest="start", metavar="VERSION", help="the oldest release swept (required unless --render-only)")
    history.add_argument("--to", dest="end", metavar="VERSION", help="the newest release swept (required unless --render-only)")
    add_set_options(history, many=False)
    history.add_argument("--candidates", action=inputs.ListOption, help="comma-separated releases to sweep instead of the package index's")
    history.add_argument("--pre", action="store_true", help="include pre-releases from the package index")
    history.add_argument("--families", action=inputs.ListOption, help="comma-separated families (default: all)")
    history.add_argument("--gpu", action="store_true", help="both lanes, on a GPU host (default: the CPU lane)")
    history.add_argument("--jobs", type=int, help="probes run side by side (default: one per two cores)")
    history.add_argument("--store", type=absolute_path, help=STORE_HELP)
    history.add_argument("--arch", action=inputs.ListOption, help=ARCH_HELP)
    history.add_argument("--output", type=absolute_path, help="the map's json, with .md and .png beside it (default: results/history-<package>.json)")
    history.add_argument("--render-only", action="store_true", help="run nothing: draw the map in --output again")

    back = commands.add_parser("backtest", help="every release of each library in stackcheck/backtest.toml: the maps, and "
                                                "the disposition of every cell that does not pass")
    back.add_argument("--libraries", action=inputs.ListOption, help="comma-separated libraries of the plan (default: all of them)")
    back.add_argument("--plan", type=absolute_path, help="the plan (default: stackcheck/backtest.toml)")
    back.add_argument("--releases", type=absolute_path, metavar="JSON",
                      help="{library: [releases]} to sweep instead of the package index's (an offline host)")
    back.add_argument("--find-links", action="append", default=[], metavar="DIR", help="extra wheel folder")
    back.add_argument("--no-index", action="store_true", help="install only from --find-links folders")
    back.add_argument("--lanes", help="cpu (the default), gpu (on a GPU host), or gpu,cpu; each lane set has its own map")
    back.add_argument("--jobs", type=int, help="probes run side by side (default: one per core)")
    back.add_argument("--store", type=absolute_path, help=STORE_HELP)
    back.add_argument("--arch", action=inputs.ListOption, help=ARCH_HELP.replace("Default: every built-in one", "Default: the plan's"))
    back.add_argument("--maps", type=absolute_path, default=RESULTS_DIR, help="folder of the libraries' history-<library>.json maps (default: results)")
    back.add_argument("--output", type=absolute_path, default=RESULTS_DIR / "backtest.json",
                      help="the page's json, with .md beside it (default: results/backtest.json)")
    back.add_argument("--render-only", action="store_true", help="run nothing: judge the maps in --maps again and draw the page")

    watch = commands.add_parser("watch", help="gate the newest releases against `latest`; bisect each family that flips")
    add_set_option(watch, many=False, default="latest")  # the recorded set to compare with
    watch.add_argument("--releases", type=absolute_path, metavar="JSON",
                       help="{package: [releases]} to use instead of the package index (an offline or test index)")
    watch.add_argument("--find-links", action="append", default=[], metavar="DIR", help="extra wheel folder")
    watch.add_argument("--no-index", action="store_true", help="install only from --find-links folders")
    watch.add_argument("--store", type=absolute_path, help=STORE_HELP)
    watch.add_argument("--output", type=absolute_path, default=watch_module.DEFAULT_OUTPUT, help="folder for summary.md and the bisect records")

    gate = commands.add_parser("gate", help="fail when a candidate set regresses a family against a baseline set")
    add_set_options(gate, many=False)  # --set is the baseline; --with bumps the candidate
    gate.add_argument("--candidate", help="candidate set name (default: the baseline set, with the --with pins)")
    gate.add_argument("--families", action=inputs.ListOption, help="comma-separated families (default: all)")
    gate.add_argument("--arch", action=inputs.ListOption, help=ARCH_HELP)
    gate.add_argument("--output", type=absolute_path, default=RESULTS_DIR / "gate", help="folder for matrix.json and summary.md")
    gate.add_argument("--bench", choices=("smoke", "tiny", "realistic", "all"),
                      help="also compare the bench of both sets as ratios (smoke runs on the CPU)")

    doctor = commands.add_parser("doctor", help="which known bugs affect an installed stack, and the smallest changes that leave them")
    doctor.add_argument("--python", help="the interpreter whose packages to read (default: this one)")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--arch", help="only the known bugs that can live on this built-in architecture")
    doctor.add_argument("--fail-on", metavar="OUTCOMES", help=exitcodes.FAIL_ON_HELP.format(default=",".join(exitcodes.INSTALL_FAIL_ON)))

    repro = commands.add_parser("repro", help="issue-ready standalone reproductions of failing cells, checked by running them")
    repro.add_argument("--from", dest="source", type=absolute_path, help="a matrix.json: export every failing cell in it")
    add_set_options(repro, many=True)  # --sets filters --from; with --test, --sets names the one set
    repro.add_argument("--test", help="one family test id, tests/families/test_<family>.py::<test>[<lane>-...]")
    repro.add_argument("--output", type=absolute_path, default=RESULTS_DIR / "repro", help="folder to write into")

    scan = commands.add_parser("scan", help="preflight a model folder (and adapter folder) on the meta device")
    scan.add_argument("model", type=absolute_path, help="folder with the model's config.json (no weights are read)")
    scan.add_argument("adapter", type=absolute_path, nargs="?", help="folder with an adapter_config.json")
    scan.add_argument("--device-map", help="the device_map as from_pretrained takes it: auto, balanced, balanced_low_0 or "
                      "sequential (accelerate's map), one device (cpu, cuda:0), or a map as JSON or a .json file")
    scan.add_argument("--max-memory", help="max_memory, as JSON or a .json file (without --device-map: accelerate's 'auto' map)")
    scan.add_argument("--quantization", help="BitsAndBytesConfig arguments, as JSON or a .json file")
    scan.add_argument("--python", help="the interpreter whose libraries build the model (default: this one)")
    scan.add_argument("--json", action="store_true", help="print the report as JSON")
    scan.add_argument("--fail-on", metavar="OUTCOMES", help=exitcodes.FAIL_ON_HELP.format(default="none"))

    report.add_arguments(commands.add_parser("report", help="one self-contained HTML page from results: the verdict grid, history, bench"))

    merge = commands.add_parser("merge", help="merge per-job matrix.json files into one matrix.json and matrix.md")
    merge.add_argument("inputs", nargs="+", type=absolute_path, help="matrix.json files")
    merge.add_argument("--output", type=absolute_path, default=DEFAULT_RESULTS, help="merged matrix.json to write")

    docs = commands.add_parser("docs", help="regenerate the generated pages of docs/ (commands, families, exit codes) from the code")
    docs.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated page is not current")
    docs.add_argument("--screenshots", action="store_true", help="also redraw docs/report/*.png (the report's browser)")
    return parser


def _paths_then(body):
    """`body` after the --output and --store files it writes are checked (bisect, history)."""
    def checked(args) -> int:
        for option, path in (("--output", args.output), ("--store", args.store)):
            if path:
                check_file_option(option, path)
        if not getattr(args, "render_only", False):
            setup.check_with_pins(args)
        return body(args)
    return checked


def _output_folder_then(body):
    """`body` after the --output folder it writes into is checked (watch, gate, repro)."""
    def checked(args) -> int:
        check_folder_option("--output", args.output)
        if args.command == "gate" and args.bench and args.bench != "smoke":
            gpu_device("`gate --bench smoke` runs on the CPU")
        return body(args)
    return checked


# Each command's body: a function of the parsed arguments that returns the exit code.
COMMANDS = {
    "matrix": matrix.run, "gpu-matrix": matrix.run, "tests": matrix.tests, "bench": bench.run,
    "versions": setup.versions, "wheelhouse": setup.wheelhouse, "refresh-latest": setup.refresh_latest, "merge": setup.merge,
    "bisect": _paths_then(bisect.run), "history": _paths_then(history.run), "backtest": backtest.run, "watch": _output_folder_then(watch.run),
    "gate": _output_folder_then(gate.run), "repro": _output_folder_then(repro.run),
    "doctor": doctor.run, "scan": lambda args: scan.run(args, args.argv), "report": report.run,
    "docs": lambda args: docgen.run(args, _parser()),
}


def _bisect_record(args) -> Path:
    return args.output or bisect.default_output(args.package.lower(), args.family or "", args.test)


# Where each command keeps what it finished, as it finishes: named when Ctrl-C stops it.
KEPT = {
    "matrix": [("cells", lambda args: args.results)], "gpu-matrix": [("cells", lambda args: args.results)],
    "gate": [("cells", lambda args: args.output / "matrix.json")],
    "bench": [("the finished sets' benchmarks", lambda args: args.results)],
    "wheelhouse": [("the downloaded wheels", lambda args: args.dest)], "repro": [("the finished exports", lambda args: args.output)],
    "bisect": [("the probes", _bisect_record), ("the probes", lambda args: args.store or DEFAULT_STORE)],
    "history": [("the probes", lambda args: args.store or DEFAULT_STORE)],
    "backtest": [("the probes", lambda args: args.store or DEFAULT_STORE), ("the maps", lambda args: args.maps)],
    "watch": [("the probes", lambda args: args.store or DEFAULT_STORE), ("the bisects", lambda args: args.output)],
}


def kept_after_interrupt(args) -> str:
    """The end of the one line Ctrl-C (or SIGTERM, SIGHUP) leaves: what the command had finished and where it is kept
    (every command writes its results as they finish; a file is never left half-written)."""
    kept = []
    for what, place in KEPT.get(getattr(args, "command", None), []):
        path = Path(place(args))
        if not path.exists():
            continue
        if what == "cells":
            try:
                data = results.load(path)
                waiting = len(data["not_run"])
                what = f"{len(data['cells'])} finished cells" + (f" ({waiting} not run)" if waiting else "")
            except (OSError, ValueError, KeyError, TypeError):
                what = "the finished cells"
        kept.append(f"{what} in {path}")
    return f"kept {'; '.join(kept)}" if kept else "nothing was recorded yet"


def main(argv: list[str] | None = None) -> int:
    """Every command: its exit code, 2 on a usage error (one line). Ctrl-C, SIGTERM and SIGHUP are one line saying what
    was kept, the pytest children stopped (stackcheck.runner.signals), and exit 128 + the signal (130, 143, 129); a
    reader that stops reading (`doctor --json | head`) ends the command quietly with 141, as SIGPIPE would."""
    argv = sys.argv[1:] if argv is None else argv
    parsed: list = []
    try:
        with signals.handled():
            try:
                code = _main(argv, parsed)
                sys.stdout.flush()  # a reader gone away is found here, not in the interpreter's own flush at exit
                return code
            except KeyboardInterrupt as interruption:
                signals.stop_all()  # children of other threads (history's probes); the main thread's are stopped
                print(f"stackcheck: interrupted{signals.described(interruption)}: "
                      f"{kept_after_interrupt(parsed[0] if parsed else None)}", file=sys.stderr)
                return exitcodes.interrupted(signals.signal_of(interruption))
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more reaches the closed pipe
        return exitcodes.READER_GONE


def _main(argv: list[str], parsed: list) -> int:
    try:
        args = _parser().parse_args(argv)
        parsed.append(args)
        check_checkout(args.command)
        check_common_options(args)
        args.argv = argv
        return COMMANDS[args.command](args)
    except (UsageError, envs.EnvBuildError, LedgerError) as exc:
        print(f"stackcheck: {exc}", file=sys.stderr)
        return exitcodes.USAGE
    except BrokenPipeError:
        raise  # the reader went away: main's own exit code
    except Exception:  # noqa: BLE001 - a bug of stackcheck: its traceback, and an exit code no finding has
        traceback.print_exc()
        print(f"stackcheck: internal error (exit {exitcodes.INTERNAL}): the traceback above is a bug of stackcheck",
              file=sys.stderr)
        return exitcodes.INTERNAL
