#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (its Python 3.12 has torch, torchvision, numpy, pillow,
# matplotlib, tqdm, safetensors, huggingface_hub and pytest, not these), fetched here into .whl/
# for the device tool to carry (`carry: [".whl"]`); benchmarks/gpu_session.sh installs them there.
# pycocoevalcap's Java jars and METEOR's paraphrase table (100 MB) are left out: there is no Java
# on that machine, and evaluation then takes the Python figures.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl pycocotools pycocoevalcap nltk
zip -q -d .whl/pycocoevalcap-*.whl '*.jar' '*/paraphrase-en.gz'
du -sh .whl
