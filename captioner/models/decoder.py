"""LSTM decoder with MLP attention, "Show, Attend and Tell" §3.1.2 and §4 (Xu et al., 2015).

Soft attention (§4.2) feeds the expected context ẑ_t = β_t Σ_i α_ti a_i; hard attention (§4.1)
feeds one sampled annotation a_{s_t}, s_t ~ Multinoulli(α_t). f_att is the MLP of eqs. (4)-(5).
Shapes: B batch, L locations (196 = 14×14), D annotation size (512), E embedding size, H LSTM size,
A attention size, T caption steps, V vocabulary size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from captioner.errors import OptionError
from captioner.models.contexts import ARGMAX, CONTEXT_MODES, EXPECTED, SAMPLE
from captioner.options import check_positive

FEATURE_STD_FLOOR = 1e-3  # under the features' std: channels dead in the training images stay zero


class Attention(nn.Module):
    """f_att, the MLP of eq. (4): e_ti = v·tanh(W_a a_i + W_h h_{t-1}); α_t = softmax(e_t), eq. (5).

    With `embed_dim`, the query also holds the word just written (+ W_y E y_{t-1}): h_{t-1} has not seen
    y_{t-1}, so without it the map for "triangle" in "a yellow triangle" cannot know which object was chosen.

    Computed as e_ti = 2v·σ(2 W_a a_i + 2 W_h h_{t-1}): tanh(x) = 2σ(2x) − 1, so the two differ by −Σv at
    every location, which softmax ignores; σ is the cheaper of the two on CPUs."""

    def __init__(self, encoder_dim: int, hidden_dim: int, attention_dim: int, embed_dim: int | None = None):
        super().__init__()
        self.W_a = nn.Linear(encoder_dim, attention_dim)  # annotation → attention space
        self.W_h = nn.Linear(hidden_dim, attention_dim, bias=False)  # previous state → attention space
        self.v = nn.Linear(attention_dim, 1, bias=False)  # score per location
        # previous word → attention space
        self.W_y = None if embed_dim is None else nn.Linear(embed_dim, attention_dim, bias=False)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """2 W_a a_i for all locations: once per image, not once per step."""
        return F.linear(features, 2 * self.W_a.weight, 2 * self.W_a.bias)  # (B, L, A)

    def query(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """W_h h_{t-1} (+ W_y E y_{t-1}) (B, A)."""
        q = self.W_h(h)
        return q if self.W_y is None else q + self.W_y(emb)

    def forward(self, projected: torch.Tensor, h: torch.Tensor, emb: torch.Tensor, sharpness: float = 1.0):
        """α_t (B, L) = softmax(k e_t), with `sharpness` k (decoding; 1 is the paper's map)."""
        s = torch.sigmoid(projected + 2 * self.query(h, emb).unsqueeze(1))  # (B, L, A)
        e = s @ (2 * sharpness * self.v.weight.view(-1))  # (B, L), k e_t
        return e.softmax(dim=1)  # (B, L), sums to 1


def choose_locations(alpha: torch.Tensor, mode: str, generator: torch.Generator | None = None):
    """The location each row attends (B,) for hard attention's modes; None for the expected context.
    `mode` is one of CONTEXT_MODES: the settings that carry it refuse any other as they are made."""
    if mode == EXPECTED:
        return None
    if mode == SAMPLE:
        return sample_from(alpha, generator)  # (B,)
    return alpha.argmax(dim=1)  # (B,), ARGMAX


def sample_from(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index (B,) drawn from each row of probabilities p (B, N): argmax p / q with q ~ Exp(1), the
    draw `torch.multinomial(p, 1)` makes (the same indices from the same generator state), without the
    validity check that reads the probabilities back to the host."""
    q = torch.empty_like(p, dtype=torch.float32).exponential_(generator=generator)  # (B, N)
    return (p.float() / q).argmax(dim=1)


@dataclass(frozen=True)
class DecoderConfig:
    """The decoder's sizes and settings; travels in the checkpoint and rebuilds the model. A field that
    is None is settled by `fit` (`train.resume.settle`) from the other options before a model is built."""

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


class Unrolled(NamedTuple):
    """A teacher-forced pass, stopped before the output layer."""

    emb: torch.Tensor  # (B, T-1, E) E y_{t-1}
    h: torch.Tensor  # (B, T-1, H) h_t
    z: torch.Tensor  # (B, T-1, D) ẑ_t
    alphas: torch.Tensor  # (B, T-1, L) α_t
    locations: torch.Tensor  # (B, T-1) location used, -1 where the context was expected


class Joined(NamedTuple):
    """A step's weights side by side (`AttentionDecoder.joined`): one product each, not three and two."""

    lstm: torch.Tensor  # (4H, E+H+D) [W_y | W_h | W_z]
    output: torch.Tensor  # (E, H+D) [L_h | L_z]


class AttentionDecoder(nn.Module):
    """Caption generator over annotation vectors, built from a settled config alone;
    `AttentionDecoder(vocab_size=V, ...)` is `AttentionDecoder(DecoderConfig.paper(vocab_size=V, ...))`."""

    def __init__(self, config: DecoderConfig | None = None, /, **fields):
        super().__init__()
        if (config is None) == (not fields):
            raise TypeError("AttentionDecoder takes a DecoderConfig or its fields as keywords, one of the two")
        config = config or DecoderConfig.paper(**fields)
        unsettled = [k for k, v in asdict(config).items() if v is None]
        if unsettled:
            raise ValueError(
                f"DecoderConfig.{', '.join(unsettled)} not settled: `train.resume.settle` settles a run's, "
                "DecoderConfig.paper(...) gives the paper's"
            )
        self.config = config
        V, D, E, H, A = config.vocab_size, config.encoder_dim, config.embed_dim, config.hidden_dim, config.attention_dim
        self.embedding = nn.Embedding(V, E)  # E, the word embedding matrix
        self.attention = Attention(D, H, A, E if config.word_query else None)  # f_att
        self.f_beta = nn.Linear(H, 1)  # gating scalar β_t = σ(f_β(h_{t-1})), §4.2.1
        self.init_h = nn.Linear(D, H)  # f_init,h on the mean annotation
        self.init_c = nn.Linear(D, H)  # f_init,c on the mean annotation
        # Eq. (1): the LSTM's affine map of [E y_{t-1}; h_{t-1}; ẑ_t], split by input so the
        # embedding part can be computed for all steps at once.
        self.lstm_y = nn.Linear(E, 4 * H)
        self.lstm_h = nn.Linear(H, 4 * H, bias=False)
        self.lstm_z = nn.Linear(D, 4 * H, bias=False)
        # Eq. (7), deep output: p(y_t) ∝ exp(L_o(E y_{t-1} + L_h h_t + L_z ẑ_t)).
        self.L_h = nn.Linear(H, E)
        self.L_z = nn.Linear(D, E, bias=False)
        self.L_o = nn.Linear(E, V)
        self.dropout = nn.Dropout(config.dropout)
        # Fixed per-channel standardisation of the annotation vectors, set from the training
        # features by `fit` (VGG channels differ in scale by orders of magnitude; standardised
        # inputs train much faster). Saved with the weights.
        self.register_buffer("feature_mean", torch.zeros(D))
        self.register_buffer("feature_std", torch.ones(D))

    def set_feature_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        self.feature_mean.copy_(mean)
        self.feature_std.copy_(std.clamp_min(FEATURE_STD_FLOOR))

    def normalize(self, features: torch.Tensor) -> torch.Tensor:
        """Raw encoder output (B, L, D) → standardised annotation vectors a_i."""
        return (features - self.feature_mean) / self.feature_std  # (B, L, D)

    def init_state(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h_0, c_0 from the mean annotation vector (§3.1.2), as in the authors' code (tanh)."""
        mean = features.mean(dim=1)  # (B, D)
        return torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))  # (B, H) each

    def start(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where every caption of raw encoder features starts, in training, decoding and the ONNX export: the
        annotation vectors a_i, their projection for attention (B, L, A), made once an image, and h_0, c_0."""
        features = self.normalize(features)  # (B, L, D)
        projected = self.attention.project(features)  # (B, L, A)
        return features, projected, *self.init_state(features)  # h, c (B, H)

    def attend(self, projected: torch.Tensor, h: torch.Tensor, emb: torch.Tensor, sharpness: float = 1.0):
        """α_t (B, L), eqs. (4)-(5), from h_{t-1} (and E y_{t-1}, with `word_query`); softmax(k e_t), k `sharpness`."""
        return self.attention(projected, h, emb, sharpness)

    def advance(
        self,
        features: torch.Tensor,
        alpha: torch.Tensor,
        emb: torch.Tensor,
        h: torch.Tensor,
        c: torch.Tensor,
        locations: torch.Tensor | None = None,
        joined: Joined | None = None,
    ):
        """The context from α_t, gated by β_t (§4.2.1), then the LSTM, eqs. (1)-(3): h_t, c_t, ẑ_t.
        `locations` (B,): where each row attends (hard attention); -1, or None for every row: the expected context."""
        beta = torch.sigmoid(self.f_beta(h))  # (B, 1)
        z = torch.bmm(alpha.unsqueeze(1).to(features.dtype), features).squeeze(1)  # (B, D), expected
        if locations is not None:
            rows = torch.arange(features.size(0), device=features.device)
            picked = features[rows, locations.clamp_min(0)]  # (B, D)
            z = torch.where((locations >= 0).unsqueeze(1), picked, z)
        z = beta * z
        gates = self.gates(emb, h, z, joined)  # (B, 4H)
        h, c = lstm_cell(gates, c)
        return h, c, z

    def gates(self, emb: torch.Tensor, h: torch.Tensor, z: torch.Tensor, joined: Joined | None = None) -> torch.Tensor:
        """Eq. (1)'s affine map of [E y_{t-1}; h_{t-1}; ẑ_t] (B, 4H); one product with `joined`."""
        if joined is None:
            return self.lstm_y(emb) + self.lstm_h(h) + self.lstm_z(z)
        return F.linear(torch.cat([emb, h, z], dim=1), joined.lstm, self.lstm_y.bias)

    def output(self, emb: torch.Tensor, h: torch.Tensor, z: torch.Tensor, joined: Joined | None = None) -> torch.Tensor:
        """Deep output layer, eq. (7): logits over the vocabulary (..., V); one product with `joined`."""
        if joined is None:
            return self.L_o(self.dropout(emb + self.L_h(h) + self.L_z(z)))
        return self.L_o(self.dropout(emb + F.linear(torch.cat([h, z], dim=1), joined.output, self.L_h.bias)))

    def joined(self) -> Joined:
        """The step's weights side by side, for a decoding loop in which they do not change (beam
        search): each caller takes them afresh, so no copy outlives an optimizer step."""
        return Joined(
            torch.cat([self.lstm_y.weight, self.lstm_h.weight, self.lstm_z.weight], dim=1),
            torch.cat([self.L_h.weight, self.L_z.weight], dim=1),
        )

    def step(
        self,
        features: torch.Tensor,
        projected: torch.Tensor,
        words: torch.Tensor,
        h: torch.Tensor,
        c: torch.Tensor,
        mode: str = EXPECTED,
        generator: torch.Generator | None = None,
        joined: Joined | None = None,
        sharpness: float | torch.Tensor | None = None,
    ):
        """One generation step from the previous words (B,): logits (B, V), h, c, α (B, L) and the
        chosen locations (B,) or None. `mode`: hard attention's location ("expected" for soft);
        `sharpness`: k of softmax(k e_t), a float or a () tensor (None: `decode_sharpness`)."""
        emb = self.embedding(words)  # (B, E)
        sharpness = self.config.decode_sharpness if sharpness is None else sharpness  # a float, or a tensor
        alpha = self.attend(projected, h, emb, sharpness)  # (B, L)
        loc = choose_locations(alpha, mode, generator)  # (B,) or None
        h, c, z = self.advance(features, alpha, emb, h, c, loc, joined)
        return self.output(emb, h, z, joined), h, c, alpha, loc

    def unroll(
        self,
        features: torch.Tensor,
        captions: torch.Tensor,
        sampled: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        locations: torch.Tensor | None = None,
    ) -> Unrolled:
        """The plain teacher-forced pass (autograd throughout), soft by default. `sampled` (B,): images
        whose context is a location drawn from α_t at every step; `locations` (B, T-1), fixed locations
        (-1: expected context), overrides it."""
        B, T = captions.shape
        features, projected, h, c = self.start(features)
        emb = self.embedding(captions[:, :-1])  # (B, T-1, E)
        hs, zs, alphas, locs = [], [], [], []
        for t in range(T - 1):
            alpha = self.attend(projected, h, emb[:, t])  # (B, L)
            loc = None if locations is None else locations[:, t]
            if loc is None and sampled is not None:
                loc = torch.where(sampled, sample_from(alpha.detach(), generator), -1)  # (B,)
            h, c, z = self.advance(features, alpha, emb[:, t], h, c, loc)
            hs.append(h), zs.append(z), alphas.append(alpha)
            locs.append(torch.full((B,), -1, device=features.device) if loc is None else loc)
        return Unrolled(emb, torch.stack(hs, 1), torch.stack(zs, 1), torch.stack(alphas, 1), torch.stack(locs, 1))

    def forward(
        self, features: torch.Tensor, captions: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The plain teacher-forced soft pass (training takes an equal faster one): logits (B, T-1, V),
        position t predicting captions[:, t+1], and α (B, T-1, L). `captions` (B, T): <start> w1 ... <end>
        then <pad>=0; `lengths` (B,) counts <start> and <end>."""
        u = self.unroll(features, captions)
        return self.output(u.emb, u.h, u.z), u.alphas


def lstm_cell(gates: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. (2)–(3): the LSTM's gates (B, 4H) and c_{t-1} (B, H) → h_t, c_t (B, H)."""
    i, f, o, g = gates.chunk(4, dim=1)  # (B, H) each
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


def step_mask(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """(B, T-1) True where position t predicts a real word or <end>, False on padding."""
    return torch.arange(steps, device=lengths.device).unsqueeze(0) < (lengths - 1).unsqueeze(1)


__all__ = ["ARGMAX", "CONTEXT_MODES", "EXPECTED", "SAMPLE", "Attention", "choose_locations", "sample_from"]
