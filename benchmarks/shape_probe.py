"""Can an object's shape be read from the cached encoder features? Probes, with a learning curve.

The demo model named colours right and shapes wrong; this asks whether the features carry the
shape at all. For every object of a synthetic set (`python -m captioner.scenes.synthetic`, prepared with
`train.py prepare`), its box's cells on the encoder's grid are averaged into one 512-vector
(standardised as the decoder standardises them); a linear classifier and a small MLP
(512-256-5) are fitted on the train split's objects and scored on the test split's, for growing
numbers of training objects. A curve still rising at its end says more scenes would help; a flat
one says the encoder is the limit.

    python benchmarks/shape_probe.py DATA_DIR SCENES/boxes.json
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F

from captioner.data.dataset import CaptionData
from captioner.evaluation.grounding import GroundingBoxes


def box_vectors(data: CaptionData, boxes: GroundingBoxes, split: str, attribute: str) -> tuple[torch.Tensor, list[str]]:
    """One standardised, box-averaged feature vector per object of a split, and its label."""
    mean, std = data.feature_stats()
    std = std.clamp_min(1e-3)  # as AttentionDecoder.set_feature_stats: a channel that never fires has std 0
    g = data.encoder.grid
    ids, rows = data.split_images(split)
    vectors, labels = [], []
    for image_id, row in zip(ids.tolist(), rows.tolist()):
        grid = ((data.features([row])[0].float() - mean) / std).view(g, g, -1)  # (g, g, D)
        # The region of the image the grid covers (all of it, or the centre crop with --crop).
        left, top, right, bottom = data.encoder.preprocess.grid_box(*boxes.size(image_id))
        for a in boxes.coco.imgToAnns.get(image_id, []):
            x0, y0, bw, bh = a["bbox"]
            c0, c1 = (max(0, min(g - 1, int((x - left) * g / (right - left)))) for x in (x0, x0 + bw))
            r0, r1 = (max(0, min(g - 1, int((y - top) * g / (bottom - top)))) for y in (y0, y0 + bh))
            vectors.append(grid[r0 : r1 + 1, c0 : c1 + 1].reshape(-1, grid.shape[-1]).mean(0))
            labels.append(boxes.coco.cats[a["category_id"]]["name"] if attribute == "shape" else a["color"])
    return torch.stack(vectors), labels


def accuracy(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    xt: torch.Tensor,
    yt: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    steps: int,
) -> float:
    opt = torch.optim.Adam(model.parameters(), lr, weight_decay=weight_decay)
    for _ in range(steps):  # full batch
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        return float((model(xt).argmax(1) == yt).float().mean())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data", help="a prepared directory (train.py prepare --out)")
    p.add_argument("boxes", help="the synthetic set's boxes.json")
    p.add_argument("--attribute", choices=("shape", "color"), default="shape", help="what to read off")
    args = p.parse_args(argv)
    data = CaptionData(args.data)
    boxes = GroundingBoxes(args.boxes)  # read and checked as `evaluate --grounding` reads them
    x, labels = box_vectors(data, boxes, "train", args.attribute)
    xt, labels_t = box_vectors(data, boxes, "test", args.attribute)
    names = sorted(set(labels))
    y = torch.tensor([names.index(v) for v in labels])
    yt = torch.tensor([names.index(v) for v in labels_t])
    print(f"{args.attribute}: {len(y)} training objects, {len(yt)} test objects, chance {1 / len(names):.2f}")
    print("training objects | linear | MLP")
    for n in sorted({500, 1000, 2000, 4000, len(y)} - {m for m in (500, 1000, 2000, 4000) if m > len(y)}):
        linear = 0.0
        for wd in (1e-4, 1e-3, 1e-2):  # the best of three weight decays
            torch.manual_seed(0)
            linear = max(
                linear,
                accuracy(nn.Linear(x.shape[1], len(names)), x[:n], y[:n], xt, yt, lr=1e-2, weight_decay=wd, steps=300),
            )
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(x.shape[1], 256), nn.ReLU(), nn.Linear(256, len(names)))
        print(f"{n} | {linear:.3f} | {accuracy(mlp, x[:n], y[:n], xt, yt, lr=1e-3, weight_decay=1e-3, steps=400):.3f}")


if __name__ == "__main__":
    main()
