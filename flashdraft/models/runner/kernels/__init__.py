"""flashdraft's own CPU kernels (C++ beside this file: the GEMM in `qgemm.cpp`, a Llama-family model's
layers in one call in `layers.cpp`, the greedy choice over logits in `argmax.cpp`), built on first use
and cached.

`available()` compiles the kernels once per source and torch version (about 20 s; the line that says
so shows the time) into the cache (`$FLASHDRAFT_CACHE/kernels`), and loads them as `torch.ops.flashdraft`.
Where no C++ compiler is found, or the build fails, it says so in one line and returns False: the
runner then stays on torch's own int8 kernel (`quant.Int8Linear`).

The GEMM takes weights in blocks of 32 inputs as GGUF stores them (`pack`: Q8_0, Q4_1) and quantizes
each activation row per block to int8, as llama.cpp's q8 path does. Its arithmetic is fixed per output
(see the header of qgemm.cpp): the same bits for a row whatever else it is computed with, and on every
code path. `FLASHDRAFT_KERNEL=reference|avx2|avx512` forces a path (the tests run each); `auto` (the
default) takes the fastest the CPU runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger("flashdraft")

HERE = Path(__file__).parent
SOURCES = [HERE / "qgemm.cpp", HERE / "layers.cpp", HERE / "argmax.cpp"]  # and kernels.h, which they share
BLOCK, TILE = 32, 16  # inputs per block, output columns per tile (as in qgemm.cpp)
KINDS = {"q8_0": 0, "q4_1": 1}
PATHS = {"auto": 0, "reference": 1, "avx2": 2, "avx512": 3}
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]

_state: dict = {}


def path() -> int:
    """The code path the GEMM runs, from $FLASHDRAFT_KERNEL (read once; `force` changes it)."""
    if "path" not in _state:
        name = os.environ.get("FLASHDRAFT_KERNEL", "auto")
        if name not in PATHS:
            raise ValueError(f"FLASHDRAFT_KERNEL must be one of {', '.join(PATHS)}, got {name!r}")
        _state["path"] = PATHS[name]
    return _state["path"]


def force(name: str) -> None:
    """Run the GEMM on this path from now on ("auto" for the fastest the CPU runs)."""
    _state["path"] = PATHS[name]


def path_name() -> str:
    """The path the GEMM runs now: the forced one, else the fastest this CPU runs."""
    return best() if path() == PATHS["auto"] else next(n for n, c in PATHS.items() if c == path())


def best() -> str:
    """The fastest path this CPU runs."""
    code = torch.ops.flashdraft.best_path()
    return next(name for name, c in PATHS.items() if c == code)


def _command(out: Path) -> list[str]:
    from torch.utils import cpp_extension

    lib = str(Path(torch.__file__).parent / "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    return [cxx, *FLAGS, abi, *includes, *map(str, SOURCES), "-o", str(out), f"-L{lib}", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{lib}"]  # fmt: skip


def _build(cache: Path) -> Path:
    """The compiled library for this source, torch and flags, compiled now if not yet cached
    (atomically: a failed or interrupted build leaves nothing behind)."""
    text = b"".join(f.read_bytes() for f in [*SOURCES, HERE / "kernels.h"])
    key = hashlib.sha256(text + " ".join([torch.__version__, *FLAGS]).encode()).hexdigest()
    lib = cache / f"flashdraft-kernels-{key[:16]}.so"
    if lib.is_file():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    print("compiling flashdraft's CPU kernels (once) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(_command(Path(tmp)), capture_output=True, text=True)
        if done.returncode:
            errors = [line for line in done.stderr.splitlines() if "error" in line]
            raise RuntimeError((errors or done.stderr.strip().splitlines() or ["the build failed"])[0])
        os.replace(tmp, lib)
    finally:
        Path(tmp).unlink(missing_ok=True)
    print(f"compiled in {time.perf_counter() - t0:.0f} s: {lib}", file=sys.stderr, flush=True)
    return lib


def available() -> bool:
    """Whether the kernels run here: built (once) and loaded. Says why not in one line."""
    if "ok" not in _state:
        from flashdraft.models.load import cache_root

        try:
            torch.ops.load_library(str(_build(cache_root() / "kernels")))
            _state["ok"] = True
        except (OSError, RuntimeError, FileNotFoundError) as e:
            log.warning(
                f"flashdraft's CPU kernels are not available ({e or type(e).__name__}): torch's int8 kernel "
                "runs instead (a C++ compiler, g++ or $CXX, gives the faster default)"
            )
            _state["ok"] = False
    return _state["ok"]


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).float()


def quantize(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks of 32 inputs as GGUF's Q8_0 / Q4_1 store them: (q, d, m) with q (N, K) in -127..127 or
    0..15 and d, m (N, K / 32) fp16 values (m None for Q8_0). K must be a multiple of 32. A GGUF's own
    blocks, dequantized, come back exactly (their d and m are fp16, so rounding ours recovers them)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if kind == "q8_0":
        d = _fp16(w.abs().amax(-1) / 127)
        q = torch.where(d[..., None] > 0, w / d[..., None], 0).round().clamp(-127, 127)
        return q.to(torch.int8).reshape(n, k), d, None
    lo, hi = w.amin(-1), w.amax(-1)
    d, m = _fp16((hi - lo) / 15), _fp16(lo)
    q = torch.where(d[..., None] > 0, (w - m[..., None]) / d[..., None], 0).round().clamp(0, 15)
    return q.to(torch.uint8).reshape(n, k), d, m


def dequantize(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The float32 weights (N, K) that `quantize`'s blocks hold: d * q (+ m), as GGUF computes them."""
    n, k = q.shape
    w = d[..., None] * q.float().reshape(n, k // BLOCK, BLOCK)
    return (w if m is None else w + m[..., None]).reshape(n, k)


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize`'s blocks in the kernel's layout (see qgemm.cpp): uint8 (tiles, blocks, 512 or 256) and
    fp16 bits (tiles, blocks, 16 or 32). Columns are padded to a multiple of 16 with zeros."""
    n, k = q.shape
    pad = -n % TILE
    q, d = torch.nn.functional.pad(q, (0, 0, 0, pad)), torch.nn.functional.pad(d, (0, 0, 0, pad))
    tiles, blocks = (n + pad) // TILE, k // BLOCK
    # (tiles, 16 columns, blocks, 8 groups of 4, 4) -> (tiles, blocks, group, column, 4)
    g = q.reshape(tiles, TILE, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    if m is None:
        packed = (g.to(torch.int16) + 128).to(torch.uint8)
    else:
        packed = g[:, :, :4] | (g[:, :, 4:] << 4)
    scales = [d] if m is None else [d, torch.nn.functional.pad(m, (0, 0, 0, pad))]
    sc = torch.stack([s.reshape(tiles, TILE, blocks).transpose(1, 2) for s in scales], 2)
    return (
        packed.reshape(tiles, blocks, -1).contiguous(),
        sc.to(torch.float16).reshape(tiles, blocks, -1).contiguous().view(torch.int16),
    )


def unpack(packed: torch.Tensor, scales: torch.Tensor, kind: str):
    """`pack`'s inverse: (q, d, m) with the columns padded to a multiple of 16."""
    tiles, blocks, _ = packed.shape
    sc = scales.view(torch.float16).float().reshape(tiles, blocks, -1, TILE).permute(2, 0, 3, 1)
    sc = sc.reshape(sc.shape[0], tiles * TILE, blocks)  # (d or d and m, N, blocks)
    if kind == "q8_0":
        g = (packed.reshape(tiles, blocks, 8, TILE, 4).to(torch.int16) - 128).to(torch.int8)
    else:
        b = packed.reshape(tiles, blocks, 4, TILE, 4)
        g = torch.cat([b & 15, b >> 4], 2)
    q = g.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, blocks * BLOCK)
    return q, sc[0], sc[1] if kind == "q4_1" else None


def qgemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int, kind: str) -> torch.Tensor:
    """x (M, K) times the packed weights' transpose: (M, n) in x's dtype."""
    return torch.ops.flashdraft.qgemm(x, packed, scales, n, KINDS[kind], path())


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of bf16 logits on the CPU (argmax.cpp: the same indices, 20x faster than torch's)."""
    return torch.ops.flashdraft.argmax_rows(x, path())
