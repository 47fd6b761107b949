#!/usr/bin/env bash
# Measured training choices: the same data, the same training time (--max-minutes) and the same evaluation
# for each variant, one at a time, from scratch, each variant changing one thing against its set's base.
#
#   scripts/recipes.sh DATA[,DATA] OUTDIR [MINUTES]
#
# SET=options (default): docs/training.md "Choices that raise tau per CPU-hour" (distillation, sub-vocabulary, init
#   from the target, against the paper's plain recipe), evaluated by the real decode loop on $EVAL.
# SET=budget: docs/recipe.md "Options for a short budget" (target features, anchors and batch, block size,
#   against the campaign's recipe), evaluated by the offline walk on $REFS; at least 30 minutes per variant.
#
# Each variant writes OUTDIR/<name>/{metrics.jsonl,summary.json,plot.png,draft}; `python
# scripts/recipes_table.py OUTDIR` prints tau per evaluation set, steps, sequences, wall and CPU time per run.
set -euo pipefail
DATA=${1:?usage: scripts/recipes.sh DATA OUTDIR [MINUTES]}
OUT=${2:?usage: scripts/recipes.sh DATA OUTDIR [MINUTES]}
MINUTES=${3:-6}
PY=${PY:-.venv/bin/python}
SET=${SET:-options}
EVAL=${EVAL:-gsm-symbolic-eval}
REFS=${REFS:-data/smollm2-135m-instruct/eval-refs-256.jsonl}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
case $SET in
    options)
        VARIANTS=${VARIANTS:-plain all no-init no-distill all-b8}
        common=(--lr 6e-4 --epochs 100 --max-steps 400 --batch-tokens 2048 --anchors 64 --mask-token-id 16 --block-size 16
                --eval-data "$EVAL" --eval-prompts 4 --eval-max-new-tokens 64 --eval-every 100000
                --save-every 100000) ;;
    budget)
        VARIANTS=${VARIANTS:-base anchors512-batch16k features2 block8}
        common=(--distill --head-vocab 8192 --cache-gb 12 --lr 6e-4 --epochs 30 --max-len 1024
                --eval-refs "$REFS" --keep-checkpoints 12 --seed 7) ;;
    *) echo "unknown SET $SET (options or budget)"; exit 2 ;;
esac
common+=(--target smollm2-135m-instruct --data "$DATA" --layers 2 --max-minutes "$MINUTES" --cache-features --no-progress)
budget_base=(--num-features 5 --block-size 16 --anchors 48 --batch-tokens 2048 --eval-every 250 --save-every 250)
for v in $VARIANTS; do
    case $SET/$v in
        options/plain) extra=() ;;
        options/headvocab) extra=(--head-vocab 8192) ;;
        options/no-init) extra=(--distill --head-vocab 8192) ;;
        options/no-distill) extra=(--init-from-target --head-vocab 8192) ;;
        options/all) extra=(--init-from-target --distill --head-vocab 8192) ;;
        options/all-b8) extra=(--init-from-target --distill --head-vocab 8192 --block-size 8) ;;
        # later options win: each budget variant is the base with one thing changed
        budget/base) extra=("${budget_base[@]}") ;;
        budget/anchors512-batch16k) extra=("${budget_base[@]}" --anchors 512 --batch-tokens 16384 --eval-every 15 --save-every 15) ;;
        budget/features2) extra=("${budget_base[@]}" --num-features 2) ;;
        budget/block8) extra=("${budget_base[@]}" --block-size 8) ;;
        *) echo "unknown variant $v of SET=$SET"; exit 2 ;;
    esac
    [ -f "$OUT/$v/summary.json" ] && { echo "$v: done already"; continue; }
    rm -rf "$OUT/$v"
    echo "== $v: ${extra[*]}"
    /usr/bin/time -f "%U %S %e" -o "$OUT/$v.time" $PY -m flashdraft train "${common[@]}" "${extra[@]}" --out "$OUT/$v" \
        2>&1 | grep -v "Loading weights" | tail -4
done
