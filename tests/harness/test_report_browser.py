"""The report's page in a real browser (issue 32): headless Chromium from the OS, driven by Playwright through its
`executable_path`. The grid renders with the counts of the results file, every filter changes it as it should,
every in-page link lands on its anchor, upstream links are the ledger's, and the console shows no error, at desktop
and at phone width. Skipped, with the reason, where Chromium or Playwright is missing; `nox -s tests` installs
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


@BOTH_WIDTHS
def test_the_grid_renders_with_the_counts_of_the_results(page, data, grid):
    assert shown(page, "#verdict-grid td.cell") == len(grid["squares"])
    assert counts(page) == (len(grid["squares"]), len(data["cells"]))
    by_verdict = Counter(square["verdict"] for square in grid["squares"].values())
    for verdict, n in by_verdict.items():
        assert shown(page, f"#verdict-grid td.cell.v-{verdict}") == n, verdict
    assert page.eval_on_selector_all("#verdict-grid td.cell", "els => els.reduce((n, el) => n + Number(el.dataset.count), 0)") == len(data["cells"])
    assert shown(page, "#verdict-grid th.col") == len(grid["columns"])
    assert page.locator(".js-plotly-plot").count() >= 2  # the history heat map and the bench plots were drawn


def test_the_filters_change_the_grid(page, data, grid):
    squares = grid["squares"]

    def expect(keep):
        mine = [key for key in squares if keep(key, squares[key])]
        assert counts(page) == (len(mine), sum(len(squares[key]["cells"]) for key in mine))
        assert shown(page, "#verdict-grid td.cell:not(.muted)") == len(mine)

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
    assert shown(page, "#verdict-grid th.col") == sum(1 for name, _lane in grid["columns"] if name == "latest")
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
    page.click(f'#verdict-grid td.cell a[href="#{square["id"]}"]')
    assert page.evaluate("location.hash") == f"#{square['id']}"
    target = page.locator(f"#{square['id']}")
    assert target.is_visible() and key[0] in target.inner_text() and page.evaluate("document.querySelector(':target').id") == square["id"]
    bug = next(c.bug for c in square["cells"] if c.verdict == "known_bug")
    target.locator(f'a.ledger[href="#bug-{bug}"]').first.click()
    assert page.evaluate("location.hash") == f"#bug-{bug}" and page.locator(f"#bug-{bug}").is_visible()
    assert bug in page.inner_text(f"#bug-{bug} h4")


def test_a_cell_links_to_its_upstream_bug_and_its_repro_command(page, grid):
    ledger = Ledger()
    for square in grid["squares"].values():
        block = page.locator(f"#{square['id']}")
        for cell in square["cells"]:
            name = cell.test.split("::", 1)[-1]
            item = block.locator("li.test", has=page.locator(f"code:text-is('{name}')"))
            if cell.bug in ledger.bugs:
                assert item.locator("a.upstream").get_attribute("href") == ledger.bugs[cell.bug].links[0]
            if cell.verdict in ("known_bug", "new_failure", "error", "fixed"):
                assert item.locator(".repro code").inner_text() == report.repro_command(cell.set_name, cell.test)


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
