"""The numerics the target runner and the draft share, written once: RMSNorm and RoPE.

Both mirror transformers' Llama / Qwen3 code bit for bit (statistics and rotary tables in float32, then
the cast back), in fewer ops: torch's fused norm gives the bits of transformers' five ops, and RoPE's
rotate_half(x) * sin is roll(x) * sin with the sign of sin's first half flipped (the same products).
The tables are made once per forward and serve every layer (and the C++ layers, which take them as
they are).
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
