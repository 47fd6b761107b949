"""How far does each choice of runner weights move the target from its checkpoint's own values? (Not a test.)

    python scripts/quant_distance.py [--target smollm2-135m-instruct] [--every 4]

Teacher-forced over the eval references' responses (every `--every`-th row of
data/<target>/eval-refs-256.jsonl), the dense float32 transformers target (for a GGUF: its own
dequantized values) against the native runner in dense bf16, torch's int8 and int4 layers + int8 head,
and our kernels' q8_0, q4_1 layers + q8_0 head (the GGUF's own types) and q4_1, all in bf16: the KL divergence of the next-token distributions
from float32, how often their top-1 tokens agree, and each one's negative log-likelihood of the
reference tokens. docs/lossless.md shows the table for SmolLM2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flashdraft.models.load import load_target
from flashdraft.models.runner import Quantization, RunnerTarget

VARIANTS = {
    "dense bf16": ("none", torch.bfloat16),
    "int8 (torch)": ("int8", torch.bfloat16),
    "int4 layers + int8 head (torch)": (Quantization("int4", "int8"), torch.bfloat16),
    "q8_0": ("q8_0", torch.bfloat16),
    "q4_1 layers + q8_0 head": (Quantization("q4_1", "q8_0"), torch.bfloat16),
    "q4_1": ("q4_1", torch.bfloat16),
}


def log_probs(target, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Next-token log-probabilities (float32) at the positions that predict ids[start:]."""
    logits, _ = target.forward(ids, torch.arange(ids.shape[1])[None], target.new_cache())
    return logits[0, start - 1 : -1].float().log_softmax(-1)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--every", type=int, default=4, help="use every n-th eval reference")
    args = ap.parse_args()
    refs = Path("data") / args.target / "eval-refs-256.jsonl"
    rows = [json.loads(line) for line in refs.read_text().splitlines()][:: args.every]
    ref = load_target(args.target, dtype=torch.float32, runner="transformers")
    runs = {name: RunnerTarget.from_target(ref, q, dtype) for name, (q, dtype) in VARIANTS.items()}
    kl = dict.fromkeys(runs, 0.0)
    agree = dict.fromkeys(runs, 0)
    nll = dict.fromkeys(["float32", *runs], 0.0)
    n = 0
    for row in rows:
        ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        start = len(row["prompt_ids"])
        want, tokens = log_probs(ref, ids, start), ids[0, start:, None]
        nll["float32"] -= want.gather(-1, tokens).sum().item()
        n += len(tokens)
        for name, run in runs.items():
            got = log_probs(run, ids, start)
            kl[name] += (want.exp() * (want - got)).sum().item()
            agree[name] += (got.argmax(-1) == want.argmax(-1)).sum().item()
            nll[name] -= got.gather(-1, tokens).sum().item()
    print(
        f"\n{args.target}, {len(rows)} references, {n} response tokens; float32: {nll['float32'] / n:.4f} nats/token\n"
    )
    print(f"| {'weights':<32} | KL from float32 | top-1 agreement | nats / token |")
    print(f"|{'-' * 34}|-----------------|-----------------|--------------|")
    for name in runs:
        print(f"| {name:<32} | {kl[name] / n:15.5f} | {agree[name] / n:15.4f} | {nll[name] / n:12.4f} |")


if __name__ == "__main__":
    main()
