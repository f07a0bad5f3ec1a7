#!/usr/bin/env bash
# A change's cost on this machine: `fit`'s training step (ms per step between the 10th and 30th
# steps, from metrics.jsonl) and `Captioner.caption` (median ms, one 640x480 image, beam 3), for an
# older checkout and this one, interleaved. The order alternates from round to round, since the
# second of two back-to-back runs tends to be the slower one.
#
#   git worktree add /tmp/before COMMIT
#   python -m captioner.scenes.synthetic /tmp/ba/scenes --n 240 --seed 0
#   python train.py prepare --images /tmp/ba/scenes/images --captions /tmp/ba/scenes/captions.json \
#       --splits /tmp/ba/scenes/splits.json --out /tmp/ba/data --encoder-weights none
#   bash benchmarks/before_after.sh /tmp/before /tmp/ba/data 8
#
# Both trees run in this venv; the caption figure uses the older tree's bundled model for both.
set -euo pipefail
BEFORE=$(cd "$1" && pwd); DATA=$2; ROUNDS=${3:-8}
AFTER=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT

caption_ms() {  # tree: median Captioner.caption latency of that tree's code
  PYTHONPATH=$1 python - "$BEFORE/captioner/assets/demo" <<'PY'
import statistics, sys, time
import numpy as np, torch
from PIL import Image
from captioner import Captioner
torch.set_num_threads(2)
cap = Captioner.load(sys.argv[1])
img = Image.fromarray((np.random.RandomState(1).rand(60, 80, 3) * 255).astype(np.uint8)).resize((640, 480))
for _ in range(3):
    cap.caption(img, beam_size=3)
ts = []
for _ in range(15):
    t0 = time.perf_counter()
    cap.caption(img, beam_size=3)
    ts.append(time.perf_counter() - t0)
print(f"{statistics.median(ts) * 1e3:.1f}")
PY
}

step_ms() {  # tree: ms per training step of a one-epoch fit with that tree's code
  local out=$WORK/run
  rm -rf "$out"
  (cd "$1" && PYTHONPATH=$1 python train.py fit --data "$DATA" --out "$out" --epochs 1 --val-images 4 \
      --val-beam-size 1 --log-every 10 --checkpoint-minutes 0 > "$WORK/fit.log" 2>&1)
  python -c "
import json, sys
t = {r['step']: r['time'] for r in map(json.loads, open(sys.argv[1])) if r.get('event') == 'train'}
print(f'{(t[30] - t[10]) / 20 * 1e3:.1f}')" "$out/metrics.jsonl"
}

for round in $(seq 1 "$ROUNDS"); do
  if (( round % 2 )); then order="$BEFORE $AFTER"; else order="$AFTER $BEFORE"; fi
  for tree in $order; do
    [ "$tree" = "$BEFORE" ] && name=before || name=after
    echo "round $round $name: train step $(step_ms "$tree") ms, caption $(caption_ms "$tree") ms"
  done
done
