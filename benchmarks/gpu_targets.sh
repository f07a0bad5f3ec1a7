#!/usr/bin/env bash
# What the GPU issue still asks after benchmarks/gpu_session.sh, in one device call (about 8 minutes),
# each part alone on the machine: the captioning targets (one caption, where its beam search spends
# its time, caption_batch) with prepare's rate; fit on a COCO-sized cache (benchmarks/gpu_coco.sh);
# then fit's compiled step (torch.compile(mode="reduce-overhead")) beside the eager one, cold and cached.
# Outputs under $OUT: targets.txt, coco.txt, compiled.txt.
#
#   bash benchmarks/gpu_targets.sh      (there, carrying .whl)
#   PARTS="coco compiled" bash benchmarks/gpu_targets.sh       (some of them)
#   DEVICE=cpu ONLY=caption,batch PREPARE_IMAGES=20 IMAGES=600 MINUTES=0.1 SETTINGS=--batch-size=16 \
#       COMPILED=fp32 BATCH_SIZES=8 STEPS=2 bash benchmarks/gpu_targets.sh      (a dry run here)
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh
{ "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  echo "code: captioner/*.py sha1 $(find captioner -name '*.py' | sort | xargs cat | sha1sum | cut -c1-12)"
  date -u; } | tee "$OUT/targets.txt"
PARTS=${PARTS:-targets coco compiled}
[[ $PARTS == *targets* ]] && timeout "${TARGET_SECONDS:-200}" "$PY" benchmarks/benchmark.py --device "$DEVICE" --steps "${STEPS:-10}" \
    --only "${ONLY:-caption,search,batch,prepare}" --prepare-images "${PREPARE_IMAGES:-500}" 2>&1 | tee -a "$OUT/targets.txt"
[[ $PARTS == *coco* ]] && MINUTES=${MINUTES:-0.6} SETTINGS=${SETTINGS:---amp=bf16,--batch-size=64 --amp=bf16,--batch-size=256} \
    timeout "${COCO_SECONDS:-230}" bash benchmarks/gpu_coco.sh
[[ $PARTS == *compiled* ]] || exit 0
# Each variant in a process of its own, the compiled one twice: cold, then from PyTorch's caches.
echo "== fit's compiled step (reduce-overhead) beside the eager one" | tee "$OUT/compiled.txt"
for batch in ${BATCH_SIZES:-32 512}; do
  for variant in ${COMPILED:-bf16+eager bf16+reduce-overhead bf16+reduce-overhead}; do
    timeout "${COMPILE_SECONDS:-90}" "$PY" - "$DEVICE" "$batch" "$variant" "${STEPS:-10}" <<'PYEOF' 2>&1 \
        | grep --line-buffered -v "^W[0-9]" | tail -4 | tee -a "$OUT/compiled.txt"
import sys, time
import torch
sys.path.insert(0, "benchmarks")
import benchmark as b
device, batch, variant, steps = torch.device(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
t0 = time.perf_counter()
t = b.interleaved({variant: b.variant_step(device, batch, variant)}, steps, device, warmup=b.WARMUP + 2)[variant]
print(f"B={batch} {variant:24s} {b.fmt(t)}  (warm-up and compiling {time.perf_counter() - t0 - sum(t):.0f} s, alone)")
PYEOF
    [ "${PIPESTATUS[0]}" = 124 ] && echo "B=$batch $variant: no figure within ${COMPILE_SECONDS:-90} s" | tee -a "$OUT/compiled.txt"
  done
done
date -u | tee -a "$OUT/targets.txt"
