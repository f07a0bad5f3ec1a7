"""The decoder's config: its sizes and settings, which travel in every checkpoint and rebuild the model."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated, Literal

from captioner.errors import OptionError
from captioner.options import check_positive


@dataclass(frozen=True)
class DecoderConfig:
    """The decoder's sizes and settings; travels in the checkpoint and rebuilds the model. A field that
    is None is settled by `fit` (`train.settle`) from the other options before a model is built."""

    vocab_size: int  # V, set from the data
    encoder_dim: int = 512  # D, set by the encoder
    embed_dim: Annotated[int, "E, the word embedding size (also the deep output layer's width)"] = 512
    hidden_dim: Annotated[int, "H, the LSTM state size"] = 512
    attention_dim: Annotated[int, "A, the hidden size of the attention MLP"] = 512
    dropout: Annotated[float | None, "dropout before the output layer (0.5 is usual on COCO)"] = None
    attention: Annotated[
        Literal["soft", "hard"],
        "soft: deterministic attention; hard: sampled locations "
        "trained with REINFORCE (both decode with the expected context by default)",
    ] = "soft"
    word_query: Annotated[
        bool | None,
        "attend from h_{t-1} and the word just written, not h_{t-1} alone as the paper does, so that a "
        "map knows which object the caption has begun to name",
    ] = None
    decode_sharpness: Annotated[
        float | None,
        "k: decoding and sampling draw each map as softmax(k e_t), training as softmax(e_t); k > 1 makes a "
        "word's map commit to one object, and the word follow it",
    ] = None

    def __post_init__(self):
        if self.attention not in ("soft", "hard"):
            raise OptionError(f"--attention must be 'soft' or 'hard', got {self.attention!r}")
        check_positive(self, "decode_sharpness")

    @classmethod
    def paper(cls, **fields) -> DecoderConfig:
        """A settled config for a model built by hand: the given fields, and the paper's settings for the
        others that `fit` settles (dropout 0.5, attention from h_{t-1} alone, maps as trained)."""
        return cls(**{"dropout": 0.5, "word_query": False, "decode_sharpness": 1.0, **fields})

    def to_dict(self) -> dict:
        return asdict(self)
