"""Where each written word was read from: the location's posterior given the word, q_ti ∝ α_ti p(y_t | s_t = i).

α_t is drawn from h_{t−1} before the word is chosen, so where a caption may name either of two objects next, α_t
lies across both (docs/attention.md). Read from location i alone, as hard attention reads it (§4.1: ẑ_t = β_t a_i),
the decoder would write the word y_t it wrote with probability p(y_t | s_t = i); Bayes' rule over α_t gives the
posterior of the location given that word. For a hard-attention model that is exactly the posterior of the paper's
latent location s_t; for a soft model, the same product with each location read alone. The caption is unchanged:
the words come from the search, and only their maps are drawn from it.

Symbols: N captions, T words, L locations, D feature size, E embedding size, H LSTM size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from captioner.decoding.beams import Hypothesis
from captioner.models.decoder import AttentionDecoder, lstm_cell
from captioner.models.vocab import PAD_ID, START_ID

FLOOR = 1e-30  # under α before its log: a location α rounds to 0 keeps a posterior of 0, not NaN
CHUNK = 1 << 25  # most of a step's widest tensor (captions × L × V, or × 4H) held at once: 128 MB in float32


@torch.inference_mode()
def posterior_maps(
    decoder: AttentionDecoder, features: torch.Tensor, hyps: list[Hypothesis], sharpness: float | None = None
) -> list[Hypothesis]:
    """`hyps` with each word's map α_t replaced by its posterior q_t (len(tokens), L); `features` (N, L, D) are
    their images' raw encoder features, one row per hypothesis, `sharpness` the k their maps were drawn with (None:
    the model's own). The state follows each caption as the search wrote it: the expected context, or the location
    it chose where its `locations` has one."""
    widest = max(decoder.config.vocab_size, 4 * decoder.config.hidden_dim)
    rows = max(1, CHUNK // (features.size(1) * widest))
    out = []
    for i in range(0, len(hyps), rows):
        out += _posterior(decoder, features[i : i + rows], hyps[i : i + rows], sharpness)
    return out


def _posterior(decoder: AttentionDecoder, features: torch.Tensor, hyps: list[Hypothesis], sharpness) -> list:
    k = decoder.config.decode_sharpness if sharpness is None else sharpness
    N, T, device = len(hyps), max(len(h.tokens) for h in hyps), features.device
    if T == 0:
        return hyps
    words = torch.full((N, T + 1), PAD_ID, dtype=torch.long)  # (N, T+1) <start> y_1 ... y_T, then <pad>
    locations = torch.full((N, T), -1, dtype=torch.long)  # (N, T)
    words[:, 0] = START_ID
    for n, h in enumerate(hyps):
        words[n, 1 : len(h.tokens) + 1] = torch.as_tensor(h.tokens)
        locations[n, : len(h.tokens)] = torch.as_tensor(h.locations)
    words, locations = words.to(device), locations.to(device)
    a, projected, h, c = decoder.start(features)  # (N, L, D), (N, L, A), (N, H) each
    emb = decoder.embedding(words)  # (N, T+1, E)
    # Each a_i read alone, as eq. (1) and eq. (7) take the context: once per caption, not once per word.
    into_lstm, into_output = decoder.lstm_z(a), decoder.L_z(a)  # (N, L, 4H), (N, L, E)
    maps = []
    for t in range(T):
        e = emb[:, t]  # (N, E) E y_{t-1}
        alpha = decoder.attend(projected, h, e, k)  # (N, L)
        beta = torch.sigmoid(decoder.f_beta(h)).unsqueeze(1)  # (N, 1, 1)
        gates = (decoder.lstm_y(e) + decoder.lstm_h(h)).unsqueeze(1) + beta * into_lstm  # (N, L, 4H)
        h_alone, _ = lstm_cell(gates.flatten(0, 1), c.repeat_interleave(a.size(1), dim=0))  # (N·L, H)
        h_alone = h_alone.view(N, -1, h_alone.size(-1))  # (N, L, H)
        logits = decoder.L_o(e.unsqueeze(1) + decoder.L_h(h_alone) + beta * into_output)  # (N, L, V)
        word = words[:, t + 1, None, None].expand(-1, a.size(1), 1)  # (N, L, 1)
        read = logits.float().log_softmax(dim=-1).gather(-1, word).squeeze(-1)  # (N, L) log p(y_t | s_t = i)
        maps.append((alpha.float().clamp_min(FLOOR).log() + read).softmax(dim=1))  # (N, L) q_t, sums to 1
        h, c, _ = decoder.advance(a, alpha, e, h, c, locations[:, t])
    maps = torch.stack(maps, dim=1).cpu().numpy()  # (N, T, L)
    return [replace(h, attention=q[: len(h.tokens)]) for h, q in zip(hyps, maps)]
