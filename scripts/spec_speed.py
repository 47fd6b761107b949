"""Batch-1 speculative decoding on held-out chat prompts: plain, chains, trees and adaptive speculation, each
with the draft's layers on our kernels in one C++ call and on torch's ops, interleaved prompt by prompt.

    python scripts/spec_speed.py [--prompts 3] [--new 96] [--chains 3,7] [--trees 3,4,6,8]

Every method decodes every prompt (greedy) before the next prompt starts, the order rotating, so the
machine's drift hits all alike; EOS is ignored (every prompt decodes --new tokens). Prints a table: decode
tokens per second (prefill excluded), the speedup over plain decoding, tau (tokens committed per verify forward) and the median draft and verify
times of a step. "torch" methods run the same quantized draft with its layers on torch's ops; "adaptive,
chains only" verifies its cut chains as chains (the default verifies a greedy row's chain of 2 or more as a
tree of as many tokens).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from flashdraft import DFlashDraft, DFlashProposer, Engine, GenerationConfig  # noqa: E402
from flashdraft.chat import chat_ids  # noqa: E402
from flashdraft.data import load_dataset  # noqa: E402
from flashdraft.engine.adaptive import make_proposer  # noqa: E402
from flashdraft.models.load import load_target  # noqa: E402

SETS = ("mt-bench", "humaneval", "gsm-symbolic-eval", "sharegpt-eval")


def methods(draft, target, chains, trees) -> dict:
    """name -> (proposer, block size)."""

    def on_torch(p):
        (p.dflash if hasattr(p, "dflash") else p).draft.native = None
        return p

    out = {"plain": (None, 1)}
    for layers, wrap in (("native", lambda p: p), ("torch", on_torch)):
        for k in chains:
            out[f"chain {k} ({layers})"] = (wrap(DFlashProposer(draft, target)), k + 1)
        for n in trees:
            out[f"tree {n} ({layers})"] = (
                wrap(DFlashProposer(draft, target, tree=n)),
                draft.config.block_size,
            )
        out[f"adaptive ({layers})"] = (wrap(make_proposer(draft, target)), draft.config.block_size)
    chains = make_proposer(draft, target)
    chains.trees = False  # its cut chains verified as chains
    out["adaptive, chains only (native)"] = (chains, draft.config.block_size)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--draft", default="checkpoints/smollm2-135m-instruct-dflash")
    p.add_argument("--prompts", type=int, default=3, help="per held-out set")
    p.add_argument("--new", type=int, default=96, help="new tokens per prompt")
    p.add_argument("--chains", default="3,7", help="drafted tokens per chain")
    p.add_argument("--trees", default="3,4,6,8", help="drafted tokens per tree")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    draft = DFlashDraft.from_pretrained(args.draft, dtype=target.dtype)
    prompts = [
        chat_ids(target.tokenizer, ex.messages()) for s in SETS for ex in load_dataset(s, limit=args.prompts)
    ]
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    runs = methods(draft, target, ints(args.chains), ints(args.trees))
    stats = {
        name: {"tokens": 0, "s": 0.0, "committed": 0, "forwards": 0, "draft": [], "verify": []}
        for name in runs
    }
    config = GenerationConfig(max_new_tokens=args.new)
    for i, ids in enumerate(prompts):
        names = list(runs)
        for name in names[i % len(names) :] + names[: i % len(names)]:
            proposer, block = runs[name]
            engine = Engine(target, proposer, block, max_batch_size=1)
            row = engine.add("0", ids, config)
            engine.step()  # the prefill and the first token
            t0 = time.perf_counter()
            while engine.pending():
                engine.step()
            s = stats[name]
            s["s"] += time.perf_counter() - t0
            s["tokens"] += len(row.tokens) - 1
            s["committed"] += engine.stats["committed"]
            s["forwards"] += engine.stats["forwards"]
            s["draft"] += row.draft_s
            s["verify"] += row.verify_s
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    print(
        f"\n{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {getattr(target, 'describe', lambda: '')()}"
    )
    print(
        f"{len(prompts)} prompts ({args.prompts} per set of {', '.join(SETS)}), up to {args.new} new tokens\n"
    )
    print("| method | tok/s | x plain | tau | draft ms | verify ms |")
    print("|---|---|---|---|---|---|")
    plain = stats["plain"]["tokens"] / stats["plain"]["s"]
    for name, s in stats.items():
        rate = s["tokens"] / s["s"]
        med = lambda xs: 1e3 * statistics.median(xs) if xs else 0.0  # noqa: E731
        print(
            f"| {name} | {rate:.1f} | {rate / plain:.2f} | {s['committed'] / max(1, s['forwards']):.2f} "
            f"| {med(s['draft']):.2f} | {med(s['verify']):.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
