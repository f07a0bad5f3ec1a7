"""The demo's encoder, pretrained on the scenes as VGG is pretrained on ImageNet for photos.

The demo cannot download ImageNet weights, and a random VGG reads the scenes' shapes poorly. So
the backbone's last block or stage (VGG16's conv5_1 to conv5_3 by default; any row's conv5_1
stage, `models.backbones`) is trained on the scenes themselves with a dense objective from their
boxes: from each cell of the 14×14 grid, two 1×1 heads read the shape and the colour of the object
covering it (background is a class of each). The layers before it keep the seeded random weights
(`--encoder-weights none`), so their output (VGG's pool4) is computed once per image and cached;
training the last block on it is cheap. The epoch kept is the one whose validation scenes' objects
are read best (the test split is never read); its block, frozen, is written with the other layers
as a state dict of the backbone (fp16 safetensors, "features.N.weight" as torchvision names VGG's),
the file `prepare --encoder-weights PATH` takes as it would a user's own.

Shapes: n images, B batch, D channels (VGG: 512), g=14 grid side, L=g*g cells, C classes.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from captioner.data.boxes import grid_cells
from captioner.data.dataset import TODO, FeatureCache
from captioner.data.extraction import ImageFiles, extract_features
from captioner.io import atomic_path, read_json, write_json_atomic
from captioner.models.backbones import backbone, meta_trunk
from captioner.models.encoder import Encoder, EncoderSpec, build_encoder, layer_input_shape
from captioner.models.fast_encoder import native_bf16, optimize_encoder
from captioner.models.tuned import CACHED, start_index
from captioner.scenes.synthetic_drawing import COLORS, SHAPES

SHAPE_CLASSES = ("background", *SHAPES)
COLOUR_CLASSES = ("background", *COLORS)


@dataclass(frozen=True)
class PretrainConfig:
    """How the conv5 block is trained on the scenes."""

    scenes: int = 1600  # training scenes whose pool4 outputs are cached and trained on
    val_scenes: int = 300  # validation scenes that choose the epoch kept
    epochs: int = 12
    minutes: float = 8.0  # no epoch starts after this
    batch_size: int = 32
    lr: float = 1e-4
    seed: int = 0
    arch: str = "vgg16"  # the backbone (`models.backbones`), its conv5_1 stage trained


# helpers


def weights_file(arch: str) -> str:
    """The name of the file `pretrain` writes for a backbone."""
    return f"{arch}_scenes.safetensors"


def tuned_from(arch: str) -> int:
    """Index in the trunk of the first trained layer: the row's conv5_1 (VGG16's 24, ResNet's layer4)."""
    return start_index(meta_trunk(arch), CACHED, arch)


def scene_split(scenes_dir: str, split: str, most: int) -> tuple[list[dict], dict[int, list[dict]]]:
    """Up to `most` scenes of a split (in the generator's order) and every scene's boxes.

    Returns:
        The scenes' COCO image records (id, file_name, width, height), and image id → annotations.
    """
    boxes = read_json(os.path.join(scenes_dir, "boxes.json"), "object boxes")
    splits = read_json(os.path.join(scenes_dir, "splits.json"), "splits")
    wanted = {int(im["cocoid"]) for im in splits["images"] if im["split"] == split}
    images = [im for im in boxes["images"] if int(im["id"]) in wanted][:most]
    anns: dict[int, list[dict]] = {int(im["id"]): [] for im in images}
    for a in boxes["annotations"]:
        if int(a["image_id"]) in anns:
            anns[int(a["image_id"])].append(a)
    return images, anns


def cell_targets(images: list[dict], anns: dict[int, list[dict]], spec: EncoderSpec) -> torch.Tensor:
    """Each cell's shape and colour class, 0 where no object covers it.

    Returns:
        (n, 2, L) long: [:, 0] shape classes (`SHAPE_CLASSES`), [:, 1] colour classes (`COLOUR_CLASSES`).
    """
    g = spec.grid
    out = torch.zeros(len(images), 2, g * g, dtype=torch.long)  # (n, 2, L)
    for i, im in enumerate(images):
        size = (int(im["width"]), int(im["height"]))
        for a in anns[int(im["id"])]:
            cells = torch.from_numpy(grid_cells([a["bbox"]], spec.preprocess.grid_box(*size), g))  # (L,)
            out[i, 0, cells] = a["category_id"]  # category ids are SHAPES' order from 1
            out[i, 1, cells] = COLOUR_CLASSES.index(a["color"])
    return out


def base_trunk(seed: int, arch: str = "vgg16") -> nn.Sequential:
    """The seeded random trunk, its weights rounded to fp16 as the written file holds them."""
    encoder, _ = build_encoder(EncoderSpec(arch=arch, weights="none", seed=seed))
    trunk = encoder.features
    for p in trunk.parameters():
        p.data = p.data.half().float()
    return trunk


def pool4(trunk: nn.Sequential, paths: list[str], cache_dir: str, name: str, spec: EncoderSpec, device: str):
    """The frozen layers' output (VGG's conv1-4, to pool4) for each image, cached in `cache_dir` (resumable).

    Returns:
        (n, L', D') fp16 array.
    """
    os.makedirs(cache_dir, exist_ok=True)
    start = tuned_from(spec.arch)
    cache = FeatureCache(cache_dir, len(paths), *layer_input_shape(spec, start), mode="r+", name=name)
    if (cache.done == TODO).any():
        frozen = optimize_encoder(Encoder(trunk[:start]), torch.device(device), image_size=spec.image_size)
        images = ImageFiles(paths, cache.todo(), spec.preprocess)
        extract_features(cache, images, frozen, batch_size=8, workers=2, device=device, progress=True)
    return cache[np.arange(len(paths))]


def file_state(trunk: nn.Sequential, arch: str = "vgg16") -> dict[str, torch.Tensor]:
    """The trunk as a state dict under torchvision's names ("features.24.weight", "layer4.0.conv1.weight"), fp16."""
    prefix = backbone(arch).prefix
    return {
        f"{prefix}{k}": (v.detach().half() if v.is_floating_point() else v.detach()).contiguous()
        for k, v in trunk.state_dict().items()
    }


# classes


class CellReader(nn.Module):
    """The trunk's last block or stage (its own modules, trained in place; BatchNorm's statistics
    kept) and two 1×1 heads reading each cell's shape and colour class."""

    def __init__(self, trunk: nn.Sequential, arch: str = "vgg16"):
        super().__init__()
        self.block = trunk[tuned_from(arch) :].requires_grad_(True)  # VGG16: conv5_1, ReLU, ..., conv5_3, ReLU
        channels = backbone(arch).channels
        self.shape = nn.Conv2d(channels, len(SHAPE_CLASSES), 1)
        self.colour = nn.Conv2d(channels, len(COLOUR_CLASSES), 1)

    def train(self, mode: bool = True) -> CellReader:
        super().train(mode)
        for m in self.block.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()  # the seeded statistics, as fine-tuning keeps them (`models.tuned`)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L', D') cached maps → shape logits (B, C_shape, L) and colour logits (B, C_colour, L)."""
        B, L, D = x.shape
        s = math.isqrt(L)
        f = self.block(x.transpose(1, 2).reshape(B, D, s, s))  # (B, D, g, g): VGG16's conv5_3 after ReLU
        return self.shape(f).flatten(2), self.colour(f).flatten(2)  # (B, C, L) each


def _loss(reader: CellReader, x: torch.Tensor, y: torch.Tensor, amp: bool) -> torch.Tensor:
    """Mean cross-entropy of the cells' shape and colour classes; x (B, L, D), y (B, 2, L)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        shape, colour = reader(x)  # (B, C, L) each
    return F.cross_entropy(shape.float(), y[:, 0]) + F.cross_entropy(colour.float(), y[:, 1])


def batch_on(device: torch.device, x: np.ndarray, y: torch.Tensor, rows: np.ndarray):
    """Rows of the cached pool4 (n, L, D) and their targets (n, 2, L) on the reader's device."""
    return torch.from_numpy(x[rows].astype(np.float32)).to(device), y[rows].to(device)  # (b, L, D), (b, 2, L)


def train_epoch(reader, opt, x: np.ndarray, y: torch.Tensor, cfg: PretrainConfig, gen, amp: bool) -> torch.Tensor:
    """One pass over the cached pool4 (n, L, D) in random order: the mean loss, on the reader's device."""
    reader.train()
    device, order, losses = next(reader.parameters()).device, torch.randperm(len(x), generator=gen).numpy(), []
    for start in range(0, len(x), cfg.batch_size):
        loss = _loss(reader, *batch_on(device, x, y, order[start : start + cfg.batch_size]), amp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


@torch.inference_mode()
def evaluate(reader: CellReader, x: np.ndarray, y: torch.Tensor, amp: bool) -> dict[str, float]:
    """How well the cells read the objects: the loss, and per object (its cells' logits averaged)
    the share whose shape and whose colour is read right."""
    reader.eval()
    device = next(reader.parameters()).device
    losses, shape_ok, colour_ok = [], [], []
    for start in range(0, len(x), 64):
        xb, yb = batch_on(device, x, y, np.arange(start, min(start + 64, len(x))))  # (b, L, D), (b, 2, L)
        losses.append(_loss(reader, xb, yb, amp).item() * len(xb))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            shape, colour = (t.float().cpu() for t in reader(xb))  # (b, C, L) each, voted on the host
        yb = yb.cpu()
        for i in range(len(xb)):
            for k in yb[i, 0].unique().tolist():
                cells = yb[i, 0] == k
                if k == 0:
                    continue
                # An object's cells vote with their summed logits, the background class left out.
                shape_ok.append(int(shape[i, 1:, cells].sum(1).argmax()) + 1 == k)
                colour_ok.append(int(colour[i, 1:, cells].sum(1).argmax()) + 1 == int(yb[i, 1, cells][0]))
    return {
        "loss": sum(losses) / len(x),
        "object_shape": float(np.mean(shape_ok)),
        "object_colour": float(np.mean(colour_ok)),
    }


def pretrain(scenes_dir: str, work: str, cfg: PretrainConfig, *, device: str = "cpu") -> tuple[str, dict]:
    """Train the last block on the scenes and write it, with the frozen layers, as a state dict of the backbone.

    Made once: a later call with the same `work` finds the file and its report and returns them.

    Args:
        scenes_dir: a synthetic scene set (`scenes.synthetic`): images, boxes.json, splits.json.
        work: where the pool4 caches, the weights file and its report go.
        cfg: the training's settings.
        device: where to run (the pool4 pass and the training).

    Returns:
        The path of the weights file (`weights_file(cfg.arch)` in `work`), and a report: the settings, the
        validation figures of every epoch and the epoch kept.
    """
    path, report_path = os.path.join(work, weights_file(cfg.arch)), os.path.join(work, "pretrain.json")
    if os.path.isfile(path) and os.path.isfile(report_path):
        return path, read_json(report_path, "encoder pretraining report")
    torch.manual_seed(cfg.seed)
    spec, trunk = EncoderSpec(arch=cfg.arch, weights="none", seed=cfg.seed), base_trunk(cfg.seed, cfg.arch)
    data = {}
    for split, most in (("train", cfg.scenes), ("val", cfg.val_scenes)):
        images, anns = scene_split(scenes_dir, split, most)
        paths = [os.path.join(scenes_dir, "images", im["file_name"]) for im in images]
        data[split] = (pool4(trunk, paths, work, f"pool4-{split}", spec, device), cell_targets(images, anns, spec))
    reader = CellReader(trunk, cfg.arch).to(device)
    amp = torch.device(device).type == "cpu" and native_bf16()  # bf16 where the CPU computes it natively
    opt = torch.optim.Adam(reader.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    t0, history, best = time.monotonic(), [], None
    for epoch in range(1, cfg.epochs + 1):
        if time.monotonic() - t0 > cfg.minutes * 60:
            break
        loss = float(train_epoch(reader, opt, *data["train"], cfg, gen, amp))
        val = evaluate(reader, *data["val"], amp)
        history.append({"epoch": epoch, "train_loss": loss, **{f"val_{k}": v for k, v in val.items()}})
        score = val["object_shape"] + val["object_colour"]
        if best is None or score > best[0]:
            best = (score, epoch, {k: v.detach().clone() for k, v in reader.block.state_dict().items()})
    reader.block.load_state_dict(best[2])  # the epoch the validation scenes chose, frozen from here
    with atomic_path(path) as tmp:
        save_file(file_state(trunk, cfg.arch), tmp)
    report = {
        "config": asdict(cfg),
        "epochs": history,
        "kept_epoch": best[1],
        "training_seconds": round(time.monotonic() - t0),
        "train_scenes": len(data["train"][0]),
        "val_scenes": len(data["val"][0]),
    }
    write_json_atomic(report_path, report)
    return path, report


def trained_on(report: dict) -> str:
    """What the card says the features came from, given `pretrain`'s report."""
    arch = report["config"].get("arch", "vgg16")
    if arch.startswith("vgg"):
        what = f"{backbone(arch).name} whose conv5 block was pretrained on {report['train_scenes']} of the training "
        what += "scenes' pool4 outputs (conv1-4 seeded random)"
    else:
        what = f"{backbone(arch).name} whose last stage was pretrained on {report['train_scenes']} of the training "
        what += "scenes' conv4_x outputs (the earlier layers seeded random)"
    encoder = "" if arch == "vgg16" else f"--encoder {arch} "
    how = f"(prepare {encoder}--encoder-weights {weights_file(arch)})"
    return f"{what}, to read each grid cell's shape and colour from the boxes {how}"


def card_record(report: dict) -> dict:
    """What the card says of the encoder's pretraining: its size, the epoch the validation scenes chose and
    how well that epoch reads their objects."""
    kept = report["epochs"][report["kept_epoch"] - 1]
    return {
        "train_scenes": report["train_scenes"],
        "val_scenes": report["val_scenes"],
        "epochs_run": len(report["epochs"]),
        "kept_epoch": report["kept_epoch"],
        "val_object_shape": round(kept["val_object_shape"], 4),
        "val_object_colour": round(kept["val_object_colour"], 4),
        "training_seconds": report["training_seconds"],
    }
