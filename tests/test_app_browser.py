"""The web demo in a real browser: Debian's Chromium driven by Playwright (never a downloaded browser).

The server is `python app.py` on its bundled model and examples, as a new user runs it. The
tests click examples and time the page against the `/caption` API on the same images, count
the caption requests an upload sends, upload a file that is not an image, click a word and
check in a screenshot that its heatmap is drawn where the model looked, and download the
figure. Screenshots are saved in pytest's tmp dir for a human to look at.
"""

from __future__ import annotations

import io
import json
import os
import re
import urllib.request

import numpy as np
import pytest
from gradio_client import Client, handle_file
from PIL import Image
from test_app import serve

from captioner.evaluation import maps
from captioner.serve.sources import DEMO_MODEL, example_images

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 600_000  # readiness waits only: how long to wait for the page, never a speed limit

pytestmark = [
    pytest.mark.slow,  # a served page in a browser
    pytest.mark.skipif(
        not os.path.exists(CHROMIUM),
        reason=f"{CHROMIUM} is absent (install Debian's chromium: apt-get install -y chromium)",
    ),
]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python app.py` on the bundled model and its examples."""
    with serve(DEMO_MODEL, tmp_path_factory.mktemp("browser") / "app.log") as url:
        yield url


def caption_fn(url: str) -> int:
    """The id of the page's caption event: the one the image input's `input` event triggers."""
    config = json.load(urllib.request.urlopen(url + "config"))
    image = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "image")
    return next(d["id"] for d in config["dependencies"] if [image, "input"] in d["targets"])


def open_page(browser, url: str):
    """A 1400 px page on the demo, recording the caption requests it sends."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
    page.set_default_timeout(WAIT_MS)
    fn, sent = caption_fn(url), []

    def record(request):
        if "queue/join" in request.url and json.loads(request.post_data or "{}").get("fn_index") == fn:
            sent.append(json.loads(request.post_data)["data"])

    page.on("request", record)
    page.goto(url)
    page.locator("#examples button").first.wait_for()
    return page, sent


def wait_for_caption(page, previous: str = "") -> tuple[str, str]:
    """Wait until a caption and a new, loaded large heatmap are on the page (two images may have
    the same caption, never the same heatmap); returns the caption and the heatmap's URL."""
    page.wait_for_function(
        """prev => {
            const text = document.querySelector('#caption textarea')?.value || '';
            const img = document.querySelector('#large-heatmap img');
            return text && img && img.src !== prev && img.complete && img.naturalWidth > 0;
        }""",
        arg=previous,
        polling=25,
    )
    return (page.locator("#caption textarea").input_value(), page.locator("#large-heatmap img").get_attribute("src"))


def test_example_click_shows_the_apis_caption_and_a_map_per_word(browser, server, tmp_path):
    client = Client(server, verbose=False)
    examples = example_images()[:3]
    page, sent = open_page(browser, server)
    heatmap = ""
    for i, path in enumerate(examples):
        text, _ = client.predict(handle_file(path), 3, api_name="/caption")
        page.locator("#examples button").nth(i).click()
        caption, heatmap = wait_for_caption(page, heatmap)
        assert caption == text  # the same model, the same answer
        assert page.locator("#word-gallery img").count() == len(text.split())
    page.screenshot(path=str(tmp_path / "examples.png"), full_page=True)
    assert len(sent) == len(examples)  # one request per click
    page.close()


ROWS = "() => document.querySelector('#alternatives [role=grid]')?.getAttribute('aria-rowcount') - 1"


def rows(page) -> int:
    """Rows of the beams' table (under its header)."""
    return page.evaluate(ROWS)


def test_another_caption_of_a_chosen_example_and_then_its_beam_caption_again(browser, server, tmp_path):
    """An example shown in the input comes back from the page as a URL to the server's copy: "Another
    caption" and "Caption" both read it, each with its maps, and no error shows."""
    page, _ = open_page(browser, server)
    page.locator("#examples button").nth(1).click()
    beam, _ = wait_for_caption(page)
    assert rows(page) == 3  # the beams
    # A sample may repeat the beam search's caption, maps and all: the table, one row, says it is there.
    page.locator("#another").click()
    page.wait_for_function(f"({ROWS})() === 1", polling=25)
    drawn, _ = wait_for_caption(page)
    assert page.locator("#word-gallery img").count() == len(drawn.split())
    page.get_by_role("button", name="Caption", exact=True).click()
    page.wait_for_function(f"({ROWS})() === 3", polling=25)
    again, _ = wait_for_caption(page)
    assert again == beam and not page.locator("#image-error").is_visible()
    page.screenshot(path=str(tmp_path / "another.png"), full_page=True)
    page.close()


def test_one_request_per_upload_and_an_error_beside_the_image(browser, server, tmp_path):
    scenes = example_images()
    notes = tmp_path / "notes.jpg"
    notes.write_text("these are notes, not a picture\n")
    page, sent = open_page(browser, server)
    upload = page.locator("#image input[type=file]")

    upload.set_input_files(scenes[0])
    _, first = wait_for_caption(page)
    upload.set_input_files(scenes[1])  # while an image is shown: once, not twice
    wait_for_caption(page, first)
    assert len(sent) == 2

    page.locator("#download-figure:not([disabled])").wait_for()
    upload.set_input_files(str(notes))
    error = page.locator("#image-error")
    error.get_by_text("notes.jpg").wait_for()
    page.screenshot(path=str(tmp_path / "error.png"), full_page=True)
    assert len(sent) == 3
    # Exactly one message naming the file, beside the image; nothing left of the previous image.
    assert page.get_by_text(re.compile(r"notes\.jpg")).count() == 1
    assert "not an image file" in error.inner_text()
    assert page.locator(".toast-body").count() == 0  # no toasts
    assert page.get_by_text(re.compile(r"^Error$")).count() == 0  # no red badges
    assert page.locator("#caption textarea").input_value() == ""
    assert page.locator("#word-gallery img").count() == 0 and page.locator("#large-heatmap img").count() == 0
    assert page.locator("#download-figure").is_disabled()

    upload.set_input_files(scenes[2])  # the next image clears the error
    wait_for_caption(page)
    assert not error.is_visible() and len(sent) == 4
    page.close()


def test_click_a_word_see_its_heatmap_where_the_model_looked(browser, server, tmp_path):
    scene = example_images()[0]
    _, data = Client(server, verbose=False).predict(handle_file(scene), 3, api_name="/caption")
    page, _ = open_page(browser, server)
    page.locator("#image input[type=file]").set_input_files(scene)
    wait_for_caption(page)
    tokens = page.locator("#words .token")
    words = [w.strip() for w in tokens.all_inner_texts()]
    assert words == data["words"]

    # Click the last word: the large view switches to its heatmap, and says which word it is.
    k = len(words) - 1
    tokens.nth(k).click()
    page.locator("#large-label").get_by_text(re.compile(rf'"?{re.escape(words[k])}"? \(word {k + 1} of')).wait_for()
    img = page.locator("#large-heatmap img")
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=img.element_handle())
    page.screenshot(path=str(tmp_path / "demo.png"), full_page=True)

    # The screenshot of the drawn image against the plain image: the heatmap is where the
    # attention is, and the places the model did not look stay as they were.
    shot = Image.open(io.BytesIO(img.screenshot())).convert("RGB")
    box = page.evaluate(
        """img => {
        const r = img.getBoundingClientRect(), fit = getComputedStyle(img).objectFit;
        let s = Math.min(r.width / img.naturalWidth, r.height / img.naturalHeight);   // contain
        if (fit === "scale-down") s = Math.min(s, 1);                                // never enlarged
        if (fit === "none") s = 1;
        const w = img.naturalWidth * s, h = img.naturalHeight * s;
        return [(r.width - w) / 2, (r.height - h) / 2, w, h];   // the picture inside the element (object-fit)
    }""",
        img.element_handle(),
    )
    scale = shot.size[0] / page.evaluate("img => img.getBoundingClientRect().width", img.element_handle())
    x, y, w, h = (round(v * scale) for v in box)
    drawn = np.asarray(shot.crop((x, y, x + w, y + h)), dtype=np.float32)
    plain = np.asarray(Image.open(scene).convert("RGB").resize((w, h), Image.BILINEAR), dtype=np.float32)
    heat = maps.upsample(np.asarray(data["attention"][k]), (w, h))
    change = np.abs(drawn - plain).mean(axis=2)  # (h, w)
    # The median where it did not look: the browser's and Pillow's resampling differ by a pixel at
    # the shapes' edges, which moves a mean but not a median.
    looked, ignored = change[heat > 0.7].mean(), np.median(change[heat < 0.05])
    print(f"\nchange of the pixels: mean {looked:.1f} where the model looked, median {ignored:.1f} where it did not")
    # Inferno's bright end is pale yellow: over the first example's yellow star the looked-at
    # pixels change by ~17 levels, those it did not look at by ~1 (median).
    assert looked > 10 and ignored < 8 and looked > 3 * ignored and (heat < 0.05).mean() > 0.2

    # The figure is drawn when asked, and downloaded.
    with page.expect_download() as download:
        page.locator("#download-figure").click()
    path = tmp_path / "figure.png"
    download.value.save_as(path)
    with Image.open(path) as fig:
        assert fig.format == "PNG" and fig.size[0] > 400
    page.close()
