"""The web demo's logic: read an upload, caption it through a shared batcher, draw its views.

Nothing here knows the page's layout. The caption event sets every output of the page at once, so
nothing stale stays on the page.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Sequence

import gradio as gr
from PIL import Image, ImageOps

from captioner.decoding.settings import METHODS, Decoding
from captioner.demo.options import PAGE_TOP_P
from captioner.demo.uploads import read_upload
from captioner.demo.views import (
    THUMB_SIDE,
    PageOutputs,
    View,
    WordView,
    caption_data,
    error_html,
    familiarity_html,
    fit_view,
    highlighted,
    large_label,
)
from captioner.errors import CaptionerError, OptionError
from captioner.options import field_info
from captioner.serve import heatmaps as viz
from captioner.serve.api import Caption, Captioner
from captioner.serve.batcher import Batcher

FIGURES_KEPT = 64  # attention PNGs kept on disk for download; older ones are deleted
MARK = (249, 115, 22)  # frame of the selected word's thumbnail (the page's orange)
FRAME = 4  # its width in pixels; the other thumbnails get a white frame


class Session:
    """One browser tab: the image it shows, and which caption request is the newest."""

    def __init__(self):
        self.view: View | None = None
        self.newest = 0  # the ticket of the newest caption request
        self.draws = 0  # "Another caption" clicks: the seed of the next sample
        self._lock = threading.Lock()

    def ticket(self) -> int:
        with self._lock:
            self.newest += 1
            return self.newest

    def draw(self) -> int:
        with self._lock:
            self.draws += 1
            return self.draws


def _frame(thumb: Image.Image, selected: bool) -> Image.Image:
    return ImageOps.expand(thumb, border=FRAME, fill=MARK if selected else (255, 255, 255))


class Demo:
    """The demo's event handlers around one loaded model; `figures_dir` holds the downloadable attention PNGs."""

    def __init__(
        self,
        captioner: Captioner,
        *,
        max_batch_size=8,
        figures_dir: str | None = None,
        method="beam",
        maps="attention",
        warm: Sequence[Decoding] = (),
    ):
        self.captioner, self.method, self.maps = captioner, method, maps
        self.batcher = Batcher(captioner, max_batch_size=max_batch_size, warm=warm)
        self.beams = max((settings.beam_size for settings in warm), default=None)  # the widest search readied
        self.figures_dir = figures_dir or tempfile.mkdtemp(prefix="captioner-demo-")
        if figures_dir is None:  # ours: removed when the server exits normally
            weakref.finalize(self, shutil.rmtree, self.figures_dir, ignore_errors=True)
        self._figures: collections.deque[str] = collections.deque()
        self._figures_lock = threading.Lock()

    def caption(self, image: dict | str | None, beam_size: float = 3) -> tuple[str, dict]:
        """The `/caption` API: an image and a beam size → the caption text, then its data.

        Args:
            image: the upload (gr.Image's payload, or a path).
            beam_size: K of the beam search (1 is greedy).

        Returns:
            The caption, and a dict with words, score, attention (n, g, g), alternatives and
            familiarity (is the image like the training images; None if the model cannot tell).
        """
        out = self._caption(read_upload(image), {"beam_size": beam_size})
        return out.text, caption_data(out)

    def caption_view(
        self,
        image: dict | str | None,
        chosen: dict,
        max_len: float,
        opacity: float,
        session: Session | None,
        *,
        show: str | None = None,
        sample: bool = False,
    ):
        """The page's caption event: yields `PageOutputs`, first with the outputs cleared, then filled.
        `image` None clears the page; `show` is a path to put in the image input first (an example was
        chosen); `sample` draws a new caption each time ("Another caption")."""
        session = session or Session()
        ticket = session.ticket()
        seed = session.draw() if sample else None
        session.view = None
        cleared = self._cleared(session, image=show if show is not None else gr.skip())
        yield cleared
        if image is None:  # the input was cleared: so is the page
            return
        cleared = cleared._replace(image=gr.skip())  # an example's picture is sent once
        try:
            picture = read_upload(image)
            out = self._caption(picture, chosen, max_len, seed)
        except gr.Error as e:  # shown beside the image: no toast, no error badge on every output
            if ticket == session.newest:
                yield cleared._replace(error=gr.update(value=error_html(str(e.message)), visible=True))
            return
        view = self._view(picture, out)
        large, gallery = self.heatmaps(view, opacity)
        if ticket != session.newest:  # a newer request started meanwhile: its results win
            return
        session.view = view
        rows = [[text, round(lp, 3)] for text, lp in out.alternatives]
        yield cleared._replace(
            caption=out.text or "(no words)",
            familiarity=familiarity_html(out.familiarity),
            view=WordView(
                highlighted(view),
                large_label(view, self.maps, self.captioner.attention_warning)
                if view.words
                else "The model wrote no words",
                large,
                gallery,
            ),
            alternatives=rows,
            data=caption_data(out),
            download=gr.update(interactive=bool(view.words)),
        )

    def _view(self, picture: Image.Image, out: Caption) -> View:
        """What the page shows of a caption: the image at the view's size, its thumbnail, the words and maps."""
        image = fit_view(picture)
        thumb = viz.fit_side(image, THUMB_SIDE)
        return View(
            image, thumb, out.text, out.words, out.attention, out.locations, self.captioner.encoder_spec.preprocess
        )

    def select_word(self, session: Session | None, opacity: float, evt: gr.SelectData):
        """A word (of the caption or the gallery) was clicked → (words, label, large heatmap, gallery)."""
        view = session.view if session else None
        if view is None or not view.words:
            return WordView(gr.skip(), gr.skip(), gr.skip(), gr.skip())
        view.selected = min(int(evt.index if not isinstance(evt.index, list) else evt.index[0]), len(view.words) - 1)
        return WordView(
            highlighted(view),
            large_label(view, self.maps, self.captioner.attention_warning),
            *self.heatmaps(view, opacity),
        )

    def redraw(self, session: Session | None, opacity: float):
        """Opacity changed → (large heatmap, gallery), redrawn from the View, not the model."""
        view = session.view if session else None
        if view is None:
            return gr.skip(), gr.skip()
        return self.heatmaps(view, opacity)

    def figure(self, session: Session | None, opacity: float) -> str | None:
        """The paper-style attention figure of the shown image as a PNG file (drawn when asked)."""
        view = session.view if session else None
        if view is None or not view.words:
            return None
        drawn = view.drawn_at(float(opacity))
        if ("figure",) in drawn and os.path.exists(drawn["figure",]):
            return drawn["figure",]
        fig = viz.attention_figure(
            view.image,
            view.words,
            view.attention,
            preprocess=view.preprocess,
            opacity=float(opacity),
            locations=view.locations,
            title=view.text,
            warning=self.captioner.attention_warning,
        )
        name = re.sub(r"[^a-z0-9]+", "-", view.text.lower()).strip("-")[:48] or "no-words"
        fd, path = tempfile.mkstemp(dir=self.figures_dir, prefix=f"attention-{name}-", suffix=".png")
        with os.fdopen(fd, "wb") as f:
            f.write(viz.figure_png(fig))
        with self._figures_lock:
            # Gradio copies returned files into its cache, so all but the latest PNGs can go.
            self._figures.append(path)
            while len(self._figures) > FIGURES_KEPT:
                os.remove(self._figures.popleft())
        drawn["figure",] = path
        return path

    def _cleared(self, session: Session, image) -> PageOutputs:
        """Every output emptied, the error line hidden and the download disabled."""
        return PageOutputs(
            image=image,
            error=gr.update(value="", visible=False),
            caption="",
            familiarity="",
            view=WordView([], "", None, []),
            alternatives=[],
            data=None,
            download=gr.update(interactive=False),
            session=session,
        )

    def _caption(
        self, picture: Image.Image, chosen: dict, max_len: float | None = None, seed: int | None = None
    ) -> Caption:
        """The caption of the page's method with the settings it reads from `chosen`, or sampled with `seed`."""
        try:
            reads = METHODS[self.method].reads
            given = {name: _number(name, value) for name, value in chosen.items() if name in reads}
            length = _number("max_len", max_len) if max_len else None
            if seed is None:
                decoding = Decoding(method=self.method, max_len=length, maps=self.maps, **given)
            else:
                decoding = Decoding(method="sampling", top_p=PAGE_TOP_P, max_len=length, seed=seed, maps=self.maps)
            if self.beams and decoding.beam_size > self.beams:
                raise OptionError(f"beam size at most {self.beams} here: the sizes this server readied its search for")
            return self.batcher.caption(picture, decoding)
        except CaptionerError as e:  # e.g. a beam size out of range: the caller can fix it
            raise gr.Error(str(e), print_exception=False) from None

    def heatmaps(self, view: View, opacity: float) -> tuple[Image.Image | None, list]:
        """The selected word's overlay at VIEW_SIDE, and every word's thumbnail (the selected one framed);
        drawn once per opacity and kept in the View, so that clicking words redraws nothing."""
        if not view.words:
            return view.image, []
        drawn = view.drawn_at(float(opacity))
        if ("thumbs",) not in drawn:
            drawn["thumbs",] = viz.word_overlays(
                view.thumb, view.attention, preprocess=view.preprocess, opacity=float(opacity), max_side=None
            )
        k = view.selected
        if ("large", k) not in drawn:
            drawn["large", k] = viz.word_overlays(
                view.image, view.attention[k : k + 1], preprocess=view.preprocess, opacity=float(opacity), max_side=None
            )[0]
        gallery = [(_frame(t, i == k), f"{i + 1}. {w}") for i, (t, w) in enumerate(zip(drawn["thumbs",], view.words))]
        return drawn["large", k], gallery


def _number(name: str, value):
    """A decoding setting as its `Decoding` field's type: the caption events skip Gradio's preprocessing,
    so the page's and the API's numbers arrive unchecked (a slider's whole numbers as floats)."""
    kind = field_info(Decoding, name)[0]
    if kind is bool:
        return bool(value)
    try:
        return kind(float(value)) if kind is int else kind(value)
    except (TypeError, ValueError):
        raise OptionError(f"{name.replace('_', ' ')} must be a number, got {value!r}") from None
