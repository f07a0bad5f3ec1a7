"""Every caption beam search returns, re-run through the decoder with teacher forcing: its score is
the summed log-probabilities of its words and <end>, each word's map is the map the decoder draws
for that word, and on a vocabulary small enough to enumerate, the captions are those a plain beam
search of that width finds (and, where the width covers every caption, the best of all captions).

Both shapes of the search (packed, fixed), beam sizes 1, 3 and 5, with and without length
normalisation, soft and hard decoders, maps drawn at the model's decoding sharpness.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from captioner.decoding.beams import banned
from captioner.decoding.decode import Hypothesis, beam_search
from captioner.models.decoder import ARGMAX, EXPECTED, AttentionDecoder
from captioner.models.vocab import END_ID, PAD_ID, START_ID

L, D = 16, 8  # a small grid and feature size: the search does not care how large


# helpers


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors, one step at a time: one thread (a second only waits on the first, and on a busy
    machine each wait costs milliseconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(V: int = 12, *, seed: int = 0, end_bias: float = 1.5, **kw) -> AttentionDecoder:
    """A small random decoder whose maps differ from step to step and from beam to beam (peaked
    attention) and whose beams end at different lengths (a likelier <end>)."""
    torch.manual_seed(seed)
    args = dict(vocab_size=V, encoder_dim=D, embed_dim=6, hidden_dim=10, attention_dim=5, dropout=0.0)
    dec = AttentionDecoder(**{**args, **kw}).eval()
    with torch.no_grad():
        dec.attention.v.weight.mul_(8.0)  # peaked maps: a wrong step's or beam's map is far off
        dec.L_o.weight.mul_(2.0)  # words of clearly different probabilities: no ties in the search
        dec.L_o.bias[END_ID] += end_bias
    return dec


def features(B: int, seed: int) -> torch.Tensor:
    return torch.randn(B, L, D, generator=torch.Generator().manual_seed(seed))  # (B, L, D)


class Forced:
    """Captions of one image re-run through the decoder, word by word: the log-probabilities of every
    word at every step (banned words as the search bans them), the maps and the locations."""

    def __init__(self, decoder: AttentionDecoder, feats: torch.Tensor, captions: list[list[int]], mode=EXPECTED):
        N, T = len(captions), max(len(c) for c in captions) + 1
        words = torch.full((N, T), PAD_ID, dtype=torch.long)  # (N, T) <start> w1 .. wn, then <pad>
        words[:, 0] = START_ID
        for i, c in enumerate(captions):
            words[i, 1 : len(c) + 1] = torch.tensor(c, dtype=torch.long)
        f = decoder.normalize(feats.unsqueeze(0)).expand(N, -1, -1)  # (N, L, D)
        projected = decoder.attention.project(f)  # (N, L, A)
        h, c = decoder.init_state(f)  # (N, H)
        logps, alphas, locs = [], [], []
        for t in range(T):
            # The plain step (separate weights, not the search's joined ones), at the model's sharpness.
            logits, h, c, alpha, loc = decoder.step(f, projected, words[:, t], h, c, mode)
            logp = logits.double().log_softmax(dim=-1)  # (N, V)
            logp[:, banned(first=t == 0)] = float("-inf")
            logps.append(logp)
            alphas.append(alpha.double())  # (N, L) the map that produced word t+1
            locs.append(torch.full((N,), -1) if loc is None else loc)
        self.captions = captions
        self.logp = torch.stack(logps, 1)  # (N, T, V)
        self.alphas = torch.stack(alphas, 1)  # (N, T, L)
        self.locations = torch.stack(locs, 1)  # (N, T)

    def score(self, i: int) -> float:
        """log p of caption i's words and <end> (an <end> forced at max_len keeps its own log-probability)."""
        picked = [*self.captions[i], END_ID]
        return float(sum(self.logp[i, t, w] for t, w in enumerate(picked)))

    def maps(self, i: int) -> np.ndarray:
        """(n, L) the map that produced each of caption i's n words."""
        return self.alphas[i, : len(self.captions[i])].numpy()


def forced_one(decoder, feats, words: list[int]) -> Forced:
    return Forced(decoder, feats, [words])


def check_against_teacher_forcing(decoder, feats, beams: list[list[Hypothesis]], mode: str, length_norm: bool):
    for b, hyps in enumerate(beams):
        forced = Forced(decoder, feats[b], [h.tokens for h in hyps], mode)
        for i, hyp in enumerate(hyps):
            n = len(hyp.tokens)
            assert hyp.score == pytest.approx(forced.score(i), abs=2e-4), (b, hyp.tokens)
            assert hyp.attention.shape == (n, L)
            np.testing.assert_allclose(
                hyp.attention, forced.maps(i), atol=2e-5, rtol=1e-4, err_msg=f"image {b}: {hyp.tokens}"
            )
            assert hyp.locations.tolist() == forced.locations[i, :n].tolist(), (b, hyp.tokens)
        key = [h.normalized_score if length_norm else h.score for h in hyps]
        assert key == sorted(key, reverse=True)


def reference_beam_search(decoder, feats, K: int, max_len: int, length_norm: bool, V: int):
    """Beam search written plainly over word lists: each live caption is extended by every allowed
    word, scored by teacher forcing from scratch; finished captions stay as candidates; the K best
    candidates survive each step; at max_len words only <end> is allowed."""
    beams = [([], 0.0, False)]  # (words, log p, ended)
    for t in range(max_len + 1):
        candidates = []
        for words, score, ended in beams:
            if ended:
                candidates.append((words, score, True))
                continue
            logp = forced_one(decoder, feats, words).logp[0, -1]  # (V,) the next word's log-probabilities
            for w in range(V):
                if (t == max_len and w != END_ID) or not np.isfinite(float(logp[w])):
                    continue
                candidates.append((words if w == END_ID else [*words, w], score + float(logp[w]), w == END_ID))
        beams = sorted(candidates, key=lambda x: x[1], reverse=True)[:K]
    key = (lambda x: x[1] / (len(x[0]) + 1)) if length_norm else (lambda x: x[1])
    return sorted(beams, key=key, reverse=True)


# every beam against teacher forcing


# <end>'s bias chosen for each so that, on these images, some captions end early and some are cut at max_len.
DECODERS = {
    "soft": dict(end_bias=0.5),
    "soft-word-query-sharp": dict(word_query=True, decode_sharpness=3.0, end_bias=-0.5),
    "hard-argmax": dict(attention="hard", word_query=True, end_bias=0.0),
}


@pytest.mark.parametrize("shapes", ["packed", "fixed"])
@pytest.mark.parametrize("length_norm", [False, True])
@pytest.mark.parametrize("beam_size", [1, 3, 5])
@pytest.mark.parametrize("kind", list(DECODERS))
def test_every_beam_equals_teacher_forcing(kind, beam_size, length_norm, shapes):
    """Each image's K captions: score, maps and locations as the decoder gives them word by word."""
    decoder = tiny(**DECODERS[kind])
    mode = ARGMAX if kind.startswith("hard") else EXPECTED
    feats = features(6, seed=1)
    with torch.no_grad():
        beams = beam_search(
            decoder, feats, beam_size=beam_size, max_len=7, length_norm=length_norm, mode=mode, shapes=shapes
        )
        check_against_teacher_forcing(decoder, feats, beams, mode, length_norm)
    # Beams ended at different steps: finished beams sat beside live ones, and some were cut at max_len.
    assert len({len(h.tokens) for hyps in beams for h in hyps}) >= 2
    assert any(h.ended for hyps in beams for h in hyps) and not all(h.ended for hyps in beams for h in hyps)
    assert all(len(hyps) == beam_size for hyps in beams)


@pytest.mark.parametrize("shapes", ["packed", "fixed"])
@pytest.mark.parametrize("beam_size", [1, 3, 5])
def test_the_bundled_models_beams_equal_teacher_forcing(shapes, beam_size, bundled):
    """The trained model (the word in the query) on three of its example scenes."""
    decoder, feats = bundled
    with torch.no_grad():
        beams = beam_search(decoder, feats, beam_size=beam_size, max_len=20, shapes=shapes)
        for b, hyps in enumerate(beams):
            forced = Forced(decoder, feats[b], [h.tokens for h in hyps])
            for i, hyp in enumerate(hyps):
                assert hyp.score == pytest.approx(forced.score(i), abs=1e-3), (b, hyp.tokens)
                np.testing.assert_allclose(hyp.attention, forced.maps(i), atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def bundled():
    from captioner import Captioner
    from captioner.serve.sources import demo_model, example_images

    cap = Captioner.load(demo_model())
    assert cap.decoder.config.word_query
    feats, _ = cap.encode(example_images()[:3])
    return cap.decoder, feats


def test_teacher_forcing_by_step_equals_the_training_pass():
    """The reference above (the decoder's step, word by word) is the training forward pass at k = 1."""
    decoder = tiny(word_query=True)
    feats = features(1, seed=2)
    words = [5, 7, 4, 9]
    caps = torch.tensor([[START_ID, *words, END_ID]])
    with torch.no_grad():
        forced = forced_one(decoder, feats[0], words)
        logits, alphas = decoder(feats, caps, torch.tensor([caps.size(1)]))  # (1, T-1, V), (1, T-1, L)
    torch.testing.assert_close(forced.alphas[0], alphas[0].double(), atol=1e-6, rtol=1e-5)
    logp = logits[0].double().log_softmax(-1)
    assert forced.score(0) == pytest.approx(float(logp[torch.arange(5), caps[0, 1:]].sum()), abs=1e-5)


# on a vocabulary small enough to enumerate

MAX_LEN = 3


def all_captions(words: int) -> list[list[int]]:
    """Every caption the search may return: 1 to MAX_LEN of the words (never <pad>, <start>, <unk>)."""
    ids = range(4, 4 + words)
    return [list(c) for n in range(1, MAX_LEN + 1) for c in itertools.product(ids, repeat=n)]


@pytest.mark.parametrize("shapes", ["packed", "fixed"])
@pytest.mark.parametrize("length_norm", [False, True])
@pytest.mark.parametrize("words,seed", [(2, 0), (2, 1), (2, 2), (4, 3)])
def test_on_a_tiny_vocabulary_the_search_finds_what_a_plain_beam_search_finds(words, seed, length_norm, shapes):
    """Beam search is not exhaustive: each width is compared with a plain one written by enumeration,
    and a width covering every caption (14 of 2 words, 84 of 4) returns all of them, the best first."""
    V = 4 + words  # with <pad>, <start>, <end>, <unk>
    decoder = tiny(V, seed=seed, end_bias=0.0, word_query=True, decode_sharpness=2.0)
    feats = features(3, seed=10 + seed)
    everything = all_captions(words)
    assert len(everything) == words + words**2 + words**3
    with torch.no_grad():
        for K in (1, 2, 3, 5):
            beams = beam_search(decoder, feats, beam_size=K, max_len=MAX_LEN, length_norm=length_norm, shapes=shapes)
            for b, hyps in enumerate(beams):
                want = reference_beam_search(decoder, feats[b], K, MAX_LEN, length_norm, V)
                assert [h.tokens for h in hyps] == [w for w, _, _ in want], (K, b)
                assert [h.score for h in hyps] == pytest.approx([s for _, s, _ in want], abs=2e-4)
            check_against_teacher_forcing(decoder, feats, beams, EXPECTED, length_norm)
        # A width that holds every caption: the search is exhaustive, and its first is the best of all.
        K = len(everything) + 2
        beams = beam_search(decoder, feats, beam_size=K, max_len=MAX_LEN, length_norm=length_norm, shapes=shapes)
        for b, hyps in enumerate(beams):
            each = Forced(decoder, feats[b], everything)
            forced = {tuple(c): each.score(i) for i, c in enumerate(everything)}
            key = (lambda c: forced[c] / (len(c) + 1)) if length_norm else (lambda c: forced[c])
            ranked = sorted(forced, key=key, reverse=True)
            assert [tuple(h.tokens) for h in hyps] == ranked
            assert [h.score for h in hyps] == pytest.approx([forced[c] for c in ranked], abs=2e-4)
            assert [h.ended for h in hyps] == [len(c) < MAX_LEN for c in ranked]
