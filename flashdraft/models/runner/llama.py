"""Our own Llama / Qwen2 / Qwen3 (SmolLM2 is a Llama) behind the interface of `flashdraft.models.target.Target`.

Why not transformers: its eager decode step spends about half its time outside the GEMMs (a cache grown
by concatenation, a few hundred dispatched ops), and its numerics are not batch-invariant, so a verify
over k tokens rounds differently from k one-token steps. Here a layer is a handful of ops: fused q/k/v
and gate/up projections, RMSNorm, RoPE, and attention as plain matmuls over the filled part of a
preallocated cache (`cache.KVCache`). Not `F.scaled_dot_product_attention`: on the CPU it costs ~260 us
a layer at one query and rounds differently with the number of queries.

Exactness: with int8 / int4 weights (`quant.py`) and bfloat16 activations every op is row-local or
batch-invariant, so a verify row equals a one-token step bitwise, and a row's output does not depend on
the rows beside it or on the dead slots between its own (tests/test_runner.py; on SmolLM2, DFlash and
batched output equal plain decoding). Not so with dense bf16 weights (bf16 GEMMs block differently with
M at SmolLM2's shapes) nor with float32 activations (float32 matmuls do too).

The model is built from a loaded transformers model's weights (`RunnerTarget.from_target`), so every
target flashdraft can load (HF directories, built-in GGUF conversions) runs here too. Each op mirrors the
transformers code it replaces (norms and rotary tables in float32, as it computes them), so in float64
the runner's logits and features equal transformers' to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.models import masks
from flashdraft.models.ops import RopeTable, rms_norm, rotate
from flashdraft.models.runner import kernels
from flashdraft.models.runner.cache import KVCache
from flashdraft.models.runner.quant import NO_BLOCKS, BlockLinear, Quantization, StoredBlocks, make_linear
from flashdraft.models.target import TargetError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # static tables; dynamic ones change with length


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache,
    i: int,
    start: int,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention of the new queries (B, T, heads, D) over layer i's cache, after storing the new keys
    and values (B, T, kv_heads, D) at slots start..: (B, T, heads * D). Shared by the families (gemma.py)
    so that they keep the same numerics."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    keys, values = cache.write(i, start, k.transpose(1, 2), v.transpose(1, 2))
    # Grouped-query attention without copying the cache: the query heads that share a kv head
    # become rows of one matmul against it, (b, kvh, g*t, d) @ (b, kvh, d, s). Each score is one
    # row-local dot product over head_dim. The sums over slots (softmax, probs @ values) are in
    # float64: their order follows the slot layout (dead slots between a row's live ones shift
    # which neighbours a bf16 kernel pairs), which moves a float64 result by ~1e-16, far below
    # what the rounding back to the activation dtype keeps; in bf16 it flips output bits.
    q = q.transpose(1, 2).reshape(b, kvh, (h // kvh) * t, d)
    scores = ((q @ keys.transpose(2, 3)) * scale).view(b, kvh, h // kvh, t, -1).double()
    if mask is not None:
        scores = scores + mask[:, :, None]
    probs = scores.softmax(-1).view(b, kvh, (h // kvh) * t, -1)
    return (probs @ values.double()).to(q.dtype).view(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)


class Layer(nn.Module):
    def __init__(self, hf_layer: nn.Module, cfg, quantize: str, dtype: torch.dtype, stored: StoredBlocks):
        """`quantize`: how the layer's linears are stored (see `quant.make_linear`; `stored`: a GGUF's blocks)."""
        super().__init__()
        att, mlp = hf_layer.self_attn, hf_layer.mlp
        self.heads, self.kv_heads, self.head_dim = Runner.layout(cfg)
        projs = (att.q_proj, att.k_proj, att.v_proj)
        bias = None if att.q_proj.bias is None else torch.cat([p.bias for p in projs])
        self.qkv = make_linear(torch.cat([p.weight for p in projs]), bias, quantize, dtype, stored.of(*projs))
        self.o = make_linear(att.o_proj.weight, att.o_proj.bias, quantize, dtype, stored.of(att.o_proj))
        gu = (mlp.gate_proj, mlp.up_proj)
        gu_bias = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
        self.gate_up = make_linear(
            torch.cat([p.weight for p in gu]), gu_bias, quantize, dtype, stored.of(*gu)
        )
        self.down = make_linear(
            mlp.down_proj.weight, mlp.down_proj.bias, quantize, dtype, stored.of(mlp.down_proj)
        )
        self.norm1 = hf_layer.input_layernorm.weight.detach().to(dtype)
        self.norm2 = hf_layer.post_attention_layernorm.weight.detach().to(dtype)
        qn = getattr(att, "q_norm", None)  # Qwen3: RMSNorm of every head's q and k before RoPE
        self.qk_norm = (
            None if qn is None else (qn.weight.detach().to(dtype), att.k_norm.weight.detach().to(dtype))
        )
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5

    def forward(
        self, x, cos, sin, cache: KVCache, i: int, start: int, mask: torch.Tensor | None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(rms_norm(x, self.norm1, self.eps)).view(b, t, h + 2 * kvh, d)
        qk, v = qkv[:, :, : h + kvh], qkv[:, :, h + kvh :]
        if self.qk_norm is not None:
            qn, kn = self.qk_norm
            qk = torch.cat([rms_norm(qk[:, :, :h], qn, self.eps), rms_norm(qk[:, :, h:], kn, self.eps)], 2)
        qk = rotate(qk, cos, sin)  # q and k heads at once
        x = x + self.o(attend(qk[:, :, :h], qk[:, :, h:], v, cache, i, start, mask, self.scale))
        gate, up = self.gate_up(rms_norm(x, self.norm2, self.eps)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Runner(nn.Module):
    """The decoder: embedding, layers, final norm and head, built from a transformers model."""

    windowed = False  # no sliding-window layers: a single query needs no mask

    @staticmethod
    def check(cfg) -> None:
        """Refuse (TargetError) a config whose model this code would compute wrongly."""
        family = cfg.model_type
        types = getattr(cfg, "layer_types", None) or []
        if getattr(cfg, "sliding_window", None) and (family == "mistral" or "sliding_attention" in types):
            raise TargetError("the native runner has no sliding-window attention: use --runner transformers")
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope not in ROPE_TYPES:
            raise TargetError(f"the native runner has no {rope!r} RoPE: use --runner transformers")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise TargetError(f"the native runner has no {cfg.hidden_act!r} MLP: use --runner transformers")

    def __init__(
        self,
        hf_model: nn.Module,
        quantize: Quantization,
        dtype: torch.dtype,
        stored: StoredBlocks = NO_BLOCKS,
    ):
        super().__init__()
        cfg = hf_model.config
        decoder = hf_model.get_decoder()
        self.embed = decoder.embed_tokens.weight.detach().to(dtype)
        self.layers = nn.ModuleList(Layer(lay, cfg, quantize.layers, dtype, stored) for lay in decoder.layers)
        self.norm = decoder.norm.weight.detach().to(dtype)
        self.eps = cfg.rms_norm_eps
        head = hf_model.get_output_embeddings()
        self.head = make_linear(head.weight, head.bias, quantize.head, dtype, stored.of(head))
        rotary = decoder.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float()
        self.rope_scale = float(rotary.attention_scaling)
        self.ropes: dict[torch.dtype, RopeTable] = {}
        self.go_native(dtype)

    def go_native(self, dtype: torch.dtype) -> None:
        """Registers the layers as one C++ call (`handle`, see `native_layers`) and notes whether the head
        runs in it too (`fused_head`: on our kernels, bf16)."""
        self.handle, self.fused = self.native_layers(dtype), True
        self.fused_head = isinstance(self.head, BlockLinear) and self.head.dtype == torch.bfloat16
        bias = getattr(self.head, "bias", None)
        self._head_bias = torch.empty(0, dtype=dtype) if bias is None else bias.data.contiguous()

    def native_layers(self, dtype: torch.dtype) -> int | None:
        """The layers as one C++ call (kernels/layers.cpp), where it computes them: bf16 activations and
        every linear on our kernels; None otherwise (the torch ops of `Layer` run). Set `fused` False
        to run `Layer` anyway (the tests compare the two)."""
        if not on_our_kernels(self.layers, dtype):
            return None
        none = torch.empty(0)
        tensors, shapes = [], []
        for lay in self.layers:
            qn, kn = lay.qk_norm or (none, none)
            tensors += [lay.norm1, lay.norm2, qn, kn]
            linear_parts(lay, tensors, shapes)
        lay = self.layers[0]
        return torch.ops.flashdraft.llama_new(
            tensors, shapes, lay.heads, lay.kv_heads, lay.head_dim, lay.eps, lay.scale
        )

    def __del__(self):
        if getattr(self, "handle", None) is not None:
            torch.ops.flashdraft.llama_free(self.handle)

    @staticmethod
    def layout(cfg) -> tuple[int, int, int]:
        heads = cfg.num_attention_heads
        return (
            heads,
            getattr(cfg, "num_key_value_heads", None) or heads,
            getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads),
        )

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables of these positions (`flashdraft.models.ops.rope_tables`, from a table)."""
        return self.table(dtype)(positions)

    def table(self, dtype: torch.dtype) -> RopeTable:
        if dtype not in self.ropes:
            self.ropes[dtype] = RopeTable(self.inv_freq, self.rope_scale, dtype)
        return self.ropes[dtype]

    @staticmethod
    def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(B, 1, Q, S) additive float32 mask: query i of row b sees slot j iff k_pos[b, j] <= q_pos[b, i]
        (see `Target.attention_mask`; a dead slot has a position past every query)."""
        return masks.positional(q_pos, k_pos)

    @property
    def ragged(self) -> bool:
        """Whether a forward computes only each row's `lengths` tokens (the C++ layers), not its padding."""
        return self.handle is not None and self.fused

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        start: int,
        mask,
        features: Sequence[int],
        lengths=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final-normed hidden states (B, T, H) and the `features` (`concat_features`), or None.
        `lengths` (B): only row b's first lengths[b] tokens are needed (where `ragged`, only they are
        computed)."""
        return self.forward_head(ids, positions, cache, start, mask, features, lengths)[:2]

    def forward_head(self, ids, positions, cache, start, mask, features, lengths=None, keep: int = 0):
        """`forward`'s outputs and, with `keep` > 0, the logits of each row's last `keep` tokens (B, keep,
        V) where the C++ call applies the head itself (on our kernels, no `lengths`), else None: the
        caller applies `head`. (A plain step's head as its own torch op ran with the caches the layers
        had just swept.)"""
        if not self.ragged:
            return *self.torch_forward(ids, positions, cache, start, mask, features), None
        # the final norm and the features' concatenation in the call too (the layers' eps: the config's),
        # and the lookups of the embeddings and RoPE rows (in `llama_forward`, from the whole tables)
        tables = self.native_tables()
        full, window = self.native_masks(mask)
        args = (cache.k, cache.v, start, full, lengths, list(features), kernels.path(), self.norm)
        head = self.head if keep and lengths is None and self.fused_head else None
        tail = (
            [] if head is None else [head.packed, head.scales, self._head_bias],
            [] if head is None else [head.out_features, kernels.KINDS[head.kind], keep],
        )

        def call(ropes, pos):  # ropes: (cos, sin) of each table; the local ones go with the window's mask
            local = [] if window is None else [*ropes[1], window]
            return torch.ops.flashdraft.llama_forward(
                self.handle, ids, *ropes[0], *args, self.embed, pos, *tail, local
            )

        out = call([(t.cos, t.sin) for t in tables], positions)
        if not out:  # a position past a table (nothing written): grown to it, or, below 0, made here
            grown = [t.whole_or_rows(positions) for t in tables]
            out = call([rows for rows, _ in grown], grown[0][1])
        return out[0], out[1] if features else None, out[-1] if head is not None else None

    def native_tables(self) -> list[RopeTable]:
        """The RoPE tables the C++ call looks positions up in: the layers' (Gemma 3: the global layers',
        then the sliding layers')."""
        return [self.table(self.embed.dtype)]

    @staticmethod
    def native_masks(mask) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the layers' mask, the sliding layers' mask or None) from what `attention_mask` made."""
        return mask, None

    def torch_forward(self, ids, positions, cache, start, mask, features):
        """`forward` as torch ops (`Layer`), where the C++ call does not run."""
        x = F.embedding(ids, self.embed)
        cos, sin = self.rope(positions, x.dtype)
        caught = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, start, mask)
            if i in features:
                caught[i] = x
        return concat_features(caught, rms_norm(x, self.norm, self.eps), features, len(self.layers) - 1)


def on_our_kernels(layers, dtype: torch.dtype) -> bool:
    """Whether the C++ call computes these layers: bf16 activations and every linear on our kernels."""
    linears = [x for lay in layers for x in (lay.qkv, lay.o, lay.gate_up, lay.down)]
    return dtype == torch.bfloat16 and all(isinstance(x, BlockLinear) for x in linears)


def linear_parts(layer, tensors: list, shapes: list) -> None:
    """Appends a layer's linears (qkv, o, gate_up, down) as the C++ call takes them: packed, scales and
    bias (empty if none) to `tensors`, outputs and kind to `shapes`."""
    for x in (layer.qkv, layer.o, layer.gate_up, layer.down):
        tensors += [x.packed, x.scales, torch.empty(0) if x.bias is None else x.bias.data]
        shapes += [x.out_features, kernels.KINDS[x.kind]]


def concat_features(
    caught: dict[int, torch.Tensor], normed: torch.Tensor, features: Sequence[int], last: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, the outputs of the layers `features` side by side in that order, or None): a DFlash draft's
    features. Layer `last`'s is the final-normed output, as transformers' last hidden state."""
    if not features:
        return normed, None
    return normed, torch.cat([normed if i == last else caught[i] for i in features], -1)
