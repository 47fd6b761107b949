"""Our CPU kernels (flashdraft/models/runner/kernels): every code path gives the reference's bits, a row's
output does not depend on the rows beside it, the output is the exact sum within float32 rounding, a
GGUF's blocks come back exactly (K-quants and Q5_0 run as stored: their values equal the file's
dequantization bitwise), and a failed build falls back with one line."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from flashdraft.models.runner import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the kernels could not be built here")
KINDS = ("q8_0", "q4_1", "q4_k", "q6_k")


@pytest.fixture
def on_path():
    """Run the GEMM on a given path; restore the default afterwards."""
    yield kernels.force
    kernels.force("auto")


def weights(kind: str, n: int, k: int, seed: int = 0):
    """(packed, scales) of random weights (N, K) of a kind: q8_0 / q4_1 quantized from floats (K padded
    to whole blocks), K-quants as random parts (codes, fp16 d of rows of different scales, small integer
    sub-scales: K must be whole super-blocks of 256)."""
    g = torch.Generator().manual_seed(seed)
    if kind in ("q8_0", "q4_1"):
        w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of different scales
        return kernels.pack(*kernels.quantize(torch.nn.functional.pad(w, (0, -k % kernels.BLOCK)), kind))
    from flashdraft.models.gguf_blocks import Parts

    def fp16(*shape):
        return (torch.rand(*shape, generator=g) * torch.rand(n, 1, generator=g) * 0.01).half().float()

    if kind == "q4_k":
        q, sc, mk = (
            torch.randint(0, hi, s, generator=g)
            for hi, s in ((16, (n, k)), (64, (n, k // 32)), (64, (n, k // 32)))
        )
        parts = Parts(
            "Q4_K", q.short(), fp16(n, k // 256), sc=sc.float(), dmin=fp16(n, k // 256), mk=mk.float()
        )
    else:
        q, sc = (
            torch.randint(-32, 32, (n, k), generator=g),
            torch.randint(-128, 128, (n, k // 16), generator=g),
        )
        parts = Parts("Q6_K", q.short(), fp16(n, k // 256), sc=sc.float())
    packed, scales, got = kernels.pack_parts(parts)
    assert got == kind
    return packed, scales


def inputs(kind: str, k: int) -> int:
    """K for a test of this kind: as asked, or whole super-blocks for the K-quants."""
    return k if kind in ("q8_0", "q4_1") else -(-k // 256) * 256


def activations(m: int, k: int, dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 3] *= 30  # an outlier channel, as LLM activations have
    return x.to(dtype)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ("avx2", "avx512"))
def test_every_path_gives_the_references_bits(kind, dtype, path, on_path):
    """Shapes that leave a partial tile (N = 200) and a partial block (K = 570), 1-20 rows (more than one
    group of 8; every row count a tile call takes, 1 to 8), bf16 and float32 activations."""
    if path not in kernels.runnable():
        pytest.skip(f"this CPU does not run the {path} path")
    k = inputs(kind, 570)
    packed, scales = weights(kind, 200, k)
    for m in (1, 2, 3, 5, 6, 7, 8, 9, 20):  # 20: tiles of 8, 8 and 4 rows
        x = activations(m, k, dtype, seed=m)
        on_path("reference")
        want = kernels.qgemm(x, packed, scales, 200, kind)
        on_path(path)
        got = kernels.qgemm(x, packed, scales, 200, kind)
        assert got.dtype == dtype and torch.equal(got, want), (kind, m, path)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_a_row_does_not_depend_on_its_batch(kind, dtype, on_path):
    """Each row of a 17-row product equals the same row alone and in other company, on every path
    (float32 outputs show every bit of the sums; bf16 ones round most differences away)."""
    packed, scales = weights(kind, 96, inputs(kind, 576))
    x = activations(17, inputs(kind, 576), dtype)
    for path in kernels.runnable():
        on_path(path)
        full = kernels.qgemm(x, packed, scales, 96, kind)
        for i in range(17):
            alone = kernels.qgemm(x[i : i + 1], packed, scales, 96, kind)
            shuffled = kernels.qgemm(torch.cat([x[i:], x[:i]]), packed, scales, 96, kind)
            assert torch.equal(full[i], alone[0]) and torch.equal(full[i], shuffled[0]), (path, i)


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """The activations the kernel multiplies: per row and block of 32, dx * round(x * 127 / amax) in float32."""
    m, k = x.shape
    xb = torch.nn.functional.pad(x.float(), (0, -k % 32)).reshape(m, -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros(()))
    return ((xb * inv).round() * (amax / 127)).reshape(m, -1)


@pytest.mark.parametrize("kind", KINDS)
def test_the_output_is_the_exact_sum_within_float32_rounding(kind, on_path):
    """Against float64, on every path: the dequantized weights times the quantized activations. Each
    output is a sum of 2 terms per block of 32 (Q6_K: per half block) in float32, so its error is at most
    about 2 * terms * 2^-24 of the sum of the terms' magnitudes."""
    packed, scales = weights(kind, 64, 1536)
    x = activations(5, 1536, torch.float32)
    w, xq = kernels.values(packed, scales, kind)[:64].double(), quantized_rows(x).double()
    want, size = xq @ w.T, xq.abs() @ w.abs().T
    bound = 2 * (1536 // 16) * 2.0**-24 * size
    for path in kernels.runnable():
        on_path(path)
        got = kernels.qgemm(x, packed, scales, 64, kind).double()
        assert ((got - want).abs() <= bound).all(), (path, ((got - want).abs() / size).max().item())
    # and the activations' quantization is what moves it from the float product (not the kernel)
    assert ((got - x.double() @ w.T).abs() > bound).any()


@pytest.mark.parametrize("kind", ("Q8_0", "Q4_1"))
def test_a_ggufs_blocks_come_back_exactly(kind):
    """Quantized by the gguf package and dequantized as transformers loads a GGUF, our blocks dequantize
    to the very same float32 values. (Not Q4_0: its grid need not span 0..15; it runs as q8_0.)"""
    from gguf import GGMLQuantizationType, quants

    t = GGMLQuantizationType[kind]
    w = (np.random.default_rng(0).standard_normal((48, 256)) * 0.02).astype(np.float32)
    gguf_values = quants.dequantize(quants.quantize(w, t), t)
    ours = "q8_0" if kind == "Q8_0" else "q4_1"
    back = kernels.dequantize(
        *kernels.unpack(*kernels.pack(*kernels.quantize(torch.from_numpy(gguf_values), ours)), ours)
    )
    assert torch.equal(back[:48], torch.from_numpy(gguf_values))


def test_a_failed_build_falls_back_with_one_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with caplog.at_level(logging.WARNING, logger="flashdraft"):
        assert not kernels.available()
    assert "kernels are not available" in caplog.text and "torch's int8 kernel runs instead" in caplog.text
    assert list((tmp_path / "kernels").iterdir()) == []  # nothing half-built left behind


def test_a_path_this_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "_state", {"ok": True})
    monkeypatch.setenv("FLASHDRAFT_KERNEL", "avx1024")
    with pytest.raises(ValueError, match="FLASHDRAFT_KERNEL must be one of auto, reference, avx2, avx512"):
        kernels.path()


@pytest.mark.parametrize("path", ("reference", "avx2", "avx512"))
def test_argmax_gives_torchs_indices(path, on_path):
    """Each row's first maximum, as torch.argmax: ties (values on a coarse grid), a maximum in a row's
    last partial group of 8, rows of -inf, a NaN (the first NaN wins), lengths 1-70."""
    if path not in kernels.runnable():
        pytest.skip(f"this CPU does not run the {path} path")
    on_path(path)
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 31, 70):
        x = (torch.randn(12, n, generator=g) * 2).round().to(torch.bfloat16)  # many equal maxima
        x[1] = float("-inf")
        x[2, -1] = 100.0  # the maximum in the tail
        if n > 3:
            x[3, 2] = x[3, n - 2] = float("nan")
            x[4, 1:] = 50.0  # ties at once after the first slot
        for rows in (x, x[5:7], x[None]):
            assert torch.equal(kernels.argmax(rows), rows.float().argmax(-1)), (n, rows.shape)


@pytest.mark.parametrize("kind", ("Q8_0", "Q5_0", "Q4_1", "Q4_K", "Q6_K"))
def test_a_ggufs_blocks_run_as_stored(kind):
    """Random valid GGUF blocks of each type that runs as stored (`kernels.STORED`): packed for our kernels,
    the values they hold are bitwise the gguf package's dequantization of the file's bytes."""
    from gguf import GGMLQuantizationType, quants
    from test_gguf_blocks import _same_bits, random_blocks

    from flashdraft.models.gguf_blocks import Blocks, parts

    per_row = 2 if kind.endswith("_K") else 16  # blocks a row: 512 inputs
    raw = random_blocks(kind, 40, per_row, seed=3)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(40, 512).copy())
    packed, scales, ours = kernels.pack_parts(parts(Blocks(kind, (40, 512), torch.from_numpy(raw))))
    assert ours == kernels.STORED[kind]
    assert _same_bits(kernels.values(packed, scales, ours)[:40], want)
