"""history: resume after a crash, incremental re-runs (a new release, new family definitions, another
platform), and agreement with bisect over the same range without a new probe; watch: the scheduled loop
(newest releases, gate, bisect of each flip, job summary) on a fake index. The probe runner is a scripted
stand-in for lane.run_timed (no environments, no network); the real sweep is in docs/history-transformers.md."""

import json

import pytest
from packaging.version import Version

from stackcheck.core.versions import resolve
from stackcheck import cli
from stackcheck.runner import envs, lane
from stackcheck.core import results
from stackcheck.core.cell import Cell
from stackcheck.commands.releases import probes

FAMILIES = "params4bit_kwargs,cache_parity"
RELEASES = ["5.10.1", "5.11.0", "5.12.0", "5.13.0", "5.14.0"]
PARAMS = "tests/families/test_params4bit_kwargs.py::test_offload_hook_moves_loaded_param_to_meta[cpu]"
CACHE = "tests/families/test_cache_parity.py::test_generate_cached_logits_match_full_forward[cpu-nf4]"


def scripted_cells(version: str) -> list[dict]:
    """params4bit_kwargs is fixed in 5.12.0; cache_parity's signature changes (not its verdict) in 5.13.0,
    and it breaks anew in 5.25.0."""
    fixed = Version(version) >= Version("5.12.0")
    params = {"verdict": "pass" if fixed else "known_bug", "bug": None if fixed else "params4bit_kwargs",
              "signature": None if fixed else "TypeError: Params4bit.__new__() got an unexpected keyword argument"}
    cache = {"verdict": "known_bug", "bug": "cache_parity_bug",
             "signature": "KeyError: 2 @ a.py:forward" if Version(version) < Version("5.13.0") else "KeyError: 'sliding_attention' @ b.py:get"}
    if Version(version) >= Version("5.25.0"):
        cache = {"verdict": "new_failure", "bug": None, "signature": "RuntimeError: boom @ c.py:generate"}
    return [dict(params, family="params4bit_kwargs", test=PARAMS, lane="cpu"), dict(cache, family="cache_parity", test=CACHE, lane="cpu")]


@pytest.fixture
def runner(monkeypatch, tmp_path):
    """lane.run_timed scripted per transformers version; `calls` lists the versions really probed, and
    `crash_at` makes one probe raise as a crashed sweep would."""
    state = {"calls": [], "crash_at": None, "families": [], "empty_at": None}

    def run_timed(vset, targets, results_path, find_links=(), no_index=False, baseline=None, lanes=("cpu",), env=None, options=()):
        version = vset.pins["transformers"].version
        if version == state["crash_at"]:
            raise KeyboardInterrupt
        state["calls"].append(version)
        results.record_set(results_path, vset.name, {package: pin.version for package, pin in vset.pins.items()})  # as the plugin does
        families = {t.removeprefix("tests/families/test_").removesuffix(".py") for t in targets}
        state["families"].append(families)
        if version == state["empty_at"]:  # a run stopped before any cell (a signal, a killed child)
            return [], {"environment": 0.0, "startup": 1.0, "fixtures": 0.0, "tests": 0.0, "exit": 0.1, "total": 1.1}
        cells = [Cell.from_dict(dict(c, set=vset.name, note=None, seconds=0.1)) for c in scripted_cells(version) if c["family"] in families]
        return cells, {"environment": 0.0, "startup": 1.0, "fixtures": 0.0, "tests": 0.5, "exit": 0.1, "total": 1.6}

    monkeypatch.setattr(lane, "run_timed", run_timed)
    monkeypatch.setattr(envs, "build", lambda *args, **kwargs: tmp_path / "python")
    monkeypatch.setattr(envs, "environment_requirements", lambda vset, groups=(): (sorted(vset.requirements()), False))
    return state


def history(tmp_path, *extra, releases=RELEASES, families=FAMILIES):
    argv = ["history", "transformers", "--from", releases[0], "--to", releases[-1], "--candidates", ",".join(releases),
            "--families", families, "--jobs", "1", "--store", str(tmp_path / "probes.json"), "--output", str(tmp_path / "history.json")]
    return cli.main([*argv, *extra])


def test_a_crash_loses_only_the_release_in_flight_and_a_rerun_resumes(tmp_path, runner):
    runner["crash_at"] = "5.13.0"
    assert history(tmp_path) == 130  # Ctrl-C: one line saying what was kept
    stored = [p["label"] for p in json.loads((tmp_path / "probes.json").read_text())["probes"]]
    # The queue is dropped when the crash reaches the main thread; a probe already started may finish.
    assert stored[:3] == ["5.10.1", "5.11.0", "5.12.0"] and "5.13.0" not in stored
    runner.update(crash_at=None, calls=[])
    assert history(tmp_path) == 0
    assert runner["calls"] == [r for r in RELEASES if r not in stored]
    record = json.loads((tmp_path / "history.json").read_text())
    assert [(r["release"], r["probe"]["reused"]) for r in record["releases"]] == [(r, r in stored) for r in RELEASES]


def test_only_what_changed_runs_again(tmp_path, runner, monkeypatch):
    assert history(tmp_path) == 0
    assert len(runner["calls"]) == 5
    runner["calls"].clear()
    assert history(tmp_path) == 0 and runner["calls"] == []  # nothing changed: nothing runs
    assert history(tmp_path, releases=[*RELEASES, "5.15.0"]) == 0 and runner["calls"] == ["5.15.0"]
    runner["calls"].clear()
    monkeypatch.setattr(probes, "probe_platform", lambda lanes: {"machine": "x86_64", "cpu_flags": "avx2"})
    assert history(tmp_path) == 0 and runner["calls"] == RELEASES  # another platform: every release again
    runner["calls"].clear()
    runner["families"].clear()
    real = results.family_fingerprints
    monkeypatch.setattr(results, "family_fingerprints",
                        lambda families: {f: "changed" if f == "cache_parity" else d for f, d in real(families).items()})
    assert history(tmp_path) == 0 and runner["calls"] == RELEASES  # one family's definitions changed: again, that family
    assert runner["families"] == [{"cache_parity"}] * len(RELEASES)
    runner["calls"].clear()
    monkeypatch.setattr(results, "fingerprint", lambda: "another-ledger")
    assert history(tmp_path) == 0 and runner["calls"] == []  # the ledger is no definition of a stored outcome


def test_the_map_marks_verdict_and_signature_transitions(tmp_path, runner):
    assert history(tmp_path) == 0
    record = json.loads((tmp_path / "history.json").read_text())
    assert [(t["family"], t["before"], t["after"], t["kind"]) for t in record["transitions"]] == [
        ("params4bit_kwargs", "5.11.0", "5.12.0", "verdict"), ("cache_parity", "5.12.0", "5.13.0", "signature")]
    table = (tmp_path / "history.md").read_text()
    assert "| release | params4bit_kwargs | cache_parity |" in table
    assert "| 5.12.0 | **P** | K |" in table and "| 5.13.0 | P | K † |" in table
    assert "- **5.11.0 → 5.12.0** (verdict):" in table


def test_the_map_has_a_row_per_known_bug_so_a_fix_is_a_change_of_colour(tmp_path, runner):
    assert history(tmp_path) == 0
    table = (tmp_path / "history.md").read_text()
    assert "- `params4bit_kwargs`: present 5.10.1…5.11.0, absent 5.12.0…5.14.0" in table
    # cache_parity's cells fail with a bug of their own: the ledger's cache_parity bugs cannot show.
    assert "- `gemma4_uncached_kv_sharing`: masked 5.10.1…5.14.0" in table


def test_bisect_over_a_swept_range_runs_only_its_flake_checks(tmp_path, runner):
    assert history(tmp_path) == 0
    runner["calls"].clear()
    output = tmp_path / "bisect.json"
    argv = ["bisect", "transformers", "--good", "5.14.0", "--bad", "5.10.1", "--family", "params4bit_kwargs",
            "--candidates", ",".join(RELEASES), "--store", str(tmp_path / "probes.json"), "--output", str(output)]
    assert cli.main(argv) == 0
    record = json.loads(output.read_text())
    # Every first run comes from the store; a flipped probe's second run is a real one (a flake check).
    assert sorted(runner["calls"]) == sorted(p["candidate"] for p in record["probes"] if p["run"] == 2) and runner["calls"]
    answer = record["answer"]
    transition = next(t for t in json.loads((tmp_path / "history.json").read_text())["transitions"] if t["family"] == "params4bit_kwargs")
    assert (answer["last_before"], answer["first"]) == (transition["before"], transition["after"]) == ("5.11.0", "5.12.0")


def test_a_bisect_probe_is_stored_and_a_history_reuses_it(tmp_path, runner):
    argv = ["bisect", "transformers", "--good", "5.14.0", "--bad", "5.10.1", "--family", "params4bit_kwargs",
            "--candidates", ",".join(RELEASES), "--store", str(tmp_path / "probes.json"), "--output", str(tmp_path / "b.json")]
    assert cli.main(argv) == 0
    probed = set(runner["calls"])
    runner["calls"].clear()
    assert history(tmp_path, families="params4bit_kwargs") == 0
    assert set(runner["calls"]) == set(RELEASES) - probed  # the bisect's probes are not run again


@pytest.mark.parametrize("argv, message", [
    (["history", "transformers", "--from", "5.14.0", "--to", "5.10.1"], "--from 5.14.0 is newer than --to 5.10.1"),
    (["history", "numpy", "--from", "1", "--to", "2"], "unknown package 'numpy'"),
    (["history", "transformers", "--from", "5.10.1", "--to", "5.14.0", "--with", "transformers==5.0.0"], "the package being swept"),
    (["history", "transformers", "--from", "5.10.1", "--to", "5.14.0", "--jobs", "0"], "--jobs 0"),
    (["history", "transformers", "--from", "5.10.1", "--to", "5.14.0", "--families", "nope"], "unknown family 'nope'"),
])
def test_usage_errors_are_one_line(argv, message, capsys, runner):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def watch(tmp_path, releases: dict) -> int:
    (tmp_path / "releases.json").write_text(json.dumps(releases))
    return cli.main(["watch", "--releases", str(tmp_path / "releases.json"), "--store", str(tmp_path / "probes.json"),
                     "--output", str(tmp_path / "watch")])


LATEST = {"peft": ["0.21.2"], "accelerate": ["1.15.0"], "bitsandbytes": ["0.50.2"]}
LATEST_TRANSFORMERS = resolve(["latest"])[0].pins["transformers"].version  # sets.toml's, refreshed by refresh-latest


def test_watch_gates_new_releases_and_bisects_the_flip_into_the_job_summary(tmp_path, runner, monkeypatch):
    step_summary = tmp_path / "step-summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step_summary))
    assert watch(tmp_path, {"transformers": ["5.22.2", "5.23.0", "5.24.0", "5.25.0"], **LATEST}) == 1  # a regression
    summary = step_summary.read_text()
    assert "## stackcheck gate: FAIL" in summary and f"transformers {LATEST_TRANSFORMERS} → 5.25.0" in summary
    assert "| cache_parity | transformers | verdicts | first broken in transformers 5.25.0 (last before it: 5.24.0) |" in summary
    record = json.loads((tmp_path / "watch" / "bisect-transformers-cache_parity.json").read_text())
    assert record["answer"]["first"] == "5.25.0"
    runner["calls"].clear()
    assert watch(tmp_path, {"transformers": ["5.22.2", "5.23.0", "5.24.0", "5.25.0"], **LATEST}) == 1
    rerun = [p["candidate"] for path in (tmp_path / "watch").glob("bisect-*.json") for p in json.loads(path.read_text())["probes"] if p["run"] == 2]
    assert sorted(runner["calls"]) == sorted(rerun)  # the next scheduled run finds every probe in the store but the flake checks


def test_watch_with_nothing_new_runs_nothing(tmp_path, runner):
    assert watch(tmp_path, {"transformers": ["5.22.2", LATEST_TRANSFORMERS], **LATEST}) == 0
    assert runner["calls"] == []
    assert "nothing new" in (tmp_path / "watch" / "summary.md").read_text()


def test_a_release_that_does_not_import_is_one_cell_per_family_saying_so(tmp_path, monkeypatch, capsys):
    """peft 0.17.1 on transformers 5 cannot import (`HybridCache` is gone): its probe says so in one line and one cell
    per family, never an error per test, and the release is kept in the store as unusable."""
    problem = "peft 0.17.1 does not import on Python 3.12 (ImportError: cannot import name 'HybridCache' from 'transformers')"
    monkeypatch.setattr(envs, "build", lambda *args, **kwargs: tmp_path / "python")
    monkeypatch.setattr(envs, "import_problem", lambda python: problem)
    monkeypatch.setattr(lane, "run_pytest", lambda *args, **kwargs: pytest.fail("a set that does not import ran its tests"))
    (vset,) = resolve(["latest"], ["peft==0.17.1"])
    cells, costs = lane.run_timed(vset, lane.family_targets(None), tmp_path / "matrix.json")
    assert capsys.readouterr().err == f"stackcheck: set {vset.name} is unusable: {problem}; its cells are not run\n"
    assert len(cells) == len({c.family for c in cells}) and {c.signature for c in cells} == {f"set unusable: {problem}"}
    assert results.load(tmp_path / "matrix.json")["sets"][vset.name]["env"] == "unusable"


def test_the_backtest_disposes_of_every_cell_that_does_not_pass_and_leaves_the_rest_open(tmp_path, runner, capsys):
    plan = tmp_path / "plan.toml"
    plan.write_text('arch = []\n[libraries.transformers]\nfrom = "5.10.1"\nto = "5.25.0"\nbase = "seed"\n'
                    f'families = {FAMILIES.split(",")!r}\n'.replace("'", '"'))
    listed = tmp_path / "releases.json"
    listed.write_text(json.dumps({"transformers": [*RELEASES, "5.25.0"]}))
    argv = ["backtest", "--plan", str(plan), "--releases", str(listed), "--jobs", "1", "--store", str(tmp_path / "probes.json"),
            "--maps", str(tmp_path), "--output", str(tmp_path / "backtest.json")]
    assert cli.main(argv) == 1  # cache_parity's new failure on 5.25.0 is open
    page = (tmp_path / "backtest.md").read_text()
    assert "| **new_failure** | cache_parity | 1 | 5.25.0 |" in page
    assert "| known_bug | params4bit_kwargs | 2 | 5.10.1…5.11.0 |" in page  # the cells that fail inside the range
    assert "| params4bit_kwargs | K 5.10.1…5.11.0, P 5.12.0…5.25.0 |" in page
    assert (tmp_path / "history-transformers.json").exists() and len(runner["calls"]) == 6
    runner["calls"].clear()
    assert cli.main([*argv, "--render-only"]) == 1 and runner["calls"] == []  # drawn again from the maps, nothing run
    assert "1 cells open" in capsys.readouterr().out


def test_a_backtest_of_some_releases_adds_them_to_the_map_an_earlier_sweep_made(tmp_path, runner):
    """A map grows over sweeps of the same shape (another session's `--releases`, a new store): the releases the earlier
    sweep probed stay, each with the family definitions it ran under, and the page says when those differ."""
    plan = tmp_path / "plan.toml"
    plan.write_text('arch = []\n[libraries.transformers]\nfrom = "5.10.1"\nto = "5.25.0"\nbase = "seed"\n'
                    f'families = {FAMILIES.split(",")!r}\n'.replace("'", '"'))
    listed = tmp_path / "releases.json"

    def backtest(releases: list[str], store: str) -> dict:
        listed.write_text(json.dumps({"transformers": releases}))
        cli.main(["backtest", "--plan", str(plan), "--releases", str(listed), "--jobs", "1", "--store", str(tmp_path / store),
                  "--maps", str(tmp_path), "--output", str(tmp_path / "backtest.json")])
        return json.loads((tmp_path / "history-transformers.json").read_text())

    first = backtest(RELEASES[:2], "first.json")
    first_digest = first["sweep"]["fingerprint"]
    record = json.loads((tmp_path / "history-transformers.json").read_text())
    record["sweep"]["fingerprint"] = "0123456789abcdef"  # as if the earlier sweep ran under other definitions
    for row in record["releases"]:
        row["probe"]["definitions"] = None  # a map written before probes named theirs
    (tmp_path / "history-transformers.json").write_text(json.dumps(record))
    runner["calls"].clear()

    grown = backtest(RELEASES[2:4], "second.json")
    assert runner["calls"] == RELEASES[2:4]  # the earlier releases were not run again
    assert [r["release"] for r in grown["releases"]] == RELEASES[:4]
    assert [r["probe"]["definitions"] for r in grown["releases"]] == ["0123456789abcdef"] * 2 + [first_digest] * 2
    assert (grown["sweep"]["from"], grown["sweep"]["to"]) == (RELEASES[0], RELEASES[3])
    page = (tmp_path / "backtest.md").read_text()
    assert f"`0123456789abcdef` {RELEASES[0]}…{RELEASES[1]}; `{first_digest}` {RELEASES[2]}…{RELEASES[3]}" in page


def test_a_probe_stopped_before_any_cell_is_not_kept_and_runs_again(tmp_path, runner):
    runner["empty_at"] = "5.12.0"
    assert history(tmp_path) == 1  # a release without a probe
    record = json.loads((tmp_path / "history.json").read_text())
    assert [r["release"] for r in record["releases"] if r["probe"] is None] == ["5.12.0"]
    runner["empty_at"], runner["calls"] = None, []
    assert history(tmp_path) == 0 and runner["calls"] == ["5.12.0"]
