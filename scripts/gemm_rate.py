"""Matmul rates of this CPU in float32 and bfloat16, at the shapes a 2-layer SmolLM2 draft's training
step multiplies (768 block tokens x 576 hidden, MLP 1536, an 8,192-row head): the ceiling the trainer
can reach in each dtype, and so the most bf16 autocast can give here.

    python scripts/gemm_rate.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from flashdraft.models.target import cpu_has_fast_bf16

SHAPES = [(768, 576, 1536), (768, 1536, 576), (720, 576, 8192), (720, 8192, 576), (768, 576, 576)]


def rate(m: int, k: int, n: int, dtype: torch.dtype, reps: int = 20) -> float:
    """GFLOP/s of an (m, k) @ (k, n) product: the mean over `reps` after 3 warm-ups."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    print(f"{cpu}, {args.threads} threads, native bf16: {cpu_has_fast_bf16()}, torch {torch.__version__}")
    print("| m x k x n | float32 GFLOP/s | bfloat16 GFLOP/s | bf16 / fp32 |\n|---|---|---|---|")
    for shape in SHAPES:
        f32, b16 = rate(*shape, torch.float32), rate(*shape, torch.bfloat16)
        print(f"| {' x '.join(map(str, shape))} | {f32:.0f} | {b16:.0f} | {b16 / f32:.2f} |")


if __name__ == "__main__":
    main()
