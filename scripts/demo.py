"""`make demo`: plain decoding vs DFlash on the built-in SmolLM2-135M-Instruct target.

Uses the shipped draft under checkpoints/ when there is one; otherwise it makes a random draft
(which accepts almost nothing: the point is then the loop, and that output equals plain decoding).
Each prompt is answered twice, plain then DFlash, both streamed; the speedup is the ratio of decode
times per token (prefill excluded, as in the paper), summed over all prompts. Timings taken while other
jobs share the cores mean nothing: the demo then says so, with the bench's own checks
(`flashdraft.bench.bench.timing_problems` and `load_problems`).
"""

import argparse
import sys
from pathlib import Path

import torch

from flashdraft import DFlashDraft, GenerationConfig, generate, load_target
from flashdraft.bench.bench import MachineLoad, load_problems, timing_problems
from flashdraft.chat import chat_ids
from flashdraft.cli import _TextStream
from flashdraft.engine.adaptive import DEFAULT_SPECULATION, SPECULATION, make_proposer
from flashdraft.models.draft import init_draft_config
from flashdraft.models.runner import kernels

TARGET = "smollm2-135m-instruct"
SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-instruct-dflash"
PROMPTS = [
    "A shop sells pens at 3 dollars each. Tom buys 7 pens and pays with a 50 dollar bill. How much change "
    "does he get?\n\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France?",
]
# On CPUs a verify forward costs more per token than on GPUs (float32 here: 16 tokens ~1.7 single steps),
# so a shorter block than the draft's 16 wins when tau is modest: the MODEL_CARD's cost table.
CPU_BLOCK_SIZE = 8


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown"
            )
    except OSError:
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--draft", type=Path, default=SHIPPED)
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"verify blocks of this size (default {CPU_BLOCK_SIZE}; the draft's own size is its maximum)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--speculation",
        choices=SPECULATION,
        default=DEFAULT_SPECULATION,
        help="fixed blocks, or DFlash and n-gram lookup behind the adaptive rule (draft or not, and where to "
        f"cut, per step) (default: {DEFAULT_SPECULATION})",
    )
    args = p.parse_args()
    torch.manual_seed(0)
    # Our kernels are built (once, cached) before anything is timed: a build beside a timing would be
    # measured as the loop's.
    path = kernels.path_name() if kernels.available() else "not built: torch's int8 kernel"
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; our kernels' path: {path}")
    print(f"loading {TARGET} (converted from its GGUF on first use) ...", flush=True)
    # The native runner: the GGUF's own Q4_1 layers and Q8_0 head on our kernels in bf16, on any CPU they
    # build on (flashdraft.models.compute).
    target = load_target(TARGET)
    if (args.draft / "config.json").is_file():
        draft, which = DFlashDraft.from_pretrained(args.draft, dtype=target.dtype), f"draft {args.draft}"
    else:
        cfg = init_draft_config(target.model.config, 2, mask_token_id=16, block_size=16)
        draft, which = DFlashDraft(cfg).to(target.dtype), "RANDOM draft (no shipped draft: expect tau ~1)"
    block = min(args.block_size or CPU_BLOCK_SIZE, draft.config.block_size)
    proposer = make_proposer(draft, target, speculation=args.speculation)
    if args.speculation == "adaptive":  # it cuts blocks itself: give it the draft's whole block
        block = args.block_size or draft.config.block_size
    print(
        f"{which}; target: {target.describe()}; {args.speculation} speculation, "
        f"DFlash verifies blocks of up to {block}\n"
    )
    tok = target.tokenizer
    totals = {"plain": [0, 0.0], "dflash": [0, 0.0]}
    committed, steps = 0, 0  # DFlash's decode tokens and its decode-time target forwards: tau
    load = MachineLoad()
    for text in PROMPTS:
        ids = chat_ids(tok, [{"role": "user", "content": text}])
        print(f"> {text}")
        results = {}
        for name, prop in (("plain", None), ("dflash", proposer)):
            print(f"[{name}] ", end="", flush=True)
            run = GenerationConfig(
                max_new_tokens=args.max_new_tokens, block_size=block, stop_ids=target.stop_ids
            )
            r = results[name] = generate(target, ids, prop, run, on_tokens=_TextStream(tok, sys.stdout))
            totals[name][0] += len(r.tokens)
            totals[name][1] += r.decode_s
            load.sample()
            print()
        plain, spec = results["plain"], results["dflash"]
        committed, steps = committed + sum(spec.acceptance_lengths), steps + len(spec.acceptance_lengths)
        same = plain.tokens == spec.tokens
        print(
            f"[plain {plain.tokens_per_s:.1f} tok/s | dflash {spec.tokens_per_s:.1f} tok/s, tau {spec.tau:.2f} | "
            f"{'same tokens as plain' if same else 'DIFFERS from plain (docs/lossless.md: rounding)'}]\n"
        )
    (n_p, t_p), (n_d, t_d) = totals["plain"], totals["dflash"]
    speedup = (n_d / t_d) / (n_p / t_p)
    print(
        f"overall: plain {n_p / t_p:.1f} tok/s, dflash {n_d / t_d:.1f} tok/s, measured speedup {speedup:.2f}x"
    )
    tau = committed / steps if steps else float("nan")
    problems = timing_problems(speedup=speedup, tau=tau) + load_problems(load.summary())
    if problems:
        print(f"WARNING: implausible timings, the speedup above is not a measurement: {'; '.join(problems)}")
        print("Rerun on an idle machine.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
