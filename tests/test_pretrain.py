"""The demo's encoder pretraining: per-cell targets from the boxes, a loss that goes down, a VGG16 file."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from captioner.models.encoder import EncoderSpec, build_encoder
from captioner.scenes.synthetic import generate
from captioner.scenes.synthetic_drawing import COLORS, SHAPES
from tools.pretrain_encoder import (
    PretrainConfig,
    base_trunk,
    cell_targets,
    pretrain,
    scene_split,
    trained_on,
    tuned_from,
)


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain_scenes")
    generate(str(out), 16, seed=29)
    return out


def test_each_cell_gets_the_shape_and_colour_of_the_object_on_it():
    image = {"id": 1, "width": 140, "height": 140}
    anns = {1: [{"bbox": [0, 0, 70, 70], "category_id": SHAPES.index("star") + 1, "color": "blue"}]}
    y = cell_targets([image], anns, EncoderSpec())  # (1, 2, L)
    grid = y.view(2, 14, 14)
    assert (grid[0, :7, :7] == SHAPES.index("star") + 1).all() and (grid[0, 7:, :] == 0).all()
    assert (grid[1, :7, :7] == list(COLORS).index("blue") + 1).all() and (grid[1, :, 7:] == 0).all()


def test_pretraining_lowers_the_loss_and_writes_a_vgg16_state_dict(scenes, tmp_path):
    cfg = PretrainConfig(scenes=8, val_scenes=4, epochs=3, batch_size=4, lr=3e-4)
    path, report = pretrain(str(scenes), str(tmp_path), cfg)
    losses = [e["train_loss"] for e in report["epochs"]]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert 1 <= report["kept_epoch"] <= 3 and report["val_scenes"] == len(scene_split(str(scenes), "val", 4)[0])
    state = load_file(path)
    seeded = base_trunk(0).state_dict()
    assert set(state) == {f"features.{k}" for k in seeded}  # torchvision's names
    assert all(v.dtype == torch.float16 for v in state.values())
    assert torch.equal(state["features.0.weight"].float(), seeded["0.weight"])  # conv1-4 stay the seeded ones
    conv5 = tuned_from("vgg16")
    assert conv5 == 24 and not torch.equal(state[f"features.{conv5}.weight"].float(), seeded[f"{conv5}.weight"])
    encoder, spec = build_encoder(EncoderSpec(weights=path))  # as `prepare --encoder-weights PATH` takes it
    assert encoder(torch.zeros(1, 3, 224, 224)).shape == (1, 196, 512)
    assert pretrain(str(scenes), str(tmp_path), cfg) == (path, report)  # made once


@pytest.mark.slow
def test_a_resnets_last_stage_pretrains_into_a_file_its_row_takes(scenes, tmp_path):
    cfg = PretrainConfig(scenes=6, val_scenes=3, epochs=2, batch_size=3, lr=3e-4, arch="resnet50")
    path, report = pretrain(str(scenes), str(tmp_path), cfg)
    assert path.endswith("resnet50_scenes.safetensors") and "--encoder resnet50" in trained_on(report)
    state, seeded = load_file(path), base_trunk(0, "resnet50").state_dict()
    assert set(state) == set(seeded)  # torchvision's names: conv1.weight, ..., layer4.2.bn3.running_var
    assert torch.equal(state["layer3.0.conv1.weight"].float(), seeded["layer3.0.conv1.weight"])  # left seeded
    assert not torch.equal(state["layer4.0.conv1.weight"].float(), seeded["layer4.0.conv1.weight"])  # trained
    assert torch.equal(state["layer4.0.bn1.running_var"], seeded["layer4.0.bn1.running_var"].half())  # stats kept
    encoder, _ = build_encoder(EncoderSpec(arch="resnet50", weights=path, image_size=64))
    assert encoder(torch.zeros(1, 3, 64, 64)).shape == (1, 196, 2048)


def test_an_epoch_trains_on_the_readers_device(tmp_path):
    """On a GPU (`python -m tools.build_demo --device cuda`) the cached pool4 and its targets, kept on
    the host, go to the reader's device, and the epoch reads nothing back until its end: on the meta
    device, which refuses a CPU tensor beside its own and every read of a value."""
    import numpy as np

    from tools.pretrain_encoder import CellReader, batch_on, train_epoch

    meta = torch.device("meta")
    reader = CellReader(base_trunk(0)).to(meta)
    x, y = np.zeros((3, 196, 512), np.float16), torch.zeros(3, 2, 196, dtype=torch.long)  # pool4 (n, L, D)
    assert {t.device for t in batch_on(meta, x, y, np.arange(2))} == {meta}
    opt = torch.optim.SGD(reader.parameters(), lr=0.1)  # Adam's step count is read on the host, off a GPU
    loss = train_epoch(reader, opt, x, y, PretrainConfig(batch_size=2), torch.Generator().manual_seed(0), amp=False)
    assert loss.device == meta and loss.shape == ()
