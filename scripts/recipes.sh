#!/usr/bin/env bash
# The measured choices of README "Choices that raise tau per CPU-hour": the same data, the same
# training time (--max-minutes) and the same evaluation for each variant, one at a time.
#
#   scripts/recipes.sh DATA[,DATA] OUTDIR [MINUTES]
#
# Each variant writes OUTDIR/<name>/{metrics.jsonl,summary.json,plot.png}; `python
# scripts/recipes_table.py OUTDIR` prints tau per evaluation set, steps, wall and CPU time per run.
set -euo pipefail
DATA=${1:?usage: scripts/recipes.sh DATA OUTDIR [MINUTES]}
OUT=${2:?usage: scripts/recipes.sh DATA OUTDIR [MINUTES]}
MINUTES=${3:-6}
PY=${PY:-.venv/bin/python}
EVAL=${EVAL:-gsm-symbolic-eval}
VARIANTS=${VARIANTS:-plain all no-init no-distill all-b8}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
common=(--target smollm2-135m-instruct --data "$DATA" --layers 2 --lr 6e-4 --epochs 100 --max-steps 400 --max-minutes "$MINUTES"
        --batch-tokens 2048 --anchors 64 --eval-data "$EVAL" --eval-prompts 4 --eval-max-new-tokens 64
        --eval-every 100000 --save-every 100000 --mask-token-id 16 --cache-features --no-progress)
for v in $VARIANTS; do
    case $v in
        plain) extra=() ;;
        headvocab) extra=(--head-vocab 8192) ;;
        no-init) extra=(--distill --head-vocab 8192) ;;
        no-distill) extra=(--init-from-target --head-vocab 8192) ;;
        all) extra=(--init-from-target --distill --head-vocab 8192) ;;
        all-b8) extra=(--init-from-target --distill --head-vocab 8192 --block-size 8) ;;
        *) echo "unknown variant $v"; exit 2 ;;
    esac
    [ -f "$OUT/$v/summary.json" ] && { echo "$v: done already"; continue; }
    rm -rf "$OUT/$v"
    echo "== $v: ${extra[*]}"
    /usr/bin/time -f "%U %S %e" -o "$OUT/$v.time" $PY -m flashdraft train "${common[@]}" "${extra[@]}" --out "$OUT/$v" \
        2>&1 | grep -v "Loading weights" | tail -4
done
