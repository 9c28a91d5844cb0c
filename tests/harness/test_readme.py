"""The README's commands, and those of docs/running.md, run as written (issue 29), so that they cannot drift from the
code again; the README stays a front door (issue 32).

A command block is marked by an HTML comment on the line before it (invisible once rendered):
- `<!-- runnable -->` (or `<!-- runnable exit=N -->`): every command runs for real and exits 0 (or N); for cheap ones.
- `<!-- checked -->`: every command runs in-process up to the first thing that costs minutes or needs the network or
  a GPU (an environment build, the package index, a download; a GPU stands in for the host's): every option is
  parsed and every check a user mistake meets runs, so a renamed option, a family or set that no longer exists or
  a path that moved fails here.
- `except=K[,L]`: the block's K-th command is left out (an example path the reader supplies, a file an earlier run
  writes).
`nox -s NAME -- ARGS` is `python -m stackcheck NAME ARGS` (noxfile.COMMANDS); `pip install` and `venv` steps are skipped.
Besides the marked blocks, the doctor sample's lines are doctor's own output on the set and CPU the sample names: in
the sample, `N` stands for a count and `...` for text left out, so that a ledger entry added does not make it wrong.
"""

import re
import shlex
import subprocess
import sys

import pytest

from stackcheck import REPO_ROOT, cli
from stackcheck.commands import matrix as matrix_command
from stackcheck.runner import envs, wheelhouse
from stackcheck.core import versions
from stackcheck.commands.releases import bisect, history, watch

README = (REPO_ROOT / "README.md").read_text()
# The pages whose command blocks are checked: the README and the guide to running every command.
PAGES = {name: (REPO_ROOT / name).read_text() for name in ("README.md", "docs/running.md")}
MARKED = re.compile(r"^<!-- (runnable|checked)((?: [a-z]+=[0-9,]+)*) -->\n\n((?:    .*\n|\n)+)", re.M)


def marked_commands(kind: str) -> list[tuple[str, str, dict]]:
    """(where, command, options) of each command in the pages' blocks of `kind`."""
    return [found for name, text in PAGES.items() for found in _marked(name, text, kind)]


def _marked(name: str, text: str, kind: str) -> list[tuple[str, str, dict]]:
    found = []
    for match in MARKED.finditer(text):
        if match[1] != kind:
            continue
        options = dict(option.split("=") for option in match[2].split())
        skipped = {int(k) for k in options.get("except", "").split(",") if k}
        text = re.sub(r"\\\n\s*", " ", match[3])  # continuation lines
        lines = [line[4:] for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        if any(line.startswith("$ ") for line in lines):
            lines = [line[2:] for line in lines if line.startswith("$ ")]
        line_number = text[: match.start()].count("\n") + 1
        found += [(f"{name}:{line_number} #{index}", line, options) for index, line in enumerate(lines, 1) if index not in skipped]
    return found


def stackcheck_argvs(command: str) -> list[list[str]]:
    """The stackcheck argument lists a README command line runs."""
    argvs = []
    for part in command.split("&&"):
        words = shlex.split(part, comments=True)
        if words[:3] in (["python3", "-m", "pip"], ["python", "-m", "pip"]) or words[:3] in (["python3", "-m", "venv"], ["."]):
            continue
        if words[:2] == ["nox", "-s"]:
            argvs.append([words[2], *words[4 if words[3:4] == ["--"] else 3:]])
        elif words[:3] in (["python", "-m", "stackcheck"], ["python3", "-m", "stackcheck"]):
            argvs.append(words[3:])
        else:
            raise AssertionError(f"a README command this test cannot run: {command}")
    return argvs


class Reached(BaseException):
    """The command got as far as checking goes: to a build, the package index or a download. A BaseException, so
    the command's own last resort (an unexpected Exception is an internal error, exit 3) lets it through."""


@pytest.fixture
def as_far_as_checks_go(monkeypatch):
    def reached(*args, **kwargs):
        raise Reached

    for owner, name in [(envs, "build"), (versions, "index_versions"), (bisect, "index_versions"), (history, "index_versions"),
                        (watch, "index_versions"), (wheelhouse, "build"), (matrix_command, "run_pytest")]:
        monkeypatch.setattr(owner, name, reached)
    monkeypatch.setattr(envs, "cuda_device", lambda: "a stand-in GPU")
    monkeypatch.setattr(wheelhouse, "require_uv", lambda: None)
    monkeypatch.chdir(REPO_ROOT)  # the README's paths are the clone's
    results = REPO_ROOT / "results"
    before = {path for path in results.rglob("*")} | {results} if results.exists() else set()
    yield
    # A command makes its output folder before its first build: take away the empty ones the check made.
    for folder in sorted((p for p in [results, *results.rglob("*")] if p.is_dir() and p not in before), key=lambda p: -len(p.parts)):
        if not any(folder.iterdir()):
            folder.rmdir()


CHECKED = marked_commands("checked")


def test_the_readme_marks_its_commands():
    assert len(CHECKED) >= 20 and any(command.startswith("nox -s tests") or "&& nox -s tests" in command for _w, command, _o in CHECKED)


def test_the_readme_is_a_front_door():
    """At most 120 lines; the main job, the tests (exactly `.ci/run`'s command) and the venv line for Pythons that refuse
    system installs in its first 20; no measured number, which would go stale (they live in docs/runs.md), but the main
    job's time on the first screen, on the line that links its run in docs/runs.md."""
    lines = README.splitlines()
    assert len(lines) <= 120, f"README.md has {len(lines)} lines: move the detail into docs/"
    head = "\n".join(lines[:20])
    ci_command = (REPO_ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "nox -s matrix" in head and "python3 -m venv .venv" in head
    assert ci_command.replace(" --quiet", "").strip() in head, f"the README's test command is not .ci/run's: {ci_command}"
    unit = r"\b\d[\d,.]* ?(?:s|min|GB|MB|MiB|GiB|cells|tokens/s|%)(?=[\s,.;)])"
    timed = [line for line in lines[:20] if "docs/runs.md" in line and re.search(unit, line)]
    assert timed, "the first screen does not say how long `nox -s matrix` takes (measured, linking docs/runs.md)"
    measured = re.findall(unit, "\n".join(line for line in lines if line not in timed))
    assert not measured, f"measured numbers in README.md (they go to docs/runs.md): {measured}"
    for target in re.findall(r"\]\(((?:docs/)[^)#]+)", README):
        assert (REPO_ROOT / target).exists(), f"README.md links to {target}, which does not exist"


@pytest.mark.parametrize("where, command, options", CHECKED, ids=[where for where, _c, _o in CHECKED])
def test_a_checked_readme_command_passes_every_check(where, command, options, as_far_as_checks_go, capsys):
    for argv in stackcheck_argvs(command):
        try:
            code = cli.main(argv)
        except Reached:
            continue
        err = capsys.readouterr().err
        assert code == 0, f"{where}: `{command}` exited {code}: {err}"


def test_the_runnable_readme_commands_run():
    for where, command, options in marked_commands("runnable"):
        for argv in stackcheck_argvs(command):
            run = subprocess.run([sys.executable, "-m", "stackcheck", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
            assert run.returncode == int(options.get("exit", 0)) and "Traceback" not in run.stderr, f"{where}: {run}"


def sample_pattern(line: str) -> re.Pattern:
    """A line of the doctor sample as a pattern: `N` is any count, `...` any text."""
    pattern = re.escape(line).replace(re.escape("..."), ".*")
    return re.compile(re.sub(r"\bN\b", r"\\d+", pattern))


def test_a_doctor_sample_line_stands_for_the_lines_it_should():
    assert sample_pattern("N known bugs affect this install, and an upgrade leaves them:").fullmatch(
        "17 known bugs affect this install, and an upgrade leaves them:")
    assert sample_pattern("- params4bit_kwargs [...]: affects accelerate<1.14.0...").fullmatch(
        "- params4bit_kwargs [meta_quant_state, tied_head]: affects accelerate<1.14.0,>=0.33.0")
    assert not sample_pattern("N known bugs affect this install, and an upgrade leaves them:").fullmatch(
        "17 known bugs affect this install, and no release leaves them:")


def test_the_doctor_sample_is_doctors_output():
    """Every line of the sample (`...` alone stands for lines left out) is doctor's, in order, where this harness runs
    the sample's set on a CPU with the sample's flags (the bugs that affect an install depend on both)."""
    page = next(text for text in PAGES.values() if "$ python -m stackcheck doctor " in text)
    sample = re.search(r"^    \$ python -m stackcheck doctor .*\n((?:    .*\n|\n)+)", page, re.M)[1]
    lines = [line[4:] for line in sample.splitlines() if line.strip() and line.strip() != "..."]
    wanted = dict(pair.split(" ", 1) for pair in lines[0].removeprefix("stackcheck doctor: ").split(", "))
    installed = versions.installed_versions()
    flags = re.search(r"cpu_flags (.*)$", lines[1])[1]
    actual = subprocess.run([sys.executable, "-m", "stackcheck", "doctor", "--python", sys.executable], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    if any(installed.get(k) != v for k, v in wanted.items() if k != "python") or f"cpu_flags {flags}\n" not in actual.stdout:
        pytest.skip("the sample is of another set or CPU")
    output = iter(actual.stdout.splitlines())
    for line in lines[2:]:
        pattern = sample_pattern(line)
        assert any(pattern.fullmatch(out) for out in output), \
            f"the doctor sample says `{line}`, which doctor no longer prints (in this order)"
