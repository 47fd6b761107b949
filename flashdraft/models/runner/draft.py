"""The DFlash draft's layers on our kernels: one C++ call per draft call (kernels/layers.cpp,
`draft_forward`), for a draft whose linears run on the runner's GGUF blocks (`DFlashDraft.quantized`).

On torch ops a draft call is about 150 small ops dispatched from Python: 3.0 ms on a 2-core EPYC, two
thirds of a target step once the target ran on our kernels, which made every speculative step lose to
plain decoding there. A draft layer has a Qwen3 layer's weights (q and k norms), so `llama_new`
registers them; only the forward differs: keys and values come from [context ; block], and the block's
queries see every slot (no causal order inside the block). The draft only proposes: its numbers may
differ from the torch ops' by rounding, which moves acceptance a little, never the output.
"""

from __future__ import annotations

import torch

from flashdraft.models import masks
from flashdraft.models.runner import kernels
from flashdraft.models.runner.quant import BlockLinear


def supports(draft, dtype: torch.dtype) -> bool:
    """Whether `draft_forward` computes this draft's layers: bf16 activations, our kernels built, every
    layer full attention (no sliding windows), and the projections it fuses whole tiles of 16 outputs."""
    cfg = draft.config
    widths = (
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    return (
        kernels.available()
        and dtype == torch.bfloat16
        and all(t == "full_attention" for t in cfg.layer_types)
        and all(w % kernels.TILE == 0 for w in widths)
    )


class NativeDraftLayers:
    """The layers of a quantized `DFlashDraft` copy (its linears `BlockLinear`s), q / k / v and gate / up
    fused, as one C++ model; called as the draft's layer loop is (models/draft.py, `DFlashDraft.forward`).
    The copy's own linears become views of the fused weights: the weights are held once."""

    def __init__(self, draft):
        tensors, shapes = [], []
        for layer in draft.layers:
            a, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm, a.q_norm, a.k_norm)
            tensors += [n.weight.detach().contiguous() for n in norms]
            for lin in (
                BlockLinear.side_by_side(a.q_proj, a.k_proj, a.v_proj),
                a.o_proj,
                BlockLinear.side_by_side(mlp.gate_proj, mlp.up_proj),
                mlp.down_proj,
            ):
                tensors += [lin.packed, lin.scales, torch.empty(0)]
                shapes += [lin.out_features, kernels.KINDS[lin.kind]]
        cfg = draft.config
        self.kv_heads, self.head_dim, self.dtype = cfg.num_key_value_heads, cfg.head_dim, draft.fc.dtype
        self.norm = draft.norm.weight.detach().contiguous()  # the final norm, applied in the call
        # the draft's fc and hidden norm, applied in the call to the raw features where it can
        self.fc = (
            (draft.fc, draft.hidden_norm.weight.detach().contiguous()) if self.fusable(draft.fc) else None
        )
        self.handle = torch.ops.flashdraft.llama_new(
            tensors,
            shapes,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            cfg.head_dim**-0.5,
        )

    def __del__(self):
        if getattr(self, "handle", None) is not None:
            torch.ops.flashdraft.llama_free(self.handle)

    @staticmethod
    def fusable(linear) -> bool:
        """Whether the call can run this linear (the draft's fc or its vocabulary's head) itself: our
        kernels' blocks, bf16 activations, no bias."""
        return isinstance(linear, BlockLinear) and linear.bias is None and linear.dtype == torch.bfloat16

    def __deepcopy__(self, memo) -> NativeDraftLayers:
        return self  # read-only weights: copies share them (and the handle is freed once)

    def __call__(self, x, ctx, rope_x, rope_ctx, cache, mask, raw=False, head=None, embed=None):
        """The layers' output for block x (B, T, H), normed by the draft's final norm, with new context
        ctx (B, C, H), their RoPE tables (cos, sin as `flashdraft.models.ops.rope_tables` makes them,
        (B, T, 1, D)) and `mask` (bool, broadcastable to (B, 1, T, slots)) or None; writes the context's
        and the block's keys and values after the cache's committed length (its length unchanged).
        Returns (output, logits, picks), the last two None but with `head`; None, having written
        nothing, where a position is past a whole table's rows (the caller grows it and calls again).

        In the engine's loop every torch op around the call runs after the target's weights swept the
        caches (a norm of 3 rows took 0.15 ms there, 0.02 ms warm), so what the call can do itself, it
        does. `raw`: ctx is the target's raw features (B, C, fc inputs), and the draft's fc and hidden
        norm (`self.fc`) run in the call. `rope_x` and `rope_ctx` may be ((cos, sin) of a whole
        `RopeTable`, positions (B, T) or (B, C)), looked up in the call. `head` (a `BlockLinear` and
        the token ids of its outputs): also the logits of the block's positions after its anchor (B,
        T - 1, head outputs) and each position's greedy choice (B, T - 1), the id of its first
        maximum. `embed` (vocab, H): x is the block's token ids (B, T), looked up in the call."""
        b, t, c = x.shape[0], x.shape[1], ctx.shape[1]
        start = cache.length
        cache.reserve(b, self.kv_heads, self.head_dim, c + t, self.dtype, x.device)
        if rope_ctx is None:
            rope_ctx = (ctx.new_zeros(b, 0, 1, self.head_dim),) * 2
        (cos, sin), positions = _tables(rope_x)
        (ccos, csin), cpositions = _tables(rope_ctx)
        if mask is not None:  # the kernels add it: boolean to additive
            mask = masks.additive(mask).expand(b, 1, t, start + c + t)
        fc = self.fc if raw else None
        linear, norm_weight = fc if fc is not None else (None, None)
        out = torch.ops.flashdraft.draft_forward(
            self.handle,
            x.contiguous(),
            ctx.contiguous(),
            cos,
            sin,
            ccos,
            csin,
            cache.k,
            cache.v,
            start,
            mask,
            kernels.path(),
            self.norm,
            [] if fc is None else [linear.packed, linear.scales, norm_weight],
            [] if head is None else [head[0].packed, head[0].scales, head[1]],
            [
                kernels.KINDS[linear.kind] if fc is not None else 0,
                head[0].out_features if head is not None else 0,
                kernels.KINDS[head[0].kind] if head is not None else 0,
            ],
            embed,
            positions,
            cpositions,
        )
        if not out:
            return None
        return out[0], *((out[1], out[2]) if head is not None else (None, None))


def _tables(rope):
    """((cos, sin), positions) for `draft_forward`: a whole table's and the positions to look up
    (`RopeTable.whole_or_rows`), or the positions' own rows (B, T, 1, D) and None."""
    return rope if isinstance(rope[0], tuple) else (rope, None)
