#!/usr/bin/env bash
# Trainer blocks/s, A/B in one run on one machine: BEFORE (default commit 28efc1d) against this tree, both
# with the CPU recipe (--distill --head-vocab 8192 --cache-features, 2-layer draft, B=16, all anchors),
# on the first 8 committed gsm sequences, one run at a time:  scripts/train_speed.sh
# Epoch 1 computes the target's features; later epochs read them from the cache.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REV=${REV:-28efc1d}
BEFORE=${BEFORE:-/tmp/flashdraft-$REV}
cd "$ROOT"
[ -d "$BEFORE" ] || git worktree add -f "$BEFORE" "$REV"
mkdir -p runs
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, torch threads ${OMP_NUM_THREADS:-default}"
.venv/bin/python -c "
import json
from flashdraft.train.datagen import read_packed
recs = list(read_packed('data/smollm2-135m-instruct/gsm-symbolic-s0-s1.npz'))[:8]
open('runs/train-speed-data.jsonl', 'w').write(''.join(json.dumps(r) + '\\n' for r in recs))
"
common="--target smollm2-135m-instruct --data $ROOT/runs/train-speed-data.jsonl --layers 2 --block-size 16 --batch-tokens 1024 --anchors 512 --max-steps 9 --epochs 3 --eval-prompts 0 --mask-token-id 16 --no-progress --save-every 100 --distill --head-vocab 8192 --cache-features"
rm -rf runs/train-speed; mkdir -p runs/train-speed
(cd "$BEFORE" && PYTHONPATH="$BEFORE" HF_HUB_OFFLINE=1 "$ROOT/.venv/bin/python" -m flashdraft train $common \
    --out "$ROOT/runs/train-speed/before" > "$ROOT/runs/train-speed/before.log" 2>&1)
HF_HUB_OFFLINE=1 .venv/bin/python -m flashdraft train $common --out runs/train-speed/after > runs/train-speed/after.log 2>&1
.venv/bin/python - <<'PY'
import json
def rate(run):
    m = [json.loads(l) for l in open(f"runs/train-speed/{run}/metrics.jsonl") if '"loss"' in l]
    bps = lambda rows: sum(x["blocks"] for x in rows) / sum(x["blocks"] / x["blocks_per_s"] for x in rows)
    return bps([x for x in m if x["epoch"] == 0]), bps([x for x in m if x["epoch"] > 0]), m[-1]["loss"]
b, a = rate("before"), rate("after")
print("| | epoch 1 blocks/s | later epochs blocks/s | last loss |\n|---|---|---|---|")
for name, r in (("before", b), ("after", a)):
    print(f"| {name} | {r[0]:.1f} | {r[1]:.1f} | {r[2]:.4f} |")
print(f"| after / before | {a[0] / b[0]:.2f}x | {a[1] / b[1]:.2f}x | |")
PY
