"""A draft call's cost in plain decoding steps, with and without its draft vocabulary: A/B in one run.

    python scripts/draft_cost.py --draft checkpoints/smollm2-135m-instruct-dflash [--block-sizes 8,16]

Uses `flashdraft bench`'s calibration (isolated forwards, medians) at the context of a real chat
prompt: c_step is a 1-token target forward, c_draft(B) one draft call (a new context token, a block
of B, the LM head on B-1 positions), c_verify(B) the B-token verify. The draft is timed as it loads
(its draft vocabulary, if any) and with the full LM head (`vocab=False`), alternately.
"""

from __future__ import annotations

import argparse
import os
import platform

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from flashdraft.bench.bench import calibrate  # noqa: E402
from flashdraft.chat import chat_ids  # noqa: E402
from flashdraft.models.draft import DFlashDraft  # noqa: E402
from flashdraft.models.load import load_target  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--draft", required=True)
    p.add_argument("--block-sizes", default="8,16")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rounds", type=int, default=3, help="alternating A/B rounds")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.block_sizes.split(",")]
    target = load_target(args.target, "auto", "cpu")
    prompt = chat_ids(
        target.tokenizer,
        [{"role": "user", "content": "Explain in a few sentences how a hash table handles collisions."}],
    )
    seq = list(prompt) + [target.tokenizer.encode(" The", add_special_tokens=False)[0]] * 64
    drafts = {
        "draft vocabulary": DFlashDraft.from_pretrained(args.draft, dtype=target.dtype),
        "full LM head": DFlashDraft.from_pretrained(args.draft, dtype=target.dtype, vocab=False),
    }
    v = drafts["draft vocabulary"].vocab
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {target.dtype}; "
        f"context {len(seq)} tokens; draft vocabulary: {'none' if v is None else f'{v.numel()} tokens'}"
    )
    runs: dict[str, list[dict]] = {k: [] for k in drafts}
    for _ in range(args.rounds):
        for name, draft in drafts.items():
            runs[name].append(calibrate(target, draft, seq, sizes, reps=args.reps))
    for name, rows in runs.items():
        c_step = sorted(r["c_step_s"] for r in rows)[len(rows) // 2]
        parts = []
        for b in sizes:
            c_draft = sorted(r["c_draft_s"][b] for r in rows)[len(rows) // 2]
            c_verify = sorted(r["c_verify_s"][b] for r in rows)[len(rows) // 2]
            parts.append(
                f"B={b}: draft {1e3 * c_draft:.1f} ms = {c_draft / c_step:.2f} steps, "
                f"verify {c_verify / c_step:.2f} steps"
            )
        print(f"{name:>16}: plain step {1e3 * c_step:.1f} ms; " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
