"""nox sessions. Each one is a thin call into stackcheck.cli, which builds one uv environment per version
set (torch from the platform, the libraries pinned), prints the resolved versions first, and runs pytest.
The same code runs as `python -m stackcheck ...` where nox is not installed."""

import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).parent))
from stackcheck import cli  # noqa: E402
from stackcheck.commands.report import browser  # noqa: E402
from stackcheck.core.versions import UsageError, every_set  # noqa: E402

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "uv"


def _run(command: str, session: nox.Session, *args: str) -> None:
    code = cli.main([command, *args, *session.posargs])
    if code:
        raise SystemExit(code)  # keeps the CLI's exit code (2 for a usage error) and its one-line message


# One session per CLI command: `nox -s NAME -- ARGS` is `python -m stackcheck NAME ARGS`.
COMMANDS = {
    "tests": "The harness's own tests plus the CPU lane of every family, on the default set; then `lint`.",
    "matrix": "The CPU lane of every set (or `-- --sets a,b --with pkg==ver`); writes results/matrix.{json,md}.",
    "gpu-matrix": "The GPU and CPU lanes of every set over the host's CUDA torch; fails in one line without a GPU.",
    "bench": "VRAM and tokens/s of each set as ratios against a baseline (`-- --sets seed,latest --smoke`); writes results/bench.md.",
    "wheelhouse": "Download every wheel the sets need for an offline target (`-- --cuda 130 --host-freeze FILE`).",
    "versions": "Print each set's pins.",
    "doctor": "Known bugs affecting an installed stack, and the changes that leave them: `-- [--python PATH] [--json]`.",
    "repro": "Standalone reproductions of failing cells, checked: `-- --from results/matrix.json` or `-- --sets seed --test ID`.",
    "scan": "Preflight a model folder (+ adapter folder) on meta: `-- MODEL [ADAPTER] [--device-map J] [--quantization J] [--python PATH]`.",
    "merge": "Merge per-job matrix.json files: `-- a/matrix.json b/matrix.json [--output results/matrix.json]`.",
    "report": "One self-contained HTML page from results/ (matrix, history sweeps, bench): `-- [--matrix F] [--output results/report.html]`.",
    "bisect": "First release where a family flips: `-- accelerate --good 1.15.0 --bad 1.13.0 --family params4bit_kwargs`.",
    "history": "Every release of a package through every family: `-- transformers --from 5.6.2 --to 5.23.0`; writes results/history-<package>.{json,md,png}.",
    "backtest": "Every release of each library in stackcheck/backtest.toml through its families, and the disposition of every cell that does not pass: `-- [--libraries peft] [--render-only]`; writes results/backtest.{json,md}.",
    "watch": "The newest releases gated against `latest`, and each family that flips bisected (the scheduled CI job); writes results/watch/.",
    "gate": "Baseline set vs candidate set: `-- --sets seed --with accelerate==1.14.0`; non-zero on a regression.",
}


def _command_session(command: str, doc: str) -> None:
    def session(session: nox.Session) -> None:
        if command == "tests":
            browser.ensure_chromium()  # on a CI machine (root, CI set): the report's browser tests run there
            session.notify("lint")  # and the layout's rules, lint and types: CI runs `nox -s tests`
        _run(command, session)

    def report(session: nox.Session) -> None:
        # The page's jinja2 and plotly (pyproject's `report` extra) in this session's own environment, not the user's.
        session.install("--quiet", "-e", ".[report]")
        session.run("python", "-m", "stackcheck", "report", *session.posargs)

    if command == "report":
        report.__doc__ = doc
        nox.session(name=command)(report)
        return
    session.__doc__ = doc
    nox.session(name=command, venv_backend="none")(session)


for _command, _doc in COMMANDS.items():
    _command_session(_command, _doc)


try:
    SET_NAMES = every_set()  # the opt-in sets (t4) run only when named: `nox -s matrix -- --sets t4,latest`
except UsageError as exc:  # `nox -l` still lists the other sessions, and says why there is no matrix_set
    print(f"stackcheck: {exc}; no matrix_set sessions", file=sys.stderr)
    SET_NAMES = []


# The lint environment's tools, pinned as the tests' are.
LINT_TOOLS = ("import-linter==2.17", "ruff==0.17.6", "mypy==2.4.1", "packaging>=23")


@nox.session
def lint(session: nox.Session) -> None:
    """The import contracts of the process boundary (pyproject's [tool.importlinter]), ruff, and the type check of
    core/, runner/ and commands/ (docs/architecture.md, "Rooms and rules"); `nox -s tests` runs it after the tests."""
    session.install("--quiet", *LINT_TOOLS)
    root = str(Path(__file__).parent)
    session.run("lint-imports", "--no-cache", env={"PYTHONPATH": root})
    session.run("ruff", "check", root)
    session.run("mypy", "--config-file", str(Path(root) / "pyproject.toml"), env={"MYPYPATH": root})


@nox.session
def docs(session: nox.Session) -> None:
    """Regenerate docs/commands.md and docs/families.md (checked current by the tests); `-- --screenshots` redraws docs/report/*.png."""
    session.install("--quiet", "-e", ".[report,browser]")
    session.run("python", "-m", "stackcheck", "docs", *session.posargs)


@nox.session(venv_backend="none")
@nox.parametrize("set_name", SET_NAMES, ids=SET_NAMES)
def matrix_set(session: nox.Session, set_name: str) -> None:
    """One set's CPU lane (one CI job each: `nox --list --json -s matrix_set` lists them); writes results/matrix.{json,md}."""
    _run("matrix", session, "--sets", set_name)
