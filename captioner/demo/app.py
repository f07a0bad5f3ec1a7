"""The web demo's page: upload an image, read its caption, see where the model looked for each word.

captioner demo [--checkpoint PATH_OR_URL#sha256=HEX] [--host 127.0.0.1] [--port 7860]
python app.py [...]     # the same, from a checkout
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline by design: no telemetry calls

import gradio as gr

from captioner.data.images import set_max_pixels
from captioner.decoding.settings import METHODS, Decoding
from captioner.demo.card import examples_note, model_card, model_notice
from captioner.demo.handlers import Demo
from captioner.demo.options import PAGE_BEAM, PAGE_TOP_P, DemoOptions
from captioner.demo.views import PageOutputs
from captioner.errors import CaptionerError
from captioner.options import add_options, choose_device, field_info, from_args
from captioner.serve import heatmaps as viz
from captioner.serve.api import Captioner
from captioner.serve.sources import example_images, model_source

# System fonts: the default theme fetches Google Fonts, which an offline machine cannot reach.
THEME = gr.themes.Soft(primary_hue="orange", font=["system-ui", "sans-serif"], font_mono=["monospace"])
CSS = """
#words .empty { min-height: 3rem !important; height: 3rem !important; }
#words .token { font-size: 1.2rem; cursor: pointer; padding: 2px 6px; }
#caption textarea { font-size: 1.35rem; font-weight: 600; }
#word-gallery .grid-wrap { height: auto !important; min-height: 0 !important; max-height: none !important; }
.image-error { color: #b91c1c; font-weight: 600; margin: 0.25rem 0.5rem; }
.familiarity { margin: 0 0.5rem; }
.familiarity.unfamiliar { color: #b45309; font-weight: 600; }
.familiarity.familiar { color: #15803d; }
#model-card table td { white-space: nowrap; word-break: normal; }
#model-card table th { white-space: normal; word-break: normal; }  /* headers wrap between words only */
"""
# The page's (lowest, highest, step) of the decoding settings a method may read; others get a number box.
RANGES = {
    "beam_size": (1, 10, 1),
    "n": (1, 10, 1),
    "temperature": (0, 2, 0.05),
    "top_k": (0, 100, 1),
    "top_p": (0.05, 1, 0.05),
}
COLORS = {"word": "#93c5fd", "shown": "#f97316"}  # shown at half opacity by Gradio
# Download the figure once the server has drawn it: one click, and nothing drawn until asked.
DOWNLOAD_JS = """(file) => {
  if (!file || !file.url) return;
  const a = document.createElement("a");
  a.href = file.url; a.download = file.orig_name || "attention.png";
  document.body.appendChild(a); a.click(); a.remove();
}"""


def get_args_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_options(p, DemoOptions)
    return p


def build_app(demo: Demo, examples: list[str]) -> gr.Blocks:
    """The page: image and settings on the left; caption, words and heatmaps on the right."""
    with gr.Blocks(title="captioner: Show, Attend and Tell", analytics_enabled=False) as app:
        gr.Markdown(
            "# Show, Attend and Tell\nUpload an image: the model writes a caption one word at a time, "
            "looking at a different place for each word. Click a word to see where it looked."
        )
        gr.Markdown(model_notice(demo.captioner), elem_id="notice")
        page = {"session": gr.State(None, time_to_live=3600)}
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=300):
                page |= _inputs(demo.captioner, examples, Decoding(method=demo.method))
            with gr.Column(scale=3, min_width=400):
                page |= _outputs()
        with gr.Accordion("Data for programs (what /caption returns)", open=False):
            page["data"] = gr.JSON(label="Caption data")
        _wire(demo, examples, page)
    return app


def _inputs(cap, examples: list[str], decoding: Decoding) -> dict:
    """The left column: the image, its examples, the settings (those of the page's method) and the model's card."""
    image = gr.Image(
        type="filepath",
        image_mode=None,
        label="Image",
        height=340,
        elem_id="image",
        sources=["upload", "clipboard", "webcam"],
    )
    error = gr.HTML(visible=False, elem_id="image-error")
    chooser = gr.Dataset(
        components=[image],
        samples=[[p] for p in examples],
        type="index",
        label="Examples",
        elem_id="examples",
        visible=bool(examples),
    )
    if examples:
        gr.Markdown(examples_note(cap, examples), elem_id="examples-note")
    controls = _controls(decoding)
    max_len = gr.Slider(1, max(50, cap.max_len), value=cap.max_len, step=1, label="Maximum length (words)")
    opacity = gr.Slider(
        0,
        1,
        value=viz.OPACITY,
        step=0.05,
        label="Heatmap opacity",
        info="at the most attended place; elsewhere it fades with the attention",
    )
    with gr.Row():
        run = gr.Button("Caption", variant="primary")
        another = gr.Button("Another caption", elem_id="another")
    gr.Markdown(
        "*Another caption* draws one word at a time from the model's probabilities (among the likeliest "
        f"words holding {PAGE_TOP_P:.0%}), not the beam search's likeliest caption: a new one each click.",
        elem_id="another-note",
    )
    with gr.Accordion("Model", open=True):
        gr.Markdown(model_card(cap), elem_id="model-card")
    return {
        "image": image,
        "error": error,
        "chooser": chooser,
        "controls": controls,
        "max_len": max_len,
        "opacity": opacity,
        "run": run,
        "another": another,
    }


def _controls(decoding: Decoding) -> dict[str, gr.components.Component]:
    """A control for each setting the page's method reads, drawn from its `Decoding` field (its help, its
    type, a range from `RANGES`); and a beam slider always, hidden unless the method reads it: /caption takes
    a beam size."""
    reads = decoding.how.reads
    controls = {}
    for name in ("beam_size", *(n for n in reads if n != "beam_size")):
        kind, text, default = field_info(Decoding, name)
        label = "Captions per image" if name == "n" else name.replace("_", " ").capitalize()
        shown = dict(label=label, info=text, visible=name in reads)
        value = PAGE_BEAM if name == "beam_size" else default
        if kind is bool:
            controls[name] = gr.Checkbox(value, **shown)
        elif name in RANGES:
            low, high, step = RANGES[name]
            controls[name] = gr.Slider(low, high, value=value, step=step, **shown)
        else:
            controls[name] = gr.Number(value, **shown)
    return controls


def _outputs() -> dict:
    """The right column: the caption, its words, the heatmaps, the beams and the figure's download."""
    return {
        "caption": gr.Textbox(label="Caption", elem_id="caption", interactive=False, buttons=["copy"]),
        "familiarity": gr.HTML(elem_id="familiarity"),
        "words": gr.HighlightedText(
            label="Click a word", elem_id="words", color_map=COLORS, show_inline_category=False, show_legend=False
        ),
        "large_label": gr.Markdown(elem_id="large-label"),
        "large": gr.Image(
            show_label=False,
            type="pil",
            interactive=False,
            height=420,
            elem_id="large-heatmap",
            format="jpeg",
            buttons=["fullscreen"],
        ),
        "gallery_note": gr.Markdown("Every word (click one to show it large; the framed one is shown)"),
        "gallery": gr.Gallery(
            show_label=False,
            columns=5,
            fit_columns=False,
            allow_preview=False,
            object_fit="contain",
            elem_id="word-gallery",
            format="jpeg",
            buttons=[],
        ),
        "alternatives": gr.Dataframe(
            headers=["Caption", "log-probability"],
            label="Top beams, or the caption drawn",
            elem_id="alternatives",
            interactive=False,
            wrap=True,
            column_widths=["80%", "20%"],
        ),
        "download": gr.Button("Download attention figure (PNG)", interactive=False, elem_id="download-figure"),
        "figure": gr.File(visible=False, elem_id="figure-file"),
    }


def _wire(demo: Demo, examples: list[str], p: dict) -> None:
    # preprocess=False: uploads reach `load_image` undecoded (see demo.uploads.upload_source).
    model_events = dict(concurrency_id="model", concurrency_limit=demo.batcher.max_batch_size, preprocess=False)
    draw_events = dict(concurrency_id="draw", concurrency_limit=2, api_visibility="private")

    names = list(p["controls"])  # the page's decoding settings, in the order the events receive them

    # One event for every way of choosing an image, so the page sends one request per image;
    # "always_last" runs a request made while one is pending after it, with the newest input.

    def caption_event(evt: gr.EventData, picture, example, length, alpha, state, *values):
        # An example is shown in the input, then captioned.
        shown = examples[int(example)] if isinstance(evt.target, gr.Dataset) else None
        pages = demo.caption_view(shown or picture, dict(zip(names, values)), length, alpha, state, show=shown)
        yield from (page.flat() for page in pages)

    def another_event(picture, length, alpha, state, *values):
        pages = demo.caption_view(picture, dict(zip(names, values)), length, alpha, state, sample=True)
        yield from (page.flat() for page in pages)

    settings = [p["max_len"], p["opacity"], p["session"], *p["controls"].values()]
    page = dict(api_visibility="private", trigger_mode="always_last", show_progress="minimal", **model_events)
    outputs = [p[name] for name in PageOutputs.names()]
    gr.on(
        [p["image"].input, p["run"].click, p["chooser"].click],
        caption_event,
        [p["image"], p["chooser"], *settings],
        outputs,
        **page,
    )
    p["another"].click(another_event, [p["image"], *settings], outputs, **page)
    shown = [p["words"], p["large_label"], p["large"], p["gallery"]]
    p["words"].select(demo.select_word, [p["session"], p["opacity"]], shown, **draw_events)
    p["gallery"].select(demo.select_word, [p["session"], p["opacity"]], shown, **draw_events)
    p["opacity"].change(demo.redraw, [p["session"], p["opacity"]], [p["large"], p["gallery"]], **draw_events)
    p["download"].click(demo.figure, [p["session"], p["opacity"]], [p["figure"]], **draw_events).success(
        None, [p["figure"]], None, js=DOWNLOAD_JS
    )
    # The API: exactly (image, beam size) → caption text, then data. No trigger on the page.
    beam = p["controls"]["beam_size"]
    gr.on([], demo.caption, [p["image"], beam], [p["caption"], p["data"]], api_name="caption", **model_events)


def page_settings(method: str) -> list[Decoding]:
    """The decoding settings the page and `/caption` offer: the method at each beam size of the page's slider."""
    if "beam_size" not in METHODS[method].reads:
        return [Decoding(method=method)]
    low, high, _ = RANGES["beam_size"]
    return [Decoding(method=method, beam_size=k) for k in range(low, high + 1)]


def main(args: argparse.Namespace | DemoOptions) -> None:
    """Serve the page until Ctrl-C or SIGTERM."""
    try:  # a bad option or model is one line naming it, before anything loads or serves
        if isinstance(args, argparse.Namespace):
            args = from_args(DemoOptions, args)
        Decoding(method=args.decoding, maps=args.maps)
        set_max_pixels(args.max_pixels)
        cap = Captioner.load(model_source(args.checkpoint), device=str(choose_device(args.device)), graphs=args.graphs)
    except CaptionerError as e:
        sys.exit(f"error: {e}")
    examples = example_images() if args.examples is None else args.examples
    warm = page_settings(args.decoding)
    demo = Demo(cap, max_batch_size=args.max_batch_size, method=args.decoding, maps=args.maps, warm=warm)
    try:
        seconds = demo.batcher.ready.result()  # on a GPU the batcher compiles the page's searches first
    except CaptionerError as e:
        sys.exit(f"error: {e}")
    if seconds:
        print(f"compiled the search in {seconds:.0f} s", file=sys.stderr)
    app = build_app(demo, examples)
    app.queue(max_size=args.queue_size, default_concurrency_limit=2)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop like Ctrl-C: temporary files go
    app.launch(
        server_name=args.host,
        server_port=args.port,
        show_error=True,
        max_file_size=args.max_file_size,
        allowed_paths=[os.path.dirname(os.path.abspath(p)) for p in examples] + [demo.figures_dir],
        theme=THEME,
        css=CSS,
        footer_links=["api"],
        run_history=False,
        state_session_capacity=1000,
    )


if __name__ == "__main__":
    main(get_args_parser().parse_args())
