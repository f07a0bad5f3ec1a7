"""Rewrite a Karpathy dataset file in COCO layout into Flickr8k/30k layout, for the acceptance check.

`python -m tools.heldout OUT --n N --seed S` (from the repo root) writes OUT/splits.json as Karpathy's
dataset_coco.json does (filepath "images", cocoid ids). Flickr's files have neither: images are
DIR/filename and `imgid` (0, 1, 2, ...) is the only id; part of the training images is marked
`restval`. This script makes such a file from the COCO-layout one, so that `prepare --karpathy`
is checked on the layout most people start with (Flickr8k):

    python -m tools.heldout /tmp/k_scenes --n 1500 --seed 3
    python benchmarks/karpathy_flickr.py /tmp/k_scenes/splits.json /tmp/k_scenes/dataset_flickr.json
    python train.py prepare --karpathy /tmp/k_scenes/dataset_flickr.json --images /tmp/k_scenes/images \\
        --out /tmp/k_data --encoder-weights none

Every tenth training image (in file order) becomes `restval`; sentences keep `tokens` and
`raw`, with `imgid` and `sentid` as in Flickr's files.
"""

from __future__ import annotations

import argparse
import json
import os


def to_flickr(data: dict, dataset: str = "flickr8k", restval_every: int = 10) -> dict:
    """The Flickr layout of a COCO-layout Karpathy dataset dict (filename only, imgid ids)."""
    images, sentid, n_train = [], 0, 0
    for imgid, img in enumerate(data["images"]):
        split = img["split"]
        if split in ("train", "restval"):
            split = "restval" if n_train % restval_every == 0 else "train"
            n_train += 1
        sentences = []
        for s in img["sentences"]:
            sentences.append({"tokens": s["tokens"], "raw": s["raw"], "imgid": imgid, "sentid": sentid})
            sentid += 1
        images.append(
            {
                "sentids": [s["sentid"] for s in sentences],
                "imgid": imgid,
                "sentences": sentences,
                "split": split,
                "filename": os.path.basename(img["filename"]),
            }
        )
    return {"images": images, "dataset": dataset}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="Karpathy dataset JSON in COCO layout (e.g. OUT/splits.json of tools.heldout)")
    p.add_argument("out", help="where to write the Flickr-layout JSON")
    p.add_argument("--restval-every", type=int, default=10, help="every Nth training image becomes restval")
    args = p.parse_args()
    with open(args.source, encoding="utf-8") as f:
        flickr = to_flickr(json.load(f), restval_every=args.restval_every)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(flickr, f)
    counts = {s: sum(img["split"] == s for img in flickr["images"]) for s in ("train", "restval", "val", "test")}
    print(f"wrote {args.out}: {len(flickr['images'])} images ({counts})")


if __name__ == "__main__":
    main()
