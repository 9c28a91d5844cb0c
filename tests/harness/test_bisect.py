"""Bisect: the search over candidates, endpoint checks, flake re-runs and untestable skips, driven by a
scripted stand-in for the probe runner (no network, no environments); the candidate lists from releases
and from a local git clone; usage errors. The real end-to-end run is in test_real_sets.py."""

import json
import math
import subprocess

import pytest
from packaging.version import Version

from stackcheck import cli
from stackcheck.core.cell import Cell
from stackcheck.commands.releases.bisect import BAD, GOOD, UNTESTABLE, Bisection, Candidate, git_candidates, release_candidates, search
from stackcheck.core.versions import UsageError

TEST = "tests/families/test_params4bit_kwargs.py::test_offload_hook_moves_loaded_param_to_meta"
KNOWN = {"test": TEST, "verdict": "known_bug", "bug": "params4bit_kwargs", "signature": "TypeError: Params4bit.__new__() ..."}
PASSED = {"test": TEST, "verdict": "pass", "bug": None, "signature": None}
VARIANT = {"test": TEST, "verdict": "new_failure", "bug": None, "signature": "KeyError: 'sliding_attention' @ x"}
UNBUILT = {"test": "tests/families/test_params4bit_kwargs.py", "verdict": "error", "bug": None, "signature": "environment not built: x"}


@pytest.mark.parametrize("count", [2, 3, 4, 7, 16, 31, 100])
def test_search_finds_every_flip_in_about_log2_probes(count):
    for flip in range(1, count):
        probed = []

        def newer_side(index, flip=flip, probed=probed):
            probed.append(index)
            return index >= flip

        assert search(count, newer_side) == (flip - 1, flip)
        assert len(probed) <= math.ceil(math.log2(count - 1)) if count > 2 else not probed


def test_search_skips_untestable_candidates_for_a_neighbour():
    untestable = {7, 8, 9}
    assert search(20, lambda i: None if i in untestable else i >= 12) == (11, 12)
    # The flip hides behind untestable candidates: the answer is a range, as with `git bisect skip`.
    assert search(20, lambda i: None if i in untestable else i >= 9) == (6, 10)


def candidates(*labels):
    return [Candidate(label, f"accelerate=={label}") for label in labels]


def scripted(outcomes):
    """A probe runner that returns the cells scripted per label; a list gives one answer per run."""
    calls = []

    def run_cells(candidate, run=1):
        calls.append(candidate.label)
        cells = outcomes[candidate.label]
        return [Cell("s", "params4bit_kwargs", c["test"], "cpu", c["verdict"], signature=c["signature"], bug=c["bug"])
                for c in (cells.pop(0) if isinstance(cells, list) and isinstance(cells[0], list) else cells)]

    return run_cells, calls


RELEASES = ["1.10.0", "1.11.0", "1.12.0", "1.13.0", "1.14.0", "1.15.0", "1.16.0", "1.17.0", "1.18.0"]


def test_first_fixed_in_with_the_json_on_disk_after_every_probe(tmp_path):
    output = tmp_path / "bisect.json"
    run_cells, calls = scripted({v: [KNOWN] if Version(v) < Version("1.14.0") else [PASSED] for v in RELEASES})

    def recorded_runs_so_far(candidate, run):
        written = json.loads(output.read_text())
        assert written["status"] == "running" and len(written["probes"]) == len(calls)
        return run_cells(candidate)

    record = Bisection(candidates(*RELEASES), True, recorded_runs_so_far, {"package": "accelerate"}, output).run()
    assert record["status"] == "answered" and record["direction"] == "first fixed in"
    assert record["answer"] == {"first": "1.14.0", "last_before": "1.13.0", "untestable_between": []}
    assert json.loads(output.read_text()) == record
    # Both endpoints, the newer one again (it flips from the older), then log2(9) probes, each good one twice.
    assert calls[:3] == ["1.18.0", "1.10.0", "1.18.0"]
    searched = calls[3:]
    assert len(set(searched)) <= math.ceil(math.log2(len(RELEASES) - 1))
    assert all(searched.count(v) == (2 if Version(v) >= Version("1.14.0") else 1) for v in set(searched))


def test_first_broken_in_reports_a_third_outcome_as_bad_with_its_signature():
    outcomes = {v: [PASSED] for v in RELEASES[:3]} | {v: [VARIANT] for v in RELEASES[3:6]} | {v: [KNOWN] for v in RELEASES[6:]}
    run_cells, _calls = scripted(outcomes)
    record = Bisection(candidates(*RELEASES), False, run_cells, {}).run()
    assert record["direction"] == "first broken in" and record["answer"]["first"] == "1.13.0"
    sides = {p["candidate"]: p["side"] for p in record["probes"]}
    assert sides["1.10.0"] == GOOD and sides["1.18.0"] == BAD
    signatures = {c["signature"] for p in record["probes"] if p["candidate"] in RELEASES[3:6] for c in p["cells"]}
    assert VARIANT["signature"] in signatures


def test_endpoints_that_do_not_differ_stop_before_any_search():
    run_cells, calls = scripted({v: [KNOWN] for v in RELEASES})
    record = Bisection(candidates(*RELEASES), True, run_cells, {}).run()
    assert record["status"].startswith("the endpoints do not differ") and record["answer"] is None
    assert calls == ["1.18.0", "1.10.0"]


def test_a_flip_that_does_not_reproduce_is_untestable_and_skipped():
    outcomes = {v: [KNOWN] if Version(v) < Version("1.14.0") else [PASSED] for v in RELEASES}
    outcomes["1.14.0"] = [[PASSED], [KNOWN]]  # flaky: passes once, then fails
    run_cells, calls = scripted(outcomes)
    record = Bisection(candidates(*RELEASES), True, run_cells, {}).run()
    assert calls.count("1.14.0") == 2
    flaky = [p for p in record["probes"] if p["candidate"] == "1.14.0"]
    assert flaky[-1]["side"] == UNTESTABLE and "flaky" in flaky[-1]["reason"]
    assert record["answer"] == {"first": "1.15.0", "last_before": "1.13.0", "untestable_between": ["1.14.0"]}
    assert record["status"].startswith("ambiguous")


def test_an_environment_that_cannot_be_built_is_skipped():
    outcomes = {v: [KNOWN] if Version(v) < Version("1.16.0") else [PASSED] for v in RELEASES}
    outcomes["1.14.0"] = [UNBUILT]
    run_cells, _calls = scripted(outcomes)
    record = Bisection(candidates(*RELEASES), True, run_cells, {}).run()
    assert record["answer"]["first"] == "1.16.0" and record["status"] == "answered"
    assert {p["side"] for p in record["probes"] if p["candidate"] == "1.14.0"} <= {UNTESTABLE}


def test_an_untestable_endpoint_ends_the_run():
    run_cells, _calls = scripted({"1.10.0": [UNBUILT], "1.18.0": [PASSED]})
    record = Bisection(candidates("1.10.0", "1.18.0"), True, run_cells, {}).run()
    assert record["status"].startswith("the bad endpoint 1.10.0 is untestable") and record["answer"] is None


def test_a_crash_keeps_the_finished_probes_on_disk(tmp_path):
    output = tmp_path / "bisect.json"
    outcomes = {v: [KNOWN] if Version(v) < Version("1.14.0") else [PASSED] for v in RELEASES}
    run_cells, _calls = scripted(outcomes)

    def crash_in_the_search(candidate, run):
        if candidate.label == "1.14.0":
            raise RuntimeError("disk full")
        return run_cells(candidate)

    with pytest.raises(RuntimeError):
        Bisection(candidates(*RELEASES), True, crash_in_the_search, {}, output).run()
    written = json.loads(output.read_text())
    assert written["status"] == "stopped: RuntimeError: disk full" and len(written["probes"]) == 3


def test_release_candidates_are_ordered_by_packaging_between_the_endpoints():
    listed = [Version(v) for v in ["1.9.0", "1.10.0", "1.2.0", "1.11.0", "1.13.0"]]
    found = release_candidates("accelerate", Version("1.11.0"), Version("1.9.0"), listed)
    assert [c.label for c in found] == ["1.9.0", "1.10.0", "1.11.0"]
    assert found[1].pin == "accelerate==1.10.0"
    with pytest.raises(UsageError, match="accelerate 1.12.0 is not among the releases"):
        release_candidates("accelerate", Version("1.12.0"), Version("1.9.0"), listed)


def test_git_candidates_are_first_parent_commits_installed_from_the_clone(tmp_path):
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    for n in range(5):
        (tmp_path / "f").write_text(str(n))
        git("add", "f")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", f"c{n}")
        git("tag", f"c{n}")
    shas = git("rev-list", "--reverse", "HEAD").split()
    found, good_is_newer = git_candidates("accelerate", tmp_path, "c4", "c1")
    assert good_is_newer and [c.label for c in found] == [s[:12] for s in shas[1:]]
    assert found[0].pin == f"accelerate@git+file://{tmp_path.resolve()}@{shas[1]}"
    assert git_candidates("accelerate", tmp_path, "c0", "c2")[1] is False


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bisect", "numpy", "--good", "1", "--bad", "2", "--family", "params4bit_kwargs"], "unknown package 'numpy'"),
        (["bisect", "accelerate", "--good", "1.15.0", "--bad", "1.13.0", "--family", "nosuch"], "unknown family 'nosuch'"),
        (["bisect", "accelerate", "--good", "1.x!", "--bad", "1.13.0", "--family", "params4bit_kwargs"], "--good '1.x!' is not a valid version"),
        (["bisect", "accelerate", "--good", "1.15.0", "--bad", "1.12.5", "--family", "params4bit_kwargs",
          "--candidates", "1.13.0,1.15.0"], "accelerate 1.12.5 is not among the releases"),
        (["bisect", "accelerate", "--good", "1.15.0", "--bad", "1.15", "--family", "params4bit_kwargs",
          "--candidates", "1.15.0"], "name the same candidate"),
        (["bisect", "accelerate", "--good", "1.15.0", "--bad", "1.13.0", "--family", "params4bit_kwargs",
          "--with", "accelerate==1.14.0"], "--with pins accelerate, the package being bisected"),
        (["bisect", "accelerate", "--good", "1.15.0", "--bad", "1.13.0", "--test", "tests/harness/test_bisect.py::x"],
         "is not a family test id"),
    ],
)
def test_bisect_usage_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stackcheck: ") and message in err and "\n" not in err


def test_the_flake_check_runs_again_instead_of_reading_the_store(tmp_path, monkeypatch, capsys):
    """bisect's second run of a flipped candidate is a real run: the probe store, which its first run has just
    written, would give that run back and the check would prove nothing."""
    from stackcheck.runner import lane
    from stackcheck.core.cell import Cell
    from stackcheck.commands.releases import probes

    runs = []

    def run_timed(vset, targets, results_path, *args, **kwargs):
        runs.append(vset.name)
        version = Version(str(vset.pins["accelerate"]))
        cell = dict(KNOWN if version < Version("1.14.0") else PASSED, family="params4bit_kwargs", set=vset.name, lane="cpu")
        return [Cell.from_dict(cell)], {"environment": 0.0, "total": 0.0}

    monkeypatch.setattr(lane, "run_timed", run_timed)
    monkeypatch.setattr(probes.lane, "run_timed", run_timed)
    store, output = tmp_path / "probes.json", tmp_path / "bisect.json"
    argv = ["bisect", "accelerate", "--good", "1.15.0", "--bad", "1.13.0", "--candidates", "1.13.0,1.14.0,1.15.0",
            "--family", "params4bit_kwargs", "--store", str(store), "--output", str(output)]
    assert cli.main(argv) == 0
    record = json.loads(output.read_text())
    assert record["answer"]["first"] == "1.14.0"
    assert len(runs) == len(record["probes"])  # every probe of the record ran, the re-runs included
    assert sum(p["run"] == 2 for p in record["probes"]) == 2  # the newer endpoint and 1.14.0, each run again
    runs.clear()
    assert cli.main(argv) == 0  # again, over a full store: only the flake checks run
    assert len(runs) == 2
