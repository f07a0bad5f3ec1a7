"""The web demo in a real browser: Debian's Chromium driven by Playwright (never a downloaded browser).

Upload a scene, wait for the caption and the heatmaps, click a word, and check that its heatmap
is shown large. The screenshot is saved in pytest's tmp dir for a human to look at.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from test_app import serve

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 120_000  # readiness waits only: how long to wait for the page, never a speed limit

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (install Debian's chromium: apt-get install -y chromium)")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def test_upload_caption_click_a_word_see_its_heatmap(browser, small_run, scenes, tmp_path):
    scene = sorted((scenes / "images").iterdir())[0]
    with serve(small_run / "best.pt", tmp_path / "app.log", "--examples", str(scene)) as url:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(WAIT_MS)
        page.goto(url)
        page.locator("input[type=file]").first.set_input_files(str(scene))

        # The caption, one clickable token per word, and one gallery overlay per word.
        tokens = page.locator("#words .token")
        tokens.first.wait_for()
        words = [w.strip() for w in tokens.all_inner_texts()]
        page.locator("#word-gallery img").nth(len(words) - 1).wait_for()
        assert page.locator("#word-gallery img").count() == len(words)
        assert page.locator("#caption textarea").input_value() == " ".join(words)

        # Click the last word: the large view switches to its heatmap.
        k = len(words) - 1
        tokens.nth(k).click()
        large = page.locator("#large-heatmap")
        large.get_by_text(re.compile(rf'"{re.escape(words[k])}" \(word {k + 1} of')).wait_for()
        heatmap = large.locator("img")
        heatmap.wait_for(state="visible")
        page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=heatmap.element_handle())
        page.screenshot(path=str(tmp_path / "demo.png"), full_page=True)

        box = heatmap.bounding_box()
        assert box is not None and box["width"] >= 250 and box["height"] >= 250   # shown large
        page.locator("#download-figure:not([disabled])").wait_for()   # the whole figure, as a PNG
        assert Path(tmp_path / "demo.png").stat().st_size > 0
        page.close()
