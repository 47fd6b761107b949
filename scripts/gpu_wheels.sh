#!/usr/bin/env bash
# Wheels of our pinned packages that the GPU box lacks or holds in other versions (it has Python 3.12,
# torch 2.11, transformers 5.17, tokenizers 0.23.2 and no gguf; it keeps its own CUDA torch), so that
# scripts/gpu_train.sh can install them there with no network. Run where PyPI is reachable, after
# `make install` (the versions are read from .venv):   scripts/gpu_wheels.sh [DIR]   (default wheels/)
# DIR is about 17 MB: it fits a call beside one GGUF part (a call carries at most 64 MiB, working tree included).
set -euo pipefail
DIR=${1:-wheels}
PYVER=${PYVER:-3.12}  # the box's Python (3.11 for a check in a local venv of this machine's Python)
cd "$(dirname "$0")/.."
PINS=$(.venv/bin/python -c "
from importlib.metadata import version
print(' '.join(f'{n}=={version(n)}' for n in ('transformers', 'tokenizers', 'gguf')))")
echo "wheels for Python $PYVER x86_64: $PINS (no dependencies)"
rm -rf "$DIR.tmp" && mkdir -p "$DIR.tmp"
# Without their dependencies: the box has them (huggingface_hub 1.33, safetensors 0.8.0, regex, typer,
# numpy, pyyaml, requests, tqdm, as its image listed them on 2026-11-17).
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any -d "$DIR.tmp" $PINS
echo "$PINS" | tr ' ' '\n' > "$DIR.tmp/requirements.txt"
rm -rf "$DIR" && mv "$DIR.tmp" "$DIR"
ls "$DIR"; du -sh "$DIR"
