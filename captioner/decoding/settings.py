"""How captions are written from a trained model: every decoding choice a user makes, declared once.

`Decoding` is the one set of settings that the Python API, `captioner caption`, `evaluate`, the
demo's request batcher and its page, and the search-graph cache read; the command lines derive
their flags and help from its fields. `decode` runs the routine it names:
- "beam": the batched beam search (`decoding.decode`; greedy is one beam);
- "sampling": captions drawn word by word, with temperature, top-k and top-p (`decoding.sampling`).

A new method is a new routine, one more `Literal` value and one line in `decode`.
Symbols: B images, L locations, D feature size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Annotated, Literal

import torch

from captioner.decoding.decode import Hypothesis, beam_search
from captioner.decoding.sampling import sample_captions
from captioner.errors import OptionError
from captioner.models.attention import CONTEXT_MODES, EXPECTED, SAMPLE
from captioner.models.decoder import AttentionDecoder

MAX_BEAMS = 50  # most beams, and most samples, per image
SAMPLING_ONLY = ("temperature", "top_k", "top_p", "n")
WHOLE = ("beam_size", "max_len", "top_k", "n", "seed")  # settings that count


@dataclass(frozen=True)
class Decoding:
    """Decoding: beam search (greedy at one beam) or sampling, and the attention's context."""

    method: Annotated[
        Literal["beam", "sampling"],
        "--decoding",
        "beam: the likeliest caption a beam search finds; sampling: captions drawn word by word "
        "(--temperature, --top-k, --top-p, --n)",
    ] = "beam"
    beam_size: Annotated[int, "beams per image (1: greedy)"] = 3
    max_len: Annotated[int | None, "most words per caption (default: the model's training maximum)"] = None
    length_norm: Annotated[bool, "rank beams by log-probability per word, not in total"] = False
    sharpness: Annotated[
        float | None, "k of the maps softmax(k e_t) that decoding draws (default: the model's own)"
    ] = None
    temperature: Annotated[float, "sampling: draw from softmax(logits / T); 0 always takes the likeliest word"] = 1.0
    top_k: Annotated[int, "sampling: draw only among the k likeliest words (0: all)"] = 0
    top_p: Annotated[float, "sampling: draw only among the fewest likeliest words that hold this probability"] = 1.0
    n: Annotated[int, "sampling: captions per image, each with its maps"] = 1
    mode: Annotated[
        Literal["expected", "argmax", "sample"] | None,
        "context for hard-attention models: expected (default), argmax or a sampled location",
    ] = None
    seed: Annotated[int, "random seed of sampling and of --mode sample (the same seed, the same captions)"] = 0

    def __post_init__(self):
        for name in WHOLE:  # the page's sliders send floats
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                object.__setattr__(self, name, int(value))
        if self.method not in ("beam", "sampling"):
            raise OptionError(f"--decoding must be 'beam' or 'sampling', got {self.method!r}")
        if self.mode not in (None, *CONTEXT_MODES):
            raise OptionError(f"--mode must be one of {CONTEXT_MODES}, got {self.mode!r}")
        for name, low, high in (
            ("beam_size", 1, MAX_BEAMS),
            ("n", 1, MAX_BEAMS),
            ("max_len", 1, None),
            ("top_k", 0, None),
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < low or (high and value > high)):
                limits = f"between {low} and {high}" if high else f"{low} or more"
                what = f"{name.replace('_', ' ')} ({_flag(name)})"
                raise OptionError(f"{what} must be a whole number {limits}, got {value}")
        if self.sharpness is not None and not self.sharpness > 0:
            raise OptionError(f"--sharpness must be positive, got {self.sharpness}")
        if not (self.temperature >= 0 and 0 < self.top_p <= 1):
            raise OptionError(
                f"sampling needs --temperature >= 0 and 0 < --top-p <= 1, got {self.temperature} and {self.top_p}"
            )
        changed = [name for name in SAMPLING_ONLY if getattr(self, name) != _DEFAULTS[name]]
        if changed and self.method != "sampling":
            raise OptionError(
                f"{', '.join(map(_flag, changed))}: for sampling only; add --decoding sampling "
                '(method="sampling" in Python)'
            )

    @property
    def context(self) -> str:
        """The attention's context: "expected" unless a hard-attention model is asked otherwise."""
        return self.mode or EXPECTED

    @property
    def randomised(self) -> bool:
        """Whether the captions depend on `seed`."""
        return self.method == "sampling" or self.context == SAMPLE

    def with_settings(self, **settings) -> Decoding:
        """These settings with some changed; None leaves a setting as it is.

        Raises:
            OptionError: a name that is not a setting, or a value out of range.
        """
        unknown = sorted(set(settings) - set(_DEFAULTS))
        if unknown:
            raise OptionError(f"unknown decoding setting {unknown[0]!r}; the settings are {', '.join(_DEFAULTS)}")
        return replace(self, **{k: v for k, v in settings.items() if v is not None})

    def to_dict(self) -> dict:
        return asdict(self)


_DEFAULTS = {f.name: f.default for f in fields(Decoding)}


def _flag(name: str) -> str:
    return "--decoding" if name == "method" else f"--{name.replace('_', '-')}"


def decode(
    decoder: AttentionDecoder,
    features: torch.Tensor,
    settings: Decoding,
    *,
    max_len: int,
    generator: torch.Generator | None = None,
    shapes: str | None = None,
    compiled: bool | None = None,
) -> list[list[Hypothesis]]:
    """Captions for a batch of images, as `settings` say.

    Args:
        decoder: the model, in eval mode.
        features: (B, L, D) annotation vectors.
        settings: how to decode.
        max_len: most words where `settings.max_len` is None (the model's training maximum).
        generator: the random source of sampling and of mode "sample"; default one seeded with
            `settings.seed` on the features' device (pass one to go on drawing across batches).
        shapes, compiled: the beam search's (`decoding.decode.beam_search`).

    Returns:
        For each image its hypotheses: the beams, best first, or the samples in the order drawn.
    """
    if generator is None and settings.randomised:
        generator = seeded(settings.seed, features.device)
    words = settings.max_len or max_len
    if settings.method == "sampling":
        return sample_captions(
            decoder,
            features,
            n=settings.n,
            max_len=words,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            mode=settings.context,
            generator=generator,
            sharpness=settings.sharpness,
        )
    return beam_search(
        decoder,
        features,
        beam_size=settings.beam_size,
        max_len=words,
        length_norm=settings.length_norm,
        mode=settings.context,
        generator=generator,
        shapes=shapes,
        compiled=compiled,
        sharpness=settings.sharpness,
    )


def seeded(seed: int, device: torch.device) -> torch.Generator | None:
    """A random source on `device`; None on the meta device, which has none (and draws nothing real)."""
    if device.type == "meta":
        return None
    return torch.Generator(device=device).manual_seed(int(seed))
