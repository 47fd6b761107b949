"""The training campaign's log and curve: held-out tau against cumulative training hours, per sitting.

    # after a sitting: append its in-run evaluations (metrics.jsonl of the run directory)
    python scripts/campaign.py add --card checkpoints/smollm2-135m-instruct-dflash --run runs/campaign-1 \
        --sitting 1 --threads 2 --note "sharegpt corpus + regenerated gsm/code, 5 features"
    # the curve (campaign.png, in the model folder) and the table for MODEL_CARD.md
    python scripts/campaign.py plot --card checkpoints/smollm2-135m-instruct-dflash

The log lives in docs/campaign/<the model folder's name>/ (`--log`), with each sitting's step metrics: a
checkpoint folder holds the model (config, weights, card, plots), not campaign logs.

Hours are hours of optimizer steps with the machine to the run alone (evaluations excluded), summed over
sittings; core-hours multiply them by the threads the run used. The log is `campaign.jsonl`: one row per
evaluation, with the sitting, the cumulative hours, the step and tau (pooled and per set).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def log_dir(card: Path, log: Path | None) -> Path:
    return log or Path(__file__).resolve().parent.parent / "docs" / "campaign" / card.resolve().name


def add(card: Path, log: Path, run: Path, sitting: int, threads: int, note: str) -> list[dict]:
    """Append the in-run evaluations of `run` as sitting `sitting`, after the hours logged so far."""
    log = log / "campaign.jsonl"
    rows = [r for r in read_rows(log) if r["sitting"] != sitting]
    before = max((r["hours"] for r in rows), default=0.0)
    busy, out = 0.0, []
    for m in read_rows(run / "metrics.jsonl"):
        if "loss" in m:
            busy += m["blocks"] / m["blocks_per_s"] / 3600
        if "tau" in m:
            taus = {k.removeprefix("tau/"): v for k, v in m.items() if k.startswith("tau/")}
            out.append(
                {
                    "sitting": sitting,
                    "hours": round(before + busy, 4),
                    "core_hours": round((before + busy) * threads, 4),
                    "step": m["step"],
                    "tau": m["tau"],
                    "sets": taus,
                    "tokens": m.get("eval_tokens"),
                    # "offline": the walk over committed references (--eval-refs); "loop": the real decode loop
                    "protocol": "offline" if "anchors" in m else "loop",
                    "note": note,
                }
            )
    text = "".join(json.dumps(r) + "\n" for r in rows + out)
    log.write_text(text)
    return out


def plot(card: Path, log: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(log / "campaign.jsonl")
    fig, ax = plt.subplots(figsize=(7, 4))
    sets = sorted({s for r in rows for s in r["sets"]})
    colours = {name: f"C{i}" for i, name in enumerate(sets)}
    styles = {
        "loop": ("-", "o", "real loop, 2 prompts x 48 tokens per set"),
        "offline": ("--", "s", "offline walk, 8 prompts x 256 tokens per set"),
    }
    labelled: set[str] = set()  # one legend entry per set, whichever protocol draws it first
    for protocol, (line, mark, what) in styles.items():
        part = [r for r in rows if r.get("protocol", "loop") == protocol]
        if not part:
            continue
        for name in sets:
            pts = [(r["hours"], r["sets"][name]) for r in part if name in r["sets"]]
            label = None if name in labelled else name
            labelled.add(name)
            ax.plot(*zip(*pts, strict=True), line, marker=".", linewidth=1, color=colours[name], label=label)
        hours, taus = [r["hours"] for r in part], [r["tau"] for r in part]
        ax.plot(hours, taus, line, marker=mark, color="k", label=f"all sets ({what})")
    for s in sorted({r["sitting"] for r in rows})[1:]:
        ax.axvline(min(r["hours"] for r in rows if r["sitting"] == s), color="0.8", linewidth=0.8)
    ax.set(xlabel="training hours (2-core machine alone)", ylabel="held-out tau (greedy)")
    ax.set_title("DFlash draft for SmolLM2-135M-Instruct: the campaign so far")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    out = card / "campaign.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add")
    a.add_argument("--card", type=Path, required=True, help="the model folder (the plot goes there)")
    a.add_argument(
        "--log", type=Path, default=None, help="where campaign.jsonl is (docs/campaign/<card name>)"
    )
    a.add_argument("--run", type=Path, required=True)
    a.add_argument("--sitting", type=int, required=True)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--note", default="")
    g = sub.add_parser("plot")
    g.add_argument("--card", type=Path, required=True, help="the model folder (the plot goes there)")
    g.add_argument(
        "--log", type=Path, default=None, help="where campaign.jsonl is (docs/campaign/<card name>)"
    )
    args = p.parse_args(argv)
    log = log_dir(args.card, args.log)
    log.mkdir(parents=True, exist_ok=True)
    if args.cmd == "add":
        for r in add(args.card, log, args.run, args.sitting, args.threads, args.note):
            print(
                f"sitting {r['sitting']} step {r['step']}: {r['hours']:.2f} h, tau {r['tau']:.3f} {r['sets']}"
            )
    else:
        print(plot(args.card, log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
