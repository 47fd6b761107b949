"""The training campaign's log and curve: held-out tau against cumulative training hours, per sitting.

    # after a sitting: append its in-run evaluations (metrics.jsonl of the run directory)
    python scripts/campaign.py add --card checkpoints/smollm2-135m-instruct-dflash --run runs/campaign-1 \
        --sitting 1 --threads 2 --note "sharegpt corpus + regenerated gsm/code, 5 features"
    # the curve (campaign.png, in the model folder) and the table for MODEL_CARD.md
    python scripts/campaign.py plot --card checkpoints/smollm2-135m-instruct-dflash
    # the shipped draft's lineage.json, rebuilt by replaying its sittings' data plans (see SITTINGS)
    python scripts/campaign.py lineage --card checkpoints/smollm2-135m-instruct-dflash

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
    lineage = run / "draft" / "lineage.json"
    unique = unique_tokens(json.loads(lineage.read_text())) if lineage.is_file() else None
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
                    "unique_tokens": unique,  # distinct response tokens of the draft's lineage at its end
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
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
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
    _plot_tokens(ax2, rows, log)
    out = card / "campaign.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def _plot_tokens(ax, rows: list[dict], log: Path) -> None:
    """Each sitting's last held-out tau against the distinct response tokens its lineage had read by then
    (the row's own count, else `lineage`'s replay of the shipped draft's sittings)."""
    replay = log / "lineage-by-sitting.json"
    known = {int(k): v for k, v in json.loads(replay.read_text()).items()} if replay.is_file() else {}
    for protocol, mark in (("loop", "o"), ("offline", "s")):
        pts = []
        for s in sorted({r["sitting"] for r in rows}):
            last = [r for r in rows if r["sitting"] == s][-1]
            tokens = last.get("unique_tokens") or known.get(s)
            if tokens and last.get("protocol", "loop") == protocol:
                pts.append((tokens, last["tau"], s))
        for x, y, s in pts:
            ax.annotate(str(s), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if pts:
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], mark, color="k", label=f"{protocol} (sitting no.)"
            )
    ax.set_xscale("log")
    ax.set(xlabel="distinct response tokens read by the lineage", ylabel="held-out tau at the sitting's end")
    ax.set_title("tau against data", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


D = "data/smollm2-135m-instruct"
CORPUS_MIX = f"sharegpt:0.7,{D}/gsm-symbolic-s0-s1.npz:0.2,{D}/code-stdlib.npz:0.1"
# The sittings that made the shipped SmolLM2 draft, oldest first, as the model card records their commands
# (every one with --batch-tokens 2048 --max-len 1024 --epochs 30, no held-out records). They ran before the
# trainer kept lineage.json; `lineage` replays each one's data plan (the plan is a pure function of the data,
# the seed and these options) for as many steps as its metrics file logs.
SITTINGS = [
    (1, CORPUS_MIX, {"corpus_limit": 1000, "corpus_skip": 0, "block_size": 16, "seed": 0}),
    (2, CORPUS_MIX, {"corpus_limit": 1000, "corpus_skip": 1000, "block_size": 16, "seed": 1}),
    (4, CORPUS_MIX, {"corpus_limit": 1000, "corpus_skip": 3000, "block_size": 16, "seed": 3}),
    (
        5,
        f"{D}/sharegpt-regen-bf16.npz:0.65,{D}/code-stdlib-regen-bf16.npz:0.15,{D}/gsm-symbolic-s0-s1.npz:0.2",
        {"block_size": 16, "seed": 5},
    ),
    (
        6,
        f"{D}/sharegpt-regen-bf16.npz:0.28,{D}/sharegpt-regen-bf16-2.npz:0.16,{D}/sharegpt-regen-bf16-3.npz:0.21,"
        f"{D}/code-stdlib-regen-bf16.npz:0.15,{D}/gsm-symbolic-s0-s1.npz:0.2",
        {"block_size": 16, "seed": 6},
    ),
    (
        10,
        f"{D}/sharegpt-regen-bf16-4.npz:0.24,{D}/sharegpt-regen-bf16-5.npz:0.24,{D}/sharegpt-regen-bf16-6.npz:0.17,"
        f"{D}/code-stdlib-regen-bf16.npz:0.15,{D}/gsm-symbolic-s0-s1.npz:0.2",
        {"block_size": 8, "seed": 10},
    ),
]


def lineage(card: Path, log: Path, target: str = "smollm2-135m-instruct") -> dict:
    """The shipped draft's lineage, rebuilt: each sitting's plan replayed and its draws counted over the
    steps it ran. Checked against the log: every replayed step has the number of sequences it logged."""
    from flashdraft.models.load import load_target
    from flashdraft.train import lineage as L
    from flashdraft.train.config import TrainConfig
    from flashdraft.train.data import drawn, plan_epochs, prepare_data

    root = Path(__file__).resolve().parent.parent
    tok = load_target(target, "float32", runner="transformers")
    prior: dict = {}
    by_sitting: dict[int, int] = {}
    for sitting, data, opts in SITTINGS:
        cfg = TrainConfig(
            target=target,
            data=[x if x.startswith("sharegpt:") else str(root / x) for x in data.split(",")],
            out="-",
            eval_prompts=0,
            batch_tokens=2048,
            max_len=1024,
            epochs=30,
            **opts,
        )
        seqs, _, stats = prepare_data(cfg, tok.vocab_size, tok.tokenizer)
        for s in stats["sources"]:
            s["name"] = s["name"].removeprefix(str(root) + "/")
        plans = plan_epochs(
            [q.source for q in seqs], [q.ids.numel() for q in seqs], stats["weights"], cfg.seed, 30, 2048
        )
        logged = [m["sequences"] for m in read_rows(log / f"campaign-{sitting}-metrics.jsonl") if "loss" in m]
        if not logged:
            raise SystemExit(f"sitting {sitting}: no step metrics in {log}")
        batches = [b for plan in plans for b in plan][: len(logged)]
        if [len(b) for b in batches] != logged:
            raise SystemExit(f"sitting {sitting}: the replayed plan does not match the logged batches")
        draws = drawn(plans, [q.source for q in seqs], len(batches), len(stats["sources"]))
        new = L.lineage_after(stats["sources"], draws, prior, 3.0)
        prior = {x["key"]: x for x in new["sources"]}
        by_sitting[sitting] = unique_tokens(new)
        print(f"sitting {sitting}: {len(batches)} steps replayed, the logged batch sizes matched", flush=True)
    L.write_lineage(card, new)
    (log / "lineage-by-sitting.json").write_text(json.dumps(by_sitting, indent=1) + "\n")
    return new


def unique_tokens(lineage: dict) -> int:
    """The distinct response tokens a lineage has trained on: every source it read, counted once."""
    return sum(s.get("response_tokens") or 0 for s in lineage["sources"] if s["views"] > 0)


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
    n = sub.add_parser("lineage")
    n.add_argument("--card", type=Path, required=True, help="the model folder (lineage.json goes there)")
    n.add_argument(
        "--log", type=Path, default=None, help="where the sittings' metrics are (docs/campaign/<card name>)"
    )
    args = p.parse_args(argv)
    log = log_dir(args.card, args.log)
    log.mkdir(parents=True, exist_ok=True)
    if args.cmd == "add":
        for r in add(args.card, log, args.run, args.sitting, args.threads, args.note):
            print(
                f"sitting {r['sitting']} step {r['step']}: {r['hours']:.2f} h, tau {r['tau']:.3f} {r['sets']}"
            )
    elif args.cmd == "lineage":
        from flashdraft.train.lineage import describe

        print("\n".join(describe(lineage(args.card, log))))
    else:
        print(plot(args.card, log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
