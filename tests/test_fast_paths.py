"""The fast paths compute what the plain ones do: the optimised encoder, the fused decoding step,
and a beam search that steps only the beams still writing."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision

from captioner.decoding.decode import beam_search
from captioner.models.decoder import AttentionDecoder
from captioner.models.encoder import EncoderSpec, build_encoder
from captioner.models.fast_encoder import FusedVGG, _WinogradConv, native_bf16, onednn_available, optimize_encoder
from captioner.models.vocab import END_ID, PAD_ID, START_ID


@pytest.fixture(scope="module")
def vgg16():
    return build_encoder(EncoderSpec(weights="none", seed=0))[0]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("size", [224, 96])
def test_optimized_encoder_gives_the_plain_features(vgg16, size):
    fast = optimize_encoder(vgg16, "cpu", image_size=224)
    if onednn_available():
        assert isinstance(fast, FusedVGG)  # the optimisation is really applied here
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain, quick = vgg16(x), fast(x)
    assert quick.shape == plain.shape == (2, (size // 16) ** 2, 512) and quick.dtype == torch.float32
    assert relative_error(quick, plain) < 1e-4  # fp32 with another summation order: rounding level
    assert (quick >= 0).all()  # conv5_3's ReLU is fused in


@pytest.mark.skipif(not native_bf16(), reason="bf16 is asked for only on CPUs with native bf16")
def test_the_bf16_encoder_is_asked_for_and_a_few_percent_off(vgg16):
    """The default is fp32 on every CPU; bf16, where asked, keeps 8 bits of mantissa."""
    assert optimize_encoder(vgg16, "cpu").dtype == torch.float32
    fast = optimize_encoder(vgg16, "cpu", bf16=True)
    assert fast.dtype == torch.bfloat16
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert 1e-3 < relative_error(fast(x), vgg16(x)) < 5e-2


@pytest.fixture(scope="module")
def biased_vgg16(vgg16):
    """vgg16 with nonzero biases (the seeded random encoder's are all 0, ImageNet's are not)."""
    enc = copy.deepcopy(vgg16)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for conv in (m for m in enc.features if isinstance(m, torch.nn.Conv2d)):
            conv.bias.copy_(0.5 * torch.randn(conv.bias.shape, generator=g))
    return enc


@pytest.fixture(scope="module")
def torchvision_features(biased_vgg16):
    """An image (1, 3, 112, 112) and torchvision's own VGG16 trunk's features of it, with those weights."""
    trunk = torchvision.models.vgg.make_layers(torchvision.models.vgg.cfgs["D"])[:30].eval()  # to conv5_3's ReLU
    trunk.load_state_dict(biased_vgg16.features.state_dict())
    x = torch.randn(1, 3, 112, 112, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return x, trunk(x).flatten(2).transpose(1, 2)  # (1, 49, 512)


@pytest.mark.skipif(not onednn_available(), reason="the fused encoder needs oneDNN")
@pytest.mark.parametrize("winograd", [True, False])
def test_the_fp32_encoder_gives_torchvisions_vgg_features(biased_vgg16, torchvision_features, winograd):
    """The encoder of CPUs without native bf16 (bf16=False here): fp32 oneDNN convolutions, the wide
    ones by Winograd unless turned off, against torchvision's VGG16 trunk; at 112 conv5's map is 7×7,
    which Winograd's 4×4 tiles do not divide."""
    fast = optimize_encoder(biased_vgg16, "cpu", image_size=224, bf16=False, winograd=winograd)
    assert isinstance(fast, FusedVGG) and fast.dtype == torch.float32
    assert any(isinstance(layer, _WinogradConv) for layer in fast.layers) == winograd
    x, want = torchvision_features
    with torch.inference_mode():
        got = fast(x)
    assert got.shape == want.shape == (1, 49, 512) and got.dtype == torch.float32
    assert relative_error(got, want) < 1e-4  # fp32 with another summation order: rounding only


def test_optimized_encoder_is_a_snapshot_and_leaves_the_original_alone(vgg16):
    before = {k: v.clone() for k, v in vgg16.state_dict().items()}
    fast = optimize_encoder(vgg16, "cpu")
    assert all(torch.equal(v, before[k]) for k, v in vgg16.state_dict().items())
    assert not list(fast.parameters()) or not any(p.requires_grad for p in fast.parameters())


def tiny(**kw) -> AttentionDecoder:
    torch.manual_seed(0)
    return AttentionDecoder(
        vocab_size=30, encoder_dim=64, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.0, **kw
    ).eval()


def test_decoding_step_computes_the_training_math():
    """Teacher-forced through `step` (fused weights) = the training forward (separate weights)."""
    dec = tiny()
    with torch.no_grad():  # give the buffers some effect
        dec.feature_mean.uniform_(0, 0.5)
        dec.feature_std.uniform_(0.5, 2)
    g = torch.Generator().manual_seed(1)
    feats = torch.rand(2, 196, 64, generator=g)
    caps = torch.tensor([[START_ID, 5, 6, 7, END_ID], [START_ID, 8, 9, END_ID, PAD_ID]])
    lengths = torch.tensor([5, 4])
    with torch.no_grad():
        logits, alphas = dec(feats, caps, lengths)  # (B, T-1, V), (B, T-1, L)
        f = dec.normalize(feats)
        proj = dec.attention.project(f)
        h, c = dec.init_state(f)
        for t in range(3):  # both captions are real up to here
            step_logits, h, c, alpha, _ = dec.step(f, proj, caps[:, t], h, c)
            torch.testing.assert_close(step_logits, logits[:, t], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(alpha, alphas[:, t], rtol=1e-4, atol=1e-6)


def test_fused_weights_follow_weight_changes():
    dec = tiny()
    feats = torch.rand(1, 196, 64, generator=torch.Generator().manual_seed(2))
    before = beam_search(dec, feats, beam_size=2, max_len=6)[0][0].score
    opt = torch.optim.SGD(dec.parameters(), lr=1.0)
    for p in dec.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # in place: the cache must notice
    after = beam_search(dec, feats, beam_size=2, max_len=6)[0][0].score
    fresh = tiny()
    fresh.load_state_dict(dec.state_dict())
    assert after == pytest.approx(beam_search(fresh, feats, beam_size=2, max_len=6)[0][0].score, abs=1e-5)
    assert after != pytest.approx(before, abs=1e-3)


def test_only_beams_still_writing_are_stepped(monkeypatch):
    """Finished beams (and the empty beams of the first step) cost no decoder work."""
    dec = tiny()  # untrained, V = 30: some beams say <end> early, others run on
    feats = torch.rand(3, 196, 64, generator=torch.Generator().manual_seed(3))
    rows, step = [], dec.step

    def counting_step(features, projected, words, h, c, *a):
        rows.append(len(words))
        assert len(features) == len(projected) == len(h) == len(c) == len(words)
        return step(features, projected, words, h, c, *a)

    monkeypatch.setattr(dec, "step", counting_step)
    K, B = 3, 3
    beams = beam_search(dec, feats, beam_size=K, max_len=10)
    assert rows[0] == B  # step 0: one live beam per image
    assert len(rows) == 11 and min(rows[1:]) < B * K  # beams that ended were dropped
    monkeypatch.undo()
    assert [[h.tokens for h in b] for b in beam_search(dec, feats, beam_size=K, max_len=10)] == [
        [h.tokens for h in b] for b in beams
    ]
    # The same captions as one image at a time.
    for b in range(B):
        alone = beam_search(dec, feats[b : b + 1], beam_size=K, max_len=10)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in beams[b]]
        for x, y in zip(alone, beams[b]):
            torch.testing.assert_close(torch.as_tensor(x.attention), torch.as_tensor(y.attention))


def test_captioner_fast_and_plain_agree(small_run, scenes):
    from captioner import Captioner

    paths = [str(p) for p in sorted((scenes / "images").iterdir())[:2]]
    fast = Captioner.load(str(small_run / "best.pt"))
    plain = Captioner.load(str(small_run / "best.pt"), fast=False)
    fast_out, plain_out = fast.caption_batch(paths, beam_size=3), plain.caption_batch(paths, beam_size=3)
    for a, b in zip(fast_out, plain_out):
        assert a.words == b.words and a.score == pytest.approx(b.score, rel=1e-3)


def test_the_benchmark_times_fits_own_step():
    """benchmarks/benchmark.py builds its decoder step from `fit`'s code: one step runs and learns."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    import benchmark as bm

    for objective in ("paper", "default"):
        step, decoder, train_step = bm.fit_step(torch.device("cpu"), 8, objective=objective)
        before = decoder.L_o.weight.detach().clone()
        step()
        terms, skipped = train_step.read()
        assert not torch.equal(before, decoder.L_o.weight) and not skipped
        assert ("consistency" in terms) == (objective == "default")


def test_the_benchmarks_default_variant_is_the_step_fit_takes_on_the_cpu(monkeypatch):
    """`benchmark.py --only decoder`'s fp32 row on a CPU times fit's packed shapes, not the GPU's fixed ones."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    import benchmark as bm

    made = []
    fit_step = bm.fit_step
    monkeypatch.setattr(bm, "fit_step", lambda *a, **k: made.append(fit_step(*a, **k)) or made[-1])
    bm.variant_step(torch.device("cpu"), 8, "fp32")
    assert made[-1][2].module.shapes == "packed" and made[-1][2].passes is None
