"""Does torch.compile of the runner's whole forward keep it exact, and is it faster? (Not a test.)

    python scripts/compile_probe.py [--quantize int8] [--rounds 6] [--modes eager,oblivious]

One compiled mode per process (a base: dynamic, oblivious or unbacked; options after `+`: cpp for
inductor's C++ wrapper, t1 for single-threaded generated kernels):
dynamo keeps its compiled graphs on the function's code, so two modes in one process could share them.

An earlier measurement (docs/speed.md) compiled the whole forward with `dynamic=True`: 14% faster, but a
verify row no longer equalled a one-token step. One suspect is dynamo's specialisation of sizes 0 and 1: a
one-token step then runs a graph of its own, whose generated kernels need not round as the verify's do.
This probe compiles the forward so that one graph serves every number of tokens and rows
(`backed_size_oblivious`, or the token and row dimensions marked unbacked), always with a mask (so that
a one-token step runs the same program as a verify), and checks, bitwise, on random prompts:

- a verify of 8 tokens against 8 one-token steps (the logits of every row);
- two rows in one batch against each row alone;

then times one-token steps and verifies of 8, eager and compiled interleaved round by round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashdraft.models.load import load_target
from flashdraft.models.runner import RunnerTarget


def make_forward(rt: RunnerTarget, mode: str):
    """A function (ids, cache, start) -> logits that runs rt's runner eagerly or compiled as `mode` says:
    a base (dynamic, oblivious, unbacked) and options after `+` (cpp: inductor's C++ wrapper; t1: the
    generated kernels single-threaded, so that a reduction is never split across threads by row count;
    emu: intermediates rounded to their dtype as in eager)."""
    runner = rt.runner
    fn = runner.forward
    base, *opts = mode.split("+")
    if base != "eager":
        import torch._inductor.config as ind
        import torch.fx.experimental._config as fx_config

        fx_config.backed_size_oblivious = base == "oblivious"
        ind.cpp_wrapper = "cpp" in opts
        if "t1" in opts:
            ind.cpp.threads = 1
        # emu: round every intermediate to its dtype as eager does, so that fusion choices (which
        # differ between graphs) cannot change the bits
        ind.emulate_precision_casts = "emu" in opts
        fn = torch.compile(runner.forward, dynamic=True)

    def forward(ids: torch.Tensor, cache, start_pos: int, wanted=frozenset()) -> torch.Tensor:
        b, t = ids.shape
        start = cache.reserve(b, t)
        positions = torch.arange(start_pos, start_pos + t)[None].expand(b, t)
        slots = torch.arange(start + t)
        mask = rt.attention_mask(positions, (slots[None] + (start_pos - start)).expand(b, -1))
        if mode.startswith("unbacked"):  # the base
            for x, dims in ((ids, (0, 1)), (positions, (0, 1)), (mask, (0, 2))):
                torch._dynamo.decorators.mark_unbacked(x, dims[0], shape_id="rows")
                torch._dynamo.decorators.mark_unbacked(x, dims[1], shape_id="tokens")
        x, _ = fn(ids, positions, cache, start, mask, set(wanted))
        cache.length = start + t
        return runner.head(x)

    return forward


def check(rt: RunnerTarget, forward, prompts: torch.Tensor, block: torch.Tensor) -> tuple[bool, bool, bool]:
    """(verify rows == one-token steps, batched rows == rows alone, logits with features == without),
    bitwise."""
    n = prompts.shape[1]
    cache = rt.new_cache()
    forward(prompts[:1], cache, 0)
    steps = []
    for j in range(block.shape[1]):
        steps.append(forward(block[:1, j : j + 1], cache, n + j)[0, 0])
    rt.crop(cache, n)
    verify = forward(block[:1], cache, n)[0]
    verify_ok = torch.equal(torch.stack(steps), verify)
    alone = []
    for r in range(2):
        c = rt.new_cache()
        forward(prompts[r : r + 1], c, 0)
        alone.append(forward(block[r : r + 1], c, n)[0])
    c = rt.new_cache()
    forward(prompts[:2], c, 0)
    both = forward(block[:2], c, n)
    batch_ok = all(torch.equal(both[r], alone[r]) for r in range(2))
    rt.crop(c, n)
    feats = forward(block[:2], c, n, frozenset({1, 8, 14, 20, 27}))
    return verify_ok, batch_ok, torch.equal(feats, both)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--quantize", default="int8")
    ap.add_argument("--modes", default="eager,oblivious")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    ref = load_target(args.target, dtype=torch.bfloat16, runner="transformers")
    rt = RunnerTarget.from_target(ref, args.quantize, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, ref.vocab_size, (2, args.context), generator=g)
    block = torch.randint(0, ref.vocab_size, (2, 8), generator=g)
    forwards = {}
    with torch.inference_mode():
        for mode in args.modes.split(","):
            t0 = time.perf_counter()
            try:
                fwd = make_forward(rt, mode)
                ok = check(rt, fwd, prompts, block)
            except Exception as e:  # a mode dynamo or inductor refuses: say so, go on
                print(f"{mode}: failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
                continue
            print(
                f"{mode}: verify == steps {ok[0]}, batch == alone {ok[1]}, with features == without {ok[2]} "
                f"(checked in {time.perf_counter() - t0:.1f}s, compiles included)",
                flush=True,
            )
            forwards[mode] = fwd
        times = {(mode, m): [] for mode in forwards for m in (1, 8)}
        caches = {}
        for mode, fwd in forwards.items():
            caches[mode] = rt.new_cache()
            fwd(prompts[:1], caches[mode], 0)
        for _ in range(args.rounds):
            for mode, fwd in forwards.items():
                for m in (1, 8):
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        fwd(block[:1, :m], caches[mode], args.context)
                        times[mode, m].append(time.perf_counter() - t0)
                        rt.crop(caches[mode], args.context)
    print(
        f"\n{args.target}, {args.quantize}, {torch.get_num_threads()} threads, {args.context} cached tokens"
    )
    print("| mode | step ms | verify-8 ms |\n|---|---|---|")
    for mode in forwards:
        s, v = (statistics.median(times[mode, m]) * 1e3 for m in (1, 8))
        print(f"| {mode} | {s:.2f} | {v:.2f} |")


if __name__ == "__main__":
    main()
