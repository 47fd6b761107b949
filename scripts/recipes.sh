#!/usr/bin/env bash
# The measured choices of docs/training.md ("Choices"): the same data, the same number of optimizer
# steps and the same evaluation for each variant, one at a time (never two heavy jobs at once).
#
#   scripts/recipes.sh DATA[,DATA] OUTDIR [STEPS]
#
# Each variant writes OUTDIR/<name>/{metrics.jsonl,summary.json,plot.png}; `python
# scripts/recipes_table.py OUTDIR` prints tau per evaluation set, steps, wall and CPU time per run.
set -euo pipefail
DATA=${1:?usage: scripts/recipes.sh DATA OUTDIR [STEPS]}
OUT=${2:?usage: scripts/recipes.sh DATA OUTDIR [STEPS]}
STEPS=${3:-60}
PY=${PY:-.venv/bin/python}
EVAL=${EVAL:-gsm-symbolic-eval,humaneval}
VARIANTS=${VARIANTS:-plain init distill headvocab all all-b8}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
common=(--target smollm2-135m-instruct --data "$DATA" --layers 2 --lr 6e-4 --epochs 100 --max-steps "$STEPS"
        --batch-tokens 4096 --anchors 64 --eval-data "$EVAL" --eval-prompts 3 --eval-max-new-tokens 96
        --eval-every "$((STEPS / 3))" --save-every "$STEPS" --mask-token-id 16 --cache-features --no-progress)
for v in $VARIANTS; do
    case $v in
        plain) extra=() ;;
        init) extra=(--init-from-target) ;;
        distill) extra=(--distill) ;;
        headvocab) extra=(--head-vocab 8192) ;;
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
