"""Shared test set-up: no hub access, and one headless chromium for the browser tests."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CHROMIUM = Path("/usr/bin/chromium")
needs_chromium = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
    ),
]


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium driven by Playwright, headless, with no background network traffic."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--no-first-run",
                "--disable-sync",
            ],
        )
        yield browser
        browser.close()
