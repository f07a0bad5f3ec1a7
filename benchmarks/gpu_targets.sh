#!/usr/bin/env bash
# What the GPU issue still asks after benchmarks/gpu_session.sh, in one device call (about 8 minutes),
# each part alone on the machine: the captioning targets (one caption, where its beam search spends
# its time, caption_batch) with prepare's rate; fit on a COCO-sized cache (benchmarks/gpu_coco.sh);
# then the step under torch.compile(mode="reduce-overhead") beside the project's graphs.
# Outputs under $OUT: targets.txt, coco.txt, compiled.txt.
#
#   bash benchmarks/gpu_targets.sh      (there, carrying .whl)
#   DEVICE=cpu ONLY=caption,batch PREPARE_IMAGES=20 IMAGES=600 MINUTES=0.1 SETTINGS=--batch-size=16 \
#       COMPILED=fp32 BATCH_SIZES=8 STEPS=2 bash benchmarks/gpu_targets.sh      (a dry run here)
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh
{ "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  echo "code: captioner/*.py sha1 $(find captioner -name '*.py' | sort | xargs cat | sha1sum | cut -c1-12)"
  date -u; } | tee "$OUT/targets.txt"
timeout "${TARGET_SECONDS:-200}" "$PY" benchmarks/benchmark.py --device "$DEVICE" --steps "${STEPS:-10}" \
    --only "${ONLY:-caption,search,batch,prepare}" --prepare-images "${PREPARE_IMAGES:-500}" 2>&1 | tee -a "$OUT/targets.txt"
MINUTES=${MINUTES:-0.6} SETTINGS=${SETTINGS:---amp=bf16,--batch-size=64 --amp=bf16,--batch-size=256} \
    timeout "${COCO_SECONDS:-230}" bash benchmarks/gpu_coco.sh
echo "== the step under torch.compile(mode='reduce-overhead') beside the project's graphs" | tee "$OUT/compiled.txt"
timeout "${COMPILE_SECONDS:-170}" "$PY" benchmarks/benchmark.py --device "$DEVICE" --steps "${STEPS:-10}" --only decoder \
    --batch-sizes "${BATCH_SIZES:-32,512}" --decoder-variants "${COMPILED:-bf16,bf16+reduce-overhead}" 2>&1 \
    | grep --line-buffered -v "^W[0-9]" | tee -a "$OUT/compiled.txt"
date -u | tee -a "$OUT/targets.txt"
