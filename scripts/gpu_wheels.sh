#!/usr/bin/env bash
# Wheels of our pinned packages that the GPU box lacks or holds in other versions (it has Python 3.12,
# torch 2.11, transformers 5.17, huggingface_hub 1.x and no gguf; it keeps its own CUDA torch), so that
# scripts/gpu_train.sh can install them there with no network. Run where PyPI is reachable, after
# `make install` (the versions are read from .venv):   scripts/gpu_wheels.sh [DIR]   (default wheels/)
# Carry DIR (about 30 MB) in its own call: a call carries at most 64 MiB, and each GGUF part takes 49.
set -euo pipefail
DIR=${1:-wheels}
PYVER=${PYVER:-3.12}  # the box's Python (3.11 for a check in a local venv of this machine's Python)
cd "$(dirname "$0")/.."
PINS=$(.venv/bin/python -c "
from importlib.metadata import version
print(' '.join(f'{n}=={version(n)}' for n in ('transformers', 'tokenizers', 'huggingface_hub', 'hf_xet', 'safetensors', 'gguf', 'fastapi', 'uvicorn', 'pydantic', 'prometheus_client')))")
echo "wheels for Python $PYVER x86_64: $PINS (and what they need)"
rm -rf "$DIR.tmp" && mkdir -p "$DIR.tmp"
# With their dependencies (pip on the box installs only those it lacks); numpy stays out: the box has one.
.venv/bin/pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$DIR.tmp" $PINS
rm -f "$DIR.tmp"/numpy-*.whl
echo "$PINS" | tr ' ' '\n' > "$DIR.tmp/requirements.txt"
rm -rf "$DIR" && mv "$DIR.tmp" "$DIR"
ls "$DIR"; du -sh "$DIR"
