"""The decoder: shapes, attention, masking, gradients, and beam search against plain greedy."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import caption_loss

from captioner.decoding.decode import beam_search
from captioner.models.checkpoint import current_decoder
from captioner.models.decoder import ARGMAX, EXPECTED, SAMPLE, AttentionDecoder, DecoderConfig
from captioner.models.fused import fused_unroll
from captioner.models.vocab import END_ID, PAD_ID, START_ID, UNK_ID
from captioner.objectives.objective import teacher_forced
from captioner.train.step import make_optimizer

V, L, D = 30, 196, 64


def tiny(**kw) -> AttentionDecoder:
    torch.manual_seed(0)
    args = dict(vocab_size=V, encoder_dim=D, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.0)
    return AttentionDecoder(**{**args, **kw})


def batch(B=3, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.rand(B, L, D, generator=g)
    lengths = torch.tensor([T, T - 2, 3][:B])
    caps = torch.randint(4, V, (B, T), generator=g)
    caps[:, 0] = START_ID
    for b, n in enumerate(lengths):
        caps[b, n - 1] = END_ID
        caps[b, n:] = PAD_ID
    return feats, caps, lengths


def test_shapes_and_attention_sums_to_one():
    dec = tiny()
    feats, caps, lengths = batch()
    logits, alphas = dec(feats, caps, lengths)
    assert logits.shape == (3, 5, V)
    assert alphas.shape == (3, 5, L)
    torch.testing.assert_close(alphas.sum(-1), torch.ones(3, 5))
    assert (alphas >= 0).all()


def test_contract_signature_with_paper_sizes():
    dec = AttentionDecoder(vocab_size=50, encoder_dim=512, embed_dim=64, hidden_dim=64, attention_dim=32, dropout=0.0)
    caps = torch.tensor([[1, 5, 6, 2, 0], [1, 7, 2, 0, 0], [1, 8, 9, 10, 2]])
    logits, alphas = dec(torch.randn(3, 196, 512), caps, torch.tensor([4, 3, 5]))
    assert logits.shape == (3, 4, 50) and alphas.shape == (3, 4, 196)


def test_the_decoder_is_built_from_its_config_alone():
    """A settled config is the model's own; keywords are the paper's config with those fields; an unsettled
    config, or a config and keywords both, are refused."""
    cfg = DecoderConfig(vocab_size=V, encoder_dim=D, embed_dim=8, dropout=0.1, word_query=True, decode_sharpness=2.0)
    assert AttentionDecoder(cfg).config is cfg
    assert AttentionDecoder(vocab_size=V, embed_dim=8).config == DecoderConfig.paper(vocab_size=V, embed_dim=8)
    assert DecoderConfig.paper(vocab_size=V) == DecoderConfig(V, dropout=0.5, word_query=False, decode_sharpness=1.0)
    with pytest.raises(ValueError, match="word_query, decode_sharpness not settled"):
        AttentionDecoder(DecoderConfig(vocab_size=V, dropout=0.0))
    with pytest.raises(TypeError):
        AttentionDecoder(cfg, dropout=0.0)


def test_padding_is_masked():
    """What sits in the padding changes neither the loss nor the real positions' outputs."""
    dec = tiny()
    feats, caps, lengths = batch()
    other = caps.clone()
    other[1, lengths[1] :] = 7  # garbage where padding was
    other[2, lengths[2] :] = 9
    l1, a1 = dec(feats, caps, lengths)
    l2, a2 = dec(feats, other, lengths)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(l1[b, : n - 1], l2[b, : n - 1])
    nll1, pen1 = caption_loss(l1, a1, caps, lengths)
    nll2, pen2 = caption_loss(l2, a2, other, lengths)
    torch.testing.assert_close(nll1, nll2)
    torch.testing.assert_close(pen1, pen2)


def fused(dec, feats, caps, lengths):
    """`AttentionDecoder.forward`'s outputs from the fused pass."""
    u = fused_unroll(dec, feats, caps)
    return dec.output(u.emb, u.h, u.z), u.alphas


def test_batch_in_any_order_equals_each_caption_alone():
    """The fused soft pass steps only unfinished captions, sorted by length: outputs and gradients
    must be those of every caption run on its own."""
    dec = tiny()
    feats, caps, lengths = batch(B=3, T=7)
    perm = torch.tensor([2, 0, 1])  # shortest first: the pass must sort
    feats, caps, lengths = feats[perm], caps[perm], lengths[perm]
    logits, alphas = fused(dec, feats, caps, lengths)
    nll, _ = caption_loss(logits, alphas, caps, lengths)
    grads = torch.autograd.grad(nll * lengths.sub(1).sum(), dec.lstm_h.weight)[0]
    alone = torch.zeros_like(grads)
    for b, n in enumerate(lengths.tolist()):
        l1, a1 = fused(dec, feats[b : b + 1, :], caps[b : b + 1, :n], lengths[b : b + 1])
        torch.testing.assert_close(l1[0], logits[b, : n - 1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a1[0], alphas[b, : n - 1], rtol=1e-5, atol=1e-6)
        nll1, _ = caption_loss(l1, a1, caps[b : b + 1, :n], lengths[b : b + 1])
        alone += torch.autograd.grad(nll1 * (n - 1), dec.lstm_h.weight)[0]
    torch.testing.assert_close(grads, alone, rtol=1e-4, atol=1e-6)
    # Past a caption's end the maps are uniform, so every row of α still sums to 1.
    torch.testing.assert_close(alphas.sum(-1), torch.ones(alphas.shape[:2]))


def test_penalty_matches_paper_formula():
    dec = tiny()
    feats, caps, lengths = batch()
    logits, alphas = dec(feats, caps, lengths)
    nll, penalty = caption_loss(logits, alphas, caps, lengths, alpha_c=1.0)
    # Eq. (14) per caption: summed log-likelihood + λ Σ_i (1 − Σ_t α_ti)²; batch total per word.
    logp = logits.log_softmax(-1)
    words = int((lengths - 1).sum())
    eq14 = sum(
        -logp[b, torch.arange(n - 1), caps[b, 1:n]].sum() + ((1 - alphas[b, : n - 1].sum(0)) ** 2).sum()
        for b, n in enumerate(lengths)
    )
    torch.testing.assert_close(nll + penalty, eq14 / words)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_every_parameter_gets_a_gradient(attention):
    dec = tiny(attention=attention, dropout=0.3)
    feats, caps, lengths = batch()
    logits, alphas = dec(feats, caps, lengths)
    nll, penalty = caption_loss(logits, alphas, caps, lengths)
    (nll + penalty).backward()
    for name, p in dec.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@torch.no_grad()
def plain_greedy(dec, feats, max_len):
    """Greedy decoding written the obvious way, one image at a time, as the reference."""
    out = []
    for b in range(feats.size(0)):
        f = feats[b : b + 1]
        proj = dec.attention.project(f)
        h, c = dec.init_state(f)
        word, words, score = torch.tensor([START_ID]), [], 0.0
        for t in range(max_len + 1):
            logits, h, c, _, _ = dec.step(f, proj, word, h, c)
            logp = logits.log_softmax(-1)[0]
            logp[[PAD_ID, START_ID, UNK_ID] + ([END_ID] if t == 0 else [])] = float("-inf")
            best = END_ID if t == max_len else int(logp.argmax())  # made to end, at <end>'s own cost
            score += float(logp[best])
            if best == END_ID:
                break
            words.append(best)
            word = torch.tensor([best])
        out.append((words, score))
    return out


@pytest.mark.parametrize("max_len", [3, 12])
def test_beam_one_equals_plain_greedy(max_len):
    dec = tiny().eval()
    feats = torch.rand(5, L, D, generator=torch.Generator().manual_seed(3))
    beams = beam_search(dec, feats, beam_size=1, max_len=max_len)
    for hyps, (words, score) in zip(beams, plain_greedy(dec, feats, max_len)):
        assert hyps[0].tokens == words
        assert hyps[0].score == pytest.approx(score, abs=1e-4)  # a cut caption's score counts its <end>
        assert hyps[0].ended == (len(words) < max_len)


def test_beam_search_terminates_and_ranks():
    """An untrained model rarely says <end>: the search must still stop at max_len."""
    dec = tiny().eval()
    feats = torch.rand(4, L, D, generator=torch.Generator().manual_seed(5))
    for K, length_norm in itertools.product((1, 3, 7), (True, False)):
        beams = beam_search(dec, feats, beam_size=K, max_len=6, length_norm=length_norm)
        assert len(beams) == 4
        for hyps in beams:
            assert 1 <= len(hyps) <= K
            assert all(len(h.tokens) <= 6 for h in hyps)
            ranked = [h.normalized_score if length_norm else h.score for h in hyps]
            assert ranked == sorted(ranked, reverse=True)
            assert all(h.attention.shape == (len(h.tokens), L) for h in hyps)
            assert len({tuple(h.tokens) for h in hyps}) == len(hyps)  # no duplicate beams


def test_every_caption_has_a_word_even_when_end_is_likeliest():
    dec = tiny().eval()
    with torch.no_grad():
        dec.L_o.bias[END_ID] = 50.0  # <end> is almost certain at every step
    feats = torch.rand(3, L, D, generator=torch.Generator().manual_seed(4))
    for K in (1, 3):
        for hyps in beam_search(dec, feats, beam_size=K, max_len=6):
            assert all(len(h.tokens) == 1 for h in hyps)  # one word, then <end>


def test_wider_beam_never_scores_worse_than_greedy():
    dec = tiny().eval()
    feats = torch.rand(6, L, D, generator=torch.Generator().manual_seed(8))
    greedy = beam_search(dec, feats, beam_size=1, max_len=8, length_norm=False)
    wide = beam_search(dec, feats, beam_size=5, max_len=8, length_norm=False)
    for g, w in zip(greedy, wide):
        assert w[0].score >= g[0].score - 1e-5


def test_batched_search_equals_one_by_one():
    dec = tiny().eval()
    feats = torch.rand(3, L, D, generator=torch.Generator().manual_seed(9))
    together = beam_search(dec, feats, beam_size=3, max_len=8)
    for b in range(3):
        alone = beam_search(dec, feats[b : b + 1], beam_size=3, max_len=8)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in together[b]]


def test_decoding_after_a_training_step_uses_the_new_weights():
    """`fit` validates between optimizer steps: each validation must decode with the weights of
    that moment. The fused Adam updates parameters without bumping their version counters, so a
    cache keyed on them kept the weights of the first validation."""
    dec = tiny().eval()
    feats, caps, lengths = batch()
    optimizer = make_optimizer([{"params": list(dec.parameters())}], 0.05)
    beam_search(dec, feats, beam_size=3, max_len=8)
    for _ in range(3):
        optimizer.zero_grad()
        nll, penalty = caption_loss(*dec(feats, caps, lengths), caps, lengths)
        (nll + penalty).backward()
        optimizer.step()
    fresh = tiny().eval()
    fresh.load_state_dict(dec.state_dict())
    after, expected = beam_search(dec, feats, beam_size=3, max_len=8), beam_search(fresh, feats, beam_size=3, max_len=8)
    for got, want in zip(after, expected):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-5)


def test_hard_modes_report_locations():
    dec = tiny(attention="hard").eval()
    feats = torch.rand(2, L, D, generator=torch.Generator().manual_seed(4))
    for mode in (ARGMAX, SAMPLE):
        gen = torch.Generator().manual_seed(0)
        hyps = beam_search(dec, feats, beam_size=2, max_len=5, mode=mode, generator=gen)
        for h in (b[0] for b in hyps):
            assert ((h.locations >= 0) & (h.locations < L)).all()
    argmax = beam_search(dec, feats, beam_size=2, max_len=5, mode=ARGMAX)[0][0]
    assert (argmax.locations == argmax.attention.argmax(1)).all()
    expected = beam_search(dec, feats, beam_size=2, max_len=5, mode=EXPECTED)[0][0]
    assert (expected.locations == -1).all()
    s1 = beam_search(dec, feats, beam_size=2, max_len=5, mode=SAMPLE, generator=torch.Generator().manual_seed(1))
    s2 = beam_search(dec, feats, beam_size=2, max_len=5, mode=SAMPLE, generator=torch.Generator().manual_seed(1))
    assert [b[0].tokens for b in s1] == [b[0].tokens for b in s2]


@pytest.mark.parametrize("embed_dim", [None, 3])
def test_attention_equals_the_paper_formula_with_gradients(embed_dim):
    """The fast score (2v·σ(2z)) gives the α and the gradients of softmax(v·tanh(z)), with z the
    paper's W_a a_i + W_h h_{t-1}, plus W_y E y_{t-1} when the query holds the word."""
    from captioner.models.decoder import Attention

    torch.manual_seed(0)
    att = Attention(6, 5, 4, embed_dim).double()
    feats = torch.randn(2, 7, 6, dtype=torch.float64)
    h = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    emb = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 7, dtype=torch.float64)

    def paper():
        q = att.W_h(h) + (0 if embed_dim is None else att.W_y(emb))
        e = att.v(torch.tanh(att.W_a(feats) + q.unsqueeze(1))).squeeze(2)
        return e.softmax(dim=1)

    params = [h, *att.parameters()] + ([emb] if embed_dim else [])
    ours = att(att.project(feats), h, emb)
    ref = paper()
    torch.testing.assert_close(ours, ref)
    for g1, g2 in zip(torch.autograd.grad((ours * w).sum(), params), torch.autograd.grad((ref * w).sum(), params)):
        torch.testing.assert_close(g1, g2)


def test_the_map_knows_the_word_just_written_only_with_the_word_query():
    """α_t changes with y_{t-1} when the query holds the word; without it (the paper's), α_t
    depends on h_{t-1} alone, which has not seen y_{t-1}; a checkpoint without the field loads as
    the paper's."""
    for word_query in (True, False):
        torch.manual_seed(0)
        dec = tiny(dropout=0.0, word_query=word_query).eval()
        feats, caps, _ = batch()
        a = fused_unroll(dec, feats, caps).alphas
        other = caps.clone()
        other[:, 1] = (other[:, 1] % (dec.config.vocab_size - 4)) + 4  # another first word
        b = fused_unroll(dec, feats, other).alphas
        torch.testing.assert_close(a[:, 0], b[:, 0])  # the map before the word
        assert torch.allclose(a[:, 1], b[:, 1]) != word_query  # the map of the word after it
    old = {k: v for k, v in dec.config.to_dict().items() if k != "word_query"}
    assert DecoderConfig(**current_decoder(old)).word_query is False


def test_decoding_draws_sharper_maps_than_training_and_old_models_decode_as_trained():
    """With decode_sharpness k, each decoded map is softmax(k e_t) = α_t^k renormalised (the first
    step, whose state is the same, shows it), the teacher-forced maps training sees are the same,
    and a checkpoint without the field decodes with the maps as trained."""
    feats, caps, _ = batch()
    plain, sharp = tiny(word_query=True).eval(), tiny(word_query=True, decode_sharpness=3.0).eval()
    assert plain.config.decode_sharpness == 1.0
    torch.testing.assert_close(fused_unroll(plain, feats, caps).alphas, fused_unroll(sharp, feats, caps).alphas)
    first = [beam_search(m, feats, beam_size=1, max_len=4)[0][0].attention[0] for m in (plain, sharp)]
    want = torch.from_numpy(first[0]).double() ** 3
    torch.testing.assert_close(torch.from_numpy(first[1]).double(), want / want.sum(), rtol=1e-4, atol=1e-7)
    assert first[1].max() > first[0].max()  # sharper
    old = {k: v for k, v in sharp.config.to_dict().items() if k != "decode_sharpness"}
    assert DecoderConfig(**current_decoder(old)).decode_sharpness == 1.0
    with pytest.raises(ValueError, match="decode-sharpness"):
        DecoderConfig(V, decode_sharpness=0.0)


@pytest.mark.parametrize("shapes", ["packed", "fixed"])
def test_training_pass_equals_the_full_loss(shapes):
    """The packed pass computes logits on real words only, the fixed one everywhere with masks; both
    give eq. (14)'s negative log-likelihood in full, with its gradients."""
    dec = tiny(dropout=0.0)
    feats, caps, lengths = batch()
    logits, alphas = dec(feats, caps, lengths)
    full, _ = caption_loss(logits, alphas, caps, lengths)
    g_full = torch.autograd.grad(full, list(dec.parameters()), allow_unused=True)
    p = teacher_forced(dec, feats, caps, lengths, shapes=shapes)
    ours = p.nll.sum() / (lengths - 1).sum()
    g_ours = torch.autograd.grad(ours, list(dec.parameters()), allow_unused=True)
    torch.testing.assert_close(ours, full)
    for a, b in zip(g_ours, g_full):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fixed_locations, word_query", [(False, False), (True, False), (False, True)])
def test_fused_pass_equals_the_plain_one(fixed_locations, word_query):
    """The fused soft pass (models.fused: h's three maps in one product, the hand-written score
    backward, W and p gradients summed once per pass) gives the values and gradients of the plain
    step-by-step pass (`attend`, `advance` at each step), in float64, on a padded, unsorted batch,
    with the paper's query and with the word in it."""
    dec = tiny(word_query=word_query).double()
    feats, caps, lengths = batch(B=3, T=7)
    feats = feats.double()
    weights = torch.rand(3, 6, L, dtype=torch.float64)

    def run(unroll):
        u = unroll()
        logits = dec.output(u.emb, u.h, u.z)  # (B, T-1, V)
        mask = torch.arange(6).unsqueeze(0) < (lengths - 1).unsqueeze(1)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), caps[:, 1:], reduction="none") * mask
        loss = nll.sum() + (u.alphas * weights * mask.unsqueeze(2)).sum()
        return nll, torch.autograd.grad(loss, list(dec.parameters()), allow_unused=True)

    nll, grads = run(lambda: fused_unroll(dec, feats, caps))
    # The expected context at every step, given as fixed locations (-1) or by default.
    plain = {"locations": torch.full((3, 6), -1)} if fixed_locations else {}
    ref_nll, ref_grads = run(lambda: dec.unroll(feats, caps, **plain))
    torch.testing.assert_close(nll, ref_nll)
    for name, g, r in zip([n for n, _ in dec.named_parameters()], grads, ref_grads):
        assert (g is None) == (r is None), name
        if g is not None:
            torch.testing.assert_close(g, r, msg=name)
