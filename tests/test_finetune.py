"""`fit --fine-tune-encoder`: the trained layers reach the checkpoint, and everything that loads it uses them."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
import torchvision
from conftest import prepare_scenes, run_cli, train_step

from captioner import Captioner
from captioner.data.batches import CaptionBatches
from captioner.data.dataset import CaptionData, FeatureCache
from captioner.data.encoder_inputs import encoded_features
from captioner.data.images import load_image
from captioner.demo.card import model_card
from captioner.evaluation.familiarity import FamiliarityStats, calibration_photos, pool
from captioner.evaluation.metrics import checkpoint_features
from captioner.models.checkpoint import current_train, load_checkpoint
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import EncoderSpec, build_encoder
from captioner.models.tuned import TunedEncoder, start_index
from captioner.train import distributed
from captioner.train.config import TrainConfig
from captioner.train.finetune import DECODER_FIRST, FineTuneConfig, FineTuning, image_batches
from captioner.train.resume import Start, settle
from captioner.train.trainer import FitJob, fit

cpu_process = distributed.Process(distributed.Dist(), torch.device("cpu"))

TINY = DecoderConfig(0, embed_dim=32, hidden_dim=48, attention_dim=24, dropout=0.0)
TUNED = {f"{i}.{p}" for i in (24, 26, 28) for p in ("weight", "bias")}  # conv5_1..conv5_3 of VGG16


def tune_cfg(epochs: int, start: str = "conv5_1", after: int = 0) -> TrainConfig:
    return TrainConfig.of(
        epochs=epochs,
        batch_size=8,
        lr=3e-3,
        val_beam_size=1,
        checkpoint_minutes=0,
        workers=0,
        fine_tune=FineTuneConfig(start, lr=1e-3, after=after),
    )


@pytest.fixture(scope="module")
def tuned_data(data_dir, tmp_path_factory):
    """A copy of the prepared scenes (fine-tuning adds its pool4 cache to the data directory)."""
    out = tmp_path_factory.mktemp("tuned") / "data"
    shutil.copytree(data_dir, out)
    return out


@pytest.fixture(scope="module")
def tuned_run(tuned_data, tmp_path_factory):
    """One epoch of conv5_1 fine-tuning on the pool4 cache."""
    out = tmp_path_factory.mktemp("tuned_run")
    fit(FitJob(str(tuned_data), str(out), TINY, tune_cfg(1), device="cpu", progress_bar=False))
    return out


def test_conv_names_of_both_vggs():
    with torch.device("meta"):
        vgg16, vgg19 = torchvision.models.vgg16().features[:30], torchvision.models.vgg19().features[:36]
    assert (start_index(vgg16, "conv5_1", "vgg16"), start_index(vgg16, "conv4_1", "vgg16")) == (24, 17)
    assert (start_index(vgg19, "conv5_1", "vgg19"), start_index(vgg19, "conv4_1", "vgg19")) == (28, 19)


def test_image_batches_hold_whole_images_once():
    rows = np.repeat(np.random.RandomState(0).permutation(40), 5)  # 40 images × 5 captions
    batches = image_batches(rows, 12, seed=3, epoch=1)
    assert sorted(np.concatenate(batches).tolist()) == list(range(200))
    assert all(len(b) == 10 for b in batches)  # round(12 / 5) = 2 images each
    assert all(np.bincount(rows[b]).max() == 5 for b in batches)  # every caption of its images
    ranks = [image_batches(rows, 12, seed=3, epoch=1, rank=r, world=2) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 10
    assert not set(rows[np.concatenate(ranks[0])]) & set(rows[np.concatenate(ranks[1])])
    assert all((a == b).all() for a, b in zip(batches, image_batches(rows, 12, seed=3, epoch=1)))


@pytest.mark.slow
def test_checkpoint_holds_the_trained_layers(tuned_run, tuned_data):
    ck = torch.load(tuned_run / "best.pt", weights_only=True)
    assert set(ck["encoder_state"]) == TUNED
    assert all(type(v) is torch.Tensor for v in ck["encoder_state"].values())
    assert ck["train"]["fine_tune"] == {"start": "conv5_1", "lr": 1e-3, "after": 0}
    assert ck["train"]["process"]["workers"] == 0
    assert "conv5_1 onward trained on the captions" in model_card(Captioner.load(str(tuned_run / "best.pt")))
    # The decoder's standardisation stays the frozen features' statistics, the same everywhere.
    mean, std = CaptionData(str(tuned_data)).feature_stats()
    assert torch.equal(ck["model"]["feature_mean"], mean)
    assert torch.equal(ck["model"]["feature_std"], std.clamp_min(1e-3))


@pytest.mark.slow
def test_round_trip_gives_the_features_training_saw(tuned_run, tuned_data, scenes):
    data = CaptionData(str(tuned_data))
    ids, rows = data.split_images("train")
    image = data.path_of(int(rows[0]))
    cap = Captioner.load(str(tuned_run / "last.pt"))
    ours, _ = cap.encode([image])  # (1, L, D), from the image
    seeded, _ = build_encoder(data.encoder)
    with torch.inference_mode():
        before = seeded(cap.encoder_spec.preprocess(load_image(image))[None])  # (1, L, D)
    # What training computed: the trained layers on the cached pool4 row.
    ck = load_checkpoint(str(tuned_run / "last.pt"))
    trunk, _ = build_encoder(data.encoder)
    tuned = TunedEncoder(trunk.features, 24, from_cache=True, arch="vgg16")
    tuned.load_encoder_state(ck["encoder_state"], "test")
    pool4 = FeatureCache(
        str(tuned_data), len(data.meta["image_ids"]), data.meta["locations"], data.meta["feature_dim"], name="pool4"
    )[[int(rows[0])]]
    with torch.inference_mode():
        seen = tuned(torch.from_numpy(pool4.astype(np.float32)))
    rel = lambda a, b: float((a - b).norm() / b.norm())
    assert rel(ours, seen) < 2e-3  # the same up to the fp16 rounding of the cached pool4 maps
    assert rel(before, seen) > 20 * rel(ours, seen)  # and not the seeded encoder's features any more
    # evaluate's features: the trained layers on the pool4 cache, exactly what training saw.
    read = checkpoint_features(build_encoder(data.encoder)[0], ck["encoder_state"], data, "cpu", "test", workers=0)
    assert torch.equal(read(rows[:1]), seen)
    assert rel(data.features(rows[:1]), seen) > 20 * rel(ours, seen)


@pytest.mark.slow
def test_evaluate_re_encodes_and_falls_back_to_images(tuned_run, tuned_data, tmp_path):
    out = tmp_path / "m.json"
    p = run_cli(
        "train.py",
        "evaluate",
        "--checkpoint",
        str(tuned_run / "best.pt"),
        "--data",
        str(tuned_data),
        "--split",
        "test",
        "--out",
        str(out),
        "--beam-size",
        "2",
    )
    assert p.returncode == 0, p.stderr[-2000:]
    # Without the pool4 cache, the images themselves are encoded: the same features up to fp16 rounding.
    bare = tmp_path / "bare"
    shutil.copytree(tuned_data, bare, ignore=shutil.ignore_patterns("pool4.*"))
    state = load_checkpoint(str(tuned_run / "best.pt"))["encoder_state"]
    data, bare_data = CaptionData(str(tuned_data)), CaptionData(str(bare))
    _, rows = data.split_images("test")
    a = checkpoint_features(build_encoder(data.encoder)[0], state, data, "cpu", "t", workers=0)(rows)
    b = checkpoint_features(build_encoder(data.encoder)[0], state, bare_data, "cpu", "t", workers=1)(rows)
    assert float((a - b).norm() / a.norm()) < 2e-3


@pytest.mark.slow
def test_familiarity_describes_the_tuned_encoder(tuned_run, tuned_data):
    """Each fine-tuned checkpoint's "unlike the training images" statistics are of its own features."""
    data = CaptionData(str(tuned_data))
    _, rows = data.split_images("train")
    events = [json.loads(line)["event"] for line in open(tuned_run / "metrics.jsonl", encoding="utf-8")]
    assert "familiarity" in events
    for name in ("best.pt", "last.pt"):
        ck = load_checkpoint(str(tuned_run / name))
        stats = FamiliarityStats.from_dict(ck["familiarity"])
        read = checkpoint_features(build_encoder(data.encoder)[0], ck["encoder_state"], data, "cpu", "t", workers=0)
        tuned = pool(read(rows), stats.feature_mean, stats.feature_std).mean(0)  # (D,)
        frozen = pool(data.features(rows), stats.feature_mean, stats.feature_std).mean(0)
        assert torch.allclose(stats.pooled_mean, tuned, atol=1e-4)
        assert (stats.pooled_mean - frozen).abs().max() > 100 * (stats.pooled_mean - tuned).abs().max()
        # The captioner scores a calibration photograph as the calibration did: same encoder, same statistics.
        photo = calibration_photos()[0]
        score = Captioner.load(str(tuned_run / name)).caption(photo, beam_size=1, max_len=3).familiarity["score"]
        assert score == pytest.approx(stats.photo_scores[f"{os.path.basename(photo)}:whole"], rel=2e-3)


@pytest.mark.slow
def test_resumed_fine_tuning_equals_uninterrupted(tuned_run, tuned_data, tmp_path):
    whole = tmp_path / "whole"
    fit(FitJob(str(tuned_data), str(whole), TINY, tune_cfg(2), device="cpu", progress_bar=False))
    resumed = tmp_path / "resumed"
    shutil.copytree(tuned_run, resumed)  # stopped after epoch 1
    fit(FitJob(str(tuned_data), str(resumed), TINY, tune_cfg(2), resume=True, device="cpu", progress_bar=False))
    a, b = (load_checkpoint(str(r / "last.pt")) for r in (whole, resumed))
    assert a["step"] == b["step"] > 0
    for k in TUNED:
        assert torch.equal(a["encoder_state"][k], b["encoder_state"][k]), k
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    with pytest.raises(Exception, match="with other --fine-tune-encoder settings"):
        fit(
            FitJob(
                str(tuned_data),
                str(resumed),
                TINY,
                tune_cfg(3, start="conv4_1"),
                resume=True,
                device="cpu",
                progress_bar=False,
            )
        )


@pytest.mark.slow
def test_decoder_trains_alone_first_then_with_the_encoder(tuned_data, tmp_path, caplog):
    cpu = torch.device("cpu")
    fresh = settle(None, TrainConfig.of(fine_tune=FineTuneConfig()), Start(9), cpu)[1]
    assert fresh.fine_tune.after == DECODER_FIRST
    older = {"fine_tune": {"start": "conv5_1", "lr": 1e-4, "workers": 2}}  # saved before --tune-after
    assert TrainConfig.from_dict(current_train(older)).fine_tune.after == 0
    run = tmp_path / "run"
    fit(FitJob(str(tuned_data), str(run), TINY, tune_cfg(1, after=1), device="cpu", progress_bar=False))
    assert "the encoder did not train" in caplog.text
    first = load_checkpoint(str(run / "last.pt"))
    seeded = build_encoder(CaptionData(str(tuned_data)).encoder)[0].features.state_dict()
    assert all(torch.equal(first["encoder_state"][k], seeded[k]) for k in TUNED)
    # The first epoch drew batches of captions from the cached features, not batches of whole images.
    assert first["step"] == CaptionBatches(CaptionData(str(tuned_data)), 8).num_batches()
    fit(FitJob(str(tuned_data), str(run), TINY, tune_cfg(2, after=1), resume=True, device="cpu", progress_bar=False))
    second = load_checkpoint(str(run / "last.pt"))
    assert all(not torch.equal(second["encoder_state"][k], seeded[k]) for k in TUNED)
    events = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [(e["epoch"], e["step"]) for e in events if e["event"] == "encoder_trains"] == [(1, first["step"])]


@pytest.mark.slow
def test_the_encoder_trains_with_boxes_too(tuned_data, scenes, tmp_path):
    """`--fine-tune-encoder --boxes`: whole-image batches carry their box masks to the term."""
    boxes = str(scenes / "boxes.json")
    fit(
        FitJob(str(tuned_data), str(tmp_path / "run"), TINY, tune_cfg(1), boxes=boxes, device="cpu", progress_bar=False)
    )
    log = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    terms = [r for r in log if r["event"] == "train"]
    assert terms and all(r["boxes"] > 0 and r["consistency"] > 0 for r in terms)


def test_amp_step_trains_the_encoder(tuned_data):
    data = CaptionData(str(tuned_data))
    cfg = TrainConfig.of(batch_size=8, amp="bf16", lr=1e-3, workers=0, fine_tune=FineTuneConfig())
    tuning = FineTuning(data, cfg, cpu_process, progress=False)
    decoder = AttentionDecoder(vocab_size=len(data.vocab), embed_dim=32, hidden_dim=48, attention_dim=24)
    decoder.set_feature_stats(*data.feature_stats())
    step = train_step(decoder, cfg, encoder=tuning.encoder, extra=tuning.parameters())
    before = {k: v.clone() for k, v in tuning.encoder.encoder_state().items()}
    batch = next(tuning.batches(seed=0, epoch=0))
    assert batch.image_index is not None and len(batch.features) < len(batch.captions)  # one input per image
    step(batch)
    terms, skipped = step.read()
    assert np.isfinite(terms["loss"]) and terms["consistency"] > 0 and not skipped
    after = tuning.encoder.encoder_state()
    assert all(not torch.equal(before[k], after[k]) for k in TUNED)


@pytest.mark.slow
def test_conv4_1_from_images(scenes, tmp_path):
    # Small images (64 px, a 4×4 grid) keep the conv4 block cheap; the path is the same at 224.
    data_dir = tmp_path / "data"
    prepare_scenes(scenes, data_dir, encoder=EncoderSpec(weights="none", image_size=64), min_count=1)
    run = tmp_path / "run"
    cfg = tune_cfg(1, start="conv4_1")
    cfg = replace(cfg, process=replace(cfg.process, workers=1))  # images decoded by a DataLoader worker
    fit(FitJob(str(data_dir), str(run), TINY, cfg, device="cpu", progress_bar=False))
    ck = load_checkpoint(str(run / "last.pt"))
    assert set(ck["encoder_state"]) == {f"{i}.{p}" for i in (17, 19, 21, 24, 26, 28) for p in ("weight", "bias")}
    assert not list(data_dir.glob("pool4.*"))  # conv4_1 reads images, no cache
    data = CaptionData(str(data_dir))
    rows = data.split_images("val")[1]
    cap = Captioner.load(str(run / "last.pt"))
    ours, _ = cap.encode([data.path_of(int(r)) for r in rows])
    trunk, _ = build_encoder(data.encoder)
    tuned = TunedEncoder(trunk.features, 17, from_cache=False, arch="vgg16")
    tuned.load_encoder_state(ck["encoder_state"], "test")
    seen = encoded_features(tuned, data, rows, cache=None, device=torch.device("cpu"), workers=0)
    torch.testing.assert_close(ours, seen)  # the same images through the same layers
    assert float((data.features(rows) - seen).norm() / seen.norm()) > 1e-2


@pytest.mark.slow
def test_fine_tune_flags_need_fine_tune_encoder(data_dir, tmp_path):
    p = run_cli("train.py", "fit", "--data", str(data_dir), "--out", str(tmp_path / "r"), "--encoder-lr", "1e-3")
    assert p.returncode == 2 and p.stderr.strip() == "error: --encoder-lr needs --fine-tune-encoder"
