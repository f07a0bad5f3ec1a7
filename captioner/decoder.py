"""LSTM decoder with MLP attention, "Show, Attend and Tell" §3.1.2 and §4 (Xu et al., 2015).

Symbols used in shape comments:
    B batch, L locations (196 = 14×14), D annotation size (512), E embedding size,
    H LSTM size, A attention size, T caption steps, V vocabulary size.

Soft attention (§4.2) feeds the expected context ẑ_t = β_t Σ_i α_ti a_i; hard attention
(§4.1) feeds one sampled annotation a_{s_t}, s_t ~ Multinoulli(α_t). The same step serves
teacher-forced training and beam search.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

# How a step turns α into the context vector.
EXPECTED, SAMPLE, ARGMAX = "expected", "sample", "argmax"
CONTEXT_MODES = (EXPECTED, SAMPLE, ARGMAX)


@dataclass
class DecoderConfig:
    """Sizes of the decoder; travels in the checkpoint and rebuilds the model."""
    vocab_size: int
    encoder_dim: int = 512
    embed_dim: int = 512
    hidden_dim: int = 512
    attention_dim: int = 512
    dropout: float | None = None  # None: 0.2 for soft, 0.5 for hard (see __post_init__)
    attention: str = "soft"  # soft | hard: how it is trained (both decode with the expected context by default)

    def __post_init__(self):
        # Measured in 8-minute runs on synthetic scenes: soft attention points better at 0.2
        # (0.69 against 0.65 at 0.5), hard attention writes better at 0.5 (BLEU-4 0.51 against
        # 0.48). On COCO 0.5 is the usual choice for both.
        if self.dropout is None:
            self.dropout = 0.5 if self.attention == "hard" else 0.2

    def to_dict(self) -> dict:
        return asdict(self)


class _Score(torch.autograd.Function):
    """e_ti = v·tanh(p_ti + q_t) up to a per-row constant, computed as 2v·σ(2p + 2q).

    tanh(x) = 2σ(2x) − 1, so the two differ by −Σv for every location, which softmax ignores:
    α is exactly the paper's. On CPU σ is about 10× cheaper than tanh, and the hand-written
    backward saves two passes over the (B, L, A) tensor; this is the decoder's hot loop. It
    takes 2p and 2q (`Attention.project` doubles p once per image), which saves a third pass
    over (B, L, A) at every step.
    """

    @staticmethod
    def forward(ctx, projected, q, v, total=None):  # projected = 2p (B, L, A), q = 2q (n, A), v (A,)
        # projected may hold more rows than q (captions that have ended): only the first len(q)
        # are used, and their gradient is written straight into a full-sized tensor, so no
        # slicing of `projected` goes through autograd (each slice would cost a zero-filled
        # (B, L, A) gradient per step). With `total` (from `_GradientSum`, in a training pass)
        # the gradient, less its factor 2v, is added into it instead: no (B, L, A) tensor per step.
        n = q.size(0)
        ctx.dtypes = projected.dtype, q.dtype, v.dtype            # under autocast they may differ
        ctx.rows, ctx.total = projected.size(0), total
        v = v.to(projected.dtype)
        s = torch.add(projected[:n], q.to(projected.dtype).unsqueeze(1)).sigmoid_()  # (n, L, A), σ(2p + 2q)
        ctx.save_for_backward(s, v)
        return s @ (2 * v)                                             # (n, L)

    @staticmethod
    def backward(ctx, grad_e):
        s, v = ctx.saved_tensors
        n, L, A = s.shape
        grad_e = grad_e.to(s.dtype)
        grad_v = 2 * torch.einsum("bl,bla->a", grad_e, s)                         # (A,)
        p_dtype, q_dtype, v_dtype = ctx.dtypes
        # d e / d(2p) = 2 v σ(1 − σ), times the incoming gradient
        if ctx.total is not None:   # total gathers Σ_t grad_e σ(1 − σ); `_GradientSum` applies 2v once
            total, scratch = ctx.total
            ds = torch.addcmul(s, s, s, value=-1, out=scratch[:n])                   # (n, L, A), σ(1 − σ)
            total[:n].addcmul_(ds, grad_e.unsqueeze(2))
            grad_q = torch.bmm(grad_e.unsqueeze(1), ds).squeeze(1).mul_(2 * v)      # (n, A)
            return None, grad_q.to(q_dtype), grad_v.to(v_dtype), None
        grad_p = s.new_empty(ctx.rows, L, A)                                      # (B, L, A)
        grad_p[n:].zero_()
        torch.addcmul(s, s, s, value=-1, out=grad_p[:n]).mul_(grad_e.unsqueeze(2)).mul_(2 * v)
        return grad_p.to(p_dtype), grad_p[:n].sum(dim=1).to(q_dtype), grad_v.to(v_dtype), None


class _GradientSum(torch.autograd.Function):
    """x, unchanged, for a recurrence whose steps add their gradients for x into `total`
    themselves (`_Score`), in place, through one reused scratch tensor: left to autograd, each
    step would allocate a gradient the size of x, and autograd would add them up. The steps add
    their gradients without the factor `scale` that all of them share (2v); it is applied here,
    once per pass, which saves a pass over the step's (n, L, A) tensor at every step."""

    @staticmethod
    def forward(ctx, x, buffers: tuple[torch.Tensor, torch.Tensor], scale: torch.Tensor):
        ctx.total, ctx.scale = buffers[0], scale
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        total = ctx.total.mul_(ctx.scale)                          # the buffer is used once
        return (total if grad is None else total + grad), None, None


class _SharedWeight(torch.autograd.Function):
    """W, unchanged, for a recurrence whose every step multiplies by it (`_StepProduct`).

    Left to autograd, each step computes its own small W gradient (n rows deep, n ≤ B) and adds
    it to the running sum: two passes over W per step. Here the steps hand their (output
    gradient, input) pairs to this node, which autograd runs after all of them, and W's gradient
    is one product over every step's rows at once.
    """

    @staticmethod
    def forward(ctx, W, pairs: list):
        ctx.pairs, ctx.dtype = pairs, W.dtype
        ctx.set_materialize_grads(False)    # the steps send W no gradient: nothing to zero-fill
        return W.view_as(W)

    @staticmethod
    def backward(ctx, _):
        if not ctx.pairs:
            return None, None
        grads, inputs = zip(*ctx.pairs)
        ctx.pairs.clear()
        g, x = (torch.cat(t).to(ctx.dtype) for t in (grads, inputs))   # (Σn, out), (Σn, in)
        return g.t() @ x, None


class _StepProduct(torch.autograd.Function):
    """x Wᵀ for one step of a recurrence, W from `_SharedWeight`: its backward computes x's
    gradient and leaves W's to `_SharedWeight`, with the pair it needs."""

    @staticmethod
    def forward(ctx, x, W, pairs: list):
        ctx.save_for_backward(x, W)
        ctx.pairs = pairs
        return F.linear(x, W.to(x.dtype))

    @staticmethod
    def backward(ctx, g):
        x, W = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            ctx.pairs.append((g, x))
        grad_x = (g @ W.to(g.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


class Unrolled(NamedTuple):
    """A teacher-forced pass, stopped before the output layer."""
    emb: torch.Tensor        # (B, T-1, E) E y_{t-1}
    h: torch.Tensor          # (B, T-1, H) h_t
    z: torch.Tensor          # (B, T-1, D) ẑ_t
    alphas: torch.Tensor     # (B, T-1, L) α_t
    locations: torch.Tensor  # (B, T-1) location used, -1 where the context was expected


class Attention(nn.Module):
    """f_att, the MLP of eq. (4): e_ti = v·tanh(W_a a_i + W_h h_{t-1}); α_t = softmax(e_t), eq. (5)."""

    def __init__(self, encoder_dim: int, hidden_dim: int, attention_dim: int):
        super().__init__()
        self.W_a = nn.Linear(encoder_dim, attention_dim)             # annotation → attention space
        self.W_h = nn.Linear(hidden_dim, attention_dim, bias=False)  # previous state → attention space
        self.v = nn.Linear(attention_dim, 1, bias=False)             # score per location

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """2 W_a a_i for all locations: once per image, not once per step (doubled for `_Score`)."""
        return F.linear(features, 2 * self.W_a.weight, 2 * self.W_a.bias)  # (B, L, A)

    def forward(self, projected: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """α_t (n, L) for the n = len(h) states; `projected` (B ≥ n, L, A): its first n rows are used."""
        return self.weights(projected, 2 * self.W_h(h))

    def weights(self, projected: torch.Tensor, q: torch.Tensor, total=None) -> torch.Tensor:
        """α_t (n, L) from q = 2 W_h h_{t-1} (n, A), already computed; `total`: see `_Score`."""
        e = _Score.apply(projected, q, self.v.weight.view(-1), total)  # (n, L)
        return e.softmax(dim=1)                                  # (n, L), sums to 1


class AttentionDecoder(nn.Module):
    """Caption generator over annotation vectors.

    Args:
        vocab_size: V, including <pad>, <start>, <end>, <unk>.
        encoder_dim: D, size of an annotation vector.
        embed_dim: E, word embedding size (also the deep output layer's width).
        hidden_dim: H, LSTM size.
        attention_dim: A, hidden size of the attention MLP.
        dropout: dropout before the output layer L_o (None: 0.2 for soft, 0.5 for hard).
        attention: "soft" or "hard" (hard is trained with REINFORCE, see `forward_hard`).
    """

    def __init__(self, *, vocab_size: int, encoder_dim: int = 512, embed_dim: int = 512,
                 hidden_dim: int = 512, attention_dim: int = 512, dropout: float | None = None,
                 attention: str = "soft"):
        super().__init__()
        if attention not in ("soft", "hard"):
            raise ValueError(f"attention must be 'soft' or 'hard', got {attention!r}")
        self.config = DecoderConfig(vocab_size, encoder_dim, embed_dim, hidden_dim, attention_dim,
                                    dropout, attention)
        E, D, H = embed_dim, encoder_dim, hidden_dim
        self.embedding = nn.Embedding(vocab_size, E)             # E, the word embedding matrix
        self.attention = Attention(D, H, attention_dim)          # f_att
        self.f_beta = nn.Linear(H, 1)                            # gating scalar β_t = σ(f_β(h_{t-1})), §4.2.1
        self.init_h = nn.Linear(D, H)                            # f_init,h on the mean annotation
        self.init_c = nn.Linear(D, H)                            # f_init,c on the mean annotation
        # Eq. (1): the LSTM's affine map of [E y_{t-1}; h_{t-1}; ẑ_t], split by input so the
        # embedding part is computed for all steps at once.
        self.lstm_y = nn.Linear(E, 4 * H)
        self.lstm_h = nn.Linear(H, 4 * H, bias=False)
        self.lstm_z = nn.Linear(D, 4 * H, bias=False)
        # Eq. (7), deep output: p(y_t) ∝ exp(L_o(E y_{t-1} + L_h h_t + L_z ẑ_t)).
        self.L_h = nn.Linear(H, E)
        self.L_z = nn.Linear(D, E, bias=False)
        self.L_o = nn.Linear(E, vocab_size)
        self.dropout = nn.Dropout(self.config.dropout)
        self._compiled = False  # compile_step
        # Fixed per-channel standardisation of the annotation vectors, set from the training
        # features by `fit` (VGG activations are non-negative with channel scales that differ
        # by orders of magnitude; standardised inputs train much faster). Saved with the weights.
        self.register_buffer("feature_mean", torch.zeros(encoder_dim))
        self.register_buffer("feature_std", torch.ones(encoder_dim))

    @classmethod
    def from_config(cls, config: DecoderConfig) -> "AttentionDecoder":
        return cls(**asdict(config))

    # pieces shared by training and decoding

    def set_feature_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        self.feature_mean.copy_(mean)
        self.feature_std.copy_(std.clamp_min(1e-3))

    def normalize(self, features: torch.Tensor) -> torch.Tensor:
        """Raw encoder output (B, L, D) → standardised annotation vectors a_i."""
        return (features - self.feature_mean) / self.feature_std  # (B, L, D)

    def init_state(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h_0, c_0 from the mean annotation vector (§3.1.2), as in the authors' code (tanh)."""
        mean = features.mean(dim=1)                                   # (B, D)
        return torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))  # (B, H) each

    def context(self, features: torch.Tensor, alpha: torch.Tensor, h: torch.Tensor, mode: str = EXPECTED,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ẑ_t from α_t: expected (soft), sampled or argmax location (hard), gated by β_t.

        Returns:
            ẑ_t (B, D), and the chosen locations (B,) for sample/argmax (None when expected).
        """
        beta = torch.sigmoid(self.f_beta(h))                               # (B, 1)
        if mode == EXPECTED:
            z = torch.bmm(alpha.unsqueeze(1), features).squeeze(1)         # (B, D)
            return beta * z, None
        if mode == SAMPLE:
            loc = torch.multinomial(alpha.float(), 1, generator=generator).squeeze(1)  # (B,)
        elif mode == ARGMAX:
            loc = alpha.argmax(dim=1)                                      # (B,)
        else:
            raise ValueError(f"context mode must be one of {CONTEXT_MODES}, got {mode!r}")
        z = features[torch.arange(features.size(0), device=features.device), loc]  # (B, D)
        return beta * z, loc

    def lstm(self, gates_y: torch.Tensor, z: torch.Tensor, h: torch.Tensor,
             c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eqs. (1)–(3) given the embedding's share of the gates (B, 4H)."""
        gates = gates_y + self.lstm_h(h) + self.lstm_z(z)        # (B, 4H)
        return lstm_cell(gates, c)

    def output(self, emb: torch.Tensor, h: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Deep output layer, eq. (7): logits over the vocabulary (..., V)."""
        return self.L_o(self.dropout(emb + self.L_h(h) + self.L_z(z)))

    def h_weights(self) -> torch.Tensor:
        """[2 W_h (attention); W_h (LSTM); f_β] (A + 4H + 1, H): every map of h_{t-1} in a step,
        stacked so that training computes them as one matrix product per step."""
        return torch.cat([2 * self.attention.W_h.weight, self.lstm_h.weight, self.f_beta.weight])

    def soft_step(self, features: torch.Tensor, projected: torch.Tensor, gates_y: torch.Tensor,
                  h: torch.Tensor, c: torch.Tensor, W_hh: torch.Tensor, W_z: torch.Tensor,
                  shared: tuple | None = None):
        """One teacher-forced soft step for the n = len(h) captions still running: attend with
        h_{t-1}, then the LSTM. `features` and `gates_y` hold those n rows; `projected` may hold
        the whole batch (its first n rows are used); W_hh is `h_weights()`, W_z the LSTM's map
        of ẑ. The same math as `attention`, `context` and `lstm`, with their three maps of
        h_{t-1} in one product. With `shared` (a training pass, `_unroll_soft`), W_hh and W_z come
        from `_SharedWeight` and `projected` from `_GradientSum`, which sum their gradients.

        Returns:
            h (n, H), c (n, H), ẑ (n, D), α (n, L).
        """
        pairs_h, pairs_z, total = shared or (None, None, None)
        hh = F.linear(h, W_hh) if shared is None else _StepProduct.apply(h, W_hh, pairs_h)  # (n, A + 4H + 1)
        q, gates_h, f = hh.split([self.config.attention_dim, gates_y.size(1), 1], dim=1)
        alpha = self.attention.weights(projected, q, total)                 # (n, L)
        beta = torch.sigmoid(f + self.f_beta.bias)                          # (n, 1)
        z = beta * torch.bmm(alpha.unsqueeze(1), features).squeeze(1)      # (n, D), expected context
        gates_z = F.linear(z, W_z) if shared is None else _StepProduct.apply(z, W_z, pairs_z)
        h, c = lstm_cell(gates_y + gates_h + gates_z, c)                   # (n, H)
        return h, c, z, alpha

    def compile_step(self) -> None:
        """torch.compile the recurrent step (fixed shapes; the step loop itself stays Python)."""
        self.soft_step = torch.compile(self.soft_step, dynamic=True)  # the batch shrinks as captions end
        self._compiled = True   # compiled steps keep autograd's own weight gradients

    def step(self, features: torch.Tensor, projected: torch.Tensor, words: torch.Tensor,
             h: torch.Tensor, c: torch.Tensor, mode: str = EXPECTED,
             generator: torch.Generator | None = None):
        """One generation step from the previous words (B,): `lstm` and `output` with their
        inputs' weights side by side, so each is one matrix product (the decoding hot loop).

        Returns:
            logits (B, V), h (B, H), c (B, H), α (B, L), chosen locations (B,) or None.
        """
        W_gates, W_out = self.step_weights()
        emb = self.embedding(words)                                   # (B, E)
        alpha = self.attention(projected, h)                          # (B, L)
        z, loc = self.context(features, alpha, h, mode, generator)    # (B, D)
        # Eq. (1): [E y_{t-1}; h_{t-1}; ẑ_t] through the three input maps at once.
        gates = F.linear(torch.cat([emb, h, z], dim=1), W_gates, self.lstm_y.bias)  # (B, 4H)
        h, c = lstm_cell(gates, c)                                    # (B, H)
        # Eq. (7): E y_{t-1} + L_h h_t + L_z ẑ_t, the last two as one product.
        out = emb + F.linear(torch.cat([h, z], dim=1), W_out, self.L_h.bias)  # (B, E)
        return self.L_o(self.dropout(out)), h, c, alpha, loc

    def step_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[W_y | W_h | W_z] (4H, E+H+D) of the LSTM and [L_h | L_z] (E, H+D) of the output.

        Without gradients (decoding) they are built once and kept until a weight changes
        (an optimizer step or load_state_dict bumps its version); with gradients, every call.
        """
        parts = (self.lstm_y.weight, self.lstm_h.weight, self.lstm_z.weight, self.L_h.weight, self.L_z.weight)
        if torch.is_grad_enabled():
            return torch.cat(parts[:3], dim=1), torch.cat(parts[3:], dim=1)
        key = tuple((p.data_ptr(), p.dtype, p._version) for p in parts)
        cached = self.__dict__.get("_step_weights")
        if cached is None or cached[0] != key:
            with torch.inference_mode(False), torch.no_grad():   # ordinary tensors, usable anywhere
                cached = key, torch.cat(parts[:3], dim=1), torch.cat(parts[3:], dim=1)
            self.__dict__["_step_weights"] = cached
        return cached[1], cached[2]

    # teacher forcing

    def unroll(self, features: torch.Tensor, captions: torch.Tensor, sampled: torch.Tensor | None = None,
               generator: torch.Generator | None = None, locations: torch.Tensor | None = None) -> Unrolled:
        """Teacher-forced pass up to the output layer, soft by default; hard where asked.

        Args:
            features: (B, L, D) annotation vectors.
            captions: (B, T) token ids.
            sampled: (B,) bool, images whose context is a location drawn from α_t at every step.
            generator: random source for those draws.
            locations: (B, T-1) fixed locations (-1: expected context); overrides `sampled`.
        """
        hard = locations is not None or (sampled is not None and bool(sampled.any()))
        if not hard:
            return self._unroll_soft(features, captions)
        B, T = captions.shape
        features = self.normalize(features)                      # (B, L, D)
        projected = self.attention.project(features)             # (B, L, A), once per image
        h, c = self.init_state(features)                         # (B, H)
        emb = self.embedding(captions[:, :-1])                   # (B, T-1, E)
        gates_y = self.lstm_y(emb).unbind(1)                     # T-1 × (B, 4H), all steps at once
        rows = torch.arange(B, device=features.device)
        hs, zs, alphas, locs = [], [], [], []
        for t in range(T - 1):
            alpha = self.attention(projected, h)                 # (B, L)
            z, _ = self.context(features, alpha, h)              # (B, D), expected context
            loc = torch.full((B,), -1, dtype=torch.long, device=features.device)
            if locations is not None:
                draw = locations[:, t]                                                    # (B,)
            else:
                draw = torch.multinomial(alpha.detach().float(), 1, generator=generator).squeeze(1)
                draw = torch.where(sampled, draw, loc)
            use = draw >= 0                                                               # (B,)
            beta = torch.sigmoid(self.f_beta(h))                                          # (B, 1)
            z = torch.where(use.unsqueeze(1), beta * features[rows, draw.clamp_min(0)], z)  # (B, D)
            h, c = self.lstm(gates_y[t], z, h, c)
            hs.append(h), zs.append(z), alphas.append(alpha), locs.append(draw)
        return Unrolled(emb, torch.stack(hs, 1), torch.stack(zs, 1), torch.stack(alphas, 1), torch.stack(locs, 1))

    def _unroll_soft(self, features: torch.Tensor, captions: torch.Tensor) -> Unrolled:
        """The soft pass, stepping only the captions still being written (longest first).

        Captions are sorted by length so that those still running at step t are a prefix of
        the batch; each step works on that prefix and finished captions cost nothing. Steps
        past a caption's end hold zeros (α: uniform), as they do not enter the loss. The sort
        is applied to the inputs and undone on the (small) outputs.
        """
        B, T1 = captions.size(0), captions.size(1) - 1
        L = features.size(1)
        steps = (captions != 0).sum(dim=1) - 1                     # (B,) positions predicting a word or <end>
        order = torch.argsort(steps, descending=True, stable=True)  # (B,)
        running = steps[order] > torch.arange(T1, device=steps.device).unsqueeze(1)   # (T-1, B), a prefix per step
        active = running.sum(1).tolist()                           # captions still running at each step
        emb = self.embedding(captions[:, :-1])                     # (B, T-1, E), in the caller's order
        features = self.normalize(features[order])                 # (B, L, D), sorted from here on
        projected = self.attention.project(features)               # (B, L, A), once per image
        h, c = self.init_state(features)                           # (B, H)
        # All steps at once, for the running captions only (time-major, step t's n rows after
        # step t-1's), then one (n, 4H) view per step: split's backward is a single cat, where
        # indexing at every step would zero-fill a (B, T-1, 4H) gradient each time.
        gates_y = self.lstm_y(emb[order].transpose(0, 1)[running]).split(active)   # T-1 × (n, 4H)
        z, alpha = features[:, 0], projected.new_zeros(B, L)        # only read when no caption runs
        W_hh, W_z = self.h_weights(), self.lstm_z.weight           # once per pass, not per step
        shared = None
        if torch.is_grad_enabled() and not self._compiled:  # gradients summed once per pass, not per step
            sums = torch.zeros_like(projected), torch.empty_like(projected)   # total, scratch
            shared = [], [], sums
            W_hh, W_z = _SharedWeight.apply(W_hh, shared[0]), _SharedWeight.apply(W_z, shared[1])
            scale = 2 * self.attention.v.weight.detach().view(-1).to(projected.dtype)   # (A,)
            projected = _GradientSum.apply(projected, sums, scale)
        hs, zs, alphas = [], [], []
        for t, n in enumerate(active):
            if n:
                h, c, z, alpha = self.soft_step(features[:n], projected, gates_y[t], h[:n], c[:n],
                                                W_hh, W_z, shared)
            rest = (0, 0, 0, B - n)                                   # pad the finished rows back in
            hs.append(F.pad(h[:n], rest)), zs.append(F.pad(z[:n], rest))
            alphas.append(F.pad(alpha[:n], rest, value=1.0 / L))
        back = torch.argsort(order)                                 # (B,) undoes the sort
        h_all, z_all, a_all = (torch.stack(x, 1)[back] for x in (hs, zs, alphas))
        locs = torch.full((B, T1), -1, dtype=torch.long, device=features.device)
        return Unrolled(emb, h_all, z_all, a_all, locs)

    def word_nll(self, unrolled: Unrolled, captions: torch.Tensor, lengths: torch.Tensor):
        """−log p(y_t) at every real position; logits are computed there only, not on padding.

        Returns:
            (B, T-1) negative log-likelihoods (0 on padding), and the (B, T-1) mask.
        """
        T1 = unrolled.h.size(1)
        mask = step_mask(lengths, T1)                                                  # (B, T-1)
        logits = self.output(unrolled.emb[mask], unrolled.h[mask], unrolled.z[mask])   # (N, V)
        nll = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
        nll[mask] = F.cross_entropy(logits.float(), captions[:, 1:T1 + 1][mask], reduction="none")
        return nll, mask

    def forward(self, features: torch.Tensor, captions: torch.Tensor,
                lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced soft pass.

        Args:
            features: (B, L, D) annotation vectors.
            captions: (B, T) <start> w1 ... <end> then <pad>=0.
            lengths: (B,) tokens per caption including <start> and <end>.

        Returns:
            logits (B, T-1, V), where position t predicts captions[:, t+1]; α (B, T-1, L).
        """
        u = self.unroll(features, captions)
        return self.output(u.emb, u.h, u.z), u.alphas


def lstm_cell(gates: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. (2)–(3): the LSTM's gates (B, 4H) and c_{t-1} (B, H) → h_t, c_t (B, H)."""
    i, f, o, g = gates.chunk(4, dim=1)                       # (B, H) each
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


def step_mask(lengths: torch.Tensor, steps: int) -> torch.Tensor:
    """(B, T-1) True where position t predicts a real word or <end>, False on padding."""
    return torch.arange(steps, device=lengths.device).unsqueeze(0) < (lengths - 1).unsqueeze(1)


def attention_penalty(alphas: torch.Tensor, mask: torch.Tensor, alpha_c: float = 1.0) -> torch.Tensor:
    """Doubly stochastic regularisation of eq. (14) per image: λ Σ_i (1 − Σ_t α_ti)², (B,)."""
    attended = (alphas * mask.unsqueeze(2)).sum(dim=1)           # (B, L), Σ_t α_ti over real steps
    return alpha_c * ((1.0 - attended) ** 2).sum(dim=1)          # (B,)


def sequence_loss(decoder: "AttentionDecoder", features: torch.Tensor, captions: torch.Tensor,
                  lengths: torch.Tensor, alpha_c: float = 1.0, words: torch.Tensor | float | None = None):
    """Training's soft loss, eq. (14) as `caption_loss`, with logits only where there are words.

    Returns:
        (negative log-likelihood per word, penalty per word).
    """
    nll, penalty, _, _ = sequence_terms(decoder, features, captions, lengths, alpha_c, words)
    return nll, penalty


def sequence_terms(decoder: "AttentionDecoder", features: torch.Tensor, captions: torch.Tensor,
                   lengths: torch.Tensor, alpha_c: float = 1.0, words: torch.Tensor | float | None = None):
    """`sequence_loss`, with the teacher-forced pass and its (B, T-1) mask of real steps, for
    terms computed on the same maps (training.Objective's equivariance term).

    Returns:
        (nll per word, penalty per word, the `Unrolled` pass, the mask).
    """
    u = decoder.unroll(features, captions)
    nll, mask = decoder.word_nll(u, captions, lengths)
    words = mask.sum() if words is None else words
    return nll.sum() / words, attention_penalty(u.alphas.float(), mask, alpha_c).sum() / words, u, mask


def caption_loss(logits: torch.Tensor, alphas: torch.Tensor, captions: torch.Tensor, lengths: torch.Tensor,
                 alpha_c: float = 1.0, words: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (14), L_d = −log P(y|a) + λ Σ_i (1 − Σ_t α_ti)², summed over the batch, per predicted word.

    Both terms are per caption as in the paper (the likelihood summed over its words, not
    averaged), so their balance is the paper's; dividing the batch total by the number of
    predicted words only sets the scale. Padding is masked out of both.

    Args:
        words: what to divide the batch totals by; default the batch's predicted words (under
            DDP, the global count divided by the number of processes).

    Returns:
        (negative log-likelihood per word, penalty per word); the loss is their sum.
    """
    B, T1, V = logits.shape
    mask = step_mask(lengths, T1)                                                # (B, T-1)
    nll = F.cross_entropy(logits.reshape(-1, V).float(), captions[:, 1:T1 + 1].reshape(-1),
                          reduction="none").view(B, T1)                          # (B, T-1)
    words = mask.sum() if words is None else words
    return (nll * mask).sum() / words, attention_penalty(alphas.float(), mask, alpha_c).sum() / words
