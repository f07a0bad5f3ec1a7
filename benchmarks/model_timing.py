"""Load time and one-caption time of models, each in a fresh process, rounds interleaved.

    python benchmarks/model_timing.py MODEL [MODEL ...] IMAGE

For each model (a checkpoint or an exported folder) and round: `Captioner.load`, the first
caption of IMAGE at beam 3, then the median of 7 more; two threads, as the bundled demo runs.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(2)
from captioner import Captioner
t = time.perf_counter(); cap = Captioner.load(sys.argv[1]); load = time.perf_counter() - t
t = time.perf_counter(); cap.caption(sys.argv[2], beam_size=3); first = time.perf_counter() - t
runs = []
for _ in range(7):
    t = time.perf_counter(); cap.caption(sys.argv[2], beam_size=3); runs.append(time.perf_counter() - t)
print(json.dumps({"load_s": load, "first_caption_s": first, "caption_median_s": statistics.median(runs)}))
"""


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    models, image = sys.argv[1:-1], sys.argv[-1]
    for _ in range(2):
        for model in models:
            out = subprocess.run([sys.executable, "-c", CHILD, model, image], capture_output=True, text=True)
            print(model, out.stdout.strip() or out.stderr[-500:], flush=True)


if __name__ == "__main__":
    main()
