"""Datagen's tokens/s on the serving runner (`--runner auto`: our kernels, the weights `serve` runs)
against transformers' path (`--runner transformers`), side by side. (Not a test.)

    python scripts/datagen_speed.py [--target smollm2-135m-instruct] [--limit 96] [--batch 64]
        [--new 128] [--rounds 3] [--alone 16]

The same prompts and settings for both, run one after the other, round after round (this kind of VM
drifts by 15-25% over minutes); the table shows every round and the ratio of the medians. Then the
first `--alone` prompts are answered again by the serving runner one at a time (batch 1): each batched
answer must have their bits (rows join and leave a batch without changing anyone's answer).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from flashdraft.models.runner import kernels
from flashdraft.train.datagen import DatagenConfig, run_datagen

RUNNERS = ("transformers", "auto")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def answers(path: Path) -> dict[str, list[int]]:
    return {r["id"]: r["response_ids"] for r in map(json.loads, path.read_text().splitlines())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dataset", default="sharegpt-train")
    ap.add_argument("--limit", type=int, default=96)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=128, help="--max-new-tokens")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--alone", type=int, default=16, help="the first N prompts answered again at batch 1")
    args = ap.parse_args()
    kernels.available()  # built before anything is timed
    print(
        f"machine: {cpu_name()}, {torch.get_num_threads()} threads, "
        f"kernel path {kernels.path_name()}; {args.dataset} x {args.limit}, batch {args.batch}, "
        f"{args.new} new tokens"
    )
    work = Path(tempfile.mkdtemp(prefix="datagen-speed-"))

    def run(runner: str, out: Path, batch: int, limit: int):
        cfg = DatagenConfig(
            target=args.target,
            datasets=[args.dataset],
            out=out,
            max_new_tokens=args.new,
            batch_size=batch,
            limit=limit,
            max_prompt_tokens=args.max_prompt_tokens,
            runner=runner,
            progress=False,
        )
        return run_datagen(cfg), cfg.weights

    rates: dict[str, list[float]] = {r: [] for r in RUNNERS}
    for i in range(args.rounds):
        for runner in RUNNERS:
            s, weights = run(runner, work / f"{runner}-{i}.jsonl", args.batch, args.limit)
            rates[runner].append(s.tokens_per_s)
            print(
                f"round {i + 1} {runner:12s} {s.tokens_per_s:7.1f} tokens/s ({s.response_tokens} tokens; {weights})"
            )
    base, ours = (statistics.median(rates[r]) for r in RUNNERS)
    print(f"median: transformers {base:.1f}, serving runner {ours:.1f} tokens/s: {ours / base:.2f}x")
    if args.alone:
        batched = answers(work / "auto-0.jsonl")
        run("auto", work / "alone.jsonl", 1, args.alone)  # the first prompts of the same list
        alone = answers(work / "alone.jsonl")
        ids = [k for k in alone if k in batched]
        same = sum(batched[k] == alone[k] for k in ids)
        print(f"batch {args.batch} answers equal to batch 1's: {same}/{len(ids)}")


if __name__ == "__main__":
    main()
