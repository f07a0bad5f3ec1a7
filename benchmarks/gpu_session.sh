#!/usr/bin/env bash
# The GPU checks of one session with a lent GPU (the device tool: 15 minutes, start included), in
# one run. First, side by side (their timings are not reported): the self-check of every training
# mode on CUDA, in groups, the tests that need a GPU, and benchmarks/gpu_checks.py (prepare on the GPU
# against the CPU, a compiled run resumed with --cuda-graphs off, every compile failing).
# Then, alone on the machine, benchmark.py's GPU figures beside the tutorial's own models.py.
# What comes back under $OUT: summary.txt (every pass/fail line), benchmark.txt, gpu_tests.txt,
# selfcheck.log and gpu_checks.log (each command and its output), runs.tar.gz (every run's metrics.jsonl).
#
#   bash benchmarks/gpu_wheels.sh          (here, once: the wheels that machine lacks, into .whl/)
#   git --git-dir=<a clone of sgrvinod/a-PyTorch-Tutorial-to-Image-Captioning> show HEAD:models.py > .tutorial/models.py
#   bash benchmarks/gpu_session.sh         (there, carrying .whl and .tutorial; DEFAULTS=none skips the fits at
#                                            their defaults, SECTIONS=none the benchmark)
#   DEVICE=cpu SECONDS_PER_MODE=3 STEPS=2 MODE_GROUPS="hard" SECTIONS=caption BATCH_SIZES=8 DEFAULT_SCENES=60 DEFAULT_EPOCHS=1 \
#       VARIANTS=fp32 bash benchmarks/gpu_session.sh        (a dry run here)
#
# There the package is not installed: it runs from the checkout (PYTHONPATH), with the carried
# wheels installed into /tmp/site.
set -u
cd "$(dirname "$0")/.."
. benchmarks/gpu_env.sh
WORK=${WORK:-/tmp/gpu_work}
[ -n "${KEEP_WORK:-}" ] || rm -rf "$WORK"  # KEEP_WORK=1 (dry runs): reuse an earlier run's soft mode and scenes
mkdir -p "$WORK"
SUMMARY=$OUT/summary.txt
{ "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  # The device gets the working tree, not the commits: the package's own hash says which code ran.
  echo "code: captioner/*.py sha1 $(find captioner -name '*.py' | sort | xargs cat | sha1sum | cut -c1-12)"
  date -u; } | tee "$SUMMARY"
defaults() {  # defaults NAME GENERATOR_MODULE SEED: fit at its defaults for docs/results.md's steps, then pointing
  local d=$WORK/defaults_$1 train=("$PY" -m captioner.cli.train)
  mkdir -p "$d"
  { "$PY" -m "$2" "$d/scenes" --n "${DEFAULT_SCENES:-1200}" --seed "$3" \
    && "${train[@]}" prepare --captions "$d/scenes/captions.json" --images "$d/scenes/images" \
         --splits "$d/scenes/splits.json" --out "$d/data" --encoder-weights none --device "$DEVICE" \
    && "${train[@]}" fit --data "$d/data" --out "$d/run" --epochs "${DEFAULT_EPOCHS:-8}" --seed 0 --device "$DEVICE" \
    && "${train[@]}" evaluate --checkpoint "$d/run/best.pt" --data "$d/data" --split test --out "$d/test.json" \
         --grounding "$d/scenes/boxes.json" --device "$DEVICE"; } > "$d.log" 2>&1
  "$PY" -c "import json,sys; from captioner.evaluation.health import problems; m=json.load(open(sys.argv[1])); \
r=lambda k, g=m: None if g.get(k) is None else round(g[k], 3); \
print(sys.argv[2], 'step', m['step'], 'BLEU-4', r('BLEU-4'), 'CIDEr', r('CIDEr'), 'pointing', r('pointing'), \
'chance', r('chance', m['grounding']), 'two objects', r('two_objects'), 'health', problems(m['attention_health']) or 'ok')" \
    "$d/test.json" "$1" > "$WORK/defaults_$1.txt" 2>&1 || tail -5 "$d.log" > "$WORK/defaults_$1.txt"
}
selfcheck() {  # selfcheck WORK_DIR MODES...
  local work=$1; shift
  "$PY" -m captioner selfcheck --device "$DEVICE" --seconds "${SECONDS_PER_MODE:-8}" --scenes 240 --work "$work" --only "$@"
}

echo "== selfcheck: soft (and the scenes' prepare), then the other modes in groups side by side" | tee -a "$SUMMARY"
[ -n "${KEEP_WORK:-}" ] && [ -d "$WORK/g0/runs/soft" ] || selfcheck "$WORK/g0" soft 2>&1 | tee -a "$SUMMARY"
MODE_GROUPS=${MODE_GROUPS:-hard,boxes,boxes-choice scst,scst-greedy bf16,bf16-scst,bf16-scst-greedy tune-conv5_1,tune-conv4_1,tune-boxes compile torchrun,ddp-2 resnet101,resnet101-tune}
pids=()
i=0
for group in $MODE_GROUPS; do
  i=$((i + 1))
  rm -rf "$WORK/g$i" && mkdir -p "$WORK/g$i/runs" && cp -r "$WORK/g0/scenes" "$WORK/g0/data" "$WORK/g$i/" && cp -r "$WORK/g0/runs/soft" "$WORK/g$i/runs/"
  (selfcheck "$WORK/g$i" ${group//,/ }; echo "(selfcheck of $group exited $?)") > "$WORK/g$i.txt" 2>&1 &
  pids+=($!)
done
for run in ${DEFAULTS:-synthetic:captioner.scenes.synthetic:21 held-out:tools.heldout:5}; do
  [ "$run" = none ] && break
  IFS=: read -r name generator seed <<< "$run"
  defaults "$name" "$generator" "$seed" &
  pids+=($!)
done
rm -rf "$WORK/checks" && mkdir -p "$WORK/checks" && cp -r "$WORK/g0/scenes" "$WORK/g0/data" "$WORK/checks/"
"$PY" benchmarks/gpu_checks.py "$WORK/checks" --device "$DEVICE" --only "${CHECKS:-prepare,resume,broken}" \
    > "$WORK/checks.txt" 2>&1 &
pids+=($!)
"$PY" -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/test_shapes.py tests/test_device_guard.py tests/test_gpu_paths.py \
    tests/test_encoder.py::test_the_apis_inputs_on_a_gpu_are_each_images_own_whatever_the_sizes_mixed \
    tests/test_sampling.py::test_sampling_on_a_gpu_writes_the_greedy_caption_at_temperature_zero_and_repeats_with_its_seed \
    tests/test_compiled.py::test_a_compiled_search_on_a_gpu_copies_its_large_inputs_once_not_at_every_replay \
    "tests/test_compiled.py::test_five_compiled_fits_in_one_process_share_one_compiled_forward[cuda]" \
    tests/test_distributed.py::test_scsts_greedy_baseline_compiles_under_ddp_as_in_one_process \
    "tests/test_compiled.py::test_a_server_compiles_on_the_thread_that_serves_and_serves_other_settings_compiled[cuda]"} \
    > "$OUT/gpu_tests.txt" 2>&1 &
pids+=($!)
if [ -n "${COCO_DATA:-}" ]; then  # benchmarks/gpu_coco.sh's data, written meanwhile (its fits run alone, later)
  "$PY" benchmarks/coco_sized.py "$COCO_DATA" --images "${COCO_IMAGES:-123287}" --device "$DEVICE" > "$WORK/coco_data.txt" 2>&1 &
  pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p"; done
for f in "$WORK"/g[1-9]*.txt; do grep -v "^selfcheck on\|^prepare " "$f"; done | tee -a "$SUMMARY"
echo "== fit at its defaults (docs/results.md has the CPU's figures at about the same steps)" | tee -a "$SUMMARY"
cat "$WORK"/defaults_*.txt 2>/dev/null | tee -a "$SUMMARY"
echo "== gpu_checks" | tee -a "$SUMMARY"
cat "$WORK/checks.txt" | tee -a "$SUMMARY"
echo "== gpu tests: $(tail -1 "$OUT/gpu_tests.txt")" | tee -a "$SUMMARY"
echo "== compiles and fallbacks in the selfcheck runs" | tee -a "$SUMMARY"
grep -h "compiled\|fell back" "$WORK"/g*/runs/*/metrics.jsonl "$WORK"/g*/selfcheck.log 2>/dev/null \
    | cut -c1-400 | sort | uniq -c | head -20 | tee -a "$SUMMARY"
cat "$WORK"/g*/selfcheck.log > "$OUT/selfcheck.log" 2>/dev/null
cp "$WORK/checks/gpu_checks.log" "$OUT/" 2>/dev/null
(cd "$WORK" && tar czf "$OUT/runs.tar.gz" $(ls -d */runs/*/metrics.jsonl */runs/*/*/metrics.json defaults_*.log \
    defaults_*/run/metrics.jsonl defaults_*/test.json 2>/dev/null))

[ -n "${COCO_DATA:-}" ] && cat "$WORK/coco_data.txt" | tee -a "$SUMMARY"
[ "${SECTIONS:-}" = none ] && exit 0
echo "== benchmark (alone)" | tee -a "$SUMMARY"
tutorial=()
[ -f .tutorial/models.py ] && tutorial=(--tutorial-models .tutorial/models.py)
"$PY" benchmarks/benchmark.py --device "$DEVICE" --steps "${STEPS:-10}" "${tutorial[@]}" \
    --only "${SECTIONS:-decoder,kernels,caption,batch,prepare}" --batch-sizes "${BATCH_SIZES:-32,512}" \
    --decoder-variants "${VARIANTS:-fp32,bf16}" --prepare-images "${PREPARE_IMAGES:-500}" \
    2>&1 | tee "$OUT/benchmark.txt"
# The step eager beside fit's compiled one (reduce-overhead), in a run of its own: its compile time is in it.
[ "${COMPILED:-}" = none ] && exit 0
echo "== benchmark: the step eager (--cuda-graphs off) beside fit's compiled one" | tee -a "$OUT/benchmark.txt"
timeout "${COMPILE_SECONDS:-200}" "$PY" benchmarks/benchmark.py --device "$DEVICE" --steps "${STEPS:-10}" --only decoder \
    --batch-sizes "${BATCH_SIZES:-32,512}" --decoder-variants "${COMPILED:-bf16,bf16+eager}" 2>&1 \
    | grep --line-buffered -v "^W[0-9]" | tee -a "$OUT/benchmark.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null | tee -a "$SUMMARY"
