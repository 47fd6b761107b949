#!/usr/bin/env bash
# Turn GPU minutes into a better shipped draft, from local files only (a GPU box may have no network).
#
#   scripts/gpu_train.sh TARGET OUT [MINUTES]
#
# TARGET: a .gguf file or HF model directory carried to the box (the SmolLM2 GGUF travels in two
# parts: `cat part1 part2 > smollm2.gguf`). Prepared on a CPU machine first:
#   python scripts/export_prompts.py      # data/prompts-*.jsonl: the training prompts (eval prompts excluded)
#   scripts/gpu_wheels.sh                 # wheels/: our pinned transformers, tokenizers, gguf, ... (~30 MB)
# Steps, each resumable (rerun the same command):
#   0. the wheels in WHEELS (default wheels/), if there, go into this Python (no torch among them: its own stays);
#   1. datagen: the target answers data/prompts-train.jsonl, greedy, bf16, large batches;
#   2. training, the campaign's recipe (checkpoints/smollm2-135m-instruct-dflash/MODEL_CARD.md): from the
#      shipped draft (INIT), regenerated answers only (the target's own greedy tokens): those of step 1
#      (weight 0.4) and the committed data/smollm2-135m-instruct/*.npz (0.1 each; with CORPUS=FILE.npz a
#      teacher-forced corpus joins at 0.2); distillation over the 8,192-token draft vocabulary, cached
#      target features, 48 anchors per sequence, bf16 autocast; evaluated by the offline walk on the
#      committed references; stopped after MINUTES (default 8) of optimizer steps, the cosine schedule
#      following the time.
# Without CUDA it runs the same steps on the CPU (slowly), e.g. as a check:
#   DEVICE=cpu LIMIT=2 NEW_TOKENS=32 BATCH=2 BATCH_TOKENS=1024 MICRO=1 scripts/gpu_train.sh TARGET OUT 0.3
set -euo pipefail
TARGET=${1:?usage: scripts/gpu_train.sh TARGET OUT [MINUTES]}
OUT=${2:?usage: scripts/gpu_train.sh TARGET OUT [MINUTES]}
MINUTES=${3:-8}
DEVICE=${DEVICE:-cuda}
LIMIT=${LIMIT:-}          # at most this many prompts per prompt file (empty: all)
BATCH=${BATCH:-256}
NEW_TOKENS=${NEW_TOKENS:-384}
BATCH_TOKENS=${BATCH_TOKENS:-65536}  # sequence tokens per optimizer step
MICRO=${MICRO:-8}                    # sequences per forward
INIT=${INIT:-checkpoints/smollm2-135m-instruct-dflash}  # the draft to continue from
CORPUS=${CORPUS:-}        # a teacher-forced corpus (scripts/export_prompts.py --corpus N) to mix in
WHEELS=${WHEELS:-wheels}  # scripts/gpu_wheels.sh
REFS=${REFS:-data/smollm2-135m-instruct/eval-refs-256.jsonl}
STEPS=${STEPS:-100000}    # upper bound; the time limit usually ends the run first
PY=${PY:-python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
[ -f data/prompts-train.jsonl ] || { echo "no data/prompts-train.jsonl: run python scripts/export_prompts.py on a CPU machine" >&2; exit 2; }
if [ -d "$WHEELS" ]; then
    $PY -m pip install -q --no-index --find-links "$WHEELS" -r "$WHEELS/requirements.txt"
fi
$PY -c "import torch, transformers, tokenizers, gguf; print(f'torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, gguf ok')"

$PY -m flashdraft datagen --target "$TARGET" --dataset data/prompts-train.jsonl --device "$DEVICE" \
    --dtype auto --batch-size "$BATCH" --max-new-tokens "$NEW_TOKENS" ${LIMIT:+--limit "$LIMIT"} \
    --out "$OUT/gpu-data.jsonl" --no-progress

DATA="$OUT/gpu-data.jsonl:0.4${CORPUS:+,$CORPUS:0.2}"
for f in data/smollm2-135m-instruct/*.npz; do DATA="$DATA,$f:0.1"; done

$PY -m flashdraft train --target "$TARGET" --data "$DATA" --init-draft "$INIT" \
    --out "$OUT/run" --device "$DEVICE" --distill --anchors 48 \
    --cache-features --head-vocab 8192 --lr 6e-4 --epochs 50 --max-steps "$STEPS" --batch-tokens "$BATCH_TOKENS" --micro-batch "$MICRO" \
    --eval-refs "$REFS" --max-minutes "$MINUTES" --no-progress \
    ${RESUME:+--resume}
ls -la "$OUT/run" "$OUT/run/checkpoints" 2>/dev/null || true
