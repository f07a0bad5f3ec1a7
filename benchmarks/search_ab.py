"""The CPU's beam search before and after it moved onto NumPy arrays (one search for both runtimes), in one
process, the two taking turns call by call so that both meet the same load on a shared machine: `caption` of
one photo, `caption_batch` of 16, and the search alone on their features, at beam 3 with the bundled model.

    git worktree add /tmp/before 419d401   # the last commit with the search over either runtime's arrays
    python benchmarks/search_ab.py /tmp/before [REPEATS] [--search-only]

The older search is loaded from the older checkout's decoding/beams.py and decoding/decode.py, beside this
checkout's modules; `caption` and `caption_batch` run this checkout's code with one or the other search.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time

import numpy as np
import torch
from PIL import Image

from captioner import Captioner
from captioner.decoding import decode
from captioner.serve.sources import demo_model


def older(tree: str):
    """The older checkout's `beam_search`, its modules renamed so that they sit beside this checkout's."""
    folder = os.path.join(tree, "captioner", "decoding")
    for name in ("beams", "decode"):
        source = open(os.path.join(folder, f"{name}.py"), encoding="utf-8").read()
        source = source.replace("captioner.decoding.beams", "older_beams")
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(f"older_{name}", loader=None))
        sys.modules[f"older_{name}"] = module
        exec(compile(source, f"{folder}/{name}.py", "exec"), module.__dict__)
    return sys.modules["older_decode"].beam_search


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    searches = {"before": older(sys.argv[1]), "after": decode.beam_search}
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    torch.set_num_threads(2)
    cap = Captioner.load(demo_model())
    rs = np.random.RandomState(3)
    photos = [
        Image.fromarray((rs.rand(60, 80, 3) * 255).astype(np.uint8)).resize((640, 480), Image.BICUBIC)
        for _ in range(16)
    ]
    feats = cap.encode(photos)[0]  # (16, L, D)
    found = [search(cap.decoder, feats, beam_size=3, max_len=cap.max_len) for search in searches.values()]
    assert [[h.tokens for h in hyps] for hyps in found[0]] == [[h.tokens for h in hyps] for hyps in found[1]]
    cases = {
        "caption, 1 photo": lambda search: cap.caption(photos[0], beam_size=3),
        "caption_batch, 16 photos": lambda search: cap.caption_batch(photos, beam_size=3, batch_size=16),
        "beam search alone, 1 image": lambda search: search(cap.decoder, feats[:1], beam_size=3, max_len=cap.max_len),
        "beam search alone, 16 images": lambda search: search(cap.decoder, feats, beam_size=3, max_len=cap.max_len),
    }
    if "--search-only" in sys.argv:
        cases = {case: fn for case, fn in cases.items() if case.startswith("beam search")}
    times = {(case, which): [] for case in cases for which in searches}
    for r in range(repeats + 1):  # the first round untimed
        for case, fn in cases.items():
            for which in searches if r % 2 else list(searches)[::-1]:
                decode.beam_search = searches[which]  # what `caption` calls, through decode.ROUTINES
                t = time.perf_counter()
                fn(searches[which])
                if r:
                    times[case, which].append(time.perf_counter() - t)
    decode.beam_search = searches["after"]
    print(f"{'median ms (min-max)':30s} {'before':>22s} {'after':>22s}  after/before")
    for case in cases:
        b, a = (times[case, which] for which in searches)
        span = lambda x: f"{statistics.median(x) * 1e3:.1f} ({min(x) * 1e3:.1f}-{max(x) * 1e3:.1f})"  # noqa: E731
        print(f"{case:30s} {span(b):>22s} {span(a):>22s}  {statistics.median(a) / statistics.median(b):.3f}")


if __name__ == "__main__":
    main()
