"""Which exact sampling proposal accepts more: drafts sampled from the draft's own distribution q
(rejection sampling with min(1, p/q)) or the draft's argmax (one-hot q: accept iff the target's
sample equals it)? Both are lossless; this measures tau for each on the same prompts and seeds.

    python scripts/sampling_acceptance.py --target smollm2-135m-instruct --draft DIR --prompts 8
"""

import argparse
import statistics

import torch

from flashdraft import DFlashDraft, DFlashProposer, GenerationConfig, SamplingConfig, generate
from flashdraft.data import load_dataset
from flashdraft.models import load_target


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--dataset", default="gsm-symbolic")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args()
    target = load_target(args.target, torch.bfloat16)
    draft = DFlashDraft.from_pretrained(args.draft, dtype=torch.bfloat16)
    tok = target.tokenizer
    prompts = [
        tok.apply_chat_template(ex.messages(), tokenize=True, add_generation_prompt=True, return_dict=False)
        for ex in load_dataset(args.dataset, limit=args.prompts, seed=1234)
    ]
    print(f"{args.prompts} {args.dataset} prompts, {args.max_new_tokens} new tokens, {args.seeds} seeds each")
    print("| temperature | top_p | tau, q-sampled drafts | tau, argmax drafts |")
    print("|---|---|---|---|")
    for temp, top_p in [(0.7, 1.0), (1.0, 1.0), (1.0, 0.9)]:
        taus = {}
        for proposal in ("draft", "greedy"):
            proposer = DFlashProposer(draft, target, proposal=proposal)
            lengths = []
            for seed in range(args.seeds):
                for p in prompts:
                    cfg = GenerationConfig(
                        args.max_new_tokens, None, SamplingConfig(temp, 0, top_p), target.stop_ids, seed=seed
                    )
                    lengths += generate(target, p, proposer, cfg).acceptance_lengths
            taus[proposal] = statistics.mean(lengths)
        print(f"| {temp} | {top_p} | {taus['draft']:.3f} | {taus['greedy']:.3f} |")


if __name__ == "__main__":
    main()
