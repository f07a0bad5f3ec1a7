"""View consistency of attention: the views, the term, the views' features, and fit using them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import prepare_scenes

from captioner.data.batches import CaptionBatches
from captioner.data.dataset import CaptionData
from captioner.data.images import load_image
from captioner.models.checkpoint import migrate
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import EncoderSpec, build_encoder
from captioner.models.views import back_from_view, max_shift, random_shifts, shifts, view
from captioner.objectives.objective import teacher_forced
from captioner.objectives.terms import consistency, disagreement, real_steps
from captioner.train.config import TrainConfig
from captioner.train.trainer import FitJob, fit

S = 14


def cell(x: int, y: int) -> torch.Tensor:
    """A map (1, L) on one grid cell."""
    m = torch.full((1, S * S), 1e-9, dtype=torch.float64)
    m[0, y * S + x] = 1.0
    return m / m.sum()


def moved(x: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """(C, H, W) moved dy pixels down and dx right, the uncovered rows and columns repeating the
    edge: each output pixel is the input's nearest pixel to where it came from."""
    H, W = x.shape[-2:]
    rows = (torch.arange(H) - dy).clamp(0, H - 1)
    cols = (torch.arange(W) - dx).clamp(0, W - 1)
    return x[..., rows[:, None], cols[None, :]]


def test_a_view_is_the_image_turned_then_moved_by_whole_cells():
    x = torch.rand(3, 2, 56, 56)  # a 4 x 4 grid of 14-pixel cells
    moves = torch.tensor([[1, -2], [0, 1], [-1, -1]])
    got = view(x, moves, grid=4)
    for i, (dy, dx) in enumerate(moves.tolist()):
        assert torch.equal(got[i], moved(torch.rot90(x[i], 2, dims=(1, 2)), 14 * dy, 14 * dx))


def test_maps_come_back_from_the_view_onto_the_images_cells():
    """A map that follows the content: on the view it is the image's map turned and moved."""
    maps = torch.rand(3, S * S)
    moves = torch.tensor([[2, -1], [-2, 2], [1, 0]])
    in_view = torch.stack(
        [
            moved(torch.rot90(m.view(1, S, S), 2, dims=(1, 2)), dy, dx).flatten()
            for m, (dy, dx) in zip(maps, moves.tolist())
        ]
    )
    back = back_from_view(in_view, moves, S)
    inside = back_from_view(torch.ones_like(in_view), moves, S) > 0  # the cells both show
    assert torch.equal(back, maps * inside)
    assert inside.sum(1).tolist() == [(S - 2) * (S - 1), (S - 2) * (S - 2), (S - 1) * S]


def test_each_image_has_its_own_move_the_same_every_time():
    rows = np.arange(5000)
    got = shifts(rows, 2)
    assert np.array_equal(got, shifts(rows, 2))  # prepare and fit agree without storing it
    assert np.abs(got).max() == 2 and not (got == 0).all(1).any()
    assert len({tuple(m) for m in got}) == 24  # every move but none
    counts = np.unique(got, axis=0, return_counts=True)[1]
    assert counts.min() > 0.6 * counts.mean()
    assert (shifts(rows, 0) == 0).all()  # data prepared with the turn alone
    drawn = random_shifts(1000, 1, torch.Generator().manual_seed(0))
    assert drawn.abs().max() == 1 and not (drawn == 0).all(1).any()
    assert max_shift(14) == 2 and max_shift(7) == 1


def test_only_a_sharp_map_on_the_content_costs_nothing():
    """An object at column 4, row 9; the view is turned and moved one row down, two columns left.
    Each way a map can fail pays, among them one that a turn alone let through."""
    x, y = 4, 9

    def cost(on_image, on_view, dy=1, dx=-2):
        return float(disagreement(on_image, on_view, torch.tensor([[dy, dx]]), S))

    def seen(x, y, dy=1, dx=-2):  # where the image's cell (column x, row y) is in the view
        return S - 1 - x + dx, S - 1 - y + dy

    vx, vy = seen(x, y)
    even = torch.full((1, S * S), 1.0 / (S * S), dtype=torch.float64)
    assert cost(cell(x, y), cell(vx, vy)) < 1e-5  # on the object in both
    assert cost(cell(x, y - 1), cell(vx, vy - 1)) > 5  # one cell above the object, both times
    # Parked on one cell whatever the image, the grid's corners and edges among them: it pays for
    # every move, whether the move keeps that cell in view or takes it out.
    moves = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3) if (dy, dx) != (0, 0)]
    for x0, y0 in ((0, 0), (S - 1, 0), (6, 0), (5, 7)):
        assert min(cost(cell(x0, y0), cell(x0, y0), dy, dx) for dy, dx in moves) > 5
    # On the image's corner cell, and on the view's uncovered corner: neither agrees with anything.
    assert cost(cell(S - 1, S - 1), cell(S - 1, 0)) > 5
    assert cost(even, even) > math.log(S * S)  # log of the grid's cells, and more for those not shared
    # On the cell mirrored through the grid's centre from the object, both times: a turn alone
    # cannot tell it from the object; the move can.
    assert cost(cell(S - 1 - x, S - 1 - y), cell(S - 1 - vx, S - 1 - vy)) > 5
    tx, ty = seen(x, y, 0, 0)
    assert cost(cell(S - 1 - x, S - 1 - y), cell(S - 1 - tx, S - 1 - ty), 0, 0) < 1e-5


def test_the_term_is_finite_on_maps_with_zeros():
    a = torch.zeros(2, S * S, requires_grad=True)
    with torch.no_grad():
        a[:, 0] = 1.0  # float32 softmax can underflow to exact zeros
    loss = disagreement(a, a.detach().flip(-1), torch.tensor([[1, 1], [0, -2]]), S).sum()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(a.grad).all()


def test_it_is_estimated_on_real_steps_of_a_share_of_the_captions(data_dir):
    mask = torch.arange(6).unsqueeze(0) < torch.tensor([[2], [6], [1], [4]])
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([0, 2, 3])
    for _ in range(20):
        assert mask[rows, real_steps(mask, rows, g)].all()
    data = CaptionData(str(data_dir))
    for batch in CaptionBatches(data, 16, view_share=0.25).batches(seed=0, epoch=0):
        assert len(batch.views.rows) == len(batch.views.features) == 4 and len(set(batch.views.rows.tolist())) == 4
        assert batch.views.features.shape[1:] == batch.features.shape[1:]
        assert batch.views.moves.shape == (4, 2) and batch.views.moves.abs().max() <= data.view_shift


def test_the_term_uses_the_passs_own_states_and_no_second_pass():
    """α' is the map the same h_{t-1} gives on the view, compared with the step's own α; the term
    trains the attention, not the LSTM's state."""
    torch.manual_seed(0)
    dec = AttentionDecoder(vocab_size=9, encoder_dim=6, embed_dim=5, hidden_dim=7, attention_dim=4, dropout=0.0)
    dec = dec.double()
    feats, turned = torch.randn(2, 4, 9, 6, dtype=torch.float64)
    captions = torch.tensor([[1, 4, 5, 2], [1, 6, 2, 0], [1, 7, 8, 2], [1, 3, 2, 0]])
    lengths = torch.tensor([4, 3, 4, 3])
    p = teacher_forced(dec, feats, captions, lengths, shapes="packed")
    u, mask = p.unrolled, p.mask
    rows = torch.tensor([0, 1, 3])
    moves = torch.tensor([[1, 0], [-1, 1], [0, -1]])
    got = consistency(dec, feats, turned[rows], rows, moves, u, mask, mask.sum(), torch.Generator().manual_seed(3))
    steps = real_steps(mask, rows, torch.Generator().manual_seed(3))
    want = []
    for b, t, move in zip(rows.tolist(), steps.tolist(), moves):
        a = dec.normalize(feats[b : b + 1])
        h, c = dec.init_state(a)
        proj = dec.attention.project(a)
        for s in range(t):  # the plain step, to the picked step
            emb = dec.embedding(captions[b : b + 1, s])
            h, c, _ = dec.advance(a, dec.attend(proj, h, emb), emb, h, c)
        emb = dec.embedding(captions[b : b + 1, t])  # the word the picked step's map follows
        on_image = dec.attend(proj, h, emb)
        on_view = dec.attend(dec.attention.project(dec.normalize(turned[b : b + 1])), h, emb)
        want.append(disagreement(on_image, on_view, move.view(1, 2), 3))
    assert float(got.detach()) == pytest.approx(float(torch.cat(want).mean().detach()), rel=1e-6)
    got.backward()
    assert all(p.grad is not None for p in dec.attention.parameters())
    for name, p in dec.named_parameters():
        if not name.startswith("attention."):
            assert p.grad is None or not p.grad.any(), name


def test_prepare_stores_the_features_of_the_views(data_dir, scenes):
    """features_views row r is the encoder's output on image r's file turned 180° by Pillow, then
    moved by row r's move in whole cells of 16 pixels."""
    data = CaptionData(str(data_dir))
    assert data.meta["views"] is True and data.views is not None and data.view_shift == 2
    encoder, spec = build_encoder(EncoderSpec(weights="none"))
    rows = [0, 5]
    images = []
    for r, (dy, dx) in zip(rows, shifts(np.array(rows), data.view_shift).tolist()):
        images.append(moved(spec.preprocess(load_image(data.path_of(r)).rotate(180)), 16 * dy, 16 * dx))
    with torch.inference_mode():
        want = encoder(torch.stack(images)).numpy()  # (2, L, D)
    got = data.views[rows].astype(np.float32)
    plain = data.cache[rows].astype(np.float32)
    scale = np.abs(want).max()
    # fp16 storage and Pillow's resampling of a turned file against turning the resampled tensor
    assert np.abs(got - want).max() < 0.05 * scale
    assert np.abs(plain - want).max() > 0.2 * scale  # the views' features are not the plain ones


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_fit_adds_the_term_when_the_data_has_views(data_dir, tmp_path, attention):
    small = DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.0, attention=attention)
    for name, weight in (("on", 1.0), ("off", 0.0)):
        cfg = TrainConfig.of(epochs=1, batch_size=8, val_images=4, log_every=1, consistency=weight)
        fit(FitJob(str(data_dir), str(tmp_path / name), small, cfg, device="cpu", progress_bar=False))
    rows = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("on", "off")
    }
    on = [r for r in rows["on"] if r["event"] == "train"]
    assert on and all(r["consistency"] > 0 for r in on)
    if attention == "soft":  # hard: the REINFORCE surrogate is no NLL
        assert all(r["loss"] > r["nll"] for r in on)
    assert all("consistency" not in r for r in rows["off"] if r["event"] == "train")


@pytest.mark.slow
def test_fit_says_when_the_data_has_no_views(scenes, tmp_path, caplog):
    out = tmp_path / "plain"
    prepare_scenes(scenes, out, min_count=1, views=False)
    assert CaptionData(str(out)).views is None
    fit(
        FitJob(
            str(out),
            str(tmp_path / "run"),
            DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12),
            TrainConfig.of(epochs=1, batch_size=16, val_images=2),
            device="cpu",
            progress_bar=False,
        )
    )
    assert "no features of the images' views" in caplog.text and "prepare again" in caplog.text
    saved = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert saved["train"]["terms"]["consistency"] == 0.0  # what it trained with, not the default
    start = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and (start["train"], start["decoder"]) == (saved["train"], saved["decoder"])


@pytest.mark.parametrize("saved", [{}, {"equivariance": 0.5}])
def test_an_older_run_resumes_without_a_term_it_was_not_trained_with(saved):
    """Checkpoints before version 3 knew no consistency term (and the equivariance term is gone)."""
    old = {
        "format": "captioner-checkpoint/2",
        "model": {},
        "decoder": {},
        "vocab": [],
        "encoder": {},
        "step": 1,
        "train": dict(saved),
    }
    cfg = TrainConfig.from_dict(migrate(old, "old.pt")["train"])
    assert cfg.terms.consistency == 0.0 and "equivariance" not in str(cfg)
