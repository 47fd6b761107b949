"""How fast are the native runner's forwards, weights by weights, against the transformers target? (Not a test.)

    python scripts/runner_speed.py [--target smollm2-135m-instruct] [--rounds 10] [--steps 6]
        [--variants transformers,int8,q8_0,q4_1+q8_0]

Times, over a cache of ~200 tokens: a one-token step, verifies of 4, 8 and 16 tokens, a step of a
batch of 8 rows, a verify of 4 tokens a row for 8 rows, the same where only one row needs its 4
(`ragged`: the others need their anchor alone, as in adaptive speculation's batches; a ragged
runner does not compute their padding), and a prompt of 512 tokens from an empty cache, twice: `prompt`
with the head on every token (the measure of earlier tables) and `prefill` with the last token's logits
only, as the engine's and datagen's prefills ask for them (`logits_to_keep=1`). Variants: `transformers` (bf16), or
the runner's weights: none (dense bf16), int8 / int4 (torch's kernels), q8_0 / q4_1 (ours; `L+H`
for layers and head apart, e.g. q4_1+q8_0, the built-in SmolLM2's own GGUF types), each on a kernel
path of its own with `@path` (q4_1+q8_0@avx2 beside q4_1+q8_0@avx512: an A/B of the paths), or `default`:
the runner `load_target` gives (a GGUF's blocks as stored: Gemma-3-270M's Q4_K_M); `!torch` after a variant
runs its layers as torch ops around our GEMMs instead of the one C++ call (an A/B of the call). They run
interleaved, round after round (this kind of VM drifts by 15-25% over minutes), and the table shows
medians. Each timed forward is cropped back, so the cache stays at the same length, as the engine's
verify steps are.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashdraft.models.load import load_target
from flashdraft.models.runner import Quantization, RunnerTarget, kernels

# name: (rows, tokens a row, the tokens each row needs: None, all of them)
SHAPES = {
    "step": (1, 1, None),
    "verify-4": (1, 4, None),
    "verify-8": (1, 8, None),
    "verify-16": (1, 16, None),
    "batch-8": (8, 1, None),
    "b8-verify-4": (8, 4, None),
    "b8-ragged-4": (8, 4, [4] + [1] * 7),
}


def build(ref, spec: str, target: str):
    if spec == "transformers":
        return ref
    weights, torch_ops, _ = spec.partition("@")[0].partition("!")
    if weights == "default":
        run = load_target(target, dtype="auto")
    else:
        layers, _, head = weights.partition("+")
        run = RunnerTarget.from_target(ref, Quantization(layers, head or layers), torch.bfloat16)
    run.runner.fused = not torch_ops
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--prompt", type=int, default=512, help="tokens of the timed prompt")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=6, help="timed forwards per variant, shape and round")
    ap.add_argument("--variants", default="transformers,int8,q8_0,q4_1+q8_0")
    args = ap.parse_args()
    ref = load_target(args.target, dtype=torch.bfloat16, runner="transformers")
    variants = {}
    for spec in args.variants.split(","):
        t0 = time.perf_counter()
        variants[spec] = build(ref, spec, args.target)
        print(f"built {spec} in {time.perf_counter() - t0:.1f}s", flush=True)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, ref.vocab_size, (8, max(args.context, args.prompt)), generator=g)
    new = torch.randint(0, ref.vocab_size, (8, 16), generator=g)
    caches = {}  # (variant, rows) -> a cache holding the context
    ends = {"prompt": 0, "prefill": 1}  # logits_to_keep: every token's, the last token's
    times = {(name, s): [] for name in variants for s in [*SHAPES, *ends]}
    with torch.inference_mode():
        for name, t in variants.items():
            for b in (1, 8):
                caches[name, b] = c = t.new_cache(sliding=False)
                t.forward(prompt[:b, : args.context], torch.arange(args.context).expand(b, -1), c)
        for _ in range(args.rounds):
            for name, t in variants.items():
                kernels.force(name.partition("@")[2] or "auto")
                for shape, (b, m, lengths) in SHAPES.items():
                    c = caches[name, b]
                    for _ in range(args.steps):
                        pos = torch.arange(args.context, args.context + m).expand(b, -1)
                        t0 = time.perf_counter()
                        t.forward(new[:b, :m], pos, c, lengths=lengths)
                        times[name, shape].append(time.perf_counter() - t0)
                        t.crop(c, args.context)
                for end, keep in ends.items():
                    fresh = t.new_cache(sliding=False)
                    t0 = time.perf_counter()
                    t.forward(
                        prompt[:1, : args.prompt], torch.arange(args.prompt)[None], fresh, logits_to_keep=keep
                    )
                    times[name, end].append(time.perf_counter() - t0)
    kernels.force("auto")
    print(
        f"\n{args.target}, {torch.get_num_threads()} threads, {args.context} cached tokens, medians of "
        f"{args.rounds * args.steps} forwards (prompt, prefill: of {args.rounds}); our kernels' path: "
        f"{kernels.path_name() if kernels.available() else 'not built'} (or as named)\n"
    )
    cols = [*SHAPES, *ends]
    print(
        f"| {'variant':<16} | "
        + " | ".join(f"{c} ms" for c in cols)
        + " | verify-4 / step | verify-8 / step | verify-16 / step | b8-ragged-4 / batch-8 |"
    )
    print(f"|{'-' * 18}|" + "|".join("-" * (len(c) + 5) for c in cols) + "|---|---|---|---|")
    for name in variants:
        ms = {c: statistics.median(times[name, c]) * 1e3 for c in cols}
        row = " | ".join(f"{ms[c]:{len(c) + 3}.1f}" for c in cols)
        print(
            f"| {name:<16} | {row} | {ms['verify-4'] / ms['step']:.2f} | {ms['verify-8'] / ms['step']:.2f} | {ms['verify-16'] / ms['step']:.2f} | "
            f"{ms['b8-ragged-4'] / ms['batch-8']:.2f} |"
        )


if __name__ == "__main__":
    main()
