"""The training objective: the paper's eq. (14) behind one switch."""

from __future__ import annotations

import torch
from conftest import caption_loss

from captioner.cli.train import get_parser
from captioner.data.batches import CaptionBatches
from captioner.data.dataset import CaptionData
from captioner.models.decoder import AttentionDecoder
from captioner.objectives.objective import Objective, objective_terms
from captioner.objectives.terms import TermState
from captioner.options import from_args
from captioner.train.config import TrainConfig
from captioner.train.resume import Start, settle


def test_the_paper_switch_gives_eq_14_exactly(data_dir):
    """`--paper-objective`: the likelihood plus λ = 1 times the doubly stochastic term, nothing else,
    even on data that carries what our attention term reads."""
    args = get_parser().parse_args(["fit", "--data", "d", "--out", "o", "--paper-objective"])
    assert from_args(TrainConfig, args) == TrainConfig.of(paper=True)
    data = CaptionData(str(data_dir))
    _, cfg = settle(None, TrainConfig.of(paper=True), Start(len(data.vocab)), torch.device("cpu"))
    assert cfg.terms.alpha_c == 1.0 and cfg.terms.consistency == 0.0
    batch = next(CaptionBatches(data, 8).batches(seed=0, epoch=0))
    torch.manual_seed(0)
    dec = AttentionDecoder(vocab_size=len(data.vocab), embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.0)
    dec.set_feature_stats(*data.feature_stats())
    terms = objective_terms(cfg.terms, attention="soft", hard=cfg.hard, views=True, state=TermState("cpu"))
    loss, terms = Objective(dec, terms)(batch, batch.count)
    logits, alphas = dec(batch.features, batch.captions, batch.lengths)
    nll, penalty = caption_loss(logits, alphas, batch.captions, batch.lengths, alpha_c=1.0)
    torch.testing.assert_close(loss, nll + penalty)
    assert set(terms) == {"nll", "penalty"}
