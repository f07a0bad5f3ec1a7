#!/usr/bin/env bash
# The GPU checks of one session with a lent GPU (the device tool: 15 minutes, start included), in
# one run: the self-check of every training mode on CUDA, the tests that need a GPU (CUDA graphs
# of the training step and of decoding), and benchmark.py's GPU figures. Each part's output goes
# to $OUT (the device tool brings it back); a part that fails does not stop the others.
#
#   bash benchmarks/gpu_wheels.sh          (here, once: the wheels that machine lacks, into .whl/)
#   DEVICE=cuda SECONDS_PER_MODE=8 STEPS=10 bash benchmarks/gpu_session.sh     (there, carrying .whl)
#   DEVICE=cpu  SECONDS_PER_MODE=3 STEPS=2 ONLY=soft bash benchmarks/gpu_session.sh   (a dry run here)
#
# There the package is not installed: it runs from the checkout (PYTHONPATH), with the carried
# wheels installed into /tmp/site.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d .whl ] && ! "$PY" -c "import pycocotools, pycocoevalcap, nltk" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT/torch.txt"
only=${ONLY:+--only $ONLY}

echo "== selfcheck"
"$PY" -m captioner selfcheck --device "$DEVICE" --seconds "${SECONDS_PER_MODE:-8}" --scenes 240 \
    --work "$OUT/selfcheck" $only 2>&1 | tee "$OUT/selfcheck.txt"
cp "$OUT/selfcheck/selfcheck.log" "$OUT/selfcheck_commands.log" 2>/dev/null

echo "== tests that need a GPU"
"$PY" -m pytest -q tests/test_shapes.py tests/test_device_guard.py 2>&1 | tee "$OUT/gpu_tests.txt"

echo "== benchmark"
"$PY" benchmarks/benchmark.py --device "$DEVICE" --steps "${STEPS:-10}" \
    --only "${SECTIONS:-decoder,kernels,caption,batch,prepare}" 2>&1 | tee "$OUT/benchmark.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null | tee "$OUT/gpu.txt"
