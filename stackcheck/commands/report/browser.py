"""A real browser for the report's page: the OS's headless Chromium, driven by Playwright through `executable_path`
(Playwright's own browser download is not used). The browser tests and the screenshots in docs/ use it.

`ensure_chromium` installs Debian's chromium where that is allowed: as root with apt-get, when `CI` is set (a CI
machine) or STACKCHECK_INSTALL_BROWSER=1. The `tests` nox session calls it, so CI runs the browser tests; elsewhere
they are skipped with the reason when no Chromium is found.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from stackcheck.core.protocol import CHROMIUM_ENV, INSTALL_BROWSER_ENV

# Debian's wrapper script (/usr/bin/chromium) sets flags for a desktop session; the binary behind it is what a
# headless run needs. STACKCHECK_CHROMIUM names another.
CANDIDATES = ("/usr/lib/chromium/chromium", "/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
# Desktop and phone screens of the screenshots in docs/ (a phone: a 390 x 844 CSS-pixel viewport). The first view of a
# full run fits the desktop's screen (tests/harness/test_report_browser.py).
DESKTOP = {"width": 1400, "height": 1000}
PHONE = {"width": 390, "height": 844}


def chromium_path() -> str | None:
    named = os.environ.get(CHROMIUM_ENV)
    if named:
        return named if Path(named).is_file() else None
    found = next((path for path in CANDIDATES if Path(path).is_file()), None)
    return found or shutil.which("chromium") or shutil.which("chromium-browser")


def missing() -> str | None:
    """Why no browser test can run here, or None: no Chromium, or no Playwright."""
    if chromium_path() is None:
        return ("no Chromium here (Debian: apt-get install chromium; or name one with STACKCHECK_CHROMIUM); "
                "`nox -s tests` installs it on a CI machine")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "no Playwright in this environment (the `browser` extra: pip install -e '.[report,browser]')"
    return None


def may_install() -> bool:
    return (os.environ.get("CI") or os.environ.get(INSTALL_BROWSER_ENV) == "1") and hasattr(os, "geteuid") \
        and os.geteuid() == 0 and shutil.which("apt-get") is not None


def ensure_chromium() -> str | None:
    """Chromium's path, installed first with apt-get where `may_install` allows (about a minute, once per machine);
    None where there is none and none may be installed. A failed install is a line of output, not an error: the browser
    tests then say why they skip."""
    if chromium_path() or not may_install():
        return chromium_path()
    print("== installing Debian's chromium for the report's browser tests (CI)", flush=True)
    quiet: dict[str, Any] = {"stdout": subprocess.DEVNULL, "env": dict(os.environ, DEBIAN_FRONTEND="noninteractive")}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"]):
        if subprocess.run(command, **quiet).returncode != 0:
            print(f"stackcheck: `{' '.join(command)}` failed: the browser tests will be skipped", flush=True)
            return None
    return chromium_path()


@contextmanager
def browser():
    """A headless Chromium under Playwright."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield chromium
        finally:
            chromium.close()


def screenshot(page_file: Path, output: Path, viewport: dict, scale: float = 1, full_page: bool = False) -> None:
    """A PNG of the page as a browser of `viewport`'s size shows it."""
    with browser() as chromium:
        context = chromium.new_context(viewport=viewport, device_scale_factor=scale, is_mobile=viewport["width"] < 600,
                                       has_touch=viewport["width"] < 600)
        page = context.new_page()
        page.goto(page_file.resolve().as_uri(), wait_until="load")
        page.screenshot(path=str(output), full_page=full_page)
        context.close()
