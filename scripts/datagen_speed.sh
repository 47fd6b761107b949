#!/usr/bin/env bash
# Datagen useful tokens/s before (commit 28efc1d: HF generate, finished rows keep decoding until the
# batch's longest ends) and after (the batched decoder: a finished row leaves at once), same prompts,
# same settings, one run at a time:  scripts/datagen_speed.sh [LIMIT] [BATCH] [NEW_TOKENS]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BEFORE=${BEFORE:-/tmp/flashdraft-28efc1d}
LIMIT=${1:-64}
BATCH=${2:-32}
NEW=${3:-128}
cd "$ROOT"
[ -d "$BEFORE" ] || git worktree add -f "$BEFORE" 28efc1d
rm -rf runs/datagen-speed; mkdir -p runs/datagen-speed
common="--target smollm2-135m-instruct --dataset sharegpt-train --limit $LIMIT --batch-size $BATCH --max-new-tokens $NEW --no-progress"
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; $common"
(cd "$BEFORE" && PYTHONPATH="$BEFORE" HF_HUB_OFFLINE=1 "$ROOT/.venv/bin/python" -m flashdraft datagen $common \
    --out "$ROOT/runs/datagen-speed/before.jsonl") | tee runs/datagen-speed/before.log
HF_HUB_OFFLINE=1 .venv/bin/python -m flashdraft datagen $common --out runs/datagen-speed/after.jsonl \
    | tee runs/datagen-speed/after.log
.venv/bin/python - <<'PY'
import json
rows = {}
for name in ("before", "after"):
    recs = {r["id"]: r for r in map(json.loads, open(f"runs/datagen-speed/{name}.jsonl"))}
    rows[name] = recs
same = sum(rows["before"][k]["response_ids"] == rows["after"].get(k, {}).get("response_ids") for k in rows["before"])
print(f"greedy answers identical before/after: {same}/{len(rows['before'])}")
PY
