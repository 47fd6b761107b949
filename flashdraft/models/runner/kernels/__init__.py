"""flashdraft's own CPU kernels (C++ beside this file: the GEMM in `qgemm.cpp`, a Llama-family model's
layers (and Gemma 3's) in one call in `layers.cpp`, the greedy choice over logits in `argmax.cpp`), built on first use
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

import ctypes
import functools
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
SOURCES = sorted(HERE.glob("*.cpp"))  # all compiled; they share the headers beside them (kernels.h)
BLOCK, TILE = 32, 16  # inputs per block, output columns per tile (as in qgemm.cpp)
KINDS = {"q8_0": 0, "q4_1": 1, "q4_k": 2, "q6_k": 3}  # kernels.h's Kind
SUPER = 8  # blocks a K-quant super-block (256 inputs)
# GGUF's types that our kernels run as stored (`pack_parts`), and the kind that runs each: Q5_0's q - 16
# and d are a Q8_0 block's (exact, in 8 bits where the file has 5).
STORED = {"Q8_0": "q8_0", "Q5_0": "q8_0", "Q4_1": "q4_1", "Q4_K": "q4_k", "Q6_K": "q6_k"}
PATHS = {"auto": 0, "reference": 1, "avx2": 2, "avx512": 3}
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]
# FLASHDRAFT_SANITIZE=1: AddressSanitizer and UndefinedBehaviorSanitizer, any report fatal (its own cache file;
# python must start with the ASan runtime preloaded, see `_asan_loaded`; scripts/sanitize.py runs the tests so)
# libstdc++ too: ASan finds the C++ runtime's __cxa_throw as it starts, and aborts at the first exception thrown
# if libstdc++ was not loaded by then (a python not linked with it loads it with torch, later)
SANITIZE = ["-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
            "-fno-sanitize-recover=all"]  # fmt: skip
ASAN_RECIPE = 'LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)" ASAN_OPTIONS=detect_leaks=0'

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


def runnable() -> list[str]:
    """Every path this CPU runs, slowest first: the scalar reference, then the vector paths up to `best`
    (what the tests compare, what the speed scripts time)."""
    order = [name for name in PATHS if name != "auto"]
    return order[: order.index(best()) + 1]


def _sanitize() -> bool:
    return os.environ.get("FLASHDRAFT_SANITIZE", "") not in ("", "0")


def _asan_loaded() -> bool:
    """Whether the ASan runtime is in the process, and libstdc++ preloaded with it (`ASAN_RECIPE`): an
    instrumented .so loaded into a python without it aborts the process ("ASan runtime does not come
    first in initial library list")."""
    return hasattr(ctypes.CDLL(None), "__asan_init") and "libstdc++" in os.environ.get("LD_PRELOAD", "")


def _files(root: Path = HERE) -> list[Path]:
    """What the build reads from this project: every .cpp (all compiled) and header beside this file."""
    return sorted([*root.glob("*.cpp"), *root.glob("*.h")])


@functools.cache
def _compiler(cxx: str) -> str:
    """The compiler's identity: its resolved path and `--version` (asked once per process)."""
    found = shutil.which(cxx)
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
        version = f"{done.returncode}\n{done.stdout}{done.stderr}"
    except (OSError, subprocess.SubprocessError) as e:  # no such compiler: the build itself says so
        version = type(e).__name__
    return f"{os.path.realpath(found) if found else cxx}\n{version}"


def _key(command: list[str], files: list[Path]) -> str:
    """The cache key of a build: the compiler's identity, the command line but its output path, torch's
    version, and each file's name and bytes (length-prefixed, so no two inputs run together)."""
    i = command.index("-o")
    parts = [_compiler(command[0]), torch.__version__, *command[:i], *command[i + 2 :]]
    h = hashlib.sha256()
    for part in [p.encode() for p in parts] + [b for f in files for b in (f.name.encode(), f.read_bytes())]:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()


def _command(out: Path) -> list[str]:
    from torch.utils import cpp_extension

    lib = str(Path(torch.__file__).parent / "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    flags = [*(f for f in FLAGS if not f.startswith("-O")), *SANITIZE] if _sanitize() else FLAGS
    return [cxx, *flags, abi, *includes, *map(str, SOURCES), "-o", str(out), f"-L{lib}", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{lib}"]  # fmt: skip


def _build(cache: Path) -> Path:
    """The compiled library for these sources and headers, compiler, command line and torch (`_key`),
    compiled now if not yet cached (atomically: a failed or interrupted build leaves nothing behind)."""
    if _sanitize() and not _asan_loaded():
        raise RuntimeError(
            f"FLASHDRAFT_SANITIZE=1 needs the ASan runtime and libstdc++ preloaded: start python as {ASAN_RECIPE}"
        )
    name = "flashdraft-kernels-asan" if _sanitize() else "flashdraft-kernels"
    lib = cache / f"{name}-{_key(_command(cache / 'out.so'), _files())[:16]}.so"
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
        if _key(_command(cache / "out.so"), _files())[:16] not in lib.name:  # not what the key names
            raise RuntimeError("the kernels' sources changed while they compiled: run again")
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
            fix = "" if _sanitize() else " (a C++ compiler, g++ or $CXX, gives the faster default)"
            log.warning(
                f"flashdraft's CPU kernels are not available ({e or type(e).__name__}): torch's int8 kernel "
                f"runs instead{fix}"
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
    pad = -q.shape[0] % TILE
    d = torch.nn.functional.pad(d, (0, 0, 0, pad))
    tiles, blocks = d.shape[0] // TILE, d.shape[1]
    scales = [d] if m is None else [d, torch.nn.functional.pad(m, (0, 0, 0, pad))]
    sc = torch.stack([s.reshape(tiles, TILE, blocks).transpose(1, 2) for s in scales], 2)
    return _codes(q, m is not None), sc.to(torch.float16).reshape(tiles, blocks, -1).contiguous().view(
        torch.int16
    )


def _codes(q: torch.Tensor, nibbles: bool) -> torch.Tensor:
    """Codes (N, K) in the kernel's layout (q4.cpp, q8.cpp): uint8 (tiles, blocks, 256 or 512), columns
    padded to a multiple of 16 with zeros; 4-bit codes two a byte, 8-bit ones as q + 128."""
    n, k = q.shape
    q = torch.nn.functional.pad(q, (0, 0, 0, -n % TILE))
    tiles, blocks = q.shape[0] // TILE, k // BLOCK
    # (tiles, 16 columns, blocks, 8 groups of 4, 4) -> (tiles, blocks, group, column, 4)
    g = q.reshape(tiles, TILE, blocks, 8, 4).permute(0, 2, 3, 1, 4)
    packed = g[:, :, :4] | (g[:, :, 4:] << 4) if nibbles else (g.to(torch.int16) + 128)
    return packed.to(torch.uint8).reshape(tiles, blocks, -1).contiguous()


def _columns_last(x: torch.Tensor, tiles: int) -> torch.Tensor:
    """Per-output values x (N, S, F) to (tiles, S, F, 16): a tile's 16 columns side by side."""
    x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, tiles * TILE - x.shape[0]))
    return x.reshape(tiles, TILE, *x.shape[1:]).permute(0, 2, 3, 1)


def pack_parts(p) -> tuple[torch.Tensor, torch.Tensor, str]:
    """A GGUF matrix's blocks as stored (`gguf_blocks.Parts` of a `STORED` type) in the kernel's layout:
    (packed, scales, kind). K-quants (q4.cpp, q8.cpp): per block their small integer scales (Q4_K sc and
    mk, Q6_K the two halves' sc), then per super-block their fp16 d (and dmin)."""
    kind = STORED[p.kind]
    if kind in ("q8_0", "q4_1"):
        return *pack(p.q, p.d, p.m), kind
    n, k = p.q.shape
    if k % (SUPER * BLOCK):
        raise ValueError(f"{p.kind} weights need inputs in whole super-blocks of 256, got {k}")
    tiles, blocks = -(-n // TILE), k // BLOCK
    small = torch.stack([p.sc, p.mk], 2) if kind == "q4_k" else p.sc.reshape(n, blocks, 2)
    small = _columns_last(small, tiles).to(torch.uint8 if kind == "q4_k" else torch.int8)
    sup = torch.stack([p.d, p.dmin], 2) if kind == "q4_k" else p.d[..., None]
    sup = _columns_last(sup, tiles).to(torch.float16)
    scales = torch.cat(
        [small.reshape(tiles, -1).view(torch.int16), sup.reshape(tiles, -1).view(torch.int16)], 1
    )
    return _codes(p.q, kind == "q4_k"), scales.contiguous(), kind


def unpack(packed: torch.Tensor, scales: torch.Tensor, kind: str):
    """`pack`'s inverse: (q, d, m) with the columns padded to a multiple of 16."""
    tiles, blocks, _ = packed.shape
    sc = scales.view(torch.float16).float().reshape(tiles, blocks, -1, TILE).permute(2, 0, 3, 1)
    sc = sc.reshape(sc.shape[0], tiles * TILE, blocks)  # (d or d and m, N, blocks)
    return _uncodes(packed, kind == "q4_1"), sc[0], sc[1] if kind == "q4_1" else None


def _uncodes(packed: torch.Tensor, nibbles: bool) -> torch.Tensor:
    """`_codes`' inverse: int16 (N padded, K)."""
    tiles, blocks, _ = packed.shape
    if nibbles:
        b = packed.reshape(tiles, blocks, 4, TILE, 4)
        g = torch.cat([b & 15, b >> 4], 2).short()
    else:
        g = packed.reshape(tiles, blocks, 8, TILE, 4).short() - 128
    return g.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, blocks * BLOCK)


def values(packed: torch.Tensor, scales: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 weights (N padded to 16, K) that packed blocks of any kind hold, rounded as GGUF's
    dequantization rounds them (tests compare them with the file's, bitwise)."""
    from flashdraft.models.gguf_blocks import Parts

    if kind in ("q8_0", "q4_1"):
        return dequantize(*unpack(packed, scales, kind))
    tiles, blocks, _ = packed.shape
    words = scales.reshape(tiles, -1)
    small = words[:, : blocks * 16].contiguous().view(torch.uint8 if kind == "q4_k" else torch.int8)
    small = small.reshape(tiles, blocks, 2, TILE).permute(0, 3, 1, 2).reshape(tiles * TILE, blocks, 2).float()
    sup = words[:, blocks * 16 :].contiguous().view(torch.float16).float()
    sup = (
        sup.reshape(tiles, blocks // SUPER, -1, TILE)
        .permute(0, 3, 1, 2)
        .reshape(tiles * TILE, blocks // SUPER, -1)
    )
    q = _uncodes(packed, kind == "q4_k")
    if kind == "q4_k":
        return Parts("Q4_K", q, sup[..., 0], sc=small[..., 0], dmin=sup[..., 1], mk=small[..., 1]).values()
    return Parts("Q6_K", q, sup[..., 0], sc=small.reshape(tiles * TILE, -1)).values()


def qgemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int, kind: str) -> torch.Tensor:
    """x (M, K) times the packed weights' transpose: (M, n) in x's dtype."""
    return torch.ops.flashdraft.qgemm(x, packed, scales, n, KINDS[kind], path())


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of bf16 logits on the CPU (argmax.cpp: the same indices, 20x faster than torch's)."""
    return torch.ops.flashdraft.argmax_rows(x, path())
