"""The backbone table: each row's trunk gives the channels and grid it declares, its stages exist, its
seeded weights are stable, a weights file is checked against the chosen row, and a ResNet fine-tunes
and travels through checkpoints as VGG does.

Trunks are shaped on the meta device (nothing allocated); the few real ones are ResNet-50 at 64×64,
whose pooled grid is still 14×14.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import prepare_scenes
from safetensors.torch import save_file
from test_device_guard import META, meta_step

from captioner import Captioner
from captioner.cli.train import get_parser
from captioner.data.batches import Batch
from captioner.errors import CaptionerError
from captioner.models.backbones import BACKBONES, backbone, layer_index, meta_trunk, seed_trunk
from captioner.models.checkpoint import load_checkpoint
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import Encoder, EncoderSpec, apply_encoder_state, build_encoder, layer_input_shape
from captioner.models.encoder import fingerprint as encoder_fingerprint
from captioner.models.tuned import STARTS, TunedEncoder, layers_of, start_index
from captioner.objectives.objective import HardAttentionConfig, Objective, objective_terms
from captioner.objectives.terms import TermsConfig, TermState
from captioner.options import from_args
from captioner.scenes.synthetic import generate
from captioner.serve.export import export
from captioner.train.config import TrainConfig
from captioner.train.finetune import FineTuneConfig
from captioner.train.prepare import PrepareConfig
from captioner.train.resume import Start, settle
from captioner.train.trainer import FitJob, fit

# The seeded random ResNet-50 must be the same network on every machine and release (NumPy's
# RandomState draws it): a change here breaks every feature cache and checkpoint made with it.
RESNET50_SEED0_FINGERPRINT = "0c7ef2986223d1ca"
SIDE = 64  # a ResNet's input in these tests: cheap, and its map still pools to 14×14


@pytest.fixture(scope="module")
def resnet50():
    return build_encoder(EncoderSpec(arch="resnet50", weights="none", image_size=SIDE))


def _file_state(encoder) -> dict[str, torch.Tensor]:
    """The encoder's trunk as torchvision saves the whole model: its names, and the head's tensors."""
    state = {k: v.clone() for k, v in encoder.features.state_dict().items()}
    return state | {"fc.weight": torch.zeros(1000, 2048), "fc.bias": torch.zeros(1000)}


# Each row's seeded random trunk (`--encoder-weights none`) must be the same network on every machine and
# release: a change breaks every feature cache and checkpoint made with it. Every parameter and buffer is
# drawn (`seed_trunk` refuses a row whose `draw` leaves one as `to_empty` left it).
SEEDED = {
    "vgg16": "e6f4db1b017eca4c",
    "vgg19": "597730a628359bfc",
    "resnet50": RESNET50_SEED0_FINGERPRINT,
    "resnet101": "71a185aa234119ec",
    "resnet152": "bcbbed4f1be7c7d1",
    "convnext_tiny": "dee072988ae9de66",
}
BIG = ("resnet101", "resnet152")  # in the whole suite only


@pytest.mark.parametrize(
    "arch, fingerprint", [pytest.param(a, f, marks=[pytest.mark.slow] * (a in BIG)) for a, f in SEEDED.items()]
)
def test_each_rows_seeded_trunk_is_drawn_whole_and_the_same_everywhere(arch, fingerprint):
    assert set(SEEDED) == set(BACKBONES)
    trunk = meta_trunk(arch).to_empty(device="cpu")
    seed_trunk(trunk, 0, arch)
    assert encoder_fingerprint(Encoder(trunk).eval()) == fingerprint


def test_a_row_whose_draw_misses_a_layer_type_is_refused(monkeypatch):
    """A family's weights drawn by another family's rule (ConvNeXt's by VGG's): its LayerNorm, linear
    layers and layer scales would keep whatever memory `to_empty` gave them, different at every build."""
    from captioner.models import backbones

    row = backbones.BACKBONES["convnext_tiny"]
    monkeypatch.setitem(backbones.BACKBONES, "convnext_tiny", replace(row, draw=backbones.draw_conv_bn))
    with pytest.raises(CaptionerError, match="undrawn"):
        seed_trunk(meta_trunk("convnext_tiny").to_empty(device="cpu"), 0, "convnext_tiny")


@pytest.mark.parametrize("arch", BACKBONES)
def test_each_rows_trunk_gives_its_channels_on_a_14x14_grid(arch):
    row, spec = backbone(arch), EncoderSpec(arch=arch)
    assert spec.image_size == row.input_size and spec.grid == 14 and spec.channels == row.channels
    x = torch.empty(1, 3, spec.image_size, spec.image_size, device="meta")
    trunk = meta_trunk(arch)
    assert trunk(x).shape == (1, row.channels, 14, 14)
    cut = list(trunk._modules).index(row.cut.rpartition(".")[2])
    unpooled = trunk[: cut + 1](x)  # (1, D, S/stride, S/stride): the map the row's stride describes
    assert unpooled.shape[-1] == spec.image_size // row.stride


@pytest.mark.parametrize("arch", BACKBONES)
@pytest.mark.parametrize("start", STARTS)
def test_each_rows_stages_are_layers_of_its_trunk(arch, start):
    trunk = meta_trunk(arch)
    i = start_index(trunk, start, arch)
    assert list(trunk._modules)[i] == backbone(arch).stage(start)
    assert layers_of(trunk[i:].state_dict()) == i  # what a checkpoint's encoder_state says of it
    L, D = layer_input_shape(EncoderSpec(arch=arch), i)
    assert trunk[:i](torch.empty(1, 3, *(2 * [EncoderSpec(arch=arch).image_size]), device="meta")).shape[1] == D
    assert L > 0


def test_resnet_rows_cut_after_the_last_stage_and_name_layers_as_torchvision():
    assert layer_index("layer4.0.conv1.weight") == 7 and layer_index("24.weight") == 24
    assert backbone("resnet101").stage("conv5_1") == "layer4"
    assert layer_input_shape(EncoderSpec(arch="resnet101"), 7) == (256, 1024)  # conv4_x at 256: 16×16×1024
    assert layer_input_shape(EncoderSpec(), 24) == (196, 512)  # VGG16's pool4, as before
    with pytest.raises(CaptionerError, match="unknown encoder"):
        backbone("resnet18")
    with pytest.raises(CaptionerError, match=r"--fine-tune-from must be one of \['conv4_1', 'conv5_1'\] for ResNet-50"):
        start_index(meta_trunk("resnet50"), "conv3_1", "resnet50")


def test_the_seeded_resnet_is_stable_and_in_fp16s_range(resnet50):
    enc, spec = resnet50
    assert spec.fingerprint == RESNET50_SEED0_FINGERPRINT
    x = torch.randn(2, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        f = enc(x)
    assert f.shape == (2, 196, 2048)
    assert torch.isfinite(f).all() and (f >= 0).all() and f.max() < 1000 and f.std() > 0.1  # fp16 caches it


def test_a_resnet50_file_is_taken_by_resnet50_and_refused_by_vgg16_by_name(tmp_path, resnet50):
    enc, spec = resnet50
    path = tmp_path / "resnet50.safetensors"
    state = _file_state(enc)
    save_file({k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}, str(path))  # as torchvision's
    with pytest.raises(CaptionerError) as e:
        build_encoder(EncoderSpec(weights=str(path)))
    assert str(path) in str(e.value) and "not a VGG16 state dict" in str(e.value)
    assert "features.0.weight" in str(e.value) and "--encoder resnet50" in str(e.value)
    _, taken = build_encoder(EncoderSpec(arch="resnet50", weights=str(path), image_size=SIDE))
    assert taken.fingerprint == spec.fingerprint
    torch.save({**state, "layer3.6.conv1.weight": torch.zeros(256, 1024, 1, 1)}, tmp_path / "deeper.pth")
    with pytest.raises(CaptionerError, match=r"holds layer3\.6\.conv1\.weight, which ResNet-50 lacks"):
        build_encoder(EncoderSpec(arch="resnet50", weights=str(tmp_path / "deeper.pth")))
    torch.save({**state, "layer4.0.conv1.weight": torch.zeros(2, 2)}, tmp_path / "shape.pth")
    with pytest.raises(CaptionerError, match=r"its layer4\.0\.conv1\.weight is \(2, 2\)"):
        build_encoder(EncoderSpec(arch="resnet50", weights=str(tmp_path / "shape.pth")))


def test_the_last_stage_fine_tunes_on_the_cache_as_on_the_images(resnet50):
    """conv5_1 (layer4) on the cached conv4_x maps gives the whole encoder's features; BatchNorm keeps its
    statistics in training mode; the trained layers go back into an encoder under the trunk's names."""
    enc, spec = resnet50
    start = start_index(enc.features, "conv5_1", "resnet50")
    x = torch.randn(2, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cached = enc.features[:start](x).flatten(2).transpose(1, 2)  # (2, L', 1024) the cache's rows
        whole = enc(x)  # (2, 196, 2048)
    tuned = TunedEncoder(enc.features, start, from_cache=True, arch="resnet50").train()
    assert not any(m.training for m in tuned.modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert (
        tuned.grid(cached) == 14 and TunedEncoder(enc.features, start, from_cache=False, arch="resnet50").grid(x) == 14
    )
    out = tuned(cached)  # (2, 196, 2048)
    torch.testing.assert_close(out, whole)
    out.sum().backward()
    assert all(p.grad is not None for p in tuned.tuned.parameters())
    assert tuned(cached, moves=torch.tensor([[1, 0], [0, -1]])).shape == whole.shape  # the views' features
    state = {k: v + 0.01 if v.is_floating_point() else v for k, v in tuned.encoder_state().items()}
    assert min(map(layer_index, state)) == start and all(k.startswith("layer4.") for k in state)
    again, _ = build_encoder(spec)
    apply_encoder_state(again, state, "test")
    assert torch.equal(again.features.state_dict()["layer4.0.conv1.weight"], state["layer4.0.conv1.weight"])
    enc.features.zero_grad(set_to_none=True)


def test_a_resnets_fine_tuning_step_stays_on_the_device():
    """The step of `fit --fine-tune-encoder` on a ResNet's cached conv4_x maps, on the meta device."""
    trunk = meta_trunk("resnet50")
    encoder = TunedEncoder(trunk, start_index(trunk, "conv5_1", "resnet50"), from_cache=True, arch="resnet50")
    dec = AttentionDecoder(vocab_size=12, encoder_dim=2048, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.1)
    dec = dec.to(META)
    terms = objective_terms(
        TermsConfig(alpha_c=0.3, consistency=1.0), attention="soft", hard=HardAttentionConfig(), views=True,
        state=TermState(META),
    )  # fmt: skip
    objective = Objective(dec, terms, shapes="fixed", encoder=encoder, view_share=0.5)
    batch = Batch(
        torch.randn(3, 64, 1024),  # conv4_x at 128×128: 8×8×1024
        torch.tensor([[1, 5, 6, 2], [1, 7, 2, 0], [1, 8, 9, 2], [1, 5, 2, 0]]),
        torch.tensor([4, 3, 4, 3]),
        image_index=torch.tensor([0, 0, 1, 2]),
    ).to(META)
    step = meta_step(objective, dec, [*dec.parameters(), *encoder.tuned.parameters()])
    step(batch)
    assert step.sums["consistency"].device == META


def test_the_decoder_takes_its_size_from_the_backbone():
    given = DecoderConfig(0, embed_dim=16)
    model, _ = settle(given, TrainConfig(), Start(9, encoder_dim=2048), torch.device("cpu"))
    assert model.encoder_dim == 2048 and model.embed_dim == 16
    model, _ = settle(given, TrainConfig(), Start(9), torch.device("cpu"))
    assert model.encoder_dim == 512


def test_prepare_takes_a_resnet_and_old_specs_read_as_before():
    base = ["prepare", "--images", "i", "--out", "o", "--captions", "c.json"]
    spec = from_args(PrepareConfig, get_parser().parse_args([*base, "--encoder", "resnet101"])).encoder
    assert (spec.arch, spec.image_size, spec.grid, spec.channels) == ("resnet101", 256, 14, 2048)
    with pytest.raises(SystemExit):
        get_parser().parse_args([*base, "--encoder", "resnet18"])
    old = {"arch": "vgg16", "weights": "none", "seed": 0, "image_size": 224, "crop": False, "fingerprint": "x"}
    assert EncoderSpec.from_dict(old).to_dict() == old and EncoderSpec.from_dict(old).grid == 14


@pytest.mark.slow
def test_a_resnet_prepares_fine_tunes_exports_and_captions(tmp_path):
    """prepare → fit --fine-tune-encoder (its last stage) → export → load, on a ResNet-50: the decoder is
    2048-d, the checkpoint holds layer4, and the exported folder captions as the checkpoint does."""
    scenes, data, run = tmp_path / "scenes", tmp_path / "data", tmp_path / "run"
    generate(str(scenes), 16, seed=31)
    prepare_scenes(scenes, data, encoder=EncoderSpec(arch="resnet50", weights="none", image_size=SIDE), min_count=1)
    tune = FineTuneConfig("conv5_1", lr=1e-3, after=0)
    cfg = TrainConfig.of(
        epochs=1, batch_size=8, lr=3e-3, val_beam_size=1, checkpoint_minutes=0, workers=0, fine_tune=tune
    )
    fit(
        FitJob(
            str(data), str(run), DecoderConfig(0, embed_dim=16, hidden_dim=16, attention_dim=8), cfg, progress_bar=False
        )
    )
    ck = load_checkpoint(str(run / "best.pt"))
    assert ck["decoder"]["encoder_dim"] == 2048 and ck["encoder"]["arch"] == "resnet50"
    assert ck["encoder_state"] and all(k.startswith("layer4.") for k in ck["encoder_state"])
    export(str(run / "best.pt"), str(tmp_path / "model"))
    images = [str(p) for p in sorted((scenes / "images").iterdir())[:2]]
    a = Captioner.load(str(run / "best.pt")).caption_batch(images, beam_size=2)
    b = Captioner.load(str(tmp_path / "model")).caption_batch(images, beam_size=2)
    assert [x.words for x in a] == [y.words for y in b] and a[0].attention.shape[1:] == (14, 14)


@pytest.mark.slow
def test_a_convnext_prepares_trains_and_captions_with_square_maps(tmp_path):
    """A row of a new family, end to end as users run it: `prepare --encoder convnext_tiny --encoder-weights
    none`, `fit`, `Captioner.load`, a caption whose maps are the 14×14 grid of ConvNeXt-T's third stage."""
    from conftest import run_cli

    scenes, data, run = tmp_path / "scenes", tmp_path / "data", tmp_path / "run"
    generate(str(scenes), 12, seed=41)
    prepare = ["train.py", "prepare", "--images", str(scenes / "images"), "--captions", str(scenes / "captions.json")]
    prepare += ["--splits", str(scenes / "splits.json"), "--out", str(data), "--encoder", "convnext_tiny"]
    p = run_cli(*prepare, "--encoder-weights", "none", "--min-count", "1", "--device", "cpu")
    assert p.returncode == 0, p.stderr[-2000:]
    fit_args = ["--data", str(data), "--out", str(run), "--epochs", "1", "--batch-size", "8", "--device", "cpu"]
    p = run_cli("train.py", "fit", *fit_args, "--embed-dim", "16", "--hidden-dim", "16", "--attention-dim", "8")
    assert p.returncode == 0, p.stderr[-2000:]
    ck = load_checkpoint(str(run / "best.pt"))
    assert ck["encoder"]["arch"] == "convnext_tiny" and ck["decoder"]["encoder_dim"] == 384
    out = Captioner.load(str(run / "best.pt")).caption(str(sorted((scenes / "images").iterdir())[0]), beam_size=2)
    assert out.words and out.attention.shape == (len(out.words), 14, 14)
