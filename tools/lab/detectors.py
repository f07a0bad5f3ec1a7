"""Where do a data directory's features hold each object word? Word detectors over the cells, scored by pointing.

One linear detector per object word scores every cell, p_iw = σ(u_w · a_i + c_w), on the standardised
features. It learns either from the captions alone (multiple-instance, after Fang et al., CVPR 2015:
an image holds w with the noisy-OR 1 − Π_i (1 − p_iw), trained on whether its captions say w) or from
the boxes (each cell's own label: whether it lies in an object that w names). A detector's map p_w
then points, as attention does in `evaluate --grounding`: a hit is its smoothed peak inside a box of
an object w names, for each object word of each test image. With boxes, the score is what the cells
alone can tell; from the captions, what a term teaching attention from the captions could reach.

    python -m tools.lab.detectors --data DATA_DIR --boxes INSTANCES_JSON [--supervision captions|boxes]
        [--targets OUT_JSON]

`--targets` writes where the caption-taught detectors put each training image's said object words, as
COCO instances that `fit --boxes` reads: one box per said word, over the grid cell at the map's smoothed
peak (the maps saturate: cells at half the peak or more are 11-25% inside the object), a category per shape
word, a "color" per colour word. The true boxes say only which words name a shape or
a colour, not where anything lies.

Symbols: N images, L cells, D feature channels, W object words.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from PIL import Image

from captioner.data.boxes import BoxTargets, GroundingBoxes
from captioner.data.dataset import CaptionData
from captioner.evaluation.grounding import pointing_accuracy
from captioner.train.word_maps import Standardised, noisy_or_loss, peak_cell, said, training_captions


def object_words(data: CaptionData, boxes: GroundingBoxes) -> list[int]:
    """The vocabulary ids of the words that name a category or a colour of the boxes."""
    return [i for i, w in enumerate(data.vocab.words) if boxes.names_object(w)]


def caption_labels(data: CaptionData, rows: np.ndarray, words: list[int]) -> np.ndarray:
    """(N, W) float: whether some caption of each image (feature row) holds each word."""
    return said(rows, training_captions(data), words)


def cell_labels(data: CaptionData, boxes: GroundingBoxes, rows: np.ndarray, words: list[int]) -> np.ndarray:
    """(N, L, W) float: whether each cell of training images `rows` lies in an object each word names."""
    targets = BoxTargets(data, boxes, data.encoder.preprocess, data.encoder.grid)
    labels = np.zeros((len(rows), targets.masks.shape[1], len(words)), dtype=np.float32)
    for n, row in enumerate(rows):
        for k, w in enumerate(words):
            mask = targets.mask_of(int(row), w)
            if mask is not None:
                labels[n, :, k] = mask
    return labels


def train_detectors(
    features: torch.Tensor, labels: np.ndarray, supervision: str, *, epochs: int, seed: int
) -> torch.nn.Linear:
    """Detectors (D → W) fitted with Adam, in batches of 64 images, on features (N, L, D)."""
    torch.manual_seed(seed)
    detectors = torch.nn.Linear(features.shape[-1], labels.shape[-1])
    optimizer = torch.optim.Adam(detectors.parameters(), lr=1e-3)
    target = torch.from_numpy(labels)
    for _ in range(epochs):
        for batch in torch.randperm(len(features)).split(64):
            logits = detectors(features[batch])  # (B, L, W)
            if supervision == "boxes":
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target[batch])
            else:
                loss = noisy_or_loss(logits, target[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return detectors


def pointing(data: CaptionData, boxes: GroundingBoxes, rows: np.ndarray, maps: np.ndarray, words: list[int]) -> dict:
    """The share of (test image, object word present in it) whose detector map (N, L, W) peaks inside a box
    the word names, as `evaluate --grounding` scores attention; by kind (colour or category) and by word."""
    grid, ids = data.encoder.grid, data.meta["image_ids"]
    captions = {}
    for n, row in enumerate(rows):
        image_id = int(ids[row])
        if image_id in boxes:
            present = [k for k, w in enumerate(words) if boxes.boxes_for(image_id, data.vocab.words[w])]
            captions[image_id] = (
                [data.vocab.words[words[k]] for k in present],
                maps[n][:, present].T.reshape(-1, grid, grid),
            )
    found = pointing_accuracy(captions, boxes, data.encoder.preprocess)
    return {
        "pointing": found["pointing"],
        "scored": found["words"],
        "by_kind": found["by_kind"],
        "by_word": {w: round(h / n, 3) for w, (h, n) in sorted(found["by_word"].items())},
    }


def word_map_instances(data: CaptionData, boxes: GroundingBoxes, rows, maps: np.ndarray, words, said) -> dict:
    """COCO instances of the detector maps (N, L, W) of images `rows` for the words each says (N, W): a box over
    the cell of the image at each map's smoothed peak."""
    preprocess, grid = data.encoder.preprocess, data.encoder.grid
    colours = {w for w in words if data.vocab.words[w] in boxes.colors}
    categories = [{"id": 1, "name": "thing"}] + [
        {"id": k + 2, "name": data.vocab.words[w]} for k, w in enumerate(words) if w not in colours
    ]
    category_of = {c["name"]: c["id"] for c in categories}
    images, annotations = [], []
    for n, row in enumerate(rows):
        image_id = int(data.meta["image_ids"][row])
        with Image.open(data.path_of(int(row))) as im:
            width, height = im.size
        images.append({"id": image_id, "width": width, "height": height})
        l, t, r, b = preprocess.grid_box(width, height)
        cw, ch = (r - l) / grid, (b - t) / grid
        for k, w in enumerate(words):
            if not said[n, k]:
                continue
            word = data.vocab.words[w]
            extra = {"category_id": 1, "color": word} if w in colours else {"category_id": category_of[word]}
            y, x = divmod(peak_cell(maps[n, :, k], grid), grid)
            box = [l + x * cw, t + y * ch, cw, ch]
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "bbox": box, **extra})
    return {"images": images, "annotations": annotations, "categories": categories}


def measure(
    data_dir: str, boxes_path: str, supervision: str, *, epochs: int = 30, seed: int = 0, targets: str | None = None
) -> dict:
    """Fit the detectors on the train split and score their maps on the test split (and write `targets`)."""
    data, boxes = CaptionData(data_dir), GroundingBoxes(boxes_path)
    words = object_words(data, boxes)
    standardised = Standardised(data)
    _, train_rows = data.split_images("train")
    _, test_rows = data.split_images("test")
    train = standardised(train_rows)  # (N, L, D)
    said = caption_labels(data, train_rows, words)
    labels = cell_labels(data, boxes, train_rows, words) if supervision == "boxes" else said
    detectors = train_detectors(train, labels, supervision, epochs=epochs, seed=seed)
    with torch.no_grad():
        maps = torch.sigmoid(detectors(standardised(test_rows))).numpy()  # (N, L, W)
        if targets:
            train_maps = torch.sigmoid(detectors(train)).numpy()
            with open(targets, "w") as f:
                json.dump(word_map_instances(data, boxes, train_rows, train_maps, words, said), f)
    return {"supervision": supervision, "words": len(words), **pointing(data, boxes, test_rows, maps, words)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a prepared data directory")
    parser.add_argument("--boxes", required=True, help="COCO instances: its train and test images' boxes")
    parser.add_argument("--supervision", choices=("captions", "boxes"), default="captions")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", help="write the training images' detector maps here, as COCO instances")
    args = parser.parse_args(argv)
    found = measure(args.data, args.boxes, args.supervision, epochs=args.epochs, seed=args.seed, targets=args.targets)
    print(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
