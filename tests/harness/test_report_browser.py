"""The report's page in a real browser (issues 32, 47): headless Chromium from the OS, driven by Playwright through its
`executable_path`. The grid renders with the counts of the results file, every filter changes it as it should and
lives in the URL, every in-page link lands on its anchor, upstream links are the ledger's, the first view of a full
two-set run fits a 1400 x 1000 screen, and the console shows no error, at desktop and at phone width. Skipped, with the reason, where Chromium or Playwright is missing; `nox -s tests` installs
Chromium on a CI machine (stackcheck.commands.report.browser.ensure_chromium)."""

import json
from collections import Counter

import pytest

from stackcheck import REPO_ROOT
from stackcheck.commands import report
from stackcheck.core import results
from stackcheck.core.ledger import Ledger
from stackcheck.commands.report import browser

pytest.importorskip("jinja2", reason="the report's template engine (the `report` extra) is not installed here")
pytest.importorskip("plotly", reason="the report's plots (the `report` extra) are not installed here")
if browser.missing():
    pytest.skip(browser.missing(), allow_module_level=True)

SAMPLE = REPO_ROOT / "docs" / "report" / "matrix.json"
HISTORY = REPO_ROOT / "docs" / "history-transformers.json"
BENCH = REPO_ROOT / "docs" / "bench"


@pytest.fixture(scope="module")
def data():
    return results.load_checked(SAMPLE)


@pytest.fixture(scope="module")
def grid(data):
    return report.grid_model(data, Ledger())


@pytest.fixture(scope="module")
def page_file(tmp_path_factory, data):
    from stackcheck.bench import compare

    bench = {path.stem: compare.load(path) for path in sorted(BENCH.glob("*.json"))}
    path = tmp_path_factory.mktemp("report") / "report.html"
    path.write_text(report.render(data, [("history-transformers", json.loads(HISTORY.read_text()))], bench))
    return path


@pytest.fixture(scope="module")
def chromium():
    with browser.browser() as launched:
        yield launched


BOTH_WIDTHS = pytest.mark.parametrize("page", ["desktop", "phone"], indirect=True)


@pytest.fixture
def page(request, chromium, page_file):
    """The page at a desktop's width (or a phone's, by parameter); the test fails if the console showed an error."""
    phone = getattr(request, "param", "desktop") == "phone"
    context = chromium.new_context(viewport=browser.PHONE if phone else browser.DESKTOP, is_mobile=phone, has_touch=phone)
    tab = context.new_page()
    errors = []
    tab.on("console", lambda message: errors.append(f"console {message.type}: {message.text}") if message.type == "error" else None)
    tab.on("pageerror", lambda error: errors.append(f"page error: {error}"))
    tab.on("requestfailed", lambda request: errors.append(f"request failed: {request.url}"))
    tab.goto(page_file.as_uri(), wait_until="load")
    yield tab
    context.close()
    assert not errors, errors


def shown(tab, selector: str) -> int:
    """How many elements matching `selector` are displayed."""
    return tab.eval_on_selector_all(selector, "els => els.filter(el => el.offsetParent !== null || el.getClientRects().length).length")


def counts(tab) -> tuple[int, int]:
    return int(tab.inner_text("#shown-squares")), int(tab.inner_text("#shown-cells"))


def columns(tab) -> int:
    """The (set, lane) columns shown: each block of the grid (a full run's families make two) heads every one."""
    per_block = tab.eval_on_selector_all("#verdict-grid table", "ts => ts.map(t => t.querySelectorAll('th.col:not(.hidden)').length)")
    assert len(set(per_block)) == 1, per_block
    return per_block[0]


@BOTH_WIDTHS
def test_the_grid_renders_with_the_counts_of_the_results(page, data, grid):
    assert shown(page, "#verdict-grid .cell") == len(grid["squares"])
    assert counts(page) == (len(grid["squares"]), len(data["cells"]))
    by_verdict = Counter(square["verdict"] for square in grid["squares"].values())
    for verdict, n in by_verdict.items():
        assert shown(page, f"#verdict-grid .cell.v-{verdict}") == n, verdict
    assert page.eval_on_selector_all("#verdict-grid .cell", "els => els.reduce((n, el) => n + Number(el.dataset.count), 0)") == len(data["cells"])
    assert columns(page) == len(grid["columns"])
    assert page.locator(".js-plotly-plot").count() >= 2  # the history heat map and the bench plots were drawn


def test_the_filters_change_the_grid(page, data, grid):
    squares = grid["squares"]

    def expect(keep):
        mine = [key for key in squares if keep(key, squares[key])]
        assert counts(page) == (len(mine), sum(len(squares[key]["cells"]) for key in mine))
        assert shown(page, "#verdict-grid .cell:not(.muted)") == len(mine)

    page.select_option("#f-arch", "llama3")
    expect(lambda key, square: key[1] == "llama3")
    page.select_option("#f-family", "qlora_step")
    expect(lambda key, square: key[1] == "llama3" and key[0] == "qlora_step")
    page.click("#f-reset")
    expect(lambda key, square: True)

    newest = grid["versions"]["latest"]["transformers"]
    page.select_option("#f-library", "transformers")
    assert page.eval_on_selector_all("#f-version option", "os => os.map(o => o.value).filter(Boolean)") == \
        sorted({v["transformers"] for v in grid["versions"].values()}, key=lambda v: tuple(map(int, v.split("."))))
    page.select_option("#f-version", newest)
    expect(lambda key, square: grid["versions"][key[2]]["transformers"] == newest)
    assert columns(page) == sum(1 for name, _lane in grid["columns"] if name == "latest")
    page.click("#f-reset")

    page.select_option("#f-lane", "cpu")
    expect(lambda key, square: key[3] == "cpu")
    page.click("#f-reset")

    wanted = {square["verdict"] for square in squares.values()} - {"pass"}
    for box in page.query_selector_all("#f-verdicts input"):
        if box.get_attribute("value") not in wanted:
            box.uncheck()
    expect(lambda key, square: square["verdict"] in wanted)
    assert shown(page, ".square") == sum(1 for square in squares.values() if square["verdict"] in wanted)


@BOTH_WIDTHS
def test_every_link_on_the_page_lands_on_its_anchor(page, grid):
    dangling = page.evaluate("""() => Array.from(document.querySelectorAll('a[href^="#"]'))
        .map(a => a.getAttribute('href').slice(1)).filter(id => id && !document.getElementById(decodeURIComponent(id)))""")
    assert not dangling, f"links to anchors the page lacks: {sorted(set(dangling))[:10]}"
    # A square of the grid: its tests, then a known bug's ledger entry, then back to the grid.
    key, square = next((key, square) for key, square in grid["squares"].items() if square["verdict"] == "known_bug")
    page.click(f'#verdict-grid a.cell[href="#{square["id"]}"]')
    assert page.evaluate("location.hash") == f"#{square['id']}"
    target = page.locator(f"#{square['id']}")
    assert target.is_visible() and key[0] in target.inner_text() and page.evaluate("document.querySelector(':target').id") == square["id"]
    bug = next(c.bug for c in square["cells"] if c.verdict == "known_bug")
    target.locator(f'a.ledger[href="#bug-{bug}"]').first.click()
    assert page.evaluate("location.hash") == f"#bug-{bug}" and page.locator(f"#bug-{bug}").is_visible()
    assert bug in page.inner_text(f"#bug-{bug} h4")


def test_a_cell_links_to_its_upstream_bug_and_its_repro_command(page, grid):
    ledger = Ledger()
    drawn = page.evaluate("""() => Object.fromEntries(Array.from(document.querySelectorAll('.square')).map(div => [div.id,
        Array.from(div.querySelectorAll('li.test')).map(li => [li.querySelector('code').textContent,
            li.querySelector('a.upstream') && li.querySelector('a.upstream').getAttribute('href'),
            li.querySelector('.repro code') && li.querySelector('.repro code').textContent])]))""")
    for square in grid["squares"].values():
        tests = {name: (upstream, repro) for name, upstream, repro in drawn[square["id"]]}
        assert len(tests) == len(square["cells"])
        for cell in square["cells"]:
            upstream, repro = tests[cell.test.split("::", 1)[-1]]
            assert upstream == (ledger.bugs[cell.bug].links[0] if cell.bug in ledger.bugs else None)
            wanted = cell.verdict in ("known_bug", "new_failure", "error", "fixed")
            assert repro == (report.repro_command(cell.set_name, cell.test) if wanted else None)


def test_a_link_to_a_square_the_filters_hide_shows_it(page, grid):
    key, square = next((key, square) for key, square in grid["squares"].items() if key[1] == "gemma4")
    page.select_option("#f-arch", "llama3")
    assert not page.locator(f"#{square['id']}").is_visible()
    page.evaluate(f"location.hash = '#{square['id']}'")
    page.wait_for_function(f"document.getElementById('{square['id']}').offsetParent !== null")
    assert page.input_value("#f-arch") == ""


@BOTH_WIDTHS
def test_the_page_fits_the_screen_the_grid_scrolls_inside_it(page):
    width = page.evaluate("window.innerWidth")
    assert page.evaluate("document.documentElement.scrollWidth") <= width + 1, "the page scrolls sideways"
    assert page.evaluate("document.querySelector('#grid .scroll').getBoundingClientRect().width") <= width


def overview_box(tab) -> dict:
    return tab.evaluate("""() => { const r = document.getElementById('overview').getBoundingClientRect();
        return {left: r.left + scrollX, top: r.top + scrollY, right: r.right + scrollX, bottom: r.bottom + scrollY}; }""")


def test_the_first_view_of_a_full_run_fits_one_screen(page, grid):
    """The committed run's changes and grid: every family, set and lane within 1400 x 1000, nothing to scroll."""
    assert page.viewport_size == {"width": 1400, "height": 1000} == browser.DESKTOP
    box = overview_box(page)
    assert box["left"] >= 0 and box["right"] <= 1400 and box["bottom"] <= 1000, box
    assert page.evaluate("(el => el.scrollWidth <= el.clientWidth)(document.querySelector('#grid .scroll'))"), "the grid scrolls sideways"
    assert shown(page, "#verdict-grid tr.row") == len(grid["families"])
    assert shown(page, "#changes li.change") >= 1


def test_a_two_lane_run_of_48_families_fits_one_screen_too(chromium, data, tmp_path):
    """A full two-set GPU run: the committed run with its GPU lane (each cell again) and a 48th family."""
    cells = list(data["cells"])
    cells += [c.replace(lane="gpu", test=c.test.replace("[cpu-", "[gpu-")) for c in cells]
    cells += [c.replace(family="a_48th_family") for c in cells if c.family == "qlora_step"]
    matrix = {**data, "cells": cells}
    mine = report.grid_model(matrix, Ledger())
    assert (len(mine["families"]), len(mine["columns"])) == (48, 4)
    path = tmp_path / "report.html"
    path.write_text(report.render(matrix, [], {}))
    context = chromium.new_context(viewport=browser.DESKTOP)
    tab = context.new_page()
    tab.goto(path.as_uri(), wait_until="load")
    box = overview_box(tab)
    assert box["right"] <= 1400 and box["bottom"] <= 1000, box
    assert shown(tab, "#verdict-grid .cell") == len(mine["squares"]) and tab.evaluate("document.documentElement.scrollWidth") <= 1400
    assert tab.evaluate("(el => el.scrollWidth <= el.clientWidth)(document.querySelector('#grid .scroll'))"), "the grid scrolls sideways"
    assert len(set(tab.eval_on_selector_all("#verdict-grid table", "ts => ts.map(t => t.getBoundingClientRect().top)"))) == 1  # side by side
    context.close()


def test_the_filters_live_in_the_url(page, grid):
    """Chosen filters are the URL's query: a reload restores them, back and forward step through them."""
    page.select_option("#f-arch", "llama3")
    page.select_option("#f-lane", "cpu")
    page.locator("#f-verdicts input[value=pass]").uncheck()
    query = page.evaluate("location.search")
    assert "arch=llama3" in query and "lane=cpu" in query and "verdicts=" in query and "pass" not in query.split("verdicts=")[1]
    squares = grid["squares"]
    wanted = [k for k in squares if k[1] == "llama3" and k[3] == "cpu" and squares[k]["verdict"] != "pass"]
    filtered = (len(wanted), sum(len(squares[k]["cells"]) for k in wanted))
    assert counts(page) == filtered

    page.reload(wait_until="load")
    assert (page.input_value("#f-arch"), page.input_value("#f-lane")) == ("llama3", "cpu")
    assert not page.locator("#f-verdicts input[value=pass]").is_checked() and counts(page) == filtered

    page.go_back()  # pass checked again
    page.wait_for_function("document.querySelector('#f-verdicts input[value=pass]').checked")
    assert page.input_value("#f-lane") == "cpu" and "verdicts" not in page.evaluate("location.search")
    page.go_back()
    page.go_back()
    page.wait_for_function("document.getElementById('f-arch').value === ''")
    assert counts(page) == (len(squares), sum(len(s["cells"]) for s in squares.values()))
    page.go_forward()
    page.wait_for_function("document.getElementById('f-arch').value === 'llama3'")
    assert page.input_value("#f-lane") == ""

    page.click("#f-reset")
    assert page.evaluate("location.search") == ""


def test_the_history_map_on_a_phone_is_readable(chromium, page_file):
    """At 390 px the heat map keeps its width and scrolls in its own box: every bug's label is whole and on screen."""
    context = chromium.new_context(viewport=browser.PHONE, is_mobile=True, has_touch=True)
    tab = context.new_page()
    tab.goto(page_file.as_uri(), wait_until="load")
    box = tab.locator("#history .heat").first
    box.scroll_into_view_if_needed()
    inner = tab.evaluate("""() => { const box = document.querySelector('#history .heat');
        return {scroll: box.scrollWidth, client: box.clientWidth, plot: box.querySelector('.js-plotly-plot').getBoundingClientRect().width}; }""")
    assert inner["client"] <= 390 and inner["scroll"] > inner["client"] and inner["plot"] >= 600, inner
    labels = tab.evaluate("""() => { const plot = document.querySelector('#history .js-plotly-plot').getBoundingClientRect();
        return Array.from(document.querySelectorAll('#history .ytick text')).map(t => {
            const r = t.getBoundingClientRect(); return [t.textContent, r.left - plot.left, r.right, r.width]; }); }""")
    assert labels and all(left >= 0 and 0 < right <= 390 and width > 20 for _text, left, right, width in labels), labels[:3]
    assert tab.evaluate("document.documentElement.scrollWidth") <= 390
    context.close()
