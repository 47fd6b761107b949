"""Linear layers for the runner: dense; GGUF's blocks of 32 (Q8_0, Q4_1) on our own kernels; or
torch's weight-only int8 per output channel and int4 in groups of 32.

Every quantized one is batch-invariant, bitwise: each row of the output is computed exactly as it
would be alone, whatever M. That is what lets a verify over k tokens give the logits of k one-token
steps. A dense bf16 GEMM is not (its blocking changes with M).

- "q8_0" / "q4_1" (`BlockLinear`): our kernels (`kernels/qgemm.cpp`), which read each weight once for
  all rows (a verify of 8 rows costs a fraction of 8 steps) and quantize the activations per row and
  block of 32 to int8, as llama.cpp does: invariant by construction, and a GGUF's Q8_0 / Q4_1
  blocks run as they are stored. CPU only.
- "int8" / "int4": torch's CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), bf16
  activations; they take rows 4 at a time, so a verify costs more with every 4 rows. The fallback
  where our kernels cannot be built.

A quantized layer is its own model: exact means equal to plain decoding with the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.models.runner import kernels

QUANTIZE = ("none", "int8", "int4", "q8_0", "q4_1", "gguf")
GROUP = 32  # int4 group size along the input dimension (GGUF's Q4_0 / Q4_1 blocks are 32 too)


@dataclass(frozen=True)
class Quantization:
    """How the weights are stored: the decoder layers' linears, and the head (a GGUF often keeps its
    embedding / head at more bits than its layers: SmolLM2's built-in file has Q4_1 layers and a Q8_0
    embedding)."""

    layers: str = "none"
    head: str = "none"

    def __post_init__(self):
        for what in (self.layers, self.head):
            if what not in QUANTIZE:
                raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {what!r}")

    @classmethod
    def of(cls, spec: str | Quantization) -> Quantization:
        """ "int8" -> int8 everywhere; a Quantization as it is."""
        return spec if isinstance(spec, Quantization) else cls(spec, spec)

    @property
    def ours(self) -> bool:
        """Whether our kernels run some of these weights (GGUF's blocks: q8_0, q4_1, or a file's as stored)."""
        return any(k in kernels.KINDS or k == "gguf" for k in (self.layers, self.head))

    @property
    def quantized(self) -> bool:
        return self.layers != "none" and self.head != "none"

    def __str__(self) -> str:
        if "gguf" in (self.layers, self.head):
            ours = "the GGUF's blocks as stored" if self.layers == "gguf" else f"{self.layers} layers"
            head = "" if self.head == self.layers else f" + {self.head} head"
            return ours + head
        if self.layers == self.head:
            return "dense" if self.layers == "none" else self.layers
        return f"{self.layers} layers + {self.head} head"


class Linear(nn.Module):
    """y = x W^T + b with the weight as loaded (the float reference and the `quantize="none"` path)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _Quantized(nn.Module):
    """Shared by the quantized layers: the kernels take 2D inputs; `weight` gives the dequantized
    matrix (what a draft's vocabulary-restricted head slices), computed once."""

    def __init__(self, out_features: int, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.out_features = out_features
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self._dense: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1]).contiguous()).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    @property
    def weight(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = self.dequantize()
        return self._dense


class Int8Linear(_Quantized):
    """int8 weights with one scale per output channel: w = q * scale, |q| <= 127."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(weight.shape[0], bias, dtype)
        w = weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(dtype))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.qweight, self.scale)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.to(self.scale.dtype) * self.scale[:, None]


class Int4Linear(_Quantized):
    """4-bit weights in groups of 32 inputs, each group with a scale and a minimum (asymmetric, as
    gpt-fast and GGUF Q4_1): w = q * scale + min, q in 0..15. The kernel stores min as a "zero"
    centred on q = 8: zero = min + 8 * scale."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(weight.shape[0], bias, dtype)
        n, k = weight.shape
        if k % GROUP:
            raise ValueError(f"int4 needs input sizes divisible by {GROUP}, got a {n}x{k} weight")
        w = weight.detach().float().reshape(n, k // GROUP, GROUP)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = ((w - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        zero = lo + 8 * scale
        # (k / GROUP, n, 2): per group and output channel, (scale, zero)
        sz = torch.stack([scale[..., 0], zero[..., 0]], -1).transpose(0, 1).contiguous()
        self.register_buffer("scales_zeros", sz.to(dtype))
        self._q = q.to(torch.uint8)  # kept only to dequantize (tests, a draft's vocabulary head)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)

    def dequantize(self) -> torch.Tensor:
        n, k = self._q.shape
        sz = self.scales_zeros.transpose(0, 1)  # (n, k / GROUP, 2)
        q = self._q.reshape(n, k // GROUP, GROUP).to(sz.dtype)
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(n, k)


class BlockLinear(_Quantized):
    """GGUF's blocks of 32 inputs on our kernels (`kernels.quantize`): Q8_0 (w = d * q) or Q4_1 (w = d * q
    + m), d and m in fp16; the activations quantized to int8 per row and block inside the kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, kind: str):
        super().__init__(weight.shape[0], bias, dtype)
        if not kernels.available():
            raise RuntimeError(f"{kind} weights need flashdraft's CPU kernels, which are not available here")
        w = F.pad(weight.detach().float(), (0, -weight.shape[1] % kernels.BLOCK))  # inputs past K: zeros
        self._hold(kind, weight.shape[1], dtype, *kernels.pack(*kernels.quantize(w, kind)))

    def _hold(self, kind: str, in_features: int, dtype: torch.dtype, packed, scales) -> None:
        self.kind, self.in_features, self.dtype = kind, in_features, dtype
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    @classmethod
    def held(
        cls, kind: str, out_features: int, in_features: int, dtype: torch.dtype, packed, scales
    ) -> BlockLinear:
        """A bias-free layer of weights already in the kernels' layout (`kernels.pack`, `pack_parts`)."""
        layer = cls.__new__(cls)
        _Quantized.__init__(layer, out_features, None, dtype)
        layer._hold(kind, in_features, dtype, packed, scales)
        return layer

    @classmethod
    def side_by_side(cls, *parts: BlockLinear) -> BlockLinear:
        """One layer of these ones' outputs side by side (no biases), theirs becoming views of its buffers,
        so the weights are held once. The weights are quantized row by row and packed tile by tile, so
        the parts' tiles side by side are the packing of their weights side by side; each part but the
        last must fill whole tiles of 16 outputs."""
        if any(p.out_features % kernels.TILE for p in parts[:-1]) or any(p.bias is not None for p in parts):
            raise ValueError("only bias-free layers of whole tiles (16 outputs) go side by side")
        first, n = parts[0], sum(p.out_features for p in parts)
        packed, scales = torch.cat([p.packed for p in parts]), torch.cat([p.scales for p in parts])
        fused = cls.held(first.kind, n, first.in_features, first.dtype, packed, scales)
        at = 0
        for p in parts:
            n = p.packed.shape[0]
            p.packed, p.scales = fused.packed[at : at + n], fused.scales[at : at + n]
            at += n
        return fused

    @classmethod
    def stored(cls, blocks: list, bias: torch.Tensor | None, dtype: torch.dtype) -> BlockLinear | None:
        """A GGUF's `blocks` (`gguf_blocks.Blocks`, one a part of the layer's outputs, side by side) as they
        are stored, or None where our kernels cannot run them so: a part without blocks, types our kernels
        do not run (`kernels.STORED`), or parts of different kinds (one kernel call runs one). Taken apart
        only here, where they run."""
        from flashdraft.models.gguf_blocks import parts

        if not blocks or any(b is None or b.ggml_type not in kernels.STORED for b in blocks):
            return None
        if any(b.ggml_type.endswith("_K") and b.shape[1] % (kernels.SUPER * kernels.BLOCK) for b in blocks):
            return None  # (GGUF writers keep K-quants to whole super-blocks)
        if len({kernels.STORED[b.ggml_type] for b in blocks}) > 1 or any(
            b.shape[0] % kernels.TILE for b in blocks[:-1]
        ):
            return None
        layers = []
        for b in blocks:
            packed, scales, kind = kernels.pack_parts(parts(b))
            layers.append(cls.held(kind, *b.shape, dtype, packed, scales))
        fused = layers[0] if len(layers) == 1 else cls.side_by_side(*layers)
        if bias is not None:
            fused.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
        return fused

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.qgemm(x, self.packed, self.scales, self.out_features, self.kind)

    def dequantize(self) -> torch.Tensor:
        w = kernels.values(self.packed, self.scales, self.kind)
        return w[: self.out_features, : self.in_features].to(self.dtype)


class StoredBlocks:
    """A GGUF's blocks by the weights they are (`of`), for `make_linear`'s "gguf": the runners build their
    linears from a transformers model, whose parameters are named as `gguf_blocks.read_blocks` names
    the file's matrices (a tied head is its embedding)."""

    def __init__(self, model: nn.Module | None = None, blocks: dict | None = None):
        self.by_id = {id(p): blocks.get(n) for n, p in model.named_parameters()} if blocks else {}

    def of(self, *linears: nn.Module) -> list:
        """Each linear's `gguf_blocks.Blocks`, or None where the file has none."""
        return [self.by_id.get(id(lin.weight)) for lin in linears]


NO_BLOCKS = StoredBlocks()  # a checkpoint without GGUF blocks


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, quantize: str, dtype: torch.dtype, stored: list = ()
) -> nn.Module:
    """A linear layer of these weights (out, in), in `dtype` activations, stored as `quantize` says; "gguf":
    the GGUF's blocks `stored` (the parts of `weight`, side by side) as they are where our kernels run them
    so (`BlockLinear.stored`), q8_0 from `weight` otherwise."""
    if quantize == "gguf":
        return BlockLinear.stored(list(stored), bias, dtype) or BlockLinear(weight, bias, dtype, "q8_0")
    if quantize == "none":
        return Linear(weight.detach().to(dtype), None if bias is None else bias.detach().to(dtype))
    if quantize == "int8":
        return Int8Linear(weight, bias, dtype)
    if quantize == "int4":
        return Int4Linear(weight, bias, dtype)
    if quantize in kernels.KINDS:
        return BlockLinear(weight, bias, dtype, quantize)
    raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
