"""Table of the runs of scripts/recipes.sh: tau per evaluation set at the end, and what it cost.

python scripts/recipes_table.py OUTDIR
"""

import json
import sys
from pathlib import Path


def main(root: Path) -> None:
    rows = []
    for run in sorted(p for p in root.iterdir() if (p / "metrics.jsonl").is_file()):
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
        evals = [m for m in metrics if m.get("tau") is not None]
        first, last = (evals[0], evals[-1]) if evals else ({}, {})
        steps = [m for m in metrics if m.get("loss") is not None]
        cpu = wall = None
        timing = root / f"{run.name}.time"
        if timing.is_file():
            user, system, wall = map(float, timing.read_text().split()[-3:])
            cpu = user + system
        sets = sorted(k for k in last if k.startswith("tau/"))
        rows.append(
            {
                "run": run.name,
                "steps": steps[-1]["step"] if steps else 0,
                "sequences": sum(m.get("sequences", 0) for m in steps),
                "loss": f"{steps[0]['loss']:.2f} -> {steps[-1]['loss']:.2f}" if steps else "-",
                "tau": f"{first.get('tau', float('nan')):.3f} -> {last.get('tau', float('nan')):.3f}",
                **{k.removeprefix("tau/"): f"{last[k]:.3f}" for k in sets},
                "blocks/s": f"{sum(m['blocks'] for m in steps) / sum(m['blocks'] / m['blocks_per_s'] for m in steps):.0f}"
                if steps
                else "-",
                "wall min": f"{wall / 60:.1f}" if wall else "-",
                "cpu min": f"{cpu / 60:.1f}" if cpu else "-",
            }
        )
    cols = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
