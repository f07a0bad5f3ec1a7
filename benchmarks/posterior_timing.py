"""What the posterior maps (`--maps posterior`) cost beside the attention's own, rounds interleaved.

    python benchmarks/posterior_timing.py MODEL IMAGE      # one caption of IMAGE at beam 3, encoder included
    python benchmarks/posterior_timing.py --coco-sized      # the decode alone: V = 10,000, paper sizes, random weights

Medians of 7 after one warm-up, two threads; the COCO-sized decoder captions batches of 1 and 50 images
(evaluate's batch) of random features, 20 words at most.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch


def median_seconds(fn, runs: int = 7) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def model(source: str, image: str) -> None:
    from captioner import Captioner

    cap = Captioner.load(source)
    for round in range(2):
        for maps in ("attention", "posterior"):
            s = median_seconds(lambda: cap.caption(image, beam_size=3, maps=maps))
            print(f"round {round + 1}, one caption, maps {maps}: {s * 1000:.1f} ms", flush=True)


def coco_sized() -> None:
    from captioner.decoding.decode import decode
    from captioner.decoding.settings import Decoding
    from captioner.models.decoder import AttentionDecoder

    torch.manual_seed(0)
    decoder = AttentionDecoder(vocab_size=10_000).eval()
    for b in (1, 50):
        feats = torch.rand(b, 196, 512)
        for round in range(2):
            for maps in ("attention", "posterior"):
                run = lambda: decode(decoder, feats, Decoding(beam_size=3, max_len=20, maps=maps), max_len=20)
                print(f"round {round + 1}, {b} images, maps {maps}: {median_seconds(run, 3) * 1000:.0f} ms", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    if sys.argv[1:] == ["--coco-sized"]:
        coco_sized()
    elif len(sys.argv) == 3:
        model(*sys.argv[1:])
    else:
        sys.exit(__doc__)
