"""Which exact sampling proposal accepts more: drafts sampled from the draft's own distribution q
(rejection sampling with min(1, p/q)) or the draft's argmax (one-hot q: accept iff the target's
sample equals it)? Both are lossless; this measures tau for each on the same prompts and seeds, and the
paired difference (per prompt and seed) with its standard error.

    python scripts/sampling_acceptance.py --target smollm2-135m-instruct --draft DIR --prompts 4
"""

import argparse
import math
import statistics

from flashdraft import DFlashDraft, DFlashProposer, GenerationConfig, SamplingConfig, generate
from flashdraft.chat import chat_ids
from flashdraft.data import load_dataset
from flashdraft.models.load import load_target


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--datasets", default="gsm-symbolic-eval,mt-bench,humaneval")
    ap.add_argument("--prompts", type=int, default=4, help="per data set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--settings", default="0.7:1.0,1.0:1.0", help="temperature:top_p pairs")
    args = ap.parse_args()
    target = load_target(args.target)  # dtype auto: float32 where the CPU has no native bf16
    draft = DFlashDraft.from_pretrained(args.draft, dtype=target.dtype)
    prompts = [
        chat_ids(target.tokenizer, ex.messages())
        for name in args.datasets.split(",")
        for ex in load_dataset(name, limit=args.prompts)[: args.prompts]
    ]
    print(
        f"{len(prompts)} prompts ({args.datasets}, {args.prompts} each), {args.max_new_tokens} new tokens, "
        f"{args.seeds} seed(s); {target.dtype}; draft {args.draft}"
    )
    print(
        "| temperature | top_p | tau, q-sampled drafts | tau, argmax drafts | difference (paired, +- s.e.) |"
    )
    print("|---|---|---|---|---|")
    for setting in args.settings.split(","):
        temp, top_p = (float(x) for x in setting.split(":"))
        taus = {}
        for proposal in ("draft", "greedy"):
            proposer = DFlashProposer(draft, target, proposal=proposal)
            taus[proposal] = []
            for seed in range(args.seeds):
                for p in prompts:
                    cfg = GenerationConfig(
                        args.max_new_tokens, None, SamplingConfig(temp, 0, top_p), target.stop_ids, seed=seed
                    )
                    taus[proposal].append(generate(target, p, proposer, cfg).tau)
        diff = [a - b for a, b in zip(taus["draft"], taus["greedy"], strict=True)]
        se = statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else float("nan")
        print(
            f"| {temp} | {top_p} | {statistics.mean(taus['draft']):.3f} | {statistics.mean(taus['greedy']):.3f} "
            f"| {statistics.mean(diff):+.3f} +- {se:.3f} |"
        )


if __name__ == "__main__":
    main()
