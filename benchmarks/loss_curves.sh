#!/usr/bin/env bash
# Whether a change leaves training as it was: the first 100 steps' losses of `fit` at the defaults,
# hard attention, --boxes and SCST (from the same --init), for an older checkout and this one, on
# one prepared data directory, compared step for step.
#
#   git worktree add /tmp/before COMMIT
#   python -m captioner.scenes.synthetic /tmp/ba/scenes --n 240 --seed 0
#   python train.py prepare --images /tmp/ba/scenes/images --captions /tmp/ba/scenes/captions.json \
#       --splits /tmp/ba/scenes/splits.json --out /tmp/ba/data --encoder-weights none
#   bash benchmarks/loss_curves.sh /tmp/before /tmp/ba/data /tmp/ba/scenes/boxes.json
#
# Both trees run in this venv, on the CPU, with one torch thread (so that sums add up in one order).
set -euo pipefail
BEFORE=$(cd "$1" && pwd); DATA=$(cd "$2" && pwd); BOXES=$(realpath "$3")
AFTER=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
COMMON=(--epochs 4 --log-every 1 --val-images 4 --val-beam-size 1 --checkpoint-minutes 0 --device cpu)

fit() {  # tree name mode args...: that tree's fit, its per-step losses in $WORK/name.mode.losses
  local tree=$1 name=$2 mode=$3; shift 3
  (cd "$tree" && OMP_NUM_THREADS=1 PYTHONPATH=$tree python train.py fit --data "$DATA" \
      --out "$WORK/$name.$mode" "${COMMON[@]}" "$@" > "$WORK/$name.$mode.log" 2>&1) \
    || { tail -5 "$WORK/$name.$mode.log"; exit 1; }
  python -c "
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if r.get('event') == 'train'][:100]
print('\n'.join(repr(r['loss']) for r in rows))" "$WORK/$name.$mode/metrics.jsonl" > "$WORK/$name.$mode.losses"
}

fit "$BEFORE" before defaults
cp "$WORK/before.defaults/best.pt" "$WORK/init.pt"
for name in before after; do
  [ $name = before ] && tree=$BEFORE || tree=$AFTER
  [ $name = after ] && fit "$tree" $name defaults
  fit "$tree" $name hard --attention hard
  fit "$tree" $name boxes --boxes "$BOXES"
  fit "$tree" $name scst --objective scst --init "$WORK/init.pt" --batch-size 8 --epochs 5
done
for mode in defaults hard boxes scst; do
  python - "$WORK/before.$mode.losses" "$WORK/after.$mode.losses" "$mode" <<'PY'
import sys
a, b = (list(map(float, open(p).read().split())) for p in sys.argv[1:3])
same = sum(x == y for x, y in zip(a, b))
worst = max((abs(x - y) for x, y in zip(a, b)), default=float("nan"))
print(f"{sys.argv[3]:9s} steps {len(a)}/{len(b)}, equal {same}, largest difference {worst:.3g}, "
      f"first {a[0]:.4f}/{b[0]:.4f}, last {a[-1]:.4f}/{b[-1]:.4f}")
PY
done
