"""Score drafts on the target's own greedy answers, without the decode loop (flashdraft.train.acceptance).

    # once: the target's greedy answers to 8 prompts of each evaluation set, 256 new tokens
    python scripts/offline_tau.py --target smollm2-135m-instruct --refs runs/refs.jsonl --make-refs \
        --sets sharegpt-eval,mt-bench,humaneval,gsm-symbolic-eval --prompts 8 --max-new-tokens 256
    # then, as often as you like: tau per set for each draft (a directory or a training checkpoint); for
    # SmolLM2 the references of the model card's table are committed: data/smollm2-135m-instruct/eval-refs-256.jsonl
    python scripts/offline_tau.py --target smollm2-135m-instruct --refs runs/refs.jsonl \
        --draft checkpoints/smollm2-135m-instruct-dflash,runs/x/checkpoints/step-00000600 [--real]

`--real` also runs the real greedy loop on the same prompts and lengths, to show that both agree. Each
prints tau per set and the acceptance per block position (the share of steps that accepted position k).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from flashdraft.models.draft import DFlashDraft  # noqa: E402
from flashdraft.models.load import load_target  # noqa: E402
from flashdraft.models.target import resolve_dtype  # noqa: E402
from flashdraft.train.acceptance import (  # noqa: E402
    greedy_references,
    offline_tau,
    offline_trees,
    read_references,
    write_references,
)
from flashdraft.train.data import dataset_prompts  # noqa: E402
from flashdraft.train.loop import evaluate_tau  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--refs", required=True, help="references JSONL (written with --make-refs)")
    p.add_argument("--make-refs", action="store_true", help="write the references first")
    p.add_argument("--sets", default="sharegpt-eval,mt-bench,humaneval,gsm-symbolic-eval")
    p.add_argument("--prompts", type=int, default=8, help="prompts per set (with --make-refs)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="with --make-refs")
    p.add_argument("--draft", default="", help="comma-separated draft directories")
    p.add_argument("--real", action="store_true", help="also run the real greedy loop on the same prompts")
    p.add_argument(
        "--context-vocab",
        action="store_true",
        help="each request's own tokens join the draft vocabulary (DFlashProposer(context_vocab=True))",
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--runner",
        default="transformers",
        choices=["transformers", "auto"],
        help="the target's model code: transformers (the campaign's yardstick since sitting 4: the features "
        "the draft trains on) or auto (the native runner and its default weights, what serve runs)",
    )
    p.add_argument(
        "--quantize",
        default="auto",
        help="with --runner auto: the runner's weights (auto, q8_0, q4_1, int8, int4, none), as `generate` takes them",
    )
    p.add_argument(
        "--trees",
        default="",
        help="comma-separated node budgets: also score trees built best-first from each block's marginals "
        "(accepted tokens per verify; issue 48's bound), e.g. 4,8,12,16",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    quantize = args.quantize if args.runner == "auto" else "auto"
    target = load_target(args.target, dtype, "cpu", runner=args.runner, quantize=quantize)
    if args.make_refs:
        prompts = {s: dataset_prompts(s, args.prompts, target.tokenizer) for s in args.sets.split(",") if s}
        t0 = time.perf_counter()
        refs = greedy_references(target, prompts, args.max_new_tokens)
        write_references(refs, args.refs)
        n = sum(len(r["response_ids"]) for r in refs)
        print(f"{len(refs)} references, {n} tokens, in {time.perf_counter() - t0:.0f} s -> {args.refs}")
    refs = read_references(args.refs)
    results = {}
    for path in (d for d in args.draft.split(",") if d):
        draft = DFlashDraft.from_pretrained(path, dtype=target.dtype)
        t0 = time.perf_counter()
        est = offline_tau(draft, target, refs, args.context_vocab)
        est["offline_s"] = round(time.perf_counter() - t0, 1)
        if args.real:
            sets: dict[str, list[list[int]]] = {}
            for r in refs:
                sets.setdefault(r["set"], []).append(r["prompt_ids"])
            longest = max(len(r["response_ids"]) for r in refs)
            real = evaluate_tau(draft, target, sets, draft.config.block_size, longest)
            est |= {f"real_{k}": v for k, v in real.items()}
        results[path] = est
        cols = " ".join(f"{k.removeprefix('tau/')} {v:.3f}" for k, v in est.items() if k.startswith("tau/"))
        line = (
            f"{path}: offline tau {est['tau']:.3f} ({cols}; {est['anchors']} anchors, {est['offline_s']} s)"
        )
        if args.real:
            line += f"; real loop tau {est['real_tau']:.3f} ({est['real_eval_s']:.0f} s)"
        print(line, flush=True)
        for key in ("position_acceptance", "real_position_acceptance"):
            if key in est:  # the share of steps that accepted the drafted token at block position k
                print(f"  {key}: " + " ".join(f"{k}:{v:.3f}" for k, v in enumerate(est[key], 1)), flush=True)
        if args.trees:
            budgets = [int(x) for x in args.trees.split(",")]
            est |= offline_trees(draft, target, refs, budgets)
            print_trees(est, draft.config.block_size - 1, budgets, sorted({r["set"] for r in refs}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def print_trees(est: dict, chain: int, budgets: list[int], sets: list[str]) -> None:
    """Accepted tokens per verify (walked, as the loop visits anchors), the chain against trees."""
    print(f"\n| drafted tokens per verify | {' | '.join(sets)} | pooled |")
    print("|---" * (len(sets) + 2) + "|")
    print(
        f"| chain of {chain} (today) | "
        + " | ".join(f"{est[f'tau/{s}']:.3f}" for s in sets)
        + f" | {est['tau']:.3f} |"
    )
    for n in budgets:
        row = " | ".join(f"{est[f'tree{n}/tau/{s}']:.3f}" for s in sets)
        print(f"| tree of {n} | {row} | {est[f'tree{n}/tau/all']:.3f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
