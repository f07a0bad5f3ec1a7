"""Fixed shapes give what packed shapes give: the training step's loss and gradients, and decoding.

Fixed-shape batches (`data.batches.FixedShapes`) pad every batch to `size` captions and to its
length bucket, and the objective then takes the plain pass with logits everywhere and masks;
packed batches hold only real captions, as long as the longest, and take the fused pass. Beam
search with fixed shapes steps every beam every time. On CUDA the fixed step and the search's
block of steps are compiled and replayed as CUDA graphs: those tests run where a GPU is.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from captioner.compiled import GRAPHS
from captioner.data.batches import CaptionBatches, FixedShapes
from captioner.data.boxes import BoxTargets, GroundingBoxes
from captioner.data.dataset import CaptionData
from captioner.decoding.decode import beam_search
from captioner.models import decoder
from captioner.models import decoder as f_att
from captioner.models.decoder import AttentionDecoder
from captioner.objectives import terms as term_module
from captioner.objectives.objective import HardAttentionConfig, Objective, objective_terms
from captioner.objectives.terms import TermsConfig, TermState

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA graphs)")


def last_real_step(mask, rows, generator=None):
    """The consistency's step, without its random draw (whose shape differs between the two)."""
    return (mask[rows].cumsum(1) == mask[rows].sum(1, keepdim=True)).int().argmax(1)


def likeliest(p, generator=None):
    """Hard attention's location, without its random draw (a step's draws depend on the batch's size)."""
    return p.argmax(dim=1)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_the_fixed_step_equals_the_packed_one(data_dir, scenes, attention, monkeypatch):
    """float64, a padded batch in length order that is not the packed pass's order, the default
    objective's terms with the consistency and --boxes: the same loss, terms and gradients."""
    monkeypatch.setattr(term_module, "real_steps", last_real_step)
    monkeypatch.setattr(decoder, "sample_from", likeliest)
    monkeypatch.setattr(f_att, "sample_from", likeliest)
    data = CaptionData(str(data_dir))
    targets = BoxTargets(data, GroundingBoxes(str(scenes / "boxes.json")), data.encoder.preprocess, 14)
    idx = np.array([5, 40, 2, 77, 13, 61])  # captions of different lengths, unsorted
    fixed = CaptionBatches(data, 6, view_share=0.5, targets=targets, fixed=FixedShapes(8, (8, 12, 16, 24)))
    packed = CaptionBatches(data, 6, view_share=0.5, targets=targets)
    results = []
    for source in (packed, fixed):
        batch = source._batch(idx, np.random.RandomState(0))
        batch.features, batch.views = (
            batch.features.double(),
            batch.views._replace(features=batch.views.features.double()),
        )
        torch.manual_seed(0)
        dec = AttentionDecoder(
            vocab_size=len(data.vocab),
            embed_dim=16,
            hidden_dim=24,
            attention_dim=12,
            dropout=0.0,
            attention=attention,
            word_query=True,
        ).double()
        dec.set_feature_stats(*data.feature_stats())
        terms = objective_terms(
            TermsConfig(alpha_c=0.3, consistency=1.0),
            attention=attention,
            hard=HardAttentionConfig(),
            views=True,
            targets=targets,
            state=TermState("cpu", {"reinforce": {"baseline": torch.tensor(-3.0, dtype=torch.float64)}}),
        )
        objective = Objective(
            dec,
            terms,
            shapes="packed" if source is packed else "fixed",
            semi_sampling=0.5 if attention == "hard" else None,
        )
        loss, values = objective(batch, batch.count, torch.Generator().manual_seed(1))
        loss.backward()
        results.append((loss, values, {n: p.grad for n, p in dec.named_parameters()}))
    (loss_p, values_p, grads_p), (loss_f, values_f, grads_f) = results
    B, T = fixed._batch(idx, np.random.RandomState(0)).captions.shape  # padded: 2 rows, and to a bucket
    assert B == 8 and T in (8, 12, 16, 24) and packed._batch(idx, np.random.RandomState(0)).captions.size(1) < T
    assert set(values_p) == set(values_f) >= {"nll", "penalty", "consistency", "boxes"}
    torch.testing.assert_close(loss_f, loss_p)
    for name in values_p:
        torch.testing.assert_close(values_f[name], values_p[name], msg=name)
    for name, g in grads_p.items():
        assert (g is None) == (grads_f[name] is None), name
        if g is not None:
            torch.testing.assert_close(grads_f[name], g, msg=name)


@pytest.fixture(scope="module")
def bundled():
    """The bundled model and its examples' features."""
    from captioner import Captioner
    from captioner.serve.sources import demo_model, example_images

    cap = Captioner.load(demo_model())
    return cap, cap.encode(example_images())[0]


@pytest.mark.parametrize("beam_size, max_len", [(1, None), (3, None), (5, None), (3, 3), (2, 4), (3, 6)])
def test_decoding_with_fixed_shapes_gives_todays_captions_and_maps(bundled, beam_size, max_len):
    """The bundled model on its own examples: the same captions, scores and maps either way, captions cut
    at max_len too (the fixed shapes step in blocks, some steps past max_len)."""
    cap, feats = bundled
    max_len = max_len or cap.max_len
    packed = beam_search(cap.decoder, feats, beam_size=beam_size, max_len=max_len, shapes="packed")
    fixed = beam_search(cap.decoder, feats, beam_size=beam_size, max_len=max_len, shapes="fixed")
    if max_len < 5:
        assert any(not h.ended for hyps in packed for h in hyps)  # some were cut
    for a, b in zip(packed, fixed):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        for x, y in zip(a, b):
            assert x.score == pytest.approx(y.score, abs=1e-4) and x.ended == y.ended
            np.testing.assert_allclose(x.attention, y.attention, atol=1e-5)


@cuda
def test_compiled_decoding_equals_the_packed_search_on_the_cpu():
    """On the same features: the compiled search (CUDA graphs) equals the same fixed-shape search eager, and
    the CPU's packed search, at one length and then another. (The features themselves differ between
    devices by up to about 1%, since cuDNN's convolutions use TF32 by default, and that can flip a weak
    model's word at a near tie.)"""
    from captioner import Captioner
    from captioner.serve.sources import demo_model, example_images

    on_cpu = Captioner.load(demo_model())
    feats = on_cpu.encode(example_images())[0]  # (B, L, D)
    gpu = copy.deepcopy(on_cpu.decoder).cuda()
    with torch.inference_mode():
        want = beam_search(on_cpu.decoder, feats, beam_size=3, max_len=20, shapes="packed")
        eager = beam_search(gpu, feats.cuda(), beam_size=3, max_len=20, compiled=False)
        for _ in range(2):  # the second search replays the recorded graphs
            graphed = beam_search(gpu, feats.cuda(), beam_size=3, max_len=20, compiled=True)
            for a, b, c in zip(want, eager, graphed):
                assert [h.tokens for h in b] == [h.tokens for h in c]
                assert a[0].tokens == c[0].tokens
                np.testing.assert_allclose(a[0].attention, c[0].attention, atol=1e-3)
        cut = beam_search(on_cpu.decoder, feats, beam_size=3, max_len=3, shapes="packed")
        graphed = beam_search(gpu, feats.cuda()[:5], beam_size=3, max_len=3, compiled=True)  # 5 images, 4 steps
        assert [h.tokens for h in graphed[0]] == [h.tokens for h in cut[0]] and not graphed[0][0].ended


@cuda
def test_each_replay_of_the_compiled_step_draws_anew(data_dir):
    """Dropout and hard attention's locations inside the compiled step's CUDA graphs: with the learning
    rate at 0 the weights stay put, so the same batch gives another loss only if the draws are new."""
    from conftest import train_step

    from captioner.train.config import TrainConfig

    data = CaptionData(str(data_dir))
    torch.manual_seed(0)
    dec = AttentionDecoder(
        vocab_size=len(data.vocab), embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.5, attention="hard"
    ).cuda()
    dec.set_feature_stats(*data.feature_stats())
    cfg = TrainConfig.of(lr=1e-12, shapes="fixed", batch_size=8)
    step = train_step(dec, cfg, device="cuda", compiled=GRAPHS)
    fixed = FixedShapes.for_data(8, int(data.lengths.max()))
    batch = next(CaptionBatches(data, 8, view_share=0.25, fixed=fixed).batches(seed=0, epoch=0)).to("cuda")
    losses = []
    for _ in range(8):
        step(batch)
        losses.append(step.read()[0]["loss"])
    assert step.passes is not None and step.passes.failed is None and not step.passes.graphless
    assert len(set(losses[-4:])) == 4, losses
