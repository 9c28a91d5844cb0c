"""`stackcheck report` (issue 32): the page's model from real results files, the repro commands it prints, and the
command's usage errors. The page in a real browser: test_report_browser.py."""

import json
import re
import shlex
import sys

import pytest

from stackcheck import REPO_ROOT, cli
from stackcheck.commands import report
from stackcheck.core import results
from stackcheck.core.ledger import SEVERITY, Ledger

pytest.importorskip("jinja2", reason="the report's template engine (the `report` extra) is not installed here")
pytest.importorskip("plotly", reason="the report's plots (the `report` extra) are not installed here")

SAMPLE = REPO_ROOT / "docs" / "report" / "matrix.json"
HISTORY = REPO_ROOT / "docs" / "history-transformers.json"
BENCH = REPO_ROOT / "docs" / "bench"


@pytest.fixture(scope="module")
def sample():
    return results.load_checked(SAMPLE)


def test_the_grid_has_one_square_per_family_arch_set_and_lane_with_every_cell(sample):
    grid = report.grid_model(sample, Ledger())
    keys = {(c.family, c.arch, c.set_name, c.lane) for c in sample["cells"]}
    assert set(grid["squares"]) == keys
    assert sum(len(square["cells"]) for square in grid["squares"].values()) == len(sample["cells"])
    for square in grid["squares"].values():
        assert square["verdict"] == min((c.verdict for c in square["cells"]), key=SEVERITY.index)
        assert sum(square["counts"].values()) == len(square["cells"])
    assert grid["sets"] == ["seed", "latest"]  # sets.toml's order


def test_changes_name_what_an_upgrade_changes(sample):
    grid = report.grid_model(sample, Ledger())
    for change in report.changes(grid):
        assert change["before"]["verdict"] != change["after"]["verdict"] and change["from"] == "seed"
    pairs = {(c["family"], c["arch"], c["lane"]) for c in report.changes(grid)}
    for family, arch in grid["rows"]:
        before, after = grid["squares"].get((family, arch, "seed", "cpu")), grid["squares"].get((family, arch, "latest", "cpu"))
        if before and after:
            assert ((family, arch, "cpu") in pairs) == (before["verdict"] != after["verdict"])


@pytest.mark.parametrize("set_name, pins", [("seed", []), ("seed+accelerate==1.14.0", ["accelerate==1.14.0"]),
                                            ("latest+peft==0.19.1+transformers==5.20.0", ["peft==0.19.1", "transformers==5.20.0"])])
def test_a_repro_command_is_one_repro_parses(set_name, pins):
    test = "tests/families/test_merge_parity.py::test_merge_into_4bit_base_reproduces_adapter_outputs[cpu-llama3]"
    command = report.repro_command(set_name, test)
    words = shlex.split(command)
    assert words[:4] == ["python", "-m", "stackcheck", "repro"]
    args = cli._parser().parse_args(words[3:])
    assert (args.sets, args.overrides, args.test) == (set_name.split("+")[0], pins, test)


def test_the_history_names_first_bad_and_first_fixed_releases():
    """The committed transformers sweep: what docs/history-transformers.md says of it, read off the page's model."""
    model = report.history_model("history-transformers", json.loads(HISTORY.read_text()))
    bugs = {bug["id"]: bug for bug in model["bugs"]}
    assert bugs["audio_tower_finfo_uint8"]["first_fixed"] == "5.11.0"
    assert bugs["vision_tower_uint8_cast"]["first_fixed"] == "5.13.0"
    assert bugs["shared_kv_redispatch"]["first_fixed"] == "5.23.0"
    assert bugs["sdpa_audio_tower"]["first_bad"] == "5.20.0" and bugs["sdpa_audio_tower"]["first_fixed"] is None
    assert bugs["vision_tower_lora_reentrant_checkpointing"]["first_bad"].startswith("5.11.0")  # masked before it


def test_bug_history_on_its_own():
    labels = ["1", "2", "3", "4", "5"]
    assert report.bug_history(["present", "present", "absent", "absent", None], labels)["first_fixed"] == "3"
    assert report.bug_history(["present", "present", "absent", "absent", None], labels)["first_bad"] == "≤ 1"
    regression = report.bug_history(["absent", "present", "absent", "present", "absent"], labels)
    assert (regression["first_bad"], regression["first_fixed"]) == ("2", "5") and "regression" in regression["note"]
    assert report.bug_history(["masked", "present", "present", "present", "present"], labels)["first_bad"] == "2 (masked before)"
    assert report.bug_history(["not applicable"] * 5, labels)["first_bad"] is None


def test_the_page_is_self_contained(tmp_path):
    output = tmp_path / "report.html"
    code = cli.main(["report", "--matrix", str(SAMPLE), "--history", str(HISTORY), "--bench", str(BENCH), "--output", str(output)])
    assert code == 0
    page = output.read_text()
    assert not re.search(r"<(script|img|iframe)[^>]+src=|<link[^>]+href=", page), "the page loads something from elsewhere"
    assert "Plotly.newPlot" in page and page.count("<script>") >= 2
    assert len(re.findall(r'<a class="cell ', page)) == len(report.grid_model(results.load(SAMPLE), Ledger())["squares"])


def test_every_square_has_one_place_in_the_strips(sample):
    """Each family's squares are strips in one architecture order, the cells of no model last."""
    grid = report.grid_model(sample, Ledger())
    assert grid["archs"][:-1] == sorted(grid["archs"][:-1]) and grid["archs"][-1] is None
    assert {(family, arch) for family, arch in grid["rows"]} <= {(f, a) for f in grid["families"] for a in grid["archs"]}
    assert len(grid["families"]) == len({c.family for c in sample["cells"]}) > 24  # a full run: the grid in two blocks


def test_the_changes_list_names_every_change_once(sample):
    grid = report.grid_model(sample, Ledger())
    found, lines = report.changes(grid), report.change_lines(report.changes(grid))
    assert sum(line["count"] for line in lines) == len(found) and len(lines) < len(found)
    assert [line["worse"] for line in lines] == sorted((line["worse"] for line in lines), reverse=True)  # regressions first
    for change in found:
        mine = [line for line in lines if line["family"] == change["family"] and change["lane"] in line["lanes"]
                and change["arch"] in [arch for arch, _ in line["squares"]]]
        assert len(mine) == 1 and (mine[0]["before"], mine[0]["after"]) == (change["before"]["verdict"], change["after"]["verdict"])


def test_the_same_change_on_two_lanes_is_one_line(sample):
    cells = list(sample["cells"]) + [c.replace(lane="gpu", test=c.test.replace("[cpu-", "[gpu-")) for c in sample["cells"]]
    grid = report.grid_model({**sample, "cells": cells}, Ledger())
    one_lane = report.change_lines(report.changes(report.grid_model(sample, Ledger())))
    lines = report.change_lines(report.changes(grid))
    assert len(lines) == len(one_lane) and all(line["lanes"] == list(results.LANES) for line in lines)
    assert sum(line["count"] for line in lines) == len(report.changes(grid)) == 2 * len(report.changes(report.grid_model(sample, Ledger())))


def test_each_bench_plot_has_a_panel_per_model_size():
    """A tiny model's bars would vanish beside a realistic model's: each size is drawn on its own y axis."""
    from stackcheck.bench import compare

    bench = {path.stem: compare.load(path) for path in sorted(BENCH.glob("*.json"))}
    figures = report.bench_figures(bench)
    assert figures and all(figure["sizes"] == ["tiny", "realistic"] for figure in figures if len(figure["sizes"]) > 1)
    memory = next(figure for figure in figures if figure["id"] == "bench-peak_allocated_bytes")
    assert memory["sizes"] == ["tiny", "realistic"] and '"yaxis2"' in memory["html"]


def test_a_failure_shows_its_detail(sample):
    """A new_failure's message past its first line (a child's traceback tail) is on the page, folded."""
    cells = list(sample["cells"])
    cells[0] = cells[0].replace(verdict="new_failure", signature="ResumeFailed: the resuming process exited with 1 @ x.py:f",
                                detail="Traceback (most recent call last):\n  TypeError: <unexpected> keyword")
    page = report.render({**sample, "cells": cells}, [], {})
    assert "<summary>the failure's message</summary><pre>Traceback (most recent call last):\n  TypeError: &lt;unexpected&gt; keyword</pre>" in page


@pytest.mark.parametrize("argv, says", [
    (["report", "--matrix", "no/such.json"], "no such file"),
    (["report", "--matrix", "docs"], "is a folder"),
    (["report", "--matrix", "docs/history-transformers.json"], "is not a stackcheck matrix.json"),
    (["report", "--history", "docs/report/matrix.json"], "is not a stackcheck history map"),
    (["report", "--matrix", "docs/report/matrix.json", "--output", "results/report.md"], "name an .html file"),
])
def test_a_wrong_input_is_one_line_and_exit_2(argv, says, capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_no_results_to_show_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path)
    assert cli.main(["report", "--output", str(tmp_path / "r.html")]) == 2
    assert "nothing to show" in capsys.readouterr().err


def test_without_the_report_extra_it_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "plotly", None)
    assert cli.main(["report", "--matrix", str(SAMPLE), "--output", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[report]'" in err and err.count("\n") == 1


def test_a_cell_not_run_is_drawn_as_not_run_never_as_an_error(sample):
    """A run stopped early lists its unreached cells apart (matrix.json's not_run): the page draws them as not run, a
    square's colour only where none of its cells has a verdict, and counts them apart from errors."""
    from stackcheck.core.cell import NOT_RUN

    reached = sample["cells"][0]
    waiting = reached.replace(family="no_such_family_yet", test=reached.test.replace("test_", "test_waiting_", 1), verdict=NOT_RUN)
    beside = reached.replace(test=reached.test + "-again", verdict=NOT_RUN)
    grid = report.grid_model({**sample, "not_run": [waiting, beside]}, Ledger())
    square = grid["squares"][(waiting.family, waiting.arch, waiting.set_name, waiting.lane)]
    assert square["verdict"] == NOT_RUN and square["counts"] == {NOT_RUN: 1}
    assert grid["squares"][(reached.family, reached.arch, reached.set_name, reached.lane)]["verdict"] != NOT_RUN
    assert grid["set_counts"][waiting.set_name][NOT_RUN] == 2 and "error" not in report.VERDICT_COLOURS[NOT_RUN]
