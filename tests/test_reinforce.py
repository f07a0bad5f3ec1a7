"""Hard attention's REINFORCE estimator: unbiased against the exact gradient, and the baseline helps."""

from __future__ import annotations

import itertools

import pytest
import torch

from captioner.data.batches import Batch
from captioner.models.decoder import AttentionDecoder
from captioner.objectives.objective import HardAttentionConfig, Objective, Reinforce, objective_terms
from captioner.objectives.terms import TermsConfig, TermState

L, V = 3, 6  # 3 locations, 2 steps: 9 location sequences to enumerate
CAPTION = torch.tensor([[1, 4, 2]])  # <start> w <end>
LENGTHS = torch.tensor([3])


def problem():
    torch.manual_seed(0)
    dec = AttentionDecoder(
        vocab_size=V, encoder_dim=4, embed_dim=4, hidden_dim=5, attention_dim=3, dropout=0.0, attention="hard"
    ).double()
    feats = torch.randn(1, L, 4, dtype=torch.float64) * 2
    return dec, feats


def hard_loss(dec, n, feats, baseline, cfg, alpha_c, generator):
    """The hard-attention objective's loss and terms on n copies of the caption, and its REINFORCE term."""
    terms = objective_terms(
        TermsConfig(alpha_c=alpha_c, consistency=0.0),
        attention="hard",
        hard=cfg,
        views=False,
        state=TermState("cpu", {"reinforce": {"baseline": torch.tensor(baseline, dtype=torch.float64)}}),
    )
    objective = Objective(dec, terms, semi_sampling=cfg.semi_sampling)
    batch = Batch(feats.expand(n, -1, -1), CAPTION.expand(n, -1), LENGTHS.expand(n))
    loss, values = objective(batch, batch.count, generator)
    return loss, values, next(t for t in objective.terms if isinstance(t, Reinforce))


def exact_gradient(dec, feats):
    """∇ Σ_s p(s|a) log p(y|s,a), enumerating every location sequence s."""
    objective = 0
    for seq in itertools.product(range(L), repeat=2):
        locs = torch.tensor([seq])
        u = dec.unroll(feats, CAPTION, locations=locs)
        alphas = u.alphas
        logits = dec.output(u.emb, u.h, u.z)
        logp_y = logits.log_softmax(-1)[0, torch.arange(2), CAPTION[0, 1:]].sum()
        p_s = alphas[0, 0, seq[0]] * alphas[0, 1, seq[1]]
        objective = objective + p_s * logp_y
    grads = torch.autograd.grad(objective, list(dec.parameters()), allow_unused=True)
    return torch.cat(
        [
            g.flatten() if g is not None else torch.zeros(p.numel(), dtype=p.dtype)
            for g, p in zip(grads, dec.parameters())
        ]
    ), float(objective.detach())


def estimate(dec, feats, n, baseline, seed):
    """The training loss's gradient on n sampled copies of the caption, as ∇ of the objective."""
    cfg = HardAttentionConfig(entropy_weight=0.0, reward_scale=1.0, semi_sampling=0.0)
    gen = torch.Generator().manual_seed(seed)
    loss, *_ = hard_loss(dec, n, feats, baseline, cfg, 0.0, gen)
    dec.zero_grad()
    loss.backward()
    # The loss is −(objective summed over copies) / words, with 2 predicted words per copy.
    return torch.cat(
        [
            (-p.grad * 2).flatten() if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype)
            for p in dec.parameters()
        ]
    )


def test_estimator_is_unbiased():
    dec, feats = problem()
    exact, objective = exact_gradient(dec, feats)
    for baseline in (0.0, objective):
        est = estimate(dec, feats, 40_000, baseline, seed=1)
        err = (est - exact).norm() / exact.norm()
        # Without the REINFORCE term the same check is off by 0.076: the test can tell.
        assert err < 0.03, (baseline, float(err))


def test_baseline_lowers_variance():
    dec, feats = problem()
    _, objective = exact_gradient(dec, feats)
    spread = {}
    for name, b in (("none", 0.0), ("baseline", objective)):
        draws = torch.stack([estimate(dec, feats, 20, b, seed=s) for s in range(60)])
        spread[name] = float(draws.var(0).sum())
    assert spread["baseline"] < 0.5 * spread["none"], spread


def test_hard_loss_is_finite_with_peaked_attention():
    """Tiny α must not give NaN or inf: log α is floored."""
    dec, feats = problem()
    feats = feats * 1e4  # extreme features → near one-hot attention
    cfg = HardAttentionConfig(semi_sampling=0.0)
    loss, terms, _ = hard_loss(dec, 8, feats, 0.0, cfg, 1.0, torch.Generator().manual_seed(0))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in terms.values())
    assert all(torch.isfinite(p.grad).all() for p in dec.parameters() if p.grad is not None)


def test_baseline_moves_towards_the_reward():
    dec, feats = problem()
    cfg = HardAttentionConfig(semi_sampling=0.0)
    _, terms, reinforce = hard_loss(dec, 4, feats, 0.0, cfg, 1.0, torch.Generator().manual_seed(0))
    assert float(reinforce.sums[1]) == 4  # captions that sampled locations
    reinforce.after_step(torch.tensor(True))
    b = float(reinforce.baseline)
    # b ← 0.9 b + 0.1 log p(y|s): from 0 it moves a tenth of the way to a negative log-likelihood.
    assert b == pytest.approx(-0.1 * float(terms["nll"]) * 2, rel=1e-6)
    reinforce.sums = [torch.tensor(5.0), torch.tensor(0.0)]
    reinforce.after_step(torch.tensor(True))
    assert float(reinforce.baseline) == b  # no sampled caption: no update
    reinforce.sums = [torch.tensor(-5.0), torch.tensor(1.0)]
    reinforce.after_step(torch.tensor(False))
    assert float(reinforce.baseline) == b  # a skipped step: no update
