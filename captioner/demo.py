"""The web demo's logic: read an upload, caption it through a shared batcher, draw its views.

`app.py` lays out the page and wires its events to a `Demo`; nothing here knows the layout.
Uploads arrive undecoded and are read once by `load_image`, so each error says what is wrong
with the image. Concurrent requests share `caption_batch` calls through a `Batcher`, each
image's failure staying its own. `captioner.viz` draws the heatmaps from the attention kept in
a per-session `View`, so changing their opacity never re-runs the model.
Symbols: n words, g×g attention grid (14×14 for VGG at 224).
"""
from __future__ import annotations

import collections
import os
import queue
import re
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass

import gradio as gr
import numpy as np
from gradio_client.utils import decode_base64_to_binary
from PIL import Image

from . import viz
from .api import Caption, Captioner
from .errors import CaptionerError, ImageError
from .images import Preprocess, load_image

VIEW_SIDE = 512       # longest side of the stored image and its overlays: enough for a screen
FIGURES_KEPT = 64     # attention PNGs kept on disk for download; older ones are deleted


@dataclass
class View:
    """What one captioned image leaves in a session: enough to redraw every heatmap."""
    image: Image.Image                # upright RGB, longest side VIEW_SIDE
    text: str
    words: list[str]
    attention: np.ndarray             # (n, g, g)
    locations: list[tuple[int, int]] | None
    preprocess: Preprocess            # tells viz which part of the image the grid covers
    selected: int = 0                 # the word shown large


class Batcher:
    """Runs concurrent caption requests through the model together, one thread owning it.

    Requests that wait while a batch runs form the next batch (up to `max_batch_size`,
    grouped by beam size and maximum length). If a batch fails, its images are retried one
    at a time, so an error reaches only the request that caused it.
    """

    def __init__(self, captioner: Captioner, *, max_batch_size: int = 8):
        self.captioner, self.max_batch_size = captioner, max_batch_size
        self._queue: queue.Queue[tuple | None] = queue.Queue()  # (image, beam_size, max_len, Future)
        self._thread = threading.Thread(target=self._loop, name="captioner-batcher", daemon=True)
        self._thread.start()

    def caption(self, image: Image.Image, beam_size: int = 3, max_len: int | None = None) -> Caption:
        """Caption one decoded image, sharing a forward pass with concurrent callers."""
        done: Future[Caption] = Future()
        self._queue.put((image, int(beam_size), max_len, done))
        return done.result()

    def close(self) -> None:
        """Stop the worker after the requests already queued."""
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            while len(batch) < self.max_batch_size:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:          # close() was called: finish this batch, then stop
                    self._queue.put(None)
                    break
                batch.append(nxt)
            groups = collections.defaultdict(list)  # caption_batch takes one beam size and length
            for image, beam_size, max_len, done in batch:
                groups[beam_size, max_len].append((image, done))
            for (beam_size, max_len), group in groups.items():
                self._run(group, beam_size, max_len)

    def _run(self, group: list[tuple[Image.Image, Future]], beam_size: int, max_len: int | None) -> None:
        try:
            outs = self.captioner.caption_batch([im for im, _ in group], beam_size=beam_size, max_len=max_len)
        except Exception as e:
            if len(group) == 1:
                group[0][1].set_exception(e)
            else:  # find the culprit: retry alone, so the others still get their captions
                for item in group:
                    self._run([item], beam_size, max_len)
            return
        for (_, done), out in zip(group, outs):
            done.set_result(out)


# helpers

def upload_source(payload: dict | str | None) -> str | bytes | None:
    """The uploaded file from gr.Image's raw payload: its path, or bytes for a data URL.

    gr.Image's own preprocessing opens each upload with Pillow and re-encodes non-RGB ones: odd
    files fail with Pillow's bare exception before our handler runs, and 16-bit images are
    clipped. So the caption events skip it and hand the file to `load_image` untouched.
    """
    if payload is None or isinstance(payload, str):  # a path: direct calls
        return payload
    if (payload.get("url") or "").startswith("data:"):  # webcam/clipboard sent inline
        return decode_base64_to_binary(payload["url"])[0]
    return payload["path"]


def read_upload(payload: dict | str | None) -> Image.Image:
    """Decode an upload with `load_image`; errors become a gr.Error about that image.

    The message names the file by its own name, not by the server's cache path.
    """
    image = upload_source(payload)
    if image is None:
        raise gr.Error("No image: upload, paste or take one first.", title="No image", print_exception=False)
    try:
        return load_image(image)
    except ImageError as e:
        message = str(e).replace(image, os.path.basename(image)) if isinstance(image, str) else str(e)
        raise gr.Error(message, title="Cannot read this image", duration=None,
                       print_exception=False) from None


def fit_view(image: Image.Image) -> Image.Image:
    """Scale to VIEW_SIDE on the longest side: tiny images become visible, huge ones light.

    The attention grid covers the resized image just as it covered the original.
    """
    w, h = image.size
    scale = VIEW_SIDE / max(w, h)
    return image.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BILINEAR)


def caption_data(out: Caption, decimals: int = 6) -> dict:
    """A caption as plain JSON for programs: words, score, attention (n, g, g) nested lists."""
    return {
        "caption": out.text,
        "words": out.words,
        "score": float(out.score),
        "attention": np.round(out.attention.astype(np.float64), decimals).tolist(),
        "alternatives": [{"caption": text, "log_prob": float(lp)} for text, lp in out.alternatives],
        "locations": [list(loc) for loc in out.locations] if out.locations is not None else None,
        "image_size": list(out.size),
    }


def highlighted(view: View) -> list[tuple[str, str]]:
    """The caption as (word, label) tokens for gr.HighlightedText; the shown word stands out."""
    return [(w, "shown" if i == view.selected else "word") for i, w in enumerate(view.words)]


class Demo:
    """The demo's event handlers around one loaded model.

    Args:
        captioner: the model.
        max_batch_size: most images per `caption_batch` call.
        figures_dir: where downloadable attention PNGs go (default: a fresh temporary directory).
    """

    def __init__(self, captioner: Captioner, *, max_batch_size: int = 8, figures_dir: str | None = None):
        self.captioner = captioner
        self.batcher = Batcher(captioner, max_batch_size=max_batch_size)
        self.figures_dir = figures_dir or tempfile.mkdtemp(prefix="captioner-demo-")
        if figures_dir is None:  # ours: removed when the server exits normally
            weakref.finalize(self, shutil.rmtree, self.figures_dir, ignore_errors=True)
        self._figures: collections.deque[str] = collections.deque()
        self._figures_lock = threading.Lock()

    # events

    def caption(self, image: dict | str | None, beam_size: float = 3) -> tuple[str, dict]:
        """The `/caption` API: an image and a beam size → the caption text, then its data.

        Args:
            image: the upload (gr.Image's payload, or a path).
            beam_size: K of the beam search (1 is greedy).

        Returns:
            The caption, and a dict with words, score, attention (n, 14, 14) and alternatives.
        """
        out = self._caption(read_upload(image), beam_size)
        return out.text, caption_data(out)

    def caption_view(self, image: dict | str | None, beam_size: float, max_len: float, opacity: float):
        """The page's caption event → (caption, words, large heatmap, gallery, beams, data, View)."""
        if image is None:  # the input was cleared
            return "", [], None, [], [], None, None
        picture = read_upload(image)
        out = self._caption(picture, beam_size, max_len)
        view = View(fit_view(picture), out.text, out.words, out.attention, out.locations,
                    self.captioner.encoder_spec.preprocess)
        large, gallery = self.heatmaps(view, opacity)
        rows = [[text, round(lp, 3)] for text, lp in out.alternatives]
        return (out.text or "(no words)", highlighted(view), large, gallery, rows, caption_data(out), view)

    def select_word(self, view: View | None, opacity: float, evt: gr.SelectData):
        """A word (of the caption or the gallery) was clicked → (words, its large heatmap, View)."""
        if view is None or not view.words:
            return gr.skip(), gr.skip(), view
        view.selected = min(int(evt.index if not isinstance(evt.index, list) else evt.index[0]),
                            len(view.words) - 1)
        large, _ = self.heatmaps(view, opacity, gallery=False)
        return highlighted(view), large, view

    def redraw(self, view: View | None, opacity: float):
        """Opacity changed → (large heatmap, gallery), redrawn from the View, not the model."""
        if view is None:
            return gr.skip(), gr.skip()
        return self.heatmaps(view, opacity)

    def figure(self, view: View | None, opacity: float) -> dict:
        """The paper-style attention figure as a PNG file: an update for the download button."""
        if view is None:
            return gr.update(value=None, interactive=False)
        fig = viz.attention_figure(view.image, view.words, view.attention, preprocess=view.preprocess,
                                   opacity=float(opacity), locations=view.locations, title=view.text)
        name = re.sub(r"[^a-z0-9]+", "-", view.text.lower()).strip("-")[:48] or "no-words"
        fd, path = tempfile.mkstemp(dir=self.figures_dir, prefix=f"attention-{name}-", suffix=".png")
        with os.fdopen(fd, "wb") as f:
            f.write(viz.figure_png(fig))
        with self._figures_lock:
            # Gradio copies returned files into its cache, so all but the latest PNGs can go.
            self._figures.append(path)
            while len(self._figures) > FIGURES_KEPT:
                os.remove(self._figures.popleft())
        return gr.update(value=path, interactive=True)

    # helpers

    def _caption(self, picture: Image.Image, beam_size: float, max_len: float | None = None) -> Caption:
        # The caption events skip Gradio's preprocessing, so the numbers arrive unchecked.
        try:
            beam, length = int(beam_size), int(max_len) if max_len else None
        except (TypeError, ValueError):
            raise gr.Error(f"beam size and maximum length must be numbers, got {beam_size!r} and {max_len!r}",
                           print_exception=False) from None
        try:
            return self.batcher.caption(picture, beam, length)
        except CaptionerError as e:  # e.g. a beam size out of range: the caller can fix it
            raise gr.Error(str(e), print_exception=False) from None

    def heatmaps(self, view: View, opacity: float, gallery: bool = True):
        """The selected word's overlay (large, labelled) and, optionally, the captioned gallery."""
        if not view.words:
            return gr.Image(value=view.image, label="The model wrote no words"), []
        words = range(len(view.words)) if gallery else [view.selected]
        overlays = dict(zip(words, viz.word_overlays(view.image, view.attention[list(words)],
                                                     preprocess=view.preprocess, opacity=float(opacity))))
        k = view.selected
        label = f'Where the model looked for "{view.words[k]}" (word {k + 1} of {len(view.words)})'
        large = gr.Image(value=overlays[k], label=label)
        return large, [(overlays[i], f"{i + 1}. {view.words[i]}") for i in words] if gallery else []


# the model panel

METRICS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr")
CARD_DATA_KEYS = ("trained_on", "data", "dataset", "description")  # card fields that say what it learnt from


def trained_on(captioner: Captioner) -> str:
    """What the model was trained on, from its card, else from its encoder and data record."""
    card = captioner.info.get("card") or {}
    for text in (card.get(k) for k in CARD_DATA_KEYS):
        if isinstance(text, str) and text.strip():
            return text.strip()
    if captioner.encoder_spec.weights == "none":
        return "synthetic scenes of coloured shapes (`captioner.synthetic`), with a random, seeded VGG encoder"
    data = captioner.info.get("data") or {}
    return f"the data prepared in `{data['dir']}`" if data.get("dir") else "unknown (the checkpoint does not say)"


def model_notice(captioner: Captioner) -> str:
    """The plain paragraph above the page: what this model can describe, and what it cannot."""
    text = f"**This model was trained on {trained_on(captioner)}.**"
    if captioner.encoder_spec.weights == "none":
        # A random encoder only separates what the synthetic scenes vary: colours, shapes, places.
        text += (" It describes scenes like the examples below and nothing else: for real photos you need a "
                 "checkpoint trained on MS-COCO (see README.md, section 'Train on MS-COCO'), served with "
                 "`python app.py --checkpoint runs/coco/best.pt`.")
    return text


def model_card(captioner: Captioner) -> str:
    """Markdown for the model panel: training data, metrics, vocabulary, attention type."""
    info, spec, cfg = captioner.info, captioner.encoder_spec, captioner.decoder.config
    weights = {"none": f"random, seeded ({spec.seed})", "imagenet": "ImageNet"}.get(spec.weights, spec.weights)
    train = info.get("train") or {}
    lines = [
        f"- **Trained on:** {trained_on(captioner)}",
        f"- **Checkpoint:** `{os.path.basename(info.get('checkpoint', '?'))}`, {info.get('step', 0)} optimizer steps",
        f"- **Attention:** {captioner.attention_type}",
        f"- **Vocabulary:** {len(captioner.vocab)} words (special tokens included)",
        f"- **Encoder:** {spec.arch.upper()} ({weights} weights), {spec.image_size}×{spec.image_size} input "
        f"→ {spec.grid}×{spec.grid} attention grid",
        f"- **Decoder:** embedding {cfg.embed_dim}, LSTM {cfg.hidden_dim}, attention {cfg.attention_dim}",
    ]
    if train:
        lines.append(f"- **Training:** up to {train.get('epochs', '?')} epochs, batch {train.get('batch_size', '?')}, "
                     f"lr {train.get('lr', '?')}, best checkpoint by {train.get('metric', '?')}")
    card = info.get("card") or {}
    shown = {k: v for k, v in card.items()
             if k not in (*CARD_DATA_KEYS, "test_images") and isinstance(v, (str, int, float))}
    lines += [f"- **{k.replace('_', ' ').capitalize()}:** " + (f"`{v}`" if k == "rebuild" else f"{v}")
              for k, v in shown.items()]
    test = {k: v for k, v in (card.get("test_metrics") or {}).items() if isinstance(v, (int, float))}
    if test:
        where = f" on {card['test_images']} held-out test images" if "test_images" in card else ""
        lines += ["", f"**Test metrics**{where} (coco-caption; pointing: share of object words whose "
                  "attention peak lies on the object):", "",
                  "| " + " | ".join(test) + " |", "|" + "---|" * len(test),
                  "| " + " | ".join(f"{v:.3f}" for v in test.values()) + " |"]
    metrics = {k: v for k, v in (info.get("metrics") or {}).items() if k in METRICS and isinstance(v, (int, float))}
    if metrics:
        where = f" on {info['metrics']['images']} validation images" if "images" in info["metrics"] else ""
        lines += ["", f"**Validation metrics**{where} (coco-caption; BLEU, METEOR, ROUGE-L as fractions):", "",
                  "| " + " | ".join(metrics) + " |", "|" + "---|" * len(metrics),
                  "| " + " | ".join(f"{v:.3f}" for v in metrics.values()) + " |"]
    return "\n".join(lines)
