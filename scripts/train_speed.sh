#!/usr/bin/env bash
# Trainer blocks/s before (commit 384c25c: dense block mask, full softmax, target forward every step)
# and after, on the first 8 committed gsm sequences, one run at a time:  scripts/train_speed.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BEFORE=${BEFORE:-/tmp/flashdraft-384c25c}
cd "$ROOT"
[ -d "$BEFORE" ] || git worktree add -f "$BEFORE" 384c25c
mkdir -p runs
.venv/bin/python -c "
import json
from flashdraft.datagen import read_packed
recs = list(read_packed('data/smollm2-135m-instruct/gsm-symbolic-s0-s1.npz'))[:8]
open('runs/train-speed-data.jsonl', 'w').write(''.join(json.dumps(r) + '\\n' for r in recs))
"
common="--target smollm2-135m-instruct --data runs/train-speed-data.jsonl --layers 2 --block-size 16 --batch-tokens 1024 --anchors 512 --max-steps 6 --epochs 3 --eval-prompts 0 --mask-token-id 16 --no-progress --save-every 100"
rm -rf runs/train-speed; mkdir -p runs/train-speed
(cd "$BEFORE" && PYTHONPATH="$BEFORE" "$ROOT/.venv/bin/python" -m flashdraft train ${common//runs\//$ROOT/runs/} --out "$ROOT/runs/train-speed/before" > "$ROOT/runs/train-speed/before.log" 2>&1)
.venv/bin/python -m flashdraft train $common --out runs/train-speed/after-plain > runs/train-speed/after-plain.log 2>&1
.venv/bin/python -m flashdraft train $common --head-vocab 8192 --distill --out runs/train-speed/after-recipe > runs/train-speed/after-recipe.log 2>&1
.venv/bin/python -m flashdraft train $common --head-vocab 8192 --distill --cache-features --out runs/train-speed/after-cached > runs/train-speed/after-cached.log 2>&1
for r in before after-plain after-recipe after-cached; do
  python3 - "$r" <<'PY'
import json, sys
r = sys.argv[1]
m = [json.loads(l) for l in open(f"runs/train-speed/{r}/metrics.jsonl") if '"loss"' in l]
e0 = [x for x in m if x["epoch"] == 0]; later = [x for x in m if x["epoch"] > 0]
bps = lambda rows: sum(x["blocks"] for x in rows) / sum(x["blocks"] / x["blocks_per_s"] for x in rows) if rows else float("nan")
print(f"{r}: epoch 1 {bps(e0):.1f} blocks/s, later epochs {bps(later):.1f} blocks/s ({len(m)} steps)")
PY
done
