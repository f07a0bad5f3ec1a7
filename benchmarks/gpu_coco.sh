#!/usr/bin/env bash
# `fit` on a COCO-sized cache on a lent GPU (benchmarks/coco_sized.py): 123,287 images of random fp16
# features (24.7 GB, written to the machine's disk), then `fit` for a minute in each setting below,
# each printing captions/s from fit's own log, the host's wait for batches, peak memory and graphs,
# with nvidia-smi's memory in use sampled beside it (the CUDA context and the graphs' pools included).
#
#   bash benchmarks/gpu_coco.sh                       (there, carrying .whl; writes $OUT/coco.txt)
#   IMAGES=600 DEVICE=cpu MINUTES=0.2 SETTINGS="--batch-size=16" bash benchmarks/gpu_coco.sh   (a dry run here)
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh
DATA=${DATA:-/tmp/coco_sized}
LOG=$OUT/coco.txt
"$PY" benchmarks/coco_sized.py "$DATA" --images "${IMAGES:-123287}" --device "$DEVICE" 2>&1 | tee -a "$LOG"
i=0
for setting in ${SETTINGS:---amp=bf16,--batch-size=64 --amp=bf16,--batch-size=256 --batch-size=32}; do
  i=$((i + 1))
  echo "== fit ${setting//[=,]/ }" | tee -a "$LOG"
  rm -rf "$DATA-run$i"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$DATA-smi$i.txt" &
    smi=$!
  fi
  "$PY" benchmarks/coco_sized.py "$DATA" --images "${IMAGES:-123287}" --device "$DEVICE" --fit --run "$DATA-run$i" \
      --max-minutes "${MINUTES:-1}" ${setting//[=,]/ } 2>&1 | grep --line-buffered -v "^W[0-9]\|it/s\]" | tee -a "$LOG"
  if [ -n "${smi:-}" ]; then
    kill "$smi"
    echo "nvidia-smi's most memory in use: $(sort -n "$DATA-smi$i.txt" | tail -1) MiB" | tee -a "$LOG"
  fi
done
