"""The numerics the target runner and the draft share, written once: RMSNorm and RoPE.

Both mirror transformers' Llama / Qwen3 code bit for bit (statistics and rotary tables in float32, then
the cast back), in fewer ops: torch's fused norm gives the bits of transformers' five ops, and RoPE's
rotate_half(x) * sin is roll(x) * sin with the sign of sin's first half flipped (the same products).
The tables serve every layer of a forward (and the C++ layers, which take them as they are); the
native runner looks them up in a `RopeTable` made once, instead of making them per forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, float64: bool = False) -> torch.Tensor:
    """transformers' LlamaRMSNorm: statistics in float32, scaled after the cast back. `float64`: float64
    inputs keep float64 statistics (the draft's choice, so its float64 tests stay float64-exact;
    transformers computes them in float32 even there, and so does the target runner)."""
    stats = x if float64 and x.dtype == torch.float64 else x.float()
    return weight * F.rms_norm(stats, x.shape[-1:], None, eps).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in 4 ops, with the tables of `rope_tables` broadcast to x's layout."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, T, 1, D) as transformers computes them (in float32, then cast), with the first
    half of sin negated for `rotate`. `inv_freq` and `scale` (its attention scaling) come from the
    model's transformers rotary module, which knows every RoPE scaling type."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], -1)[:, :, None]
    sin = (emb.sin() * scale).to(dtype)
    half = sin.shape[-1] // 2
    return (emb.cos() * scale).to(dtype), torch.cat([-sin[..., :half], sin[..., half:]], -1)


class RopeTable:
    """`rope_tables` of positions 0..n-1, made once (and grown when a position passes n) and looked up per
    forward: making them took 0.09 ms of a 5 ms one-token step (ten small ops). A position's entries
    are elementwise functions of it alone, made in blocks of BLOCK positions (small enough that torch
    runs them on one thread in whole vectors, as it does a forward's few positions), so they are the
    bits `rope_tables` gives."""

    BLOCK = 128

    def __init__(self, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
        self.inv_freq, self.scale, self.dtype = inv_freq, scale, dtype
        self.cos = self.sin = torch.empty(0, 2 * inv_freq.numel(), dtype=dtype)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, T, 1, D) of these positions (B, T), as `rope_tables`, which makes them itself
        off the CPU (the table lives there) and for a negative position (a table has none)."""
        if positions.device.type != "cpu" or not positions.numel():
            return rope_tables(positions, self.inv_freq, self.scale, self.dtype)
        if not self.covers(positions):
            return rope_tables(positions, self.inv_freq, self.scale, self.dtype)
        return self.cos[positions][:, :, None], self.sin[positions][:, :, None]

    def whole_or_rows(self, positions: torch.Tensor):
        """What a C++ forward takes for these positions (B, T) when a call with the whole tables found one
        past them: ((cos, sin) of the whole tables, positions) once grown to cover them, or, for a
        negative position, (their own rows (B, T, 1, D), None)."""
        return ((self.cos, self.sin), positions) if self.covers(positions) else (self(positions), None)

    def covers(self, positions: torch.Tensor) -> bool:
        """Whether the tables hold rows for these positions (grown to, where they are past its end);
        False for a negative one. Then `cos` and `sin` (n, D) are what the C++ forwards look them up in
        (their `positions` argument)."""
        low, high = (int(v) for v in positions.aminmax())
        if low < 0:
            return False
        if high >= self.cos.shape[0]:
            self._grow(max(high + 1, 2 * self.cos.shape[0]))
        return True

    def _grow(self, n: int) -> None:
        n = -(-n // self.BLOCK) * self.BLOCK
        parts = [
            rope_tables(torch.arange(i, i + self.BLOCK)[None], self.inv_freq, self.scale, self.dtype)
            for i in range(self.cos.shape[0], n, self.BLOCK)
        ]
        self.cos = torch.cat([self.cos, *(c[0, :, 0] for c, _ in parts)])
        self.sin = torch.cat([self.sin, *(s[0, :, 0] for _, s in parts)])
