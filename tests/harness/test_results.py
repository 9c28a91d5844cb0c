"""matrix.json is written cell by cell, merges idempotently, and renders matrix.md from the same data."""

import json
import os

import pytest

from stackcheck import cli
from stackcheck.core import results
from stackcheck.core.cell import Cell
from stackcheck.core.versions import UsageError

VERSIONS = {"python": "3.11", "torch": "2.13.0", "transformers": "5.6.2", "peft": "0.19.1", "accelerate": "1.13.0", "bitsandbytes": "0.49.2"}


def cell(test, verdict, set_name="seed", bug=None, **fields):
    return Cell(set_name, fields.pop("family", "shared_kv_redispatch"), test, fields.pop("lane", "cpu"), verdict,
                signature="KeyError: 2 @ x" if bug else None, bug=bug, seconds=1.5, **fields)


def test_each_cell_is_on_disk_as_soon_as_it_is_recorded(tmp_path):
    path = tmp_path / "matrix.json"
    results.record_set(path, "seed", VERSIONS)
    results.record_cells(path, [cell("t1", "known_bug", bug="shared_kv_redispatch")])
    assert [c["test"] for c in json.loads(path.read_text())["cells"]] == ["t1"]  # on disk, as matrix.json holds it
    results.record_cells(path, [cell("t2", "pass")])
    data = json.loads(path.read_text())
    assert {c["test"] for c in data["cells"]} == {"t1", "t2"}
    assert set(data) == {"sets", "cells", "fingerprint"} and data["sets"]["seed"]["transformers"] == "5.6.2"
    assert set(results.CELL_KEYS) <= set(data["cells"][0])
    markdown = path.with_suffix(".md").read_text()
    assert "| shared_kv_redispatch | - | **known_bug** [shared_kv_redispatch]" in markdown
    assert "5.6.2" in markdown


def test_merge_is_idempotent_and_replaces_a_rerun_cell():
    run = {"sets": {"seed": VERSIONS}, "cells": [cell("t1", "known_bug", bug="shared_kv_redispatch")]}
    merged = results.merge_into(results.empty(), run)
    again = results.merge_into(results._decoded(json.loads(json.dumps(merged, default=Cell.to_dict))), run)
    assert again == merged
    rerun = {"sets": {"seed": VERSIONS}, "cells": [cell("t1", "pass")]}
    assert [c.verdict for c in results.merge_into(merged, rerun)["cells"]] == ["pass"]


def test_merge_refuses_one_set_name_with_two_version_lists():
    merged = results.merge_into(results.empty(), {"sets": {"seed": VERSIONS}, "cells": []})
    with pytest.raises(ValueError, match="different versions"):
        results.merge_into(merged, {"sets": {"seed": dict(VERSIONS, peft="0.20.0")}, "cells": []})


def test_family_cell_shows_the_worst_verdict():
    assert results.worst(["pass", "known_bug", "pass"]) == "known_bug"
    assert results.worst(["known_bug", "new_failure"]) == "new_failure"


def two_jobs(tmp_path):
    """Two per-job matrix.json files, as two CI jobs write them."""
    seed, latest = tmp_path / "seed" / "matrix.json", tmp_path / "latest" / "matrix.json"
    results.record_set(seed, "seed", VERSIONS)
    results.record_cells(seed, [cell("t1", "known_bug", bug="shared_kv_redispatch")])
    results.record_set(latest, "latest", dict(VERSIONS, transformers="5.23.0"))
    results.record_cells(latest, [cell("t1", "pass", set_name="latest")])
    return seed, latest


def test_merge_files_is_idempotent(tmp_path):
    seed, latest = two_jobs(tmp_path)
    output = tmp_path / "merged" / "matrix.json"
    merged = results.merge_files([seed, latest], output)
    written = output.read_text(), output.with_suffix(".md").read_text()
    assert {c.set_name for c in merged["cells"]} == {"seed", "latest"}
    assert results.merge_files([latest, seed, latest, output], output) == merged
    assert (output.read_text(), output.with_suffix(".md").read_text()) == written


def test_merge_refuses_results_of_other_family_definitions(tmp_path, capsys):
    seed, latest = two_jobs(tmp_path)
    other = json.loads(latest.read_text())
    other["fingerprint"] = "0" * 16
    latest.write_text(json.dumps(other))
    assert cli.main(["merge", str(seed), str(latest), "--output", str(tmp_path / "m.json")]) == 2
    assert "results of different family definitions" in capsys.readouterr().err
    del other["fingerprint"]  # written before fingerprints existed: its definitions are unknown
    latest.write_text(json.dumps(other))
    with pytest.raises(UsageError, match="different family definitions"):
        results.merge_files([seed, latest], tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()


def test_recording_over_results_of_other_definitions_moves_them_aside(tmp_path):
    path = tmp_path / "matrix.json"
    results.write_json(path, {"fingerprint": "0" * 16, "sets": {"seed": VERSIONS}, "cells": [cell("t1", "pass")]})
    results.record_set(path, "latest", VERSIONS)
    assert set(json.loads(path.read_text())["sets"]) == {"latest"}
    assert json.loads((tmp_path / f"matrix.stale-{'0' * 16}.json").read_text())["cells"][0]["test"] == "t1"


PLATFORM = {"os": "Linux-6", "cpu": "Xeon", "cpu_flags": "avx2 avx512f avx512_bf16", "torch_cpu_capability": "AVX512",
            "bnb_cpu_packed_path": "taken", "gpu": "none"}


def test_a_set_recorded_with_new_pins_or_platform_loses_every_lanes_old_cells(tmp_path, capsys):
    """After refresh-latest (new pins) or on another machine, no GPU cell stays listed under the new set."""
    path = tmp_path / "matrix.json"
    results.record_set(path, "seed", VERSIONS, PLATFORM)
    results.record_cells(path, [cell("t[cpu]", "pass"), cell("t[gpu]", "pass", lane="gpu")])
    results.record_set(path, "seed", VERSIONS, PLATFORM)  # the same pins and platform keep them
    assert len(results.load(path)["cells"]) == 2
    results.record_set(path, "seed", dict(VERSIONS, transformers="5.23.0"), PLATFORM)
    assert results.load(path)["cells"] == [] and "2 earlier cells are dropped" in capsys.readouterr().err
    results.record_cells(path, [cell("t[cpu]", "pass")])
    results.record_set(path, "seed", dict(VERSIONS, transformers="5.23.0"), dict(PLATFORM, bnb_cpu_packed_path="not taken"))
    assert results.load(path)["cells"] == []


def test_cells_of_a_run_whose_file_was_taken_over_follow_its_earlier_cells(tmp_path):
    """A concurrent run of other definitions moved this run's file aside: later cells go there, not into theirs."""
    path = tmp_path / "matrix.json"
    results.record_set(path, "seed", VERSIONS)
    ours = results.fingerprint()
    results.record_cells(path, [cell("t1", "pass")], ours)
    results.write_json(path, {"fingerprint": "f" * 16, "sets": {"latest": VERSIONS}, "cells": []})  # the other run
    os.replace(path, tmp_path / "other.json")
    results.write_json(results.stale_path(path, ours), results.load(tmp_path / "other.json") | {"fingerprint": ours})
    results.write_json(path, {"fingerprint": "f" * 16, "sets": {"latest": VERSIONS}, "cells": []})
    results.record_cells(path, [cell("t2", "pass")], ours)
    assert results.load(path)["cells"] == []
    assert [c.test for c in results.load(results.stale_path(path, ours))["cells"]] == ["t2"]


def test_report_hides_nothing(tmp_path):
    """fixed outranks known_bug, skipped and missing cells show, each cell's note and the platform reach matrix.md."""
    path = tmp_path / "matrix.json"
    results.record_set(path, "seed", VERSIONS, PLATFORM)
    results.record_cells(path, [
        cell("a", "known_bug", bug="shared_kv_redispatch"),
        cell("b", "fixed", bug="shared_kv_redispatch", note="passes although the ledger says these versions have it"),
        cell("c", "skipped", note="depends on the CPU", family="bnb_cpu_packed_width"),
        cell("d", "pass", family="merge_parity", lane="gpu"),
    ])
    markdown = path.with_suffix(".md").read_text()
    assert "| shared_kv_redispatch | - | **missing** | **fixed** [shared_kv_redispatch](" in markdown
    assert "(1 fixed, 1 known_bug)" in markdown
    assert "| merge_parity | - | **pass** (1 pass) | **missing** |" in markdown  # ran in the GPU lane only
    assert "| bnb_cpu_packed_width | - | **missing** | **skipped** (1 skipped) |" in markdown
    assert "passes although the ledger says these versions have it" in markdown and "depends on the CPU" in markdown
    assert "| seed | Xeon | avx2 avx512f avx512_bf16 | taken | AVX512 | none | n/a | n/a | Linux-6 |" in markdown


def test_results_files_take_the_umask_and_keep_their_mode(tmp_path):
    """Created as open() would create them (0666 less the umask, not a temporary file's 0600); a file replaced
    keeps the mode it had (merge once reset it to 0600)."""
    old = os.umask(0o002)
    try:
        path = tmp_path / "matrix.json"
        results.record_set(path, "seed", VERSIONS)
        assert path.stat().st_mode & 0o777 == 0o664 and path.with_suffix(".md").stat().st_mode & 0o777 == 0o664
        os.chmod(path, 0o640)
        results.record_cells(path, [cell("t1", "pass")])
        assert path.stat().st_mode & 0o777 == 0o640
        merged = tmp_path / "merged.json"
        assert cli.main(["merge", str(path), "--output", str(merged)]) == 0
        assert merged.stat().st_mode & 0o777 == 0o664
        os.umask(0o077)
        results.merge_files([path], merged)
        assert merged.stat().st_mode & 0o777 == 0o664  # an existing file keeps its mode
    finally:
        os.umask(old)


def _record_many(path, worker):
    for index in range(10):
        results.record_cells(path, [cell(f"w{worker}-{index}", "pass")])


def test_concurrent_writers_lose_nothing_and_leave_no_lock_file(tmp_path):
    import multiprocessing

    path = tmp_path / "matrix.json"
    results.record_set(path, "seed", VERSIONS)
    workers = [multiprocessing.get_context("fork").Process(target=_record_many, args=(path, worker)) for worker in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert len(json.loads(path.read_text())["cells"]) == 40
    assert sorted(p.name for p in tmp_path.iterdir()) == ["matrix.json", "matrix.md"]  # no .lock, no temporary file


def placeholder(test, **fields):
    return Cell.not_run("seed", fields.pop("family", "shared_kv_redispatch"), test, [], run=fields.pop("run", "r2"))


def test_a_run_replaces_only_the_cells_it_collected(tmp_path):
    """A `-k` re-check, another architecture, lane or family keeps every cell it did not collect."""
    path = tmp_path / "matrix.json"
    results.record_set(path, "seed", VERSIONS)
    kept = [cell("t[gpu]", "pass", lane="gpu"), cell("u[cpu-phi4]", "pass"), cell("v[cpu]", "pass", family="merge_parity")]
    results.record_cells(path, [cell("t[cpu-llama3]", "known_bug", bug="shared_kv_redispatch"), *kept])
    results.begin_run(path, "seed", VERSIONS, None, [placeholder("t[cpu-llama3]")])
    results.record_cells(path, [cell("t[cpu-llama3]", "pass", run="r2")])
    cells = {c.test: c for c in results.load(path)["cells"]}
    assert cells["t[cpu-llama3]"].verdict == "pass" and all(cells[c.test] == c for c in kept)


def test_a_family_that_imports_again_loses_its_module_cells(tmp_path):
    path = tmp_path / "matrix.json"
    results.record_set(path, "seed", VERSIONS)
    broken = Cell.lost("seed", "shared_kv_redispatch", "tests/families/test_shared_kv_redispatch.py[cpu]", [], "family module does not import: x")
    other = Cell.lost("seed", "merge_parity", "tests/families/test_merge_parity.py[cpu]", [], "family module does not import: y")
    results.record_cells(path, [broken, other])
    results.begin_run(path, "seed", VERSIONS, None, [placeholder("t[cpu]")])
    data = results.load(path)
    assert {c.test for c in data["cells"]} == {other.test} and [c.test for c in data["not_run"]] == ["t[cpu]"]


def test_a_collected_cell_never_takes_the_place_of_a_recorded_verdict(tmp_path):
    """What is on disk after each step of a run is what a SIGKILL at that moment leaves: the earlier verdicts stay
    until this run's replace them, this run's stay, and a cell without any reads not run, apart from the verdicts."""
    path = tmp_path / "matrix.json"
    results.record_set(path, "seed", VERSIONS)
    before = [cell(test, "known_bug", bug="shared_kv_redispatch", run="r1") for test in ("a[cpu]", "b[cpu]")]
    results.record_cells(path, before)
    results.begin_run(path, "seed", VERSIONS, None, [placeholder(test) for test in ("a[cpu]", "b[cpu]", "c[cpu]")])
    on_disk = results.load(path)
    assert on_disk["cells"] == before and [(c.test, c.verdict, c.run) for c in on_disk["not_run"]] == [("c[cpu]", "not_run", "r2")]
    results.record_cells(path, [cell("a[cpu]", "pass", run="r2"), cell("c[cpu]", "pass", run="r2")])
    on_disk = results.load(path)
    assert {c.test: (c.verdict, c.run) for c in on_disk["cells"]} == {
        "a[cpu]": ("pass", "r2"), "b[cpu]": ("known_bug", "r1"), "c[cpu]": ("pass", "r2")}
    assert on_disk["not_run"] == []
    assert "not_run" not in json.loads(path.read_text())  # a file without cells not run looks as before


def test_not_run_cells_are_shown_and_merged_apart_from_the_verdicts(tmp_path):
    path = tmp_path / "matrix.json"
    results.record_set(path, "seed", VERSIONS)
    results.record_cells(path, [cell("a[cpu]", "pass", run="r1")])
    results.begin_run(path, "seed", VERSIONS, None, [placeholder("a[cpu]"), placeholder("b[cpu]")])
    markdown = path.with_suffix(".md").read_text()
    assert "**pass** (1 pass, 1 not run)" in markdown and "| `b[cpu]` | not run |" in markdown, markdown
    merged = results.merge_files([path, path], tmp_path / "merged.json")  # the merge command keeps them apart too
    assert [c.test for c in merged["cells"]] == ["a[cpu]"] and [c.test for c in merged["not_run"]] == ["b[cpu]"]
    broken = json.loads(path.read_text()) | {"not_run": [{"set": "seed", "test": "b[cpu]"}]}
    path.write_text(json.dumps(broken))
    with pytest.raises(UsageError, match="not_run 0 is not a not-run cell"):
        results.load_checked(path)


def test_a_file_of_an_older_stackcheck_is_moved_aside(tmp_path, capsys):
    """A matrix.json from before fingerprints: its cells cannot be told current, so they are not kept under today's."""
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps({"sets": {"seed": VERSIONS}, "cells": [cell("a[cpu]", "pass").to_dict()]}))
    results.begin_run(path, "seed", VERSIONS, None, [placeholder("b[cpu]")])
    stale = tmp_path / "matrix.stale-older.json"
    assert capsys.readouterr().err == f"stackcheck: {path} held results of an older stackcheck (no fingerprint); moved to {stale}\n"
    assert [c["test"] for c in json.loads(stale.read_text())["cells"]] == ["a[cpu]"]
    assert results.load(path)["cells"] == [] and results.load(path)["fingerprint"] == results.fingerprint()


def test_a_cell_survives_the_file_as_it_is_and_keeps_keys_it_does_not_know():
    data = {"set": "seed", "family": "f", "test": "t[cpu]", "lane": "cpu", "arch": None, "verdict": "error", "signature": "s",
            "bug": None, "note": None, "seconds": 0.5, "ranks": [{"rank": 0}], "run": "r", "detail": "d", "from_the_future": 1}
    assert Cell.from_dict(data).to_dict() == data
    old = {k: v for k, v in data.items() if k in results.CELL_KEYS}  # a cell of a file from before `ranks` and `run`
    assert Cell.from_dict(old).to_dict() == old
