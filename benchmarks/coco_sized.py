"""`fit`'s own throughput on a COCO-sized data directory of random features.

    python benchmarks/coco_sized.py DIR [--images 123287] [--device cuda] [--fit --max-minutes 3] [FIT ARGS]
    python benchmarks/coco_sized.py /tmp/cs --images 600 --device cpu --fit --max-minutes 0.3   (a dry run)

Writes DIR as `train.py prepare` leaves it (unless DIR already holds --images rows): the seeded
random VGG16 as its encoder, --images rows of random fp16 features (N, L=196, D=512: 24.7 GB for
COCO's 123,287 images, drawn on --device), 5 captions of 8-20 words per image from --words words,
and a Karpathy-like split (5,000 val and 5,000 test images, at most a twentieth each; the rest
train). Neither nltk nor pycocotools is needed for that; `fit` needs them and pycocoevalcap (its
validation scores). With --fit it runs `fit` (unknown options go to it, e.g. --batch-size 64)
and prints from its metrics.jsonl the captions per second, what compiled and what fell back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from captioner.data.dataset import DONE, FORMAT, CaptionData, FeatureCache  # noqa: E402  # noqa: E402
from captioner.io import atomic_path, check_free_space, read_json, write_json_atomic  # noqa: E402
from captioner.models.encoder import FEATURE_DIM, EncoderSpec, build_encoder  # noqa: E402
from captioner.models.vocab import END_ID, PAD_ID, SPECIALS, START_ID, Vocabulary  # noqa: E402

MAX_LEN, PER_IMAGE = 20, 5  # prepare's default --max-len; COCO's captions per image
CHUNK = 1024  # feature rows drawn at a time (205 MB)


def write_captions(out: str, n: int, n_words: int, rng: np.random.Generator) -> None:
    """vocab.json, captions.npz and splits.json as `train.dataset_files` writes them."""
    vocab = Vocabulary([*SPECIALS, *(f"w{i}" for i in range(n_words))])
    held = min(5000, n // 20)
    splits = {"train": range(n - 2 * held), "val": range(n - 2 * held, n - held), "test": range(n - held, n)}
    rows = np.repeat(np.arange(n), PER_IMAGE)  # (C,) the image of each caption
    words = rng.integers(8, MAX_LEN + 1, size=len(rows))  # (C,)
    ids = rng.integers(len(SPECIALS), len(vocab), size=(len(rows), MAX_LEN))  # (C, MAX_LEN)
    # <start> w1 ... wk <end> <pad> ..., as Vocabulary.encode and padding make them
    tokens = np.full((len(rows), MAX_LEN + 2), PAD_ID, np.int32)  # (C, MAX_LEN + 2)
    tokens[:, 0] = START_ID
    tokens[:, 1:-1] = np.where(np.arange(MAX_LEN) < words[:, None], ids, PAD_ID)
    tokens[np.arange(len(rows)), words + 1] = END_ID
    train = rows < len(splits["train"])
    with atomic_path(os.path.join(out, "captions.npz")) as tmp:
        np.savez(tmp, tokens=tokens[train], lengths=(words[train] + 2).astype(np.int32), rows=rows[train])
    write_json_atomic(os.path.join(out, "vocab.json"), {"words": vocab.words, "min_count": 5, "max_len": MAX_LEN})
    refs = {
        s: {str(r): [" ".join(vocab.decode(t)) for t in tokens[r * PER_IMAGE : (r + 1) * PER_IMAGE]] for r in splits[s]}
        for s in ("val", "test")
    }
    images = {s: [[r, r] for r in rs] for s, rs in splits.items()}  # [image id, row]: the ids are the rows
    write_json_atomic(
        os.path.join(out, "splits.json"), {"images": images, "references": refs, "dropped": {s: [] for s in splits}}
    )


def write_features(out: str, n: int, locations: int, device: str, seed: int) -> np.ndarray:
    """features.npy and features.done (FeatureCache's files), random in [0, 1); returns the mapped array."""
    cache = FeatureCache(out, n, locations, FEATURE_DIM, mode="r+")  # the files, sparse until written
    short = check_free_space(cache.path, cache.unallocated_bytes(), "the feature cache")
    if short:
        sys.exit(short)
    feats = np.load(cache.path, mmap_mode="r+")  # (N, L, D) fp16
    g = torch.Generator(device).manual_seed(seed)
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        draw = torch.rand(b - a, locations, FEATURE_DIM, generator=g, device=device, dtype=torch.float16)
        torch.from_numpy(feats[a:b]).copy_(draw)  # (b - a, L, D), straight into the file's pages
    feats.flush()  # on disk before the rows are marked done, as FeatureCache.write does
    cache.done[:] = DONE
    cache.done.flush()
    return feats


def make_data(out: str, n: int, n_words: int, device: str, seed: int, times: dict) -> None:
    """A complete data directory of n random images; meta.json is written last, marked complete."""
    os.makedirs(out, exist_ok=True)
    t = time.monotonic()
    _, spec = build_encoder(EncoderSpec(weights="none"))  # fills in the fingerprint fit checks
    write_captions(out, n, n_words, np.random.default_rng(seed))
    times["encoder and captions"] = time.monotonic() - t
    t = time.monotonic()
    feats = write_features(out, n, spec.grid**2, device, seed)
    times["features"] = time.monotonic() - t
    sample = feats[:: max(1, n // 500)].astype(np.float32).reshape(-1, FEATURE_DIM)  # (s*L, D): all rows alike
    # meta.json as prepare completes it: the encoder, the settings (no views), the images, the statistics
    meta = {"format": FORMAT, "encoder": spec.to_dict(), "locations": spec.grid**2, "feature_dim": FEATURE_DIM}
    meta |= {"max_len": MAX_LEN, "min_count": 5, "views": False, "view_shift": 0, "sources": {"random": seed}}
    paths = [os.path.join(out, "images", f"{i:012d}.jpg") for i in range(n)]  # none on disk
    meta |= {"image_ids": list(range(n)), "paths": paths, "complete": True}
    meta |= {"feature_mean": sample.mean(0).round(6).tolist(), "feature_std": sample.std(0).round(6).tolist()}
    write_json_atomic(os.path.join(out, "meta.json"), meta)


def report(run: str) -> None:
    """Throughput, compiles and what else fit's metrics.jsonl says about speed."""
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"), encoding="utf-8")]
    start = next(x for x in lines if x["event"] == "start")
    batch, train = start["train"]["optim"]["batch_size"], [x for x in lines if x["event"] == "train"]
    # Between log lines of one epoch, leaving out the first (warm-up, compiling) and validations.
    pairs = [(a, b) for a, b in zip(train, train[1:]) if a["epoch"] == b["epoch"]]
    steps, secs = sum(b["step"] - a["step"] for a, b in pairs), sum(b["time"] - a["time"] for a, b in pairs)
    last = train[-1]
    print(f"train lines: {len(train)}, {last['step']} steps of {batch} captions, {last['time']:.1f} s since fit began")
    whole = last["step"] * batch / max(last["time"] - start["time"], 1e-9)
    print(f"captions/s: {steps * batch / secs:.0f} steady ({steps} steps)" if secs else "captions/s: too few log lines")
    print(f"captions/s: {whole:.0f} from the start line (warm-up included)")
    for x in (x for x in lines if x["event"] in ("compiled", "compiled_failed")):
        print(f"{x['event']}: {x['message']}")
    for x in (x for x in lines if "seconds" in x):
        print(f"{x['event']} at step {x['step']}: {x['seconds']} s")
    waited = sum(b.get("load_s", 0.0) for _, b in pairs)
    share = waited / max(secs, 1e-9)
    print(f"the host's wait for batches: {waited:.2f} s of {secs:.1f} s between those lines ({share:.1%})")
    peak = max((x.get("peak_gib", 0.0) for x in train), default=0.0)
    print(f"peak GPU memory held by tensors: {peak:.2f} GiB" if peak else "peak GPU memory: not logged (CPU)")


def main() -> None:
    # allow_abbrev off: a fit option must not be taken for a prefix of one of these
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("out", help="the data directory to write (reused if it holds --images rows)")
    p.add_argument("--images", type=int, default=123_287, help="images (default: COCO's 123,287)")
    p.add_argument("--words", type=int, default=10_000, help="vocabulary words besides the four specials")
    p.add_argument("--device", default="cuda", help="cuda or cpu: where features are drawn and fit runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fit", action="store_true", help="then run fit on it and report its throughput")
    p.add_argument("--run", help="fit's run directory, which must not exist (default: OUT-run)")
    p.add_argument("--max-minutes", type=float, default=3.0)
    p.add_argument("--val-images", type=int, default=100)
    p.add_argument("--log-every", type=int, default=50)
    args, fit_args = p.parse_known_args()
    times: dict[str, float] = {}
    began = time.monotonic()
    meta = os.path.join(args.out, "meta.json")
    if os.path.exists(meta) and len(read_json(meta, "data directory metadata")["image_ids"]) == args.images:
        print(f"{args.out}: reused")
    else:
        make_data(args.out, args.images, args.words, args.device, args.seed, times)
    data = CaptionData(args.out)  # what fit reads: refuses a directory it would not train on
    n, gb = len(data.cache.done), os.path.getsize(data.cache.path) / 1e9
    print(f"data: {n} images ({gb:.1f} GB), {len(data.rows)} train captions, {len(data.vocab)} words")
    if args.fit:
        run = args.run or args.out.rstrip("/") + "-run"
        if os.path.exists(run):
            sys.exit(f"{run} exists: pass another --run or remove it")
        cmd = [sys.executable, "-m", "captioner.cli.train", "fit", "--data", args.out, "--out", run]
        cmd += ["--device", args.device, "--max-minutes", str(args.max_minutes), "--val-images", str(args.val_images)]
        cmd += ["--log-every", str(args.log_every), *fit_args]
        print("$ " + " ".join(cmd), flush=True)
        t = time.monotonic()
        path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": path})
        times["fit"] = time.monotonic() - t
        report(run)
    times["total"] = time.monotonic() - began
    print("times: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))


if __name__ == "__main__":
    main()
