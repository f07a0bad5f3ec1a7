"""The web demo: its handlers called directly, then `python app.py` driven through gradio_client.

The model is conftest's tiny `small_run`; images of every awkward kind are made here.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
from conftest import REPO, run_cli
from gradio_client import Client, handle_file
from PIL import Image

from captioner import Captioner, CaptionerError
from captioner.decoding.settings import Decoding
from captioner.demo.app import page_settings
from captioner.demo.card import examples_note, model_card, model_notice
from captioner.demo.handlers import Batcher, Demo, Session
from captioner.demo.options import PAGE_TOP_P, DemoOptions
from captioner.demo.uploads import read_upload, upload_source
from captioner.demo.views import PageOutputs, fit_view
from captioner.models.hub import download_checkpoint, resolve, sha256_file
from captioner.serve.api import Caption

# file name → the words its message must contain
BAD = {"empty.png": "empty", "truncated.png": "truncated", "text.jpg": "not an image", "bomb.png": "decompression bomb"}


# helpers


def _png_header_only(path: Path, width: int, height: int) -> None:
    """A 70-byte PNG claiming width×height pixels: a decompression bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


PIDS: dict[str, int] = {}  # server URL → its process id, to read its memory


def rss_mb(pid: int) -> float:
    """Resident memory of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(checkpoint: Path, log: Path, *extra: str):
    """Run `python app.py --checkpoint CKPT --port P` until the block ends; yields its URL."""
    port = free_port()
    # Its temporary files (Gradio's upload cache, attention PNGs) stay in pytest's tmp dir.
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1", "TMPDIR": str(log.parent)}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "app.py"), "--checkpoint", str(checkpoint), "--port", str(port), *extra],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}/"
    PIDS[url] = proc.pid
    try:
        deadline = (
            time.monotonic() + 900
        )  # readiness wait, not a performance limit (a busy shared machine starts slowly)
        while True:
            if proc.poll() is not None:
                pytest.fail(f"app.py exited with {proc.returncode}:\n{log.read_text()}")
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"app.py did not start serving:\n{log.read_text()}")
                time.sleep(0.25)
        yield url
    finally:
        proc.kill()  # its temporary files are in pytest's tmp dir: no graceful shutdown needed
        proc.wait()


# fixtures


@pytest.fixture(scope="session")
def checkpoint(small_run) -> Path:
    return small_run / "best.pt"


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> dict[str, Path]:
    """Valid images of every awkward kind, and bad files, by name."""
    d = tmp_path_factory.mktemp("upload")
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    paths = {}

    def save(name: str, img: Image.Image, **kw) -> None:
        paths[name] = d / name
        img.save(paths[name], **kw)

    save("rgb.jpg", Image.fromarray(rgb))
    save("gray.png", Image.fromarray(rgb[..., 0]))
    save("rgba.png", Image.fromarray(np.dstack([rgb, rgb[..., :1]])))
    save("palette.gif", Image.fromarray(rgb).convert("P"))
    save("cmyk.jpg", Image.fromarray(rgb).convert("CMYK"))
    save("16bit.png", Image.fromarray(rng.integers(0, 65536, (40, 50), dtype=np.uint16)))
    save("tiny.png", Image.new("RGB", (1, 1), (200, 30, 30)))
    save("wide.png", Image.new("RGB", (3000, 12), (30, 200, 30)))
    save("large.png", Image.new("RGB", (1500, 1400), (90, 90, 200)))  # over the server's --max-pixels
    frames = [Image.new("RGB", (40, 40), c) for c in ((255, 0, 0), (0, 0, 255))]
    save("animated.gif", frames[0], save_all=True, append_images=frames[1:], duration=80, loop=0)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° to show upright
    save("exif.jpg", Image.new("RGB", (60, 30), (0, 0, 255)), exif=exif)
    (d / "empty.png").write_bytes(b"")
    (d / "truncated.png").write_bytes(paths["gray.png"].read_bytes()[:200])
    (d / "text.jpg").write_text("this is not a picture\n")
    _png_header_only(d / "bomb.png", 100_000, 100_000)
    paths.update({name: d / name for name in BAD})
    return paths


MAX_PIXELS = 2_000_000  # the test server's limit
VALID = [
    "rgb.jpg",
    "gray.png",
    "rgba.png",
    "palette.gif",
    "cmyk.jpg",
    "16bit.png",
    "tiny.png",
    "wide.png",
    "animated.gif",
    "exif.jpg",
]


@pytest.fixture(scope="module")
def demo(checkpoint, tmp_path_factory) -> Demo:
    d = Demo(Captioner.load(str(checkpoint)), figures_dir=str(tmp_path_factory.mktemp("figures")))
    yield d
    d.batcher.close()


@pytest.fixture(scope="module")
def server(checkpoint, scenes, tmp_path_factory):
    examples = sorted(str(p) for p in (scenes / "images").iterdir())[:2]
    with serve(
        checkpoint,
        tmp_path_factory.mktemp("server") / "app.log",
        "--examples",
        *examples,
        "--max-pixels",
        str(MAX_PIXELS),
    ) as url:
        yield url


# the handlers, directly


@pytest.fixture(scope="module")
def api(checkpoint) -> Captioner:
    """The Python API on the demo's checkpoint: a model of its own, nothing shared with the demo's."""
    return Captioner.load(str(checkpoint))


@pytest.fixture(scope="module")
def awkward(tmp_path_factory) -> dict[str, Path]:
    """Images whose decoding could differ between the page and the API, each with detail everywhere
    (a plain colour looks the same turned or flattened): a PNG with varying alpha, a JPEG stored on
    its side with an EXIF orientation, and a greyscale PNG."""
    d = tmp_path_factory.mktemp("awkward")
    rng = np.random.default_rng(1)
    ramp = np.linspace(0, 255, 80, dtype=np.uint8)
    rgb = np.dstack(
        [np.tile(ramp, (40, 1)), rng.integers(0, 256, (40, 80), dtype=np.uint8), np.tile(ramp[::-1], (40, 1))]
    )
    paths = {name: d / name for name in ("alpha.png", "exif.jpg", "grey.png")}
    alpha = np.tile(np.linspace(0, 255, 40, dtype=np.uint8)[:, None], (1, 80))  # transparent at the top
    Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(paths["alpha.png"])
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 80×40, shown 40 wide and 80 high
    Image.fromarray(rgb).save(paths["exif.jpg"], exif=exif, quality=95)
    Image.fromarray(rgb[..., 1]).save(paths["grey.png"])
    return paths


def assert_same_caption(text: str, data: dict, want: Caption, *, atol: float = 2e-6, score_atol: float = 1e-5) -> None:
    """/caption's (text, data) is the Python API's caption: text, words, score, maps, beams and size."""
    assert text == data["caption"] == want.text and data["words"] == want.words
    assert data["score"] == pytest.approx(want.score, abs=score_atol)
    att = np.asarray(data["attention"])
    assert att.shape == want.attention.shape == (len(want.words), 14, 14)
    np.testing.assert_allclose(att, want.attention, atol=atol, rtol=0)  # /caption rounds to 6 decimals
    assert [a["caption"] for a in data["alternatives"]] == [t for t, _ in want.alternatives]
    want_lp = [lp for _, lp in want.alternatives]
    assert [a["log_prob"] for a in data["alternatives"]] == pytest.approx(want_lp, abs=score_atol)
    assert data["image_size"] == list(want.size) and data["familiarity"] == want.familiarity


@pytest.mark.parametrize("beam_size", [1, 3])
@pytest.mark.parametrize("name", ["alpha.png", "exif.jpg", "grey.png"])
def test_caption_answers_what_the_python_api_answers(demo, api, awkward, name, beam_size):
    """The /caption handler, given an upload as Gradio hands it over, against `Captioner.caption`."""
    upload = {"path": str(awkward[name]), "orig_name": name, "url": "http://host/gradio_api/file=x"}
    text, data = demo.caption(upload, beam_size)
    assert_same_caption(text, data, api.caption(str(awkward[name]), beam_size=beam_size))
    np.testing.assert_allclose(np.asarray(data["attention"]).sum(axis=(1, 2)), 1.0, atol=1e-4)  # α_t sums to 1
    assert len(data["alternatives"]) == beam_size
    if name == "exif.jpg":
        assert data["image_size"] == [40, 80]  # upright


def shown(
    demo: Demo, image, beam: int = 2, max_len: int = 8, opacity: float = 0.6, session: Session | None = None
) -> PageOutputs:
    """The page after a caption event: its last PageOutputs."""
    return list(demo.caption_view(image, {"beam_size": beam}, max_len, opacity, session or Session()))[-1]


@pytest.mark.parametrize("name", VALID)
def test_every_valid_image_is_captioned(demo, api, images, name):
    page = shown(demo, str(images[name]))  # beam 2, at most 8 words
    assert_same_caption(page.caption, page.data, api.caption(str(images[name]), beam_size=2, max_len=8))
    view = page.session.view
    assert page.caption and len(page.view.words) == len(page.data["words"]) == len(page.view.gallery)
    assert view.image.size[0] <= 512 and view.image.size[1] <= 512 and max(view.thumb.size) <= 160
    assert page.alternatives[0][0] == page.data["caption"]
    assert page.error["visible"] is False and page.download["interactive"] is True


def test_caption_event_clears_the_page_first(demo, images):
    events = demo.caption_view(str(images["rgb.jpg"]), {"beam_size": 2}, 8, 0.6, Session())
    first = next(events)  # checked before the generator goes on and fills the session
    assert first.caption == "" and first.view.words == [] and first.view.gallery == [] and first.view.large is None
    assert first.data is None and first.download["interactive"] is False and first.session.view is None
    assert list(events)[-1].caption


def test_exif_rotated_image_is_upright(demo, images):
    page = shown(demo, str(images["exif.jpg"]), 1, 5)
    assert page.data["image_size"] == [30, 60]  # stored 60×30, shown 30 wide and 60 high
    assert page.session.view.image.size[1] > page.session.view.image.size[0]


@pytest.mark.parametrize("name", list(BAD))
def test_bad_file_raises_message_about_the_image(demo, images, name):
    with pytest.raises(gr.Error) as err:
        demo.caption(str(images[name]), 2)
    message = str(err.value.message)
    assert message.startswith(f"{name}: ") and BAD[name] in message
    assert str(images[name].parent) not in message  # the server's paths stay private


def test_bad_file_on_the_page_clears_everything_and_says_why_once(demo, images):
    session = Session()
    before = shown(demo, str(images["rgb.jpg"]), session=session)
    assert before.caption and session.view is not None
    upload = {"path": str(images["text.jpg"]), "orig_name": "notes.jpg", "url": "http://host/x"}
    page = shown(demo, upload, session=session)
    assert page.error["visible"] is True and page.error["value"].count("notes.jpg: not an image") == 1
    assert page.caption == "" and page.view.words == [] and page.view.gallery == [] and page.view.large is None
    assert page.data is None and page.familiarity == "" and page.download["interactive"] is False
    assert session.view is None and demo.figure(session, 0.6) is None  # no stale figure either


def test_a_newer_request_wins_over_an_older_one_still_running(demo, images):
    session = Session()
    older = demo.caption_view(str(images["rgb.jpg"]), {"beam_size": 2}, 8, 0.6, session)
    next(older)  # started: the page is cleared for it
    newer = shown(demo, str(images["gray.png"]), session=session)
    assert list(older) == []  # its results are dropped, not shown
    assert session.view.text == newer.caption


def test_uploads_reach_load_image_undecoded(images):
    path = str(images["16bit.png"])
    assert upload_source({"path": path, "url": "http://host/gradio_api/file=x", "orig_name": "16bit.png"}) == path
    raw = images["gray.png"].read_bytes()
    inline = {"path": None, "url": "data:image/png;base64," + base64.b64encode(raw).decode()}
    assert upload_source(inline) == raw  # webcam and clipboard images can come inline


def test_an_image_the_server_put_on_the_page_is_read_from_its_cache(tmp_path, monkeypatch):
    """A chosen example shown in the input comes back from the page with a URL and no path: the file is
    the server's cached copy, read there; a URL naming any other file is refused."""
    cache = tmp_path / "gradio"
    (cache / "0f3a").mkdir(parents=True)
    shown = cache / "0f3a" / "scene 1.jpg"
    Image.new("RGB", (8, 8), "red").save(shown)
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(cache))
    url = "http://127.0.0.1:7860/gradio_api/file=" + urllib.parse.quote(str(shown))
    assert upload_source({"path": None, "url": url, "orig_name": None}) == str(shown)
    for outside in ("/etc/passwd", str(cache / ".." / "secret.jpg")):
        with pytest.raises(gr.Error, match="not an image this page was given"):
            read_upload({"path": None, "url": "http://127.0.0.1:7860/gradio_api/file=" + outside})


def test_no_image_says_so(demo):
    with pytest.raises(gr.Error, match="No image"):
        demo.caption(None, 2)
    pages = list(demo.caption_view(None, {"beam_size": 2}, 8, 0.6, Session()))
    assert len(pages) == 1 and pages[0].session.view is None and pages[0].caption == ""  # cleared input


def test_select_word_and_opacity_redraw_without_the_model(demo, images, monkeypatch):
    page = shown(demo, str(images["rgb.jpg"]))
    session, gallery = page.session, page.view.gallery
    view, k = page.session.view, len(page.session.view.words) - 1

    def no_model(*args, **kwargs):
        raise AssertionError("the model ran again")

    monkeypatch.setattr(demo.captioner, "caption_batch", no_model)
    words, label, large, gallery2 = demo.select_word(
        session, 0.6, gr.SelectData(None, {"index": k, "value": view.words[k]})
    )
    assert view.selected == k and [label for _, label in words].count("shown") == 1 and words[k][1] == "shown"
    assert f'"{view.words[k]}"' in label
    framed = [np.asarray(t)[0, 0].tolist() for t, _ in gallery2]  # a corner pixel: the frame's colour
    assert framed[k] == [249, 115, 22] and framed.count([249, 115, 22]) == 1  # the shown word is marked
    large2, gallery3 = demo.redraw(session, 0.1)
    assert len(gallery3) == len(gallery) and gallery3[k][1].endswith(view.words[k])
    a, b = np.asarray(gallery2[k][0], dtype=float), np.asarray(gallery3[k][0], dtype=float)
    assert a.shape == b.shape and np.abs(a - b).mean() > 1  # a fainter heatmap, same image
    assert demo.redraw(session, 0.1)[0] is large2  # drawn once per opacity, then reused


def test_figure_is_drawn_when_asked_and_once(demo, images):
    session = shown(demo, str(images["gray.png"])).session
    path = demo.figure(session, 0.5)
    with Image.open(path) as fig:
        assert fig.format == "PNG" and fig.size[0] > fig.size[1]
    assert demo.figure(session, 0.5) == path and demo.figure(session, 0.3) != path
    assert demo.figure(Session(), 0.5) is None  # nothing shown, nothing to download


def test_fit_view_keeps_the_shape():
    for size in [(1, 1), (4000, 10), (10, 4000), (800, 600)]:
        w, h = fit_view(Image.new("RGB", size)).size
        scale = 512 / max(size)
        assert max(w, h) == 512 and abs(w - size[0] * scale) <= 1 and abs(h - size[1] * scale) <= 1


class _SlowFake:
    """Stands in for Captioner: blocks on its first call, fails a batch holding a 'bad' image."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.started, self.release = threading.Event(), threading.Event()

    def caption_batch(self, images, decoding):
        self.calls.append(list(images))
        self.started.set()
        self.release.wait(timeout=60)
        if "bad" in images:
            raise ValueError("cannot caption 'bad'")
        return [f"{im}@{decoding.beam_size}" for im in images]


def test_batcher_batches_waiting_requests_and_keeps_errors_apart():
    fake = _SlowFake()
    batcher = Batcher(fake, max_batch_size=8)
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(batcher.caption, "a", Decoding(beam_size=2))
        assert fake.started.wait(timeout=60)
        # These queue up while the first batch runs, so they go through the model together.
        later = [pool.submit(batcher.caption, im, Decoding(beam_size=2)) for im in ["b", "bad", "c", "d"]]
        deadline = time.monotonic() + 60
        while batcher._queue.qsize() < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        fake.release.set()
        assert first.result() == "a@2"
        assert [f.result() for f in later if f is not later[1]] == ["b@2", "c@2", "d@2"]
        with pytest.raises(ValueError, match="bad"):
            later[1].result()
    assert fake.calls[1] == ["b", "bad", "c", "d"]  # one batch of four ...
    assert sorted(map(tuple, fake.calls[2:])) == [("b",), ("bad",), ("c",), ("d",)]  # ... retried alone
    batcher.close()


def test_another_caption_draws_a_sample_with_its_maps_a_new_seed_each_click(demo, api, images):
    """The page's "Another caption": the Python API's sample at the page's top-p and the click's seed."""
    session, path = Session(), str(images["rgb.jpg"])
    for seed in (1, 2, 3):
        page = list(demo.caption_view(path, {"beam_size": 2}, 8, 0.6, session, sample=True))[-1]
        want = api.caption(path, method="sampling", top_p=PAGE_TOP_P, max_len=8, seed=seed)
        assert_same_caption(page.caption, page.data, want)
        assert len(page.view.gallery) == len(page.view.words) == len(want.words) and len(want.samples) == 1
    beam = shown(demo, path, session=session)  # "Caption" is the beam search's again
    assert_same_caption(beam.caption, beam.data, api.caption(path, beam_size=2, max_len=8))


def test_batched_captions_equal_single_ones(demo, images):
    pictures = [Image.open(images[n]).convert("RGB") for n in ("rgb.jpg", "gray.png", "tiny.png")]
    batched = demo.captioner.caption_batch(pictures, beam_size=2)
    single = [demo.captioner.caption(p, beam_size=2) for p in pictures]
    assert [b.text for b in batched] == [s.text for s in single]


def test_model_panel_describes_the_model(demo):
    card, notice = model_card(demo.captioner), model_notice(demo.captioner)
    assert f"{len(demo.captioner.vocab)} words" in card and demo.captioner.attention_type in card
    assert "synthetic" in card and "| CIDEr |" in card  # one metric per row: no broken words
    assert "MS-COCO" in notice and "--" not in notice  # plain words, not command-line flags


def test_model_panel_shows_attention_health_and_the_examples_record(demo, tmp_path, monkeypatch):
    cap = demo.captioner
    health = {"entropy": 0.3, "stay": 0.9, "border": 1.0, "top5": 0.5, "words": 40, "captions": 10}
    examples = [str(tmp_path / f"{i}.jpg") for i in range(3)]
    card = {
        "attention_health": health,
        "scene_accuracy": 0.75,
        "test_images": 200,
        "examples": [{"file": f"{i}.jpg", "caption": "x", "correct": i != 1} for i in range(3)],
    }
    monkeypatch.setattr(cap, "info", {**cap.info, "card": card})
    text, note = model_card(cap), examples_note(cap, examples)
    assert "NOT MEANINGFUL" in text and "stay 0.90" in text  # captioner.health.summary of the card's figures
    assert "75% of 200 test scenes" in text
    assert "2 of these 3" in note and "✓ ✗ ✓" in note and "75%" in note


def test_model_panel_explains_two_objects_only_when_the_card_has_it(demo, monkeypatch):
    cap = demo.captioner
    monkeypatch.setattr(cap, "info", {**cap.info, "card": {"test_metrics": {"pointing": 0.8}}})
    assert "two_objects" not in model_card(cap)
    monkeypatch.setattr(cap, "info", {**cap.info, "card": {"test_metrics": {"pointing": 0.8, "two_objects": 0.25}}})
    text = model_card(cap)
    assert "| two_objects | 0.250 |" in text and "two separate objects" in text


def test_pinned_url_is_downloaded_once_and_a_mismatch_refused(checkpoint, tmp_path):
    digest = sha256_file(str(checkpoint))
    url = checkpoint.as_uri()
    path = download_checkpoint(f"{url}#sha256={digest}", cache_dir=str(tmp_path), progress=False)
    assert sha256_file(path) == digest and Path(path).parent == tmp_path
    mtime = os.stat(path).st_mtime_ns
    assert resolve(f"{url}#sha256={digest}", cache_dir=str(tmp_path)) == path
    assert os.stat(path).st_mtime_ns == mtime  # reused, not fetched again
    with pytest.raises(CaptionerError, match="refused"):
        download_checkpoint(f"{url}#sha256={'0' * 64}", cache_dir=str(tmp_path), progress=False)
    with pytest.raises(CaptionerError, match="sha256"):
        download_checkpoint(url, cache_dir=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]  # nothing half-written left


# the server, through gradio_client


def test_a_demo_refuses_a_wider_beam_than_it_readied_its_search_for(checkpoint, images):
    """A server readies its search for the page's beam sizes (compiled on a GPU); a wider beam asked of
    `/caption` would grow the search's buffers past what its graphs were recorded on."""
    demo = Demo(Captioner.load(str(checkpoint)), warm=page_settings("beam"))
    try:
        with pytest.raises(gr.Error, match="beam size at most 10 here"):
            demo.caption(str(images["rgb.jpg"]), beam_size=11)
        assert demo.caption(str(images["rgb.jpg"]), beam_size=10)[0]
    finally:
        demo.batcher.close()


def test_a_demo_of_posterior_maps_shows_them_and_says_what_they_are(checkpoint, api, images):
    """`captioner demo --maps posterior`: the page's maps are the API's posterior maps, the same caption's, and its
    label says they show where the word was read, not where the model looked."""
    demo = Demo(Captioner.load(str(checkpoint)), maps="posterior")
    try:
        page = shown(demo, str(images["rgb.jpg"]))
        want = api.caption(str(images["rgb.jpg"]), beam_size=2, max_len=8, maps="posterior")
        looked = api.caption(str(images["rgb.jpg"]), beam_size=2, max_len=8)
        assert_same_caption(page.caption, page.data, want)
        assert want.text == looked.text
        assert not np.allclose(want.attention, looked.attention, atol=1e-3)
        assert "Where the model read" in page.view.large_label and "looked for" not in page.view.large_label
    finally:
        demo.batcher.close()


@pytest.mark.slow
def test_api_takes_image_and_beam_size(server):
    api = Client(server, verbose=False).view_api(return_format="dict", print_info=False)
    endpoint = api["named_endpoints"]["/caption"]
    assert [p["parameter_name"] for p in endpoint["parameters"]] == ["image", "beam_size"]
    assert [r["component"] for r in endpoint["returns"]] == ["Textbox", "Json"]


@pytest.mark.slow
def test_api_captions_every_kind_of_image(server, api, images):
    client = Client(server, verbose=False)
    for name in VALID:
        text, data = client.predict(handle_file(str(images[name])), 2, api_name="/caption")
        want = api.caption(str(images[name]), beam_size=2, maps="posterior")  # the page's maps by default
        assert_same_caption(text, data, want, atol=1e-4, score_atol=1e-3)


@pytest.mark.slow
def test_api_through_the_server_answers_what_the_python_api_answers(server, api, awkward):
    """Uploaded by gradio_client to `python app.py` (Gradio's upload and its cache in between), another
    process: the same captions, and maps (the demo's default, the posterior maps) and scores to the encoder's
    rounding."""
    client = Client(server, verbose=False)
    for path in awkward.values():
        for k in (1, 3):
            text, data = client.predict(handle_file(str(path)), k, api_name="/caption")
            want = api.caption(str(path), beam_size=k, maps="posterior")
            assert_same_caption(text, data, want, atol=1e-4, score_atol=1e-3)


@pytest.mark.slow
def test_api_bad_files_get_their_message_and_the_server_goes_on(server, images):
    client = Client(server, verbose=False)
    for name, words in BAD.items():
        with pytest.raises(Exception) as err:
            client.predict(handle_file(str(images[name])), 2, api_name="/caption")
        assert name in str(err.value) and words in str(err.value), name
    with pytest.raises(Exception, match=r"beam size \(--beam-size\) must be a whole number between 1 and 50"):
        client.predict(handle_file(str(images["rgb.jpg"])), 0, api_name="/caption")
    with pytest.raises(Exception, match="beam size at most 10 here"):
        client.predict(handle_file(str(images["rgb.jpg"])), 11, api_name="/caption")
    assert client.predict(handle_file(str(images["rgb.jpg"])), 1, api_name="/caption")[0]


@pytest.mark.slow
def test_api_refuses_images_over_the_pixel_limit(server, images):
    client = Client(server, verbose=False)
    with pytest.raises(Exception, match=f"large.png: 2100000 pixels is over the limit of {MAX_PIXELS}"):
        client.predict(handle_file(str(images["large.png"])), 2, api_name="/caption")


@pytest.mark.slow
def test_api_concurrent_requests_all_succeed(server, images):
    """20 valid images at once, with 4 bad ones mixed in that fail on their own.

    Each request has its own client: one gradio_client Client used from several threads at once
    can lose a reply in its own shared event stream (a CancelledError the server never sent).
    """
    jobs = [VALID[i % len(VALID)] for i in range(20)] + list(BAD)
    clients = [Client(server, verbose=False) for _ in jobs]

    def ask(i: int):
        try:
            return clients[i].predict(handle_file(str(images[jobs[i]])), 1 + i % 3, api_name="/caption")[0]
        except Exception as e:
            return e

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(ask, range(len(jobs))))
    assert all(isinstance(r, str) and r for r in results[:20]), results[:20]
    assert all(isinstance(r, Exception) and name in str(r) for r, name in zip(results[20:], BAD))


def test_app_refuses_a_checkpoint_url_with_the_wrong_digest(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    spec = importlib.util.spec_from_file_location("captioner_app", REPO / "app.py")
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    args = app.get_args_parser().parse_args(["--checkpoint", f"{checkpoint.as_uri()}#sha256={'ab' * 32}"])
    with pytest.raises(SystemExit) as exit_:
        app.main(args)
    assert "refused" in str(exit_.value.code) and "sha256" in str(exit_.value.code)


@pytest.mark.parametrize(
    "given, said",
    [
        (["--decoding", "bogus"], "--decoding must be one of beam, sampling, got 'bogus'"),
        pytest.param(  # the same path as --decoding's, through another option: 5 s of importing gradio again
            ["--device", "bogus"], "--device: expected auto, cpu, cuda or cuda:N, got 'bogus'", marks=pytest.mark.slow
        ),
    ],
)
def test_app_py_names_a_bad_option_in_one_line(given, said):
    """`python app.py` (the README's demo command) as `captioner demo` does: the option named, no traceback,
    before any model is loaded."""
    p = run_cli("app.py", *given, "--port", "1")
    assert p.returncode != 0 and p.stderr.strip() == f"error: {said}", p.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads memory from /proc")
def test_load_50_requests_from_10_clients_memory_flat(server, images):
    """Two waves of 50 requests from 10 clients: every one captioned, memory flat.

    Each client sends its five requests one after another from its own thread, as ten users would
    (a gradio_client Client shared between threads can lose a reply on its own side). At most ten
    requests wait at once, well under the server's queue: none may be turned away as busy.
    """
    assert DemoOptions().queue_size > 10  # the test server runs with the default queue
    clients = [Client(server, verbose=False) for _ in range(10)]

    def ask(i: int) -> str:
        try:
            text, data = clients[i % 10].predict(
                handle_file(str(images[VALID[i % len(VALID)]])), 1 + i % 3, api_name="/caption"
            )
        except Exception as e:
            return f"refused: {e}"
        return "ok" if text and text == data["caption"] else f"no caption: {text!r}"

    def user(k: int) -> list[str]:
        return [ask(i) for i in range(k, 50, 10)]

    memory = []
    for _wave in range(2):
        with ThreadPoolExecutor(max_workers=10) as pool:
            answers = [a for answers in pool.map(user, range(10)) for a in answers]
        assert answers == ["ok"] * 50, [a for a in answers if a != "ok"][:5]
        memory.append(rss_mb(PIDS[server]))
    # The second wave must not grow the server by more than a small margin over the first.
    assert memory[1] - memory[0] < 150, memory
    assert Client(server, verbose=False).predict(handle_file(str(images["rgb.jpg"])), 1, api_name="/caption")[0]


def test_a_page_of_another_method_captions_with_the_settings_its_controls_send(checkpoint, api, images):
    """A sampling page sends its sliders' values (floats, as Gradio's sliders do) and gets the API's sample;
    a setting it does not read is ignored, and one that is not a number is named."""
    demo, path = Demo(Captioner.load(str(checkpoint)), method="sampling"), str(images["rgb.jpg"])
    chosen = {"beam_size": 7.0, "temperature": 0.7, "top_k": 5.0, "top_p": 0.8, "n": 2.0}
    page = list(demo.caption_view(path, chosen, 8, 0.6, Session()))[-1]
    want = api.caption(path, method="sampling", temperature=0.7, top_k=5, top_p=0.8, n=2, max_len=8)
    assert_same_caption(page.caption, page.data, want)
    page = list(demo.caption_view(path, {**chosen, "top_k": "many"}, 8, 0.6, Session()))[-1]
    assert page.error["visible"] is True and "top k must be a number, got &#x27;many&#x27;" in page.error["value"]
    demo.batcher.close()
