# Sourced by the GPU scripts: the checkout on PYTHONPATH (the package is not installed there), Python's
# output unbuffered, and the carried wheels (benchmarks/gpu_wheels.sh) installed into /tmp/site.
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d .whl ] && ! "$PY" -c "import pycocotools, pycocoevalcap, nltk" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
