"""Our GEMM's rate on each kernel path this CPU runs, at the built-in SmolLM2's shapes (not a test).

    python scripts/qgemm_rate.py [--rows 1,4,8,64] [--rounds 5]

Products a second (multiply-adds, G/s) of `kernels.qgemm` on random weights of the shapes a verify
multiplies most: the MLP's gate and up (Q4_1, 3072 x 576), its down projection (Q4_1, 576 x 1536) and
the head (Q8_0, 49152 x 576), for 1-64 activation rows. The paths run interleaved, round after round
(this kind of VM drifts by 15-25% over minutes), and the table shows medians and each path's rate over
the fastest path's in the same run: an A/B of two builds is two runs of this script, compared by those
ratios, not by the raw rates.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashdraft.models.runner import kernels

SHAPES = [("q4_1", 3072, 576), ("q4_1", 576, 1536), ("q8_0", 49152, 576)]  # kind, outputs, inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8,64")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("our kernels did not build here: nothing to time")
    rows = [int(r) for r in args.rows.split(",")]
    paths = [p for p in kernels.runnable() if p != "reference"]
    if not paths:
        raise SystemExit("this CPU runs only the reference path: nothing fast to time")
    g = torch.Generator().manual_seed(0)
    weights = {
        s: kernels.pack(*kernels.quantize(torch.randn(s[1], s[2], generator=g) * 0.05, s[0])) for s in SHAPES
    }
    rates: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for path in paths:
            kernels.force(path)
            for (kind, n, k), (packed, scales) in weights.items():
                for m in rows:
                    x = torch.randn(m, k, generator=g).bfloat16()
                    reps = max(3, int(4e9 / (m * n * k)))
                    kernels.qgemm(x, packed, scales, n, kind)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        kernels.qgemm(x, packed, scales, n, kind)
                    rates.setdefault((path, kind, n, k, m), []).append(
                        m * n * k * reps / (time.perf_counter() - t0) / 1e9
                    )
    kernels.force("auto")
    print(
        f"{torch.get_num_threads()} threads, medians of {args.rounds} rounds, G multiply-adds/s (x the {paths[-1]} path's)\n"
    )
    print("| path | weights | outputs x inputs | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|---|---|" + "---|" * len(rows))
    for path in paths:
        for kind, n, k in SHAPES:
            cells = []
            for m in rows:
                r = statistics.median(rates[path, kind, n, k, m])
                cells.append(f"{r:.1f} ({r / statistics.median(rates[paths[-1], kind, n, k, m]):.2f})")
            print(f"| {path} | {kind} | {n} x {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
