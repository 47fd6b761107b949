#!/usr/bin/env bash
# Batch-1 step time of the engine against commit 28efc1d (the separate batch-1 loop), A/B in one run on one
# machine: scripts/bench_step.py from each tree, alternately, ROUNDS times each; prints the median step times
# and this tree's ratio (goal: within 3%, i.e. ratio <= 1.03).   scripts/engine_speed.sh [ROUNDS] [DTYPE]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REV=${REV:-28efc1d}
BEFORE=${BEFORE:-/tmp/flashdraft-$REV}
ROUNDS=${1:-3}
DTYPE=${2:-float32}
PY=${PYTHON:-$ROOT/.venv/bin/python}  # the environment of this tree (PYTHON=... to use another)
cd "$ROOT"
[ -d "$BEFORE" ] || git worktree add -f "$BEFORE" "$REV"
mkdir -p runs/engine-speed
echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores, torch threads ${OMP_NUM_THREADS:-default}; $DTYPE"
for i in $(seq "$ROUNDS"); do
    (cd "$BEFORE" && PYTHONPATH="$BEFORE" "$PY" scripts/bench_step.py --dtype "$DTYPE") \
        > "runs/engine-speed/before-$i.log"
    PYTHONPATH="$ROOT" "$PY" scripts/bench_step.py --dtype "$DTYPE" > "runs/engine-speed/after-$i.log"
done
"$PY" - "$ROUNDS" <<'PY'
import re, statistics, sys
rounds = int(sys.argv[1])
def steps(name):
    out = {}
    for i in range(1, rounds + 1):
        for line in open(f"runs/engine-speed/{name}-{i}.log"):
            m = re.match(r"\s*(.+?): step\s+([\d.]+) ms", line)
            if m:
                out.setdefault(m.group(1), []).append(float(m.group(2)))
    return out
before, after = steps("before"), steps("after")
print("| mode | before: median step ms | after: median step ms | after / before |\n|---|---|---|---|")
for mode in before:
    b, a = statistics.median(before[mode]), statistics.median(after[mode])
    print(f"| {mode} | {b:.1f} | {a:.1f} | {a / b:.3f} |")
PY
