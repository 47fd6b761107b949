"""Bookkeeping overhead of one speculative step (issue 2, acceptance 7).

A ~110M-parameter random Llama target in bf16 and a 2-layer DFlash draft: for every step of the
decode loop we time the draft forward, the verify forward and the whole step; bookkeeping is the
rest (acceptance, commit, cache crops, feature hand-over). Prints the median share of bookkeeping.
Run on an otherwise idle machine: `make bench-step`.
"""

import argparse
import statistics

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flashdraft import DFlashDraft, DFlashProposer, GenerationConfig, SamplingConfig, Target, generate
from flashdraft.models.draft import init_draft_config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    dtype = getattr(torch, args.dtype)
    model = LlamaForCausalLM(cfg).to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    target = Target(model)
    draft = DFlashDraft(init_draft_config(cfg, 2, mask_token_id=0, block_size=args.block_size)).to(dtype)
    proposer = DFlashProposer(draft, target)
    prompt = torch.randint(0, 32000, (args.prompt,)).tolist()
    print(
        f"target: {n_params / 1e6:.0f}M parameters, {args.dtype}, {torch.get_num_threads()} threads; "
        f"draft: 2 layers; block {args.block_size}; prompt {args.prompt}; {args.new} new tokens"
    )
    for name, sampling in [
        ("greedy", SamplingConfig()),
        ("sampling t=0.8 top-p=0.9", SamplingConfig(0.8, 0, 0.9)),
    ]:
        run = GenerationConfig(args.new, args.block_size, sampling, seed=0)
        generate(target, prompt, proposer, GenerationConfig(8, args.block_size, sampling, seed=0))  # warm-up
        steps, drafts, verifies, books = [], [], [], []
        for _ in range(args.runs):
            res = generate(target, prompt, proposer, run)
            for s, d, v in zip(res.step_s, res.draft_s, res.verify_s, strict=True):
                steps.append(s)
                drafts.append(d)
                verifies.append(v)
                books.append(s - d - v)
        med = statistics.median
        share = sum(books) / sum(steps)
        print(
            f"{name:>26}: step {med(steps) * 1e3:6.1f} ms = draft {med(drafts) * 1e3:5.1f} + verify "
            f"{med(verifies) * 1e3:5.1f} + bookkeeping {med(books) * 1e3:4.2f} ms (median); bookkeeping "
            f"{100 * share:.1f}% of step time over {len(steps)} steps -> {'OK' if share <= 0.10 else 'OVER'} (<= 10%)"
        )


if __name__ == "__main__":
    main()
