#!/usr/bin/env bash
# Turn GPU minutes into a better shipped draft, from local files only (a GPU box may have no network).
#
#   scripts/gpu_train.sh TARGET OUT [MINUTES]
#
# TARGET: a .gguf file or HF model directory carried to the box (the SmolLM2 GGUF travels in parts:
# `cat part1 part2 > smollm2.gguf`). Prepared on a CPU machine first:
#   python scripts/export_prompts.py      # data/prompts-*.jsonl: the training prompts (eval prompts excluded)
#   scripts/gpu_wheels.sh                 # wheels/: our pinned transformers, tokenizers, gguf (17 MB)
# A call to the box carries at most 64 MiB with the working tree: the GGUF (94 MiB) and the draft (36 MiB)
# travel in separate calls (split -b; the box keeps /tmp while it stays warm).
# Stages (STAGES, default all, in this order), each resumable (rerun the same command):
#   datagen  the target answers data/prompts-train.jsonl (later ShareGPT turns with their history, new
#            gsm-symbolic problems), greedy, bf16, BATCH rows at once, for at most DATAGEN_MINUTES;
#   code     it answers data/prompts-code.jsonl sampled at CODE_TEMPERATURE (the committed data holds
#            their greedy answers), for at most CODE_MINUTES;
#   train    the campaign's recipe (checkpoints/smollm2-135m-instruct-dflash/MODEL_CARD.md) from the
#            shipped draft (INIT): those answers and the committed data/smollm2-135m-instruct/*.npz, each
#            source drawn at most 3 times over the draft's lineage (--max-views), distillation over the
#            draft vocabulary, target features computed on the fly (cheap on a GPU), bf16 autocast,
#            EPOCHS epochs or MINUTES of optimizer steps, whichever ends first, evaluated by the offline
#            walk on the committed references about ten times, a checkpoint at each evaluation;
#   best     the checkpoint with the best evaluated tau, saved as a bf16 draft in OUT/best;
#   pack     each datagen stage's answers packed as .npz token files as soon as it ends (OUT/*.npz, about
#            1.5 bytes a token), so that a later stage that fails loses none of them.
# Without CUDA it runs the same steps on the CPU (slowly), e.g. as a check:
#   DEVICE=cpu LIMIT=4 NEW_TOKENS=24 BATCH=4 BATCH_TOKENS=1024 MICRO=2 EPOCHS=1 scripts/gpu_train.sh TARGET OUT 0.3
set -euo pipefail
TARGET=${1:?usage: scripts/gpu_train.sh TARGET OUT [MINUTES]}
OUT=${2:?usage: scripts/gpu_train.sh TARGET OUT [MINUTES]}
MINUTES=${3:-4}
STAGES=${STAGES:-datagen code train best pack}
DEVICE=${DEVICE:-cuda}
LIMIT=${LIMIT:-}          # at most this many prompts per prompt file (empty: all)
BATCH=${BATCH:-384}
NEW_TOKENS=${NEW_TOKENS:-384}
DATAGEN_MINUTES=${DATAGEN_MINUTES:-4}
CODE_MINUTES=${CODE_MINUTES:-1}
CODE_TEMPERATURE=${CODE_TEMPERATURE:-0.8}
BATCH_TOKENS=${BATCH_TOKENS:-16384}  # sequence tokens per optimizer step
MICRO=${MICRO:-16}                   # sequences per forward
EPOCHS=${EPOCHS:-3}
LR=${LR:-3e-4}            # 2x the CPU continuation's 1.5e-4, for 8x its batch
INIT=${INIT:-checkpoints/smollm2-135m-instruct-dflash}  # the draft to continue from
WHEELS=${WHEELS:-wheels}  # scripts/gpu_wheels.sh
REFS=${REFS:-data/smollm2-135m-instruct/eval-refs-256.jsonl}
PY=${PY:-python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
if [ -d "$WHEELS" ]; then  # beside the box's own packages, not over them
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/flashdraft-site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/flashdraft-site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -c "import torch, transformers, tokenizers, gguf; print(f'torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, gguf ok, cuda {torch.cuda.is_available()}')"

datagen() {  # datagen PROMPTS OUTFILE MINUTES [more options]
    local prompts=$1 file=$2 minutes=$3
    shift 3
    [ -f "$prompts" ] || { echo "no $prompts: run python scripts/export_prompts.py on a CPU machine" >&2; exit 2; }
    $PY -m flashdraft datagen --target "$TARGET" --dataset "$prompts" --device "$DEVICE" \
        --dtype auto --batch-size "$BATCH" --max-new-tokens "$NEW_TOKENS" ${LIMIT:+--limit "$LIMIT"} \
        --max-minutes "$minutes" --out "$file" --no-progress "$@"
}
pack() {  # the answers so far as OUT/NAME.npz, at once: a later stage that fails must not lose them
    [ -s "$1" ] && $PY -m flashdraft pack-data "$1" --out "${1%.jsonl}.npz"
    return 0
}
if has datagen; then
    datagen data/prompts-train.jsonl "$OUT/gpu-data.jsonl" "$DATAGEN_MINUTES" || true
    if has pack; then pack "$OUT/gpu-data.jsonl"; fi
fi
if has code; then
    datagen data/prompts-code.jsonl "$OUT/gpu-code.jsonl" "$CODE_MINUTES" \
        --temperature "$CODE_TEMPERATURE" --seed 1 || true
    if has pack; then pack "$OUT/gpu-code.jsonl"; fi
fi

if has train; then
    DATA=""
    for f in "$OUT/gpu-data.jsonl" "$OUT/gpu-code.jsonl" data/smollm2-135m-instruct/*.npz; do
        [ -s "$f" ] && DATA="$DATA${DATA:+,}$f"
    done
    $PY -m flashdraft train --target "$TARGET" --data "$DATA" --init-draft "$INIT" \
        --out "$OUT/run" --device "$DEVICE" --distill --anchors 48 --head-vocab 4096 \
        --lr "$LR" --warmup 0.05 --decay 0.3 --epochs "$EPOCHS" --max-len 1024 \
        --batch-tokens "$BATCH_TOKENS" --micro-batch "$MICRO" --keep-checkpoints 12 \
        --eval-refs "$REFS" --max-minutes "$MINUTES" --no-progress ${RESUME:+--resume}
fi

if has best; then
    $PY - "$OUT" <<'EOF'
import json, shutil, sys
from pathlib import Path

import torch

from flashdraft.models.draft import DFlashDraft

out = Path(sys.argv[1])
rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
scored = {r["step"]: r["tau"] for r in rows if r.get("tau") is not None}
kept = {int(p.name.split("-")[1]): p for p in (out / "run" / "checkpoints").glob("step-*")}
candidates = [s for s in scored if s in kept]
print("evaluated tau by step:", ", ".join(f"{s}: {t:.3f}" for s, t in sorted(scored.items())))
if not candidates:
    sys.exit("no evaluated step has a checkpoint left: nothing to export")
step = max(candidates, key=lambda s: scored[s])
draft = DFlashDraft.from_pretrained(kept[step])
if (out / "best").exists():
    shutil.rmtree(out / "best")
draft.save_pretrained(out / "best", dtype=torch.bfloat16)
for extra in ("lineage.json",):
    if (kept[step] / extra).exists():
        shutil.copy(kept[step] / extra, out / "best" / extra)
print(f"best: step {step}, tau {scored[step]:.3f} -> {out / 'best'}")
EOF
fi

ls -la "$OUT" "$OUT/run" "$OUT/run/checkpoints" 2>/dev/null || true
