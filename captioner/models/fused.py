"""The fast soft training pass: `AttentionDecoder.unroll`'s values and gradients, with less work, tested
equal to it. It steps only the captions still being written, which reads their lengths back to the
host once per pass, so GPUs take the plain pass.
Symbols: B batch, L locations, D annotation size, E embedding size, H LSTM size, A attention
size, T steps, n captions still running at a step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from captioner.models.decoder import AttentionDecoder, Unrolled, lstm_cell


class _Score(torch.autograd.Function):
    """e_ti = v·tanh(p_ti + q_t) up to a per-row constant, computed as 2v·σ(2p + 2q) (see `Attention`).

    This is the decoder's hot loop: the hand-written backward saves two passes over the (B, L, A)
    tensor, and taking 2p and 2q (p doubled once per image) saves a third."""

    @staticmethod
    def forward(ctx, projected, q, v, total=None):  # projected = 2p (B, L, A), q = 2q (n, A), v (A,)
        # projected may hold more rows than q (captions that have ended): only the first len(q) are used, and their
        # gradient is written straight into a full-sized tensor, so no slicing of `projected` goes through autograd
        # (each slice would cost a zero-filled (B, L, A) gradient per step). With `total` (from `_GradientSum`, in a
        # training pass) the gradient, less its factor 2v, is added into it instead: no (B, L, A) tensor per step.
        n = q.size(0)
        ctx.dtypes = projected.dtype, q.dtype, v.dtype  # under autocast they may differ
        ctx.rows, ctx.total = projected.size(0), total
        v = v.to(projected.dtype)
        s = torch.add(projected[:n], q.to(projected.dtype).unsqueeze(1)).sigmoid_()  # (n, L, A), σ(2p + 2q)
        ctx.save_for_backward(s, v)
        return s @ (2 * v)  # (n, L)

    @staticmethod
    def backward(ctx, grad_e):
        s, v = ctx.saved_tensors
        n, L, A = s.shape
        grad_e = grad_e.to(s.dtype)
        grad_v = 2 * torch.einsum("bl,bla->a", grad_e, s)  # (A,)
        p_dtype, q_dtype, v_dtype = ctx.dtypes
        # d e / d(2p) = 2 v σ(1 − σ), times the incoming gradient
        if ctx.total is not None:  # total gathers Σ_t grad_e σ(1 − σ); `_GradientSum` applies 2v once
            total, scratch = ctx.total
            ds = torch.addcmul(s, s, s, value=-1, out=scratch[:n])  # (n, L, A), σ(1 − σ)
            total[:n].addcmul_(ds, grad_e.unsqueeze(2))
            grad_q = torch.bmm(grad_e.unsqueeze(1), ds).squeeze(1).mul_(2 * v)  # (n, A)
            return None, grad_q.to(q_dtype), grad_v.to(v_dtype), None
        grad_p = s.new_empty(ctx.rows, L, A)  # (B, L, A)
        grad_p[n:].zero_()
        torch.addcmul(s, s, s, value=-1, out=grad_p[:n]).mul_(grad_e.unsqueeze(2)).mul_(2 * v)
        return grad_p.to(p_dtype), grad_p[:n].sum(dim=1).to(q_dtype), grad_v.to(v_dtype), None


class _GradientSum(torch.autograd.Function):
    """x, unchanged, for a recurrence whose steps add their gradients for x into `total` themselves,
    in place: left to autograd, each step would allocate a gradient the size of x. The factor `scale`
    that all steps share (2v) is applied here, once per pass, not at every step."""

    @staticmethod
    def forward(ctx, x, buffers: tuple[torch.Tensor, torch.Tensor], scale: torch.Tensor):
        ctx.total, ctx.scale = buffers[0], scale
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        total = ctx.total.mul_(ctx.scale)  # the buffer is used once
        return (total if grad is None else total + grad), None, None


class _SharedWeight(torch.autograd.Function):
    """W, unchanged, for a recurrence whose every step multiplies by it (`_StepProduct`). Left to autograd,
    each step would add its own thin W gradient to the running sum: two passes over W per step. Here W's
    gradient is one product over every step's (output gradient, input) rows, after all the steps."""

    @staticmethod
    def forward(ctx, W, pairs: list):
        ctx.pairs, ctx.dtype = pairs, W.dtype
        ctx.set_materialize_grads(False)  # the steps send W no gradient: nothing to zero-fill
        return W.view_as(W)

    @staticmethod
    def backward(ctx, _):
        if not ctx.pairs:
            return None, None
        grads, inputs = zip(*ctx.pairs)
        ctx.pairs.clear()
        g, x = (torch.cat(t).to(ctx.dtype) for t in (grads, inputs))  # (Σn, out), (Σn, in)
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


def _h_weights(decoder: AttentionDecoder) -> torch.Tensor:
    """[2 W_h (attention); W_h (LSTM); f_β] (A + 4H + 1, H): every map of h_{t-1} in a step, stacked."""
    return torch.cat([2 * decoder.attention.W_h.weight, decoder.lstm_h.weight, decoder.f_beta.weight])


def _attention_weights(decoder: AttentionDecoder, projected: torch.Tensor, q: torch.Tensor, total=None):
    """α_t (n, L) from q = 2 W_h h_{t-1} (n, A); `projected` may hold more rows (see `_Score`)."""
    e = _Score.apply(projected, q, decoder.attention.v.weight.view(-1), total)  # (n, L)
    return e.softmax(dim=1)  # (n, L), sums to 1


def fused_unroll(decoder: AttentionDecoder, features: torch.Tensor, captions: torch.Tensor) -> Unrolled:
    """Captions are sorted by length so that those still running at step t are a prefix of the batch.
    Steps past a caption's end hold zeros (α: uniform), as they do not enter the loss."""
    B, T1 = captions.size(0), captions.size(1) - 1
    L = features.size(1)
    steps = (captions != 0).sum(dim=1) - 1  # (B,) positions predicting a word or <end>
    order = torch.argsort(steps, descending=True, stable=True)  # (B,)
    running = steps[order] > torch.arange(T1, device=steps.device).unsqueeze(1)  # (T-1, B), a prefix per step
    active = running.sum(1).tolist()  # captions still running at each step
    emb = decoder.embedding(captions[:, :-1])  # (B, T-1, E), in the caller's order
    features, projected, h, c = decoder.start(features[order])  # sorted from here on
    # All steps at once, for the running captions only (time-major, step t's n rows after
    # step t-1's), then one (n, 4H) view per step: split's backward is a single cat, where
    # indexing at every step would zero-fill a (B, T-1, 4H) gradient each time.
    words = _word_maps(decoder, emb[order].transpose(0, 1)[running]).split(active)  # T-1 × (n, [A +] 4H)
    z, alpha = features[:, 0], projected.new_zeros(B, L)  # only read when no caption runs
    W_hh, W_z = _h_weights(decoder), decoder.lstm_z.weight  # once per pass, not per step
    shared = None
    if torch.is_grad_enabled():  # gradients summed once per pass, not per step
        sums = torch.zeros_like(projected), torch.empty_like(projected)  # total, scratch
        shared = [], [], sums
        W_hh, W_z = _SharedWeight.apply(W_hh, shared[0]), _SharedWeight.apply(W_z, shared[1])
        scale = 2 * decoder.attention.v.weight.detach().view(-1).to(projected.dtype)  # (A,)
        projected = _GradientSum.apply(projected, sums, scale)
    hs, zs, alphas = [], [], []
    for t, n in enumerate(active):
        if n:
            h, c, z, alpha = _step(decoder, features[:n], projected, words[t], h[:n], c[:n], W_hh, W_z, shared)
        rest = (0, 0, 0, B - n)  # pad the finished rows back in
        hs.append(F.pad(h[:n], rest)), zs.append(F.pad(z[:n], rest))
        alphas.append(F.pad(alpha[:n], rest, value=1.0 / L))
    back = torch.argsort(order)  # (B,) undoes the sort
    h_all, z_all, a_all = (torch.stack(x, 1)[back] for x in (hs, zs, alphas))
    locs = torch.full((B, T1), -1, dtype=torch.long, device=features.device)
    return Unrolled(emb, h_all, z_all, a_all, locs)


def _word_maps(decoder: AttentionDecoder, emb: torch.Tensor) -> torch.Tensor:
    """[2 W_y E y_{t-1};] the LSTM's map of E y_{t-1} (N, [A +] 4H), for every step's running rows at once."""
    W_y = decoder.attention.W_y
    if W_y is None:
        return decoder.lstm_y(emb)
    weight = torch.cat([2 * W_y.weight, decoder.lstm_y.weight])  # (A + 4H, E)
    return F.linear(emb, weight, F.pad(decoder.lstm_y.bias, (W_y.out_features, 0)))


def _step(
    decoder: AttentionDecoder,
    features: torch.Tensor,
    projected: torch.Tensor,
    words: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor,
    W_hh: torch.Tensor,
    W_z: torch.Tensor,
    shared: tuple | None = None,
):
    """One teacher-forced soft step for the n = len(h) captions still running: h (n, H), c (n, H), ẑ (n, D)
    and α (n, L), as `AttentionDecoder.attend` and `advance` give them. `projected` may hold the whole batch."""
    pairs_h, pairs_z, total = shared or (None, None, None)
    hh = F.linear(h, W_hh) if shared is None else _StepProduct.apply(h, W_hh, pairs_h)  # (n, A + 4H + 1)
    q, gates_h, f = hh.split([decoder.config.attention_dim, decoder.lstm_h.out_features, 1], dim=1)
    if decoder.attention.W_y is None:
        gates_y = words
    else:
        q_y, gates_y = words.split([q.size(1), gates_h.size(1)], dim=1)
        q = q + q_y
    alpha = _attention_weights(decoder, projected, q, total)  # (n, L)
    beta = torch.sigmoid(f + decoder.f_beta.bias)  # (n, 1)
    z = beta * torch.bmm(alpha.unsqueeze(1), features).squeeze(1)  # (n, D), expected context
    gates_z = F.linear(z, W_z) if shared is None else _StepProduct.apply(z, W_z, pairs_z)
    h, c = lstm_cell(gates_y + gates_h + gates_z, c)  # (n, H)
    return h, c, z, alpha
