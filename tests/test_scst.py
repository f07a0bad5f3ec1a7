"""Self-critical training: CIDEr-D equals coco-caption's, the gradient favours samples that beat
the baseline, a resumed run equals an uninterrupted one, and bad flags get a clear error."""

from __future__ import annotations

import inspect
import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as torch_dist
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from torch.nn.parallel import DistributedDataParallel

from captioner.cli.train import main as train_main
from captioner.data.batches import TrainingImages
from captioner.data.dataset import CaptionData
from captioner.models.checkpoint import load_checkpoint
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.vocab import END_ID, PAD_ID, START_ID, UNK_ID
from captioner.objectives import scst
from captioner.objectives.cider import DocumentFrequency, NgramScorer, References, cached_document_frequency
from captioner.objectives.objective import Objective
from captioner.objectives.scst import ScstConfig, SelfCritical, sample_captions
from captioner.train.checkpoints import Live
from captioner.train.config import OptimConfig, TrainConfig
from captioner.train.distributed import Dist, Process
from captioner.train.step import TrainStep, make_optimizer
from captioner.train.trainer import FitJob, fit

# helpers


def padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.zeros(len(seqs), max([len(s) for s in seqs] + [1]), dtype=torch.long)
    for i, s in enumerate(seqs):
        t[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return t, torch.tensor([len(s) for s in seqs])


def random_set(rs: np.random.RandomState, images: int, vocab: int):
    """References (1-5 per image, 0-11 words) and 3 candidates per image: random, or a
    reference with a word changed, so that matches of every order occur."""
    refs = {i: [list(rs.randint(1, vocab, rs.randint(0, 12))) for _ in range(rs.randint(1, 6))] for i in range(images)}
    cands = {}
    for i in range(images):
        edited = list(refs[i][0])
        if edited:
            edited[rs.randint(len(edited))] = int(rs.randint(1, vocab))
        cands[i] = [list(rs.randint(1, vocab, rs.randint(0, 12))), edited, list(refs[i][-1])]
    return refs, cands


# CIDEr-D and BLEU-4 against pycocoevalcap


@pytest.mark.parametrize("seed,vocab", [(0, 6), (1, 12), (2, 40)])
def test_scores_equal_pycocoevalcap(seed, vocab):
    """pycocoevalcap's `Cider` is CIDEr-D (clipping, length penalty) with document frequencies
    from the references it is given: ours gets the same references and their df."""
    rs = np.random.RandomState(seed)
    images = 30
    refs, cands = random_set(rs, images, vocab)
    flat = [(i, r) for i in range(images) for r in refs[i]]
    tokens, lengths = padded([r for _, r in flat])
    R = References(tokens, lengths, torch.tensor([i for i, _ in flat]), base=vocab)
    scorer = NgramScorer(R, DocumentFrequency.from_references(R))
    text = lambda ids: " ".join(f"w{t}" for t in ids)
    gts = {i: [text(r) for r in refs[i]] for i in range(images)}
    cider, bleu = [], []
    for k in range(3):  # pycocoevalcap takes one candidate per image: one call per set
        res = {i: [text(cands[i][k])] for i in range(images)}
        cider.append(Cider().compute_score(gts, res)[1])
        bleu.append(Bleu(4).compute_score(gts, res, verbose=0)[1][3])
    # Ours scores all 90 candidates in one call.
    tokens, lengths = padded([cands[i][k] for k in range(3) for i in range(images)])
    ours_cider, ours_bleu = scorer.score(tokens, lengths, torch.arange(images).repeat(3), bleu=True)
    np.testing.assert_allclose(ours_cider.numpy(), np.concatenate(cider), rtol=0, atol=1e-6)
    np.testing.assert_allclose(ours_bleu.numpy(), np.concatenate(bleu), rtol=0, atol=1e-6)
    assert np.concatenate(cider).std() > 0.3 and np.concatenate(bleu).max() > 0.5  # not all zeros


def test_document_frequency_cache(tmp_path):
    rs = np.random.RandomState(3)
    refs, _ = random_set(rs, 10, 9)
    flat = [(i, r) for i in range(10) for r in refs[i]]
    tokens, lengths = padded([r for _, r in flat])
    R = References(tokens, lengths, torch.tensor([i for i, _ in flat]), base=9)
    path = str(tmp_path / "df.npz")
    first = cached_document_frequency(path, R, salt="vocab A")
    stamp = os.stat(path).st_mtime_ns
    again = cached_document_frequency(path, R, salt="vocab A")
    assert os.stat(path).st_mtime_ns == stamp  # read back, not rewritten
    assert torch.equal(again.codes, first.codes) and torch.equal(again.counts, first.counts)
    assert again.documents == first.documents == 10
    cached_document_frequency(path, R, salt="vocab B")  # another vocabulary: rebuilt
    assert os.stat(path).st_mtime_ns != stamp
    (tmp_path / "df.npz").write_bytes(b"not a zip")  # damaged: rebuilt, not an error
    assert torch.equal(cached_document_frequency(path, R, salt="vocab B").counts, first.counts)
    assert os.listdir(tmp_path) == ["df.npz"]  # no temporary file left


def test_the_document_frequencies_follow_whether_end_counts(data_dir):
    """One cache file in the data directory: counted with `<end>` or without (--no-end-token), each is
    rebuilt when the other was cached, never read for it."""
    from captioner.data.dataset import CaptionData
    from captioner.objectives.scst import training_scorer

    data = CaptionData(str(data_dir))
    with_end, without = training_scorer(data, end_token=True).df, training_scorer(data, end_token=False).df
    assert with_end.counts.sum() > without.counts.sum()  # the n-grams with <end> are counted too
    again = training_scorer(data, end_token=True).df
    assert torch.equal(again.codes, with_end.codes) and torch.equal(again.counts, with_end.counts)


# the objective on a toy problem

V = 9


def toy():
    """Image 0, referenced as '4 5 6 7 <end>' (two more images only make the idf informative), and
    a tiny random decoder over 9 ids."""
    torch.manual_seed(0)
    dec = AttentionDecoder(vocab_size=V, encoder_dim=6, embed_dim=8, hidden_dim=10, attention_dim=5, dropout=0.0)
    tokens, lengths = padded([[4, 5, 6, 7, END_ID], [8, 4, END_ID], [6, 8, 5, END_ID]])
    refs = References(tokens, lengths, torch.tensor([0, 1, 2]), base=V)
    scorer = NgramScorer(refs, DocumentFrequency.from_references(refs))
    return dec, scorer, torch.randn(1, 5, 6)


def sample_logp(dec, feats, tokens, max_len=6):
    """log p of given captions under the sampler's distribution (banned words removed), teacher-forced;
    an <end> forced at max_len words was no choice and has no probability."""
    captions = torch.cat([torch.full((len(tokens), 1), START_ID), tokens], 1)  # (N, T+1)
    logits, _ = dec(feats.expand(len(tokens), -1, -1), captions, (captions != PAD_ID).sum(1))
    logits[..., [PAD_ID, START_ID, UNK_ID]] = float("-inf")
    logits[:, 0, END_ID] = float("-inf")  # no empty caption
    logp = logits.log_softmax(-1).gather(2, tokens.unsqueeze(2)).squeeze(2)  # (N, T)
    chosen = (tokens != PAD_ID) & (torch.arange(tokens.size(1)) < max_len)
    return torch.where(chosen, logp, 0.0).sum(1)


@pytest.mark.parametrize("baseline", ["mean", "greedy"])
def test_one_step_raises_samples_that_beat_the_baseline(baseline):
    dec, scorer, feats = toy()
    cfg = ScstConfig(samples=8, baseline=baseline)
    objective = Objective(dec, [SelfCritical(cfg, scorer, max_len=6)])
    gen = torch.Generator().manual_seed(1)
    s = sample_captions(dec, feats, 8, 6, generator=torch.Generator().manual_seed(1))  # the draws forward makes
    with torch.no_grad():
        assert torch.allclose(sample_logp(dec, feats, s.tokens), s.logp, atol=1e-5)  # the sampler's own log p
    reward = scorer.score(s.tokens, s.words + 1, torch.zeros(8, dtype=torch.long))[0]
    loss, terms = objective(_batch(feats), 1.0, generator=gen)
    assert terms["reward"] == pytest.approx(float(reward.mean()), rel=1e-6)
    if baseline == "mean":
        base = (reward.sum() - reward) / 7
        assert float(terms["baseline"]) == pytest.approx(float(base.mean()), rel=1e-6)
    else:  # the greedy caption's reward (checked in test_greedy_baseline_is_the_greedy_captions_reward)
        base = torch.full((8,), float(terms["baseline"]), dtype=torch.float64)
    advantage = reward - base
    assert advantage.max() > 0 > advantage.min(), advantage
    before = sample_logp(dec, feats, s.tokens).detach()
    loss.backward()
    with torch.no_grad():
        for p in dec.parameters():
            p -= 0.05 * p.grad
        after = sample_logp(dec, feats, s.tokens)
    change = after - before
    assert change[advantage.argmax()] > 0, (advantage, change)  # the best sample gained
    assert change[advantage.argmin()] < 0, (advantage, change)  # the worst lost
    assert float((advantage * change).sum()) > 0  # the expected advantage went up


def test_samples_are_never_empty_as_decoding_never_is():
    """SCST trains on captions the model can output: <end> is not allowed as the first word."""
    dec, _, feats = toy()
    with torch.no_grad():
        dec.L_o.bias[END_ID] = 50.0  # <end> is almost certain at every step
    s = sample_captions(dec, feats, 6, 5, generator=torch.Generator().manual_seed(0))
    assert (s.words >= 1).all() and (s.words == 1).all()  # one word, then <end>
    assert torch.isfinite(s.logp).all()


def _batch(feats):
    from captioner.data.batches import ImageBatch

    return ImageBatch(feats, torch.zeros(len(feats), dtype=torch.long))


def test_greedy_baseline_is_the_greedy_captions_reward():
    from captioner.decoding.decode import beam_search

    dec, scorer, feats = toy()
    objective = Objective(dec, [SelfCritical(ScstConfig(samples=4, baseline="greedy"), scorer, max_len=6)])
    _, terms = objective(_batch(feats), 1.0, generator=torch.Generator().manual_seed(0))
    dec.eval()
    words = beam_search(dec, feats, beam_size=1, max_len=6)[0][0].tokens
    tokens, lengths = padded([words + [END_ID]])
    assert float(terms["baseline"]) == pytest.approx(float(scorer.score(tokens, lengths, torch.tensor([0]))[0]))


def test_training_raises_the_reward_and_works_under_autocast():
    dec, scorer, feats = toy()
    objective = Objective(dec, [SelfCritical(ScstConfig(samples=8), scorer, max_len=6)])
    opt = torch.optim.Adam(dec.parameters(), lr=0.03)
    gen = torch.Generator().manual_seed(2)
    rewards = []
    for _ in range(40):
        loss, terms = objective(_batch(feats), 1.0, generator=gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rewards.append(float(terms["reward"]))
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 2.0, rewards
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, terms = objective(_batch(feats), 1.0, generator=gen)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in terms.values())


def test_hard_model_can_sample_locations_too():
    """With either context every parameter gets a finite, nonzero gradient, and it is the loss's own:
    a central difference of the loss along the gradient (the same draws: the same generator seed)
    gives its length, and so does one along its attention part, which with sampled locations reaches
    the loss only through their log-probabilities."""
    torch.manual_seed(0)
    dec = AttentionDecoder(
        vocab_size=V, encoder_dim=6, embed_dim=8, hidden_dim=10, attention_dim=5, dropout=0.0, attention="hard"
    )
    _, scorer, feats = toy()
    params = dict(dec.named_parameters())
    for context in ("expected", "sample"):
        objective = Objective(dec, [SelfCritical(ScstConfig(samples=8, context=context), scorer, max_len=6)])

        def loss_at(shift: dict[str, torch.Tensor] | None = None, eps: float = 0.0) -> torch.Tensor:
            with torch.no_grad():
                for name, d in (shift or {}).items():
                    params[name] += eps * d
            try:
                return objective(_batch(feats), 1.0, generator=torch.Generator().manual_seed(0))
            finally:
                with torch.no_grad():
                    for name, d in (shift or {}).items():
                        params[name] -= eps * d

        dec.zero_grad()
        loss, terms = loss_at()
        assert float(terms["advantage_abs"]) > 0  # the samples' rewards differ: there is a gradient
        loss.backward()
        grads = {name: p.grad.detach().clone() for name, p in params.items()}
        for name, g in grads.items():
            assert torch.isfinite(g).all() and g.abs().sum() > 0, (context, name)
        attention = {name: g for name, g in grads.items() if name.startswith("attention.")}
        for part in (grads, attention):
            norm = torch.sqrt(sum((g**2).sum() for g in part.values()))
            direction = {name: g / norm for name, g in part.items()}
            eps = 1e-3
            with torch.no_grad():
                slope = (loss_at(direction, eps)[0] - loss_at(direction, -eps)[0]) / (2 * eps)
            assert float(slope) == pytest.approx(float(norm), rel=2e-2), (context, sorted(part)[0])


# training runs


def test_training_images_are_each_seen_once_per_epoch(data_dir):
    data = CaptionData(str(data_dir))
    images = TrainingImages(data, 4)
    for world in (1, 2):
        seen = [
            r
            for rank in range(world)
            for b in images.batches(seed=0, epoch=1, rank=rank, world=world)
            for r in b.rows.tolist()
        ]
        assert sorted(seen) == sorted(np.unique(data.rows).tolist())
        assert images.num_batches(world) == len(list(images.batches(seed=0, epoch=1, world=world)))
    rows = lambda e: [b.rows.tolist() for b in images.batches(seed=0, epoch=e)]
    assert rows(1) == rows(1) != rows(2)


def scst_config(**kw) -> TrainConfig:
    return TrainConfig.of(
        objective="scst",
        epochs=2,
        batch_size=8,
        lr=1e-3,
        val_beam_size=1,
        checkpoint_every=1,
        checkpoint_minutes=0,
        log_every=1,
        scst=ScstConfig(samples=3),
        **kw,
    )


@pytest.mark.slow
def test_scst_resumed_equals_uninterrupted(data_dir, small_run, tmp_path, monkeypatch):
    init = small_run / "best.pt"

    def run(out: str, train: TrainConfig, **kw):
        return fit(FitJob(str(data_dir), str(tmp_path / out), train=train, device="cpu", progress_bar=False, **kw))

    whole = run("whole", scst_config(), init=str(init))
    from captioner.train import checkpoints

    real = checkpoints.save_checkpoint  # fit saves through train.checkpoints.Checkpoints

    def save_then_die(ck, path):
        real(ck, path)
        if ck["step"] == 3:
            raise KeyboardInterrupt  # as if killed right after the step-3 checkpoint

    monkeypatch.setattr(checkpoints, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run("run", scst_config(), init=str(init))
    monkeypatch.setattr(checkpoints, "save_checkpoint", real)
    resumed = run("run", TrainConfig.of(epochs=2), resume=True)
    assert resumed.step == whole.step > 3
    a, b = (load_checkpoint(str(tmp_path / r / "last.pt")) for r in ("whole", "run"))
    for name, value in a["model"].items():
        assert torch.equal(b["model"][name], value), name
    assert b["train"]["objective"] == "scst" and b["data"]["init"] == str(init)  # where the run began
    log = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in log if r["event"] == "train"]
    assert all({"reward", "baseline", "entropy"} <= set(r) for r in train)
    assert os.path.exists(data_dir / "cider_df.npz")  # df cached in the data directory


@pytest.mark.slow
def test_init_starts_from_the_checkpoint_weights(data_dir, small_run, tmp_path):
    cfg = TrainConfig.of(objective="scst", epochs=1, batch_size=8, lr=1e-12, val_beam_size=1)
    init = str(small_run / "best.pt")
    fit(FitJob(str(data_dir), str(tmp_path / "run"), train=cfg, init=init, device="cpu", progress_bar=False))
    start, end = (load_checkpoint(str(p)) for p in (small_run / "best.pt", tmp_path / "run" / "last.pt"))
    assert end["decoder"] == start["decoder"]  # sizes come from --init
    for name, value in start["model"].items():  # a vanishing lr: still the same weights
        assert torch.allclose(end["model"][name], value, atol=1e-6), name
    assert end["step"] == end["progress"]["step"] > 0 and end["train"]["optim"]["lr"] == 1e-12
    # How to decode is the command line's when it says (--decode-sharpness), the weights' otherwise.
    sharp = DecoderConfig(0, decode_sharpness=2.0)
    fit(FitJob(str(data_dir), str(tmp_path / "sharp"), sharp, cfg, init=init, device="cpu", progress_bar=False))
    assert load_checkpoint(str(tmp_path / "sharp" / "last.pt"))["decoder"]["decode_sharpness"] == 2.0
    again = str(tmp_path / "sharp" / "last.pt")
    fit(FitJob(str(data_dir), str(tmp_path / "again"), train=cfg, init=again, device="cpu", progress_bar=False))
    assert load_checkpoint(str(tmp_path / "again" / "last.pt"))["decoder"]["decode_sharpness"] == 2.0


def test_bad_flags(data_dir, small_run, tmp_path, capsys):
    fit_args = ["fit", "--data", str(data_dir), "--out", str(tmp_path / "run"), "--epochs", "1"]

    def error(*extra: str) -> str:
        assert train_main([*fit_args, *extra]) == 2
        return capsys.readouterr().err

    assert "--init" in error("--objective", "scst")
    assert "--init" in error("--objective", "scst", "--init", str(tmp_path / "missing.pt"))
    ck = torch.load(small_run / "best.pt", weights_only=True)
    torch.save({**ck, "vocab": ck["vocab"] + ["zebra"]}, tmp_path / "other_vocab.pt")
    assert "vocabulary" in error("--objective", "scst", "--init", str(tmp_path / "other_vocab.pt"))
    torch.save({**ck, "data": {**ck["data"], "fingerprint": "0123456789abcdef"}}, tmp_path / "other_encoder.pt")
    assert "encoder" in error("--objective", "scst", "--init", str(tmp_path / "other_encoder.pt"))
    assert "cross-entropy run" in error("--objective", "scst", "--resume", "--out", str(small_run))
    assert "--samples" in error("--objective", "scst", "--init", str(small_run / "best.pt"), "--samples", "1")


@pytest.mark.parametrize("baseline", ["greedy", "mean"])
def test_the_loss_and_its_gradient_are_the_self_critical_formula(baseline, monkeypatch):
    """Known rewards for a batch of 2 images × 3 samples: the loss is -(1/(B n)) Σ (r(wˢ) - b) log p(wˢ)
    and its gradient in log p(wˢ) is -(r(wˢ) - b)/(B n) (Rennie et al. 2017, eq. 9), with b the greedy
    caption's reward or the mean of the image's other samples' rewards (Luo 2020)."""
    from types import SimpleNamespace

    B, n = 2, 3
    sampled = torch.tensor([[1.0, 0.5, 0.0], [0.2, 0.2, 0.8]], dtype=torch.float64)  # r(wˢ), (B, n)
    greedy = torch.tensor([0.4, 0.3], dtype=torch.float64)  # r(ŵ), (B,)
    logp = torch.tensor([-1.0, -2.0, -3.0, -1.5, -0.5, -2.5], requires_grad=True)  # (B n,)
    tokens = torch.zeros(B * n, 2, dtype=torch.long)
    monkeypatch.setattr(
        scst, "sample_captions", lambda *a, **k: scst.Samples(tokens, torch.ones(B * n, dtype=torch.long), logp, logp)
    )
    monkeypatch.setattr(scst, "greedy_tokens", lambda *a: (tokens[:B], torch.ones(B, dtype=torch.long)))
    term = SelfCritical(ScstConfig(samples=n, baseline=baseline), scorer=None, max_len=5)
    monkeypatch.setattr(term, "reward", lambda t, w, rows: sampled.view(-1) if len(t) == B * n else greedy)
    decoder = SimpleNamespace(config=SimpleNamespace(attention="soft"))
    ctx = SimpleNamespace(decoder=decoder, features=None, batch=SimpleNamespace(rows=torch.arange(B)), generator=None)
    ctx.words = B

    loss = term(ctx)
    loss.backward()

    if baseline == "greedy":
        b = greedy.unsqueeze(1).expand(B, n)
    else:
        b = torch.tensor([[0.25, 0.5, 0.75], [0.5, 0.5, 0.2]], dtype=torch.float64)  # the other two samples' mean
    advantage = (sampled - b).view(-1).float()
    assert loss.item() == pytest.approx(-(advantage * logp.detach()).sum().item() / (B * n))
    torch.testing.assert_close(logp.grad, -advantage / (B * n))


def test_the_greedy_baseline_is_searched_outside_ddps_forward(tmp_path, monkeypatch):
    """Under torchrun the step's objective runs inside DistributedDataParallel's forward, where the compiler's
    DDPOptimizer cuts a compiled graph at the gradient buckets: the greedy baseline's search, which needs no
    gradient, runs before that forward, and the step's baseline is the same as without DDP."""
    searched_inside = []
    search = scst.greedy_tokens

    def recorded(*args):
        frames = inspect.stack()
        searched_inside.append(any(f.function == "forward" and "parallel/distributed" in f.filename for f in frames))
        return search(*args)

    monkeypatch.setattr(scst, "greedy_tokens", recorded)
    baselines = []
    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for wrap in (DistributedDataParallel, lambda objective: objective):
            dec, scorer, feats = toy()
            objective = Objective(dec, [SelfCritical(ScstConfig(samples=4, baseline="greedy"), scorer, max_len=6)])
            optimizer = make_optimizer([{"params": list(dec.parameters())}], 1e-3)
            live = Live(dec, None, None, optimizer, None, torch.Generator().manual_seed(1), None)
            step = TrainStep(wrap(objective), live, OptimConfig(), Process(Dist(), torch.device("cpu")))
            step(_batch(feats))
            baselines.append(step.read()[0]["baseline"])
    finally:
        torch_dist.destroy_process_group()
    assert searched_inside == [False, False]
    assert baselines[0] == pytest.approx(baselines[1])
