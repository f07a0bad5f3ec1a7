"""The web demo's options, apart from the page so that reading them needs no gradio."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from captioner.data.images import DEFAULT_MAX_PIXELS
from captioner.options import Device

PAGE_BEAM = 3  # where the page's beam-size slider starts; the examples' card records are captioned at it
PAGE_TOP_P = 0.9  # "Another caption" samples from the likeliest words holding 90%: the tail writes nonsense


@dataclass(frozen=True)
class DemoOptions:
    checkpoint: Annotated[
        str | None,
        "the model: a checkpoint, an exported folder, URL#sha256=HEX (downloaded once into torch's hub cache) or "
        "hf://ORG/NAME (default: the bundled demo model)",
    ] = None
    host: Annotated[str, "address to serve on"] = "127.0.0.1"
    port: Annotated[int, "port"] = 7860
    examples: Annotated[list[str] | None, "example images shown on the page (default: the bundled examples)"] = None
    max_file_size: Annotated[str, "largest upload"] = "20mb"
    max_pixels: Annotated[int, "largest image in pixels, against decompression bombs"] = DEFAULT_MAX_PIXELS
    max_batch_size: Annotated[int, "most concurrent images captioned in one forward pass"] = 8
    queue_size: Annotated[int, "requests waiting beyond this are told the server is busy"] = 64
    decoding: Annotated[str, "the method the page's captions and /caption use (beam: a beam search)"] = "beam"
    maps: Annotated[
        Literal["attention", "posterior"],
        "the heatmap of each word: posterior, where the word it wrote was read from (decoding.posterior); "
        "attention, where the model looked before it wrote the word (the paper's maps)",
    ] = "posterior"
    device: Device = "auto"
    graphs: Annotated[
        bool, "on a GPU, compile the search before serving and replay it as CUDA graphs (--no-graphs: never)"
    ] = True
