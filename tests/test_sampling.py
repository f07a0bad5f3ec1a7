"""Sampled captions (`decoding.sampling`) and the decoding settings (`decoding.settings`): a temperature of 0
and top-k = 1 write the greedy caption; every sample's score and maps are the decoder's under teacher
forcing on that sample; the words come from the distribution asked for; the same seed, the same
samples; the settings refuse what cannot be decoded, by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_beam_teacher import DECODERS, Forced, features, tiny

from captioner.decoding.beams import banned
from captioner.decoding.decode import beam_search, decode, seeded
from captioner.decoding.sampling import Draw, sample_captions, sampling_step
from captioner.decoding.search_state import Search
from captioner.decoding.settings import Decoding
from captioner.errors import OptionError
from captioner.models.decoder import ARGMAX, EXPECTED, SAMPLE
from captioner.models.vocab import END_ID


@pytest.fixture(autouse=True)
def one_thread_no_grad():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.no_grad():
        yield
    torch.set_num_threads(threads)


def mode_of(kind: str) -> str:
    return ARGMAX if kind.startswith("hard") else EXPECTED


@pytest.mark.parametrize("kind", list(DECODERS))
@pytest.mark.parametrize("greedy", [dict(temperature=0.0), dict(top_k=1), dict(temperature=1e-4)])
def test_temperature_zero_and_top_k_one_write_the_greedy_caption(kind, greedy):
    """Words, scores and maps of every sample equal beam search at one beam."""
    decoder, feats = tiny(**DECODERS[kind]), features(6, seed=1)
    mode = mode_of(kind)
    beams = beam_search(decoder, feats, beam_size=1, max_len=7, mode=mode)
    generator = torch.Generator().manual_seed(3)
    samples = sample_captions(decoder, feats, n=2, max_len=7, mode=mode, generator=generator, **greedy)
    for hyps, (best,) in zip(samples, beams):
        for s in hyps:
            assert s.tokens == best.tokens
            assert s.score == pytest.approx(best.score, abs=1e-5)
            np.testing.assert_allclose(s.attention, best.attention, atol=1e-6)
            assert s.ended == best.ended
    assert any(not b.ended for (b,) in beams) and any(b.ended for (b,) in beams)  # cut and ended ones alike


@pytest.mark.parametrize("kind", list(DECODERS))
@pytest.mark.parametrize("draw", [dict(), dict(temperature=1.5, top_k=4), dict(top_p=0.8)])
def test_every_sample_equals_teacher_forcing(kind, draw):
    """Each sample's score is the decoder's log-probability of its words and <end>; each word's map and
    location are those the decoder gives for that word under teacher forcing."""
    decoder, feats = tiny(**DECODERS[kind]), features(5, seed=2)
    mode = mode_of(kind)
    samples = sample_captions(
        decoder, feats, n=4, max_len=7, mode=mode, generator=torch.Generator().manual_seed(0), **draw
    )
    assert len({tuple(s.tokens) for hyps in samples for s in hyps}) > 5  # they do differ
    for b, hyps in enumerate(samples):
        assert len(hyps) == 4
        forced = Forced(decoder, feats[b], [s.tokens for s in hyps], mode)
        for i, s in enumerate(hyps):
            n = len(s.tokens)
            assert s.score == pytest.approx(forced.score(i), abs=2e-4)
            np.testing.assert_allclose(s.attention, forced.maps(i), atol=2e-5, rtol=1e-4)
            assert s.locations.tolist() == forced.locations[i, :n].tolist()
            assert not set(s.tokens) & set(banned(first=False))


def test_sampled_words_follow_the_distribution_asked_for():
    """The first word of many samples: at temperature T its frequencies are softmax(logits / T) over the
    allowed words; with top-k only the k likeliest appear, with top-p only the fewest reaching p."""
    decoder, feats = tiny(V=10, end_bias=-2.0), features(1, seed=4)
    logp = Forced(decoder, feats[0], [[]]).logp[0, 0]  # (V,) the first word's, banned at -inf
    draws = 6000

    def first_words(**kw) -> np.ndarray:
        out = sample_captions(decoder, feats, n=draws, max_len=1, generator=torch.Generator().manual_seed(1), **kw)
        return np.bincount([s.tokens[0] for s in out[0]], minlength=10) / draws

    for T in (1.0, 0.5):
        p = (logp / T).softmax(-1).numpy()
        np.testing.assert_allclose(first_words(temperature=T), p, atol=0.025)
    order = torch.argsort(logp, descending=True).tolist()
    assert set(np.flatnonzero(first_words(top_k=2))) == set(order[:2])
    p = logp.softmax(-1)
    reach = int((p[order].cumsum(0) < 0.6).sum()) + 1  # the fewest likeliest words holding 0.6
    assert set(np.flatnonzero(first_words(top_p=0.6))) == set(order[:reach])


def test_the_same_seed_draws_the_same_samples():
    decoder, feats = tiny(attention="hard", end_bias=0.0), features(3, seed=5)
    settings = Decoding(method="sampling", n=3, top_p=0.9, mode=SAMPLE, seed=7)

    def tokens(s: Decoding):
        return [[h.tokens for h in hyps] for hyps in decode(decoder, feats, s, max_len=6)]

    assert tokens(settings) == tokens(settings)
    assert tokens(settings) != tokens(Decoding(method="sampling", n=3, top_p=0.9, mode=SAMPLE, seed=8))


def test_the_sampling_step_reads_nothing_back_on_the_meta_device():
    """The fixed-shape step with every draw (temperature, top-k, top-p, sampled locations): on the meta
    device, which refuses every read of a value, as a GPU's step must not make one."""
    meta = torch.device("meta")
    decoder = tiny(attention="hard", word_query=True).to(meta)
    s = Search.start(decoder, features(2, seed=0).to(meta), 3, 6)
    t, last = torch.zeros((), dtype=torch.long, device=meta), torch.full((), 5, dtype=torch.long, device=meta)
    for draw in (Draw(0.7, 3, 0.9), Draw(0.0), Draw(1.0, 0, 0.5)):
        sampling_step(decoder, s, t, last, draw, SAMPLE, seeded(0, meta))
    assert s.words.shape == (6,) and s.words.device == meta


def test_decoding_settings_refuse_what_cannot_be_decoded_by_name():
    with pytest.raises(OptionError, match="--temperature.*--decoding sampling"):
        Decoding(temperature=0.5)
    with pytest.raises(OptionError, match="--beam-size"):
        Decoding(beam_size=0)
    with pytest.raises(OptionError, match="--top-p"):
        Decoding(method="sampling", top_p=0.0)
    with pytest.raises(OptionError, match=r"n \(--n\) must be a whole number between 1 and 50"):
        Decoding(method="sampling", n=0)
    with pytest.raises(OptionError, match="unknown decoding setting 'beams'"):
        Decoding().with_settings(beams=2)
    assert Decoding(beam_size=3.0).beam_size == 3 and isinstance(Decoding(beam_size=3.0).beam_size, int)
    assert Decoding().with_settings(beam_size=None, max_len=5) == Decoding(max_len=5)


def test_decoding_at_another_sharpness_draws_those_maps():
    """`sharpness` overrides the model's k: the maps are those of a model built with that k."""
    decoder, feats = tiny(word_query=True), features(2, seed=6)
    sharp = tiny(word_query=True, decode_sharpness=3.0)
    for settings in (Decoding(sharpness=3.0), Decoding(method="sampling", temperature=0.0, sharpness=3.0)):
        ours = decode(decoder, feats, settings, max_len=6)
        theirs = decode(sharp, feats, Decoding(**{**settings.to_dict(), "sharpness": None}), max_len=6)
        for a, b in zip(ours, theirs):
            assert a[0].tokens == b[0].tokens
            np.testing.assert_allclose(a[0].attention, b[0].attention, atol=1e-6)
    plain = decode(decoder, feats, Decoding(), max_len=6)
    assert not np.allclose(plain[0][0].attention[:1], ours[0][0].attention[:1], atol=1e-3)


def test_end_is_the_only_word_at_max_len():
    decoder, feats = tiny(end_bias=-4.0), features(2, seed=7)
    for hyps in sample_captions(decoder, feats, n=5, max_len=3, generator=torch.Generator().manual_seed(0)):
        assert all(len(s.tokens) <= 3 and END_ID not in s.tokens for s in hyps)
        assert any(not s.ended for s in hyps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_sampling_on_a_gpu_writes_the_greedy_caption_at_temperature_zero_and_repeats_with_its_seed():
    """On CUDA (fixed shapes, eager): temperature 0 writes the graphed beam search's greedy caption, and the
    same seed draws the same samples."""
    decoder, feats = tiny(**DECODERS["soft"]).cuda(), features(4, seed=1).cuda()
    (beams,) = zip(*beam_search(decoder, feats, beam_size=1, max_len=7))
    greedy = sample_captions(decoder, feats, n=2, max_len=7, temperature=0.0)
    for hyps, best in zip(greedy, beams):
        assert all(s.tokens == best.tokens for s in hyps)
    drawn = [
        sample_captions(decoder, feats, n=3, max_len=7, generator=seeded(11, torch.device("cuda")), top_p=0.9)
        for _ in range(2)
    ]
    assert [[s.tokens for s in hyps] for hyps in drawn[0]] == [[s.tokens for s in hyps] for hyps in drawn[1]]
