"""Training memory on a COCO-sized feature cache (123,287 images, 616k captions, 10k words).

    python benchmarks/memory.py [--images 123287] [--minutes 3] [--dir /tmp/coco-sized]

Writes a data directory of COCO's size whose feature file (123,287 × 196 × 512 fp16, 24.7 GB)
is sparse (holes read as zeros, so it costs no disk), runs `train.py fit` on it for a few
minutes, samples the training process's resident memory twice a second and prints the peak.
Features are read with pread, so what the process holds does not grow with the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from load_test import rss_mb  # noqa: E402  (this script's directory is on sys.path)

from captioner.data.dataset import FORMAT  # noqa: E402
from captioner.models.encoder import EncoderSpec, build_encoder  # noqa: E402
from captioner.models.vocab import SPECIALS  # noqa: E402


def make_cache(out: str, n: int, vocab_size: int = 10_000, captions_per_image: int = 5, val: int = 5000) -> None:
    os.makedirs(out, exist_ok=True)
    rs = np.random.RandomState(0)
    L, D = 196, 512
    with open(os.path.join(out, "features.npy"), "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f2", "fortran_order": False, "shape": (n, L, D)})
        f.truncate(f.tell() + n * L * D * 2)  # sparse: the holes read back as zeros
    np.ones(n, np.uint8).tofile(os.path.join(out, "features.done"))
    words = [*SPECIALS, *(f"w{i}" for i in range(vocab_size - len(SPECIALS)))]
    with open(os.path.join(out, "vocab.json"), "w") as f:
        json.dump({"words": words, "min_count": 5, "max_len": 20}, f)
    train = n - 2 * val
    c = train * captions_per_image
    lengths = rs.randint(8, 23, size=c).astype(np.int32)
    tokens = rs.randint(4, vocab_size, size=(c, 22)).astype(np.int32)
    tokens[:, 0] = 1
    tokens[np.arange(c), lengths - 1] = 2
    tokens[np.arange(22)[None] >= lengths[:, None]] = 0
    np.savez(
        os.path.join(out, "captions.npz"),
        tokens=tokens,
        lengths=lengths,
        rows=np.repeat(np.arange(train), captions_per_image).astype(np.int64),
    )
    ids = list(range(1, n + 1))
    refs = {str(i): ["a picture of something"] * 5 for i in ids[train:]}
    with open(os.path.join(out, "splits.json"), "w") as f:
        json.dump(
            {
                "images": {
                    "train": [[i, r] for r, i in enumerate(ids[:train])],
                    "val": [[i, train + k] for k, i in enumerate(ids[train : train + val])],
                    "test": [[i, train + val + k] for k, i in enumerate(ids[train + val :])],
                },
                "references": {
                    "val": {k: refs[k] for k in list(refs)[:val]},
                    "test": {k: refs[k] for k in list(refs)[val:]},
                },
            },
            f,
        )
    _, spec = build_encoder(EncoderSpec(weights="none"))
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(
            {
                "format": FORMAT,
                "encoder": spec.to_dict(),
                "locations": L,
                "feature_dim": D,
                "max_len": 20,
                "min_count": 5,
                "image_ids": ids,
                "paths": [f"/coco/{i:012d}.jpg" for i in ids],
                "feature_mean": [0.0] * D,
                "feature_std": [1.0] * D,
                "complete": True,
            },
            f,
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=123_287)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--dir", default="/tmp/coco-sized")
    args = p.parse_args(argv)
    data = os.path.join(args.dir, "data")
    if not os.path.exists(os.path.join(data, "meta.json")):
        make_cache(data, args.images)
    size = os.path.getsize(os.path.join(data, "features.npy")) / 1e9
    print(f"cache: {args.images} images, features.npy {size:.1f} GB (sparse)")
    cmd = [
        sys.executable,
        os.path.join(REPO, "train.py"),
        "fit",
        "--data",
        data,
        "--out",
        os.path.join(args.dir, "run"),
        "--max-minutes",
        str(args.minutes),
        "--val-images",
        "200",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak, samples = 0.0, []
    while proc.poll() is None:
        try:
            rss = rss_mb(proc.pid)
        except (FileNotFoundError, StopIteration):
            break
        peak = max(peak, rss)
        samples.append(rss)
        time.sleep(0.5)
    log = [json.loads(x) for x in open(os.path.join(args.dir, "run", "metrics.jsonl"))]
    steps = max(r.get("step", 0) for r in log)
    print(
        f"fit: {steps} steps in {args.minutes:g} min; resident memory peak {peak:.0f} MB, "
        f"median {np.median(samples):.0f} MB over {len(samples)} samples"
    )


if __name__ == "__main__":
    main()
