"""How captions are written from a trained model: every decoding choice a user makes, declared once.

Every caller reads `Decoding`, and the command lines derive their flags and help from its fields. Callers
ask a `Method` what it does rather than its name; a new method is its routine, one line here and one in
`decoding.decode.ROUTINES`. No torch here: the ONNX runtime reads the settings too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Annotated, Literal, NamedTuple

from captioner.errors import OptionError
from captioner.models.contexts import CONTEXT_MODES, EXPECTED, SAMPLE

MAX_BEAMS = 50  # most beams, and most samples, per image
WHOLE = ("beam_size", "max_len", "top_k", "n", "seed")  # settings that count
MAPS = ("attention", "posterior")  # what a word's map shows (`Decoding.maps`)
RANGES = (("beam_size", 1, MAX_BEAMS), ("n", 1, MAX_BEAMS), ("max_len", 1, None), ("top_k", 0, None))  # least, most


class Method(NamedTuple):
    """A way to write captions from the decoder (its routine: `decoding.decode.ROUTINES`)."""

    reads: tuple[str, ...]  # its own settings (`Decoding` fields): another method's, changed, is refused
    compiles: bool = False  # a fixed-shape search that compiles (`compiled`); its batches are padded to a few sizes
    draws: bool = False  # its hypotheses are samples, each an image's caption of its own (not ranked beams)


METHODS: dict[str, Method] = {
    "beam": Method(("beam_size", "length_norm"), compiles=True),
    "sampling": Method(("temperature", "top_k", "top_p", "n"), draws=True),
}


@dataclass(frozen=True)
class Decoding:
    """Decoding: beam search (greedy at one beam) or sampling, and the attention's context."""

    method: Annotated[
        str,
        "--decoding",
        "beam: the likeliest caption a beam search finds (--beam-size, --no-length-norm); sampling: captions drawn "
        "word by word (--temperature, --top-k, --top-p, --n)",
    ] = "beam"
    beam_size: Annotated[int, "beams per image (1: greedy)"] = 3
    max_len: Annotated[int | None, "most words per caption (default: the model's training maximum)"] = None
    length_norm: Annotated[
        bool,
        "beams ranked by log-probability per word; off (--no-length-norm), by their total, which favours short "
        "captions",
    ] = True
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
    maps: Annotated[
        Literal["attention", "posterior"],
        "each word's map: attention, α_t as the decoder attended (the paper's); posterior, where the word written "
        "was read from (α_t times each location's own likelihood of that word; decoding.posterior)",
    ] = "attention"

    def __post_init__(self):
        for name in WHOLE:  # the page's sliders send floats
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():
                object.__setattr__(self, name, int(value))
        if self.method not in METHODS:
            raise OptionError(f"--decoding must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.mode not in (None, *CONTEXT_MODES):
            raise OptionError(f"--mode must be one of {CONTEXT_MODES}, got {self.mode!r}")
        if self.maps not in MAPS:
            raise OptionError(f"--maps must be one of {MAPS}, got {self.maps!r}")
        for name, low, high in RANGES:
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
        for name, other in METHODS.items():
            changed = [k for k in other.reads if getattr(self, k) != _DEFAULTS[k] and k not in self.how.reads]
            if changed:
                raise OptionError(
                    f"{', '.join(map(_flag, changed))}: for {name} only; add --decoding {name} "
                    f'(method="{name}" in Python)'
                )

    @property
    def how(self) -> Method:
        """The method these settings name."""
        return METHODS[self.method]

    @property
    def context(self) -> str:
        """The attention's context: "expected" unless a hard-attention model is asked otherwise."""
        return self.mode or EXPECTED

    @property
    def randomised(self) -> bool:
        """Whether the captions depend on `seed`."""
        return self.how.draws or self.context == SAMPLE

    def with_settings(self, **settings) -> Decoding:
        """These settings with some changed; None leaves a setting as it is. Raises `OptionError`."""
        unknown = sorted(set(settings) - set(_DEFAULTS))
        if unknown:
            raise OptionError(f"unknown decoding setting {unknown[0]!r}; the settings are {', '.join(_DEFAULTS)}")
        return replace(self, **{k: v for k, v in settings.items() if v is not None})

    def to_dict(self) -> dict:
        return asdict(self)


_DEFAULTS = {f.name: f.default for f in fields(Decoding)}


def _flag(name: str) -> str:
    return "--decoding" if name == "method" else f"--{name.replace('_', '-')}"
