"""The posterior maps: each word's map q_ti ∝ α_ti p(y_t | s_t = i), against the decoder's own step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captioner.decoding.beams import Hypothesis
from captioner.decoding.decode import decode
from captioner.decoding.posterior import posterior_maps
from captioner.decoding.settings import Decoding
from captioner.errors import OptionError
from captioner.models.decoder import AttentionDecoder
from captioner.models.vocab import START_ID

V, L, D = 30, 196, 64


def tiny(**kw) -> AttentionDecoder:
    torch.manual_seed(0)
    args = dict(vocab_size=V, encoder_dim=D, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.0)
    return AttentionDecoder(**{**args, **kw}).eval()


def by_steps(dec: AttentionDecoder, feats: torch.Tensor, tokens: list[int], locations: list[int], k: float):
    """q (T, L) the long way: for each word, the decoder's own step run once per location with that location
    as its context (hard attention's reading), its probability of the word times α_ti, normalised."""
    a, projected, h, c = dec.start(feats.unsqueeze(0))
    words = [START_ID, *tokens]
    maps = []
    for t, word in enumerate(tokens):
        w = torch.tensor([words[t]])
        logits = _step_at(dec, a, projected, w, h, c, k)  # (L, V)
        alpha = dec.attend(projected, h, dec.embedding(w), k)[0]  # (L,)
        q = alpha * logits.log_softmax(-1)[:, word].exp()  # (L,)
        maps.append(q / q.sum())
        h, c, _ = dec.advance(a, alpha.unsqueeze(0), dec.embedding(w), h, c, torch.tensor([locations[t]]))
    return torch.stack(maps)


def _step_at(dec, a, projected, w, h, c, k):
    """The decoder's step (logits (L, V)) with row i's context fixed at location i."""
    emb = dec.embedding(w.expand(L))  # (L, E)
    alpha = dec.attend(projected.expand(L, -1, -1), h.expand(L, -1), emb, k)  # (L, L)
    h1, _, z = dec.advance(a.expand(L, -1, -1), alpha, emb, h.expand(L, -1), c.expand(L, -1), torch.arange(L))
    return dec.output(emb, h1, z)  # (L, V)


@pytest.mark.parametrize("attention", ["soft", "hard"])
@pytest.mark.parametrize("k", [1.0, 2.0])
def test_the_posterior_is_alpha_times_each_locations_own_reading(attention, k):
    """Against the decoder's own step with each location as the context, along the expected path and along a
    hard model's chosen locations alike."""
    dec = tiny(attention=attention)
    feats = torch.rand(L, D, generator=torch.Generator().manual_seed(1))
    tokens = [5, 9, 7, 12]
    locations = [-1, -1, -1, -1] if attention == "soft" else [3, -1, 100, 195]
    hyp = Hypothesis(tokens, -3.0, np.full((4, L), 1 / L, dtype=np.float32), np.array(locations), True)
    with torch.no_grad():
        (got,) = [h.attention for h in posterior_maps(dec, feats[None], [hyp], sharpness=k)]
        want = by_steps(dec, feats, tokens, locations, k).numpy()
    assert got.shape == (4, L)
    np.testing.assert_allclose(got.sum(1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)  # at most 1.3e-6 apart under DEFAULT, AVX2 and AVX512
    assert hyp.attention[0, 0] == pytest.approx(1 / L)  # the hypothesis it came from is left as it was


def test_a_context_that_says_nothing_leaves_the_attention_as_it_was():
    """Where no location's reading differs (the context reaches neither the LSTM nor the output), q_t = α_t."""
    dec = tiny()
    with torch.no_grad():
        dec.lstm_z.weight.zero_()
        dec.L_z.weight.zero_()
    feats = torch.rand(1, L, D, generator=torch.Generator().manual_seed(2))
    (attended,) = [h[0] for h in decode(dec, feats, Decoding(beam_size=2), max_len=6)]
    (posterior,) = [h[0] for h in decode(dec, feats, Decoding(beam_size=2, maps="posterior"), max_len=6)]
    assert posterior.tokens == attended.tokens and posterior.score == attended.score
    np.testing.assert_allclose(posterior.attention, attended.attention, rtol=1e-4, atol=1e-7)


def test_decoding_draws_the_posterior_for_every_caption_it_shows():
    """The best beam of each image, and every sample, get the posterior; the words stay the search's."""
    dec = tiny()
    feats = torch.rand(2, L, D, generator=torch.Generator().manual_seed(3))
    plain = decode(dec, feats, Decoding(beam_size=3), max_len=6)
    shown = decode(dec, feats, Decoding(beam_size=3, maps="posterior"), max_len=6)
    for image, (p, s) in enumerate(zip(plain, shown)):
        assert [h.tokens for h in p] == [h.tokens for h in s]
        (want,) = [h.attention for h in posterior_maps(dec, feats[image : image + 1], p[:1])]
        np.testing.assert_allclose(s[0].attention, want, rtol=1e-5, atol=1e-8)
    drawn = decode(dec, feats, Decoding(method="sampling", n=3, maps="posterior", seed=4), max_len=6)
    for image, samples in enumerate(drawn):
        for h in samples:
            np.testing.assert_allclose(h.attention.sum(1), 1.0, rtol=1e-5)
            (want,) = [x.attention for x in posterior_maps(dec, feats[image : image + 1], [h])]
            np.testing.assert_allclose(h.attention, want, rtol=1e-5, atol=1e-8)


def test_an_unknown_map_is_refused_with_the_choices():
    with pytest.raises(OptionError, match="--maps must be one of"):
        Decoding(maps="gradcam")


def test_captions_of_different_lengths_in_one_batch_or_one_at_a_time(monkeypatch):
    """Padding a batch to its longest caption, and cutting it into chunks, changes no map."""
    import captioner.decoding.posterior as posterior

    dec = tiny(attention="hard")
    feats = torch.rand(3, L, D, generator=torch.Generator().manual_seed(5))
    hyps = [
        Hypothesis(tokens, 0.0, np.zeros((len(tokens), L), np.float32), np.array(locs), True)
        for tokens, locs in [([5], [-1]), ([6, 7, 8, 9, 10], [-1, 4, -1, 8, -1]), ([11, 12], [190, -1])]
    ]
    together = posterior_maps(dec, feats, hyps)
    monkeypatch.setattr(posterior, "CHUNK", 1)  # one caption at a time
    for h, alone in zip(together, posterior_maps(dec, feats, hyps)):
        assert h.attention.shape == (len(h.tokens), L)
        np.testing.assert_allclose(h.attention, alone.attention, rtol=1e-5, atol=1e-8)
