"""`make demo`: plain decoding vs DFlash on the built-in SmolLM2-135M-Instruct target.

Uses the shipped draft under checkpoints/ when there is one; otherwise it makes a random draft
(which accepts almost nothing: the point is then the loop, and that output equals plain decoding).
"""

import sys
from pathlib import Path

import torch

from flashdraft import DFlashDraft, DFlashProposer, GenerationConfig, generate, load_target
from flashdraft.draft import init_draft_config

TARGET = "smollm2-135m-instruct"
SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-instruct-dflash"
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "A shop sells pens at 3 dollars each. Tom buys 7 pens and pays with a 50 dollar bill. How much change?",
]


def main():
    torch.manual_seed(0)
    print(f"loading {TARGET} (converted from its GGUF on first use) ...", flush=True)
    target = load_target(TARGET)  # bf16 where the CPU has it, else float32
    if (SHIPPED / "config.json").is_file():
        draft, which = (
            DFlashDraft.from_pretrained(SHIPPED, dtype=target.dtype),
            f"shipped draft {SHIPPED.name}",
        )
    else:
        cfg = init_draft_config(target.model.config, 2, mask_token_id=16, block_size=16)
        draft, which = (
            DFlashDraft(cfg).to(target.dtype),
            "RANDOM draft (no shipped draft yet: expect tau ~1)",
        )
    proposer = DFlashProposer(draft, target)
    print(f"draft: {which}\n")
    tok = target.tokenizer
    totals = {"plain": [0, 0.0], "dflash": [0, 0.0]}
    for text in PROMPTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        run = GenerationConfig(max_new_tokens=96, stop_ids=target.stop_ids)
        plain = generate(target, ids, None, run)
        spec = generate(target, ids, proposer, run)
        for name, r in (("plain", plain), ("dflash", spec)):
            totals[name][0] += len(r.tokens)
            totals[name][1] += r.decode_s
        print(f"> {text}\n{tok.decode(spec.tokens, skip_special_tokens=True).strip()}")
        diff = next(
            (i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens, strict=False)) if a != b), None
        )
        agree = (
            "same tokens as plain"
            if diff is None and len(plain.tokens) == len(spec.tokens)
            else (f"bf16 rounding: first differs from plain at token {diff} (README, 'Lossless')")
        )
        print(
            f"[plain {plain.tokens_per_s:.1f} tok/s | dflash {spec.tokens_per_s:.1f} tok/s, tau {spec.tau:.2f} | "
            f"{agree}]\n"
        )
    (n_p, t_p), (n_d, t_d) = totals["plain"], totals["dflash"]
    print(
        f"overall: plain {n_p / t_p:.1f} tok/s, dflash {n_d / t_d:.1f} tok/s, speedup {(n_d / t_d) / (n_p / t_p):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
