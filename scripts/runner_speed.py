"""How fast is a decode step of the native runner against the transformers target? (Not a test.)

    python scripts/runner_speed.py [--target smollm2-135m-instruct] [--rounds 15] [--steps 8]

Times one-token steps (and 8-token verifies) over a cache of ~200 tokens, for the transformers target in
bf16 and the runner in bf16, int8 and int4 weights. The variants run interleaved, round after round
(this kind of VM drifts by 15-25% over minutes), and the table shows medians. Each timed forward is
cropped back, so the cache stays at the same length, as the engine's verify steps are.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashdraft.models.load import load_target
from flashdraft.models.runner import RunnerTarget


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=8, help="timed forwards per variant and round")
    args = ap.parse_args()
    ref = load_target(args.target, dtype=torch.bfloat16, runner="transformers")
    variants = {"transformers bf16": ref}
    for q in ("none", "int8", "int4"):
        t0 = time.perf_counter()
        variants[f"runner {'bf16' if q == 'none' else q}"] = RunnerTarget.from_target(ref, q, torch.bfloat16)
        print(f"built runner {q} in {time.perf_counter() - t0:.1f}s", flush=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, ref.vocab_size, (1, args.context), generator=g)
    block = torch.randint(0, ref.vocab_size, (1, 8), generator=g)
    caches = {}
    with torch.inference_mode():
        for name, t in variants.items():
            caches[name] = t.new_cache(sliding=False)
            t.forward(prompt, torch.arange(args.context)[None], caches[name])
        times = {(name, m): [] for name in variants for m in (1, 8)}
        for _ in range(args.rounds):
            for name, t in variants.items():
                for m in (1, 8):
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        t.forward(
                            block[:, :m], torch.arange(args.context, args.context + m)[None], caches[name]
                        )
                        times[name, m].append(time.perf_counter() - t0)
                        t.crop(caches[name], args.context)
    print(
        f"\n{args.target}, {torch.get_num_threads()} threads, {args.context} cached tokens, medians of "
        f"{args.rounds * args.steps} forwards\n"
    )
    print(f"| {'target':<18} | step ms | tok/s | verify-8 ms | verify / step |")
    print(f"|{'-' * 20}|---------|-------|-------------|---------------|")
    for name in variants:
        one, eight = (statistics.median(times[name, m]) * 1e3 for m in (1, 8))
        print(f"| {name:<18} | {one:7.1f} | {1e3 / one:5.1f} | {eight:11.1f} | {eight / one:13.2f} |")


if __name__ == "__main__":
    main()
