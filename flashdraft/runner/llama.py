"""Our own Llama / Qwen2 / Qwen3 (SmolLM2 is a Llama) behind the interface of `flashdraft.target.Target`.

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

from ..target import Target, TargetError
from .cache import KVCache
from .quant import QUANTIZE, make_linear

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # static tables; dynamic ones change with length


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: statistics in float32 (even for float64 inputs), scaled after the cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in 4 ops: transformers' rotate_half(x) * sin is roll(x) * sin with the sign of sin's first
    half flipped (see `Runner.rope`), the same products bit for bit."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Layer(nn.Module):
    def __init__(self, hf_layer: nn.Module, cfg, quantize: str, dtype: torch.dtype):
        super().__init__()
        att, mlp = hf_layer.self_attn, hf_layer.mlp
        self.heads, self.kv_heads, self.head_dim = Runner.layout(cfg)
        projs = (att.q_proj, att.k_proj, att.v_proj)
        bias = None if att.q_proj.bias is None else torch.cat([p.bias for p in projs])
        self.qkv = make_linear(torch.cat([p.weight for p in projs]), bias, quantize, dtype)
        self.o = make_linear(att.o_proj.weight, att.o_proj.bias, quantize, dtype)
        gu_bias = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
        self.gate_up = make_linear(
            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gu_bias, quantize, dtype
        )
        self.down = make_linear(mlp.down_proj.weight, mlp.down_proj.bias, quantize, dtype)
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
        q, k = qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2)
        keys, values = cache.write(i, start, k, v.transpose(1, 2))
        # Grouped-query attention without copying the cache: the query heads that share a kv head
        # become rows of one matmul against it, (b, kvh, g*t, d) @ (b, kvh, d, s). Each score is one
        # row-local dot product over head_dim. The sums over slots (softmax, probs @ values) are in
        # float64: their order follows the slot layout (dead slots between a row's live ones shift
        # which neighbours a bf16 kernel pairs), which moves a float64 result by ~1e-16, far below
        # what the rounding back to the activation dtype keeps; in bf16 it flips output bits.
        q = q.reshape(b, kvh, (h // kvh) * t, d)
        scores = ((q @ keys.transpose(2, 3)) * self.scale).view(b, kvh, h // kvh, t, -1).double()
        if mask is not None:
            scores = scores + mask[:, :, None]
        probs = scores.softmax(-1).view(b, kvh, (h // kvh) * t, -1)
        out = (probs @ values.double()).to(x.dtype).view(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)
        x = x + self.o(out)
        gate, up = self.gate_up(rms_norm(x, self.norm2, self.eps)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Runner(nn.Module):
    """The decoder: embedding, layers, final norm and head, built from a transformers model."""

    def __init__(self, hf_model: nn.Module, quantize: str, dtype: torch.dtype):
        super().__init__()
        cfg = hf_model.config
        decoder = hf_model.get_decoder()
        self.embed = decoder.embed_tokens.weight.detach().to(dtype)
        self.layers = nn.ModuleList(Layer(lay, cfg, quantize, dtype) for lay in decoder.layers)
        self.norm = decoder.norm.weight.detach().to(dtype)
        self.eps = cfg.rms_norm_eps
        head = hf_model.get_output_embeddings()
        self.head = make_linear(head.weight, head.bias, quantize, dtype)
        rotary = decoder.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float()
        self.rope_scale = float(rotary.attention_scaling)

    @staticmethod
    def layout(cfg) -> tuple[int, int, int]:
        heads = cfg.num_attention_heads
        return (
            heads,
            getattr(cfg, "num_key_value_heads", None) or heads,
            getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads),
        )

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B, T, 1, D) as transformers computes them (in float32, then cast), with the first
        half of sin negated for `rotate`."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], -1)[:, :, None]
        sin = (emb.sin() * self.rope_scale).to(dtype)
        half = sin.shape[-1] // 2
        return (emb.cos() * self.rope_scale).to(dtype), torch.cat([-sin[..., :half], sin[..., half:]], -1)


class RunnerTarget:
    """A `Target` look-alike (the same attributes and methods the engine, proposers and CLI use) that
    runs `Runner` with its own cache. Build it with `from_target`."""

    def __init__(self, target: Target, quantize: str = "none", dtype: torch.dtype | None = None):
        cfg = target.config
        family = getattr(cfg, "model_type", None)
        if family not in FAMILIES:
            raise TargetError(
                f"the native runner covers {', '.join(FAMILIES)} models, not {family!r}: use the transformers runner"
            )
        types = getattr(cfg, "layer_types", None) or []
        if getattr(cfg, "sliding_window", None) and (family == "mistral" or "sliding_attention" in types):
            raise TargetError(
                "the native runner has no sliding-window attention: use the transformers runner"
            )
        rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope not in ROPE_TYPES:
            raise TargetError(f"the native runner has no {rope!r} RoPE: use the transformers runner")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise TargetError(f"the native runner has no {cfg.hidden_act!r} MLP: use the transformers runner")
        if quantize not in QUANTIZE:
            raise TargetError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
        dtype = dtype or target.dtype
        if quantize != "none" and dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TargetError(
                f"{quantize} weights need float32, float16 or bfloat16 activations, not {dtype}"
            )
        self.reference, self.quantize = target, quantize
        self.tokenizer, self.config = target.tokenizer, cfg
        self.num_layers, self.hidden_size, self.head_layout = (
            target.num_layers,
            target.hidden_size,
            target.head_layout,
        )
        self.vocab_size, self.max_length = target.vocab_size, target.max_length
        self.runner = Runner(target.model, quantize, dtype).to(target.device)
        self.embedding = nn.Embedding.from_pretrained(self.runner.embed, freeze=True)
        self.lm_head = self.runner.head  # a draft proposes through it (a quantized head is faster)
        self.model = target.model  # generation_config and export still read it

    @classmethod
    def from_target(cls, target: Target, quantize: str = "none", dtype: torch.dtype | None = None):
        """The native runner for a loaded transformers target (HF directory or converted GGUF), with
        `quantize` weights ("none", "int8": per output channel, "int4": groups of 32) and activations
        in `dtype` (default: the target's)."""
        return cls(target, quantize, dtype)

    dtype = property(lambda self: self.runner.embed.dtype)
    device = property(lambda self: self.runner.embed.device)
    stop_ids = property(lambda self: self.reference.stop_ids)

    def default_mask_token_id(self):
        return self.reference.default_mask_token_id()

    def new_cache(self, sliding: bool = True) -> KVCache:
        """`sliding` is accepted for the Target interface; these families have no sliding windows."""
        return KVCache(self.num_layers, *self.head_layout[1:], self.dtype, self.device)

    @staticmethod
    def crop(cache: KVCache, length: int) -> None:
        cache.crop(length)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.runner.embed)

    def attention_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(B, 1, Q, S) additive float32 mask: query i of row b sees slot j iff k_pos[b, j] <= q_pos[b, i]
        (see `Target.attention_mask`; a dead slot has a position past every query)."""
        visible = k_pos[:, None, None, :] <= q_pos[:, None, :, None]
        return torch.where(visible, 0.0, torch.finfo(torch.float32).min)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        logits_to_keep: int = 0,
        features: Sequence[int] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `Target.forward`: logits (B, T or logits_to_keep, V) and the features of the listed
        layers (the last one: the final-normed output), concatenated (B, T, n*H)."""
        bad = [i for i in features or () if not 0 <= i < self.num_layers]
        if bad:
            raise TargetError(
                f"target layer ids {bad} are outside the target's layers 0..{self.num_layers - 1}"
            )
        m = self.runner
        b, t = input_ids.shape
        start = cache.reserve(b, t)
        if attention_mask is None and t > 1:  # causal, slots in position order (one token sees all)
            slots = torch.arange(start + t, device=input_ids.device)
            attention_mask = self.attention_mask((slots[start:])[None], slots[None])
        x = F.embedding(input_ids, m.embed)
        cos, sin = m.rope(positions, x.dtype)
        wanted, caught = set(features or ()), {}
        for i, layer in enumerate(m.layers):
            x = layer(x, cos, sin, cache, i, start, attention_mask)
            if i in wanted:
                caught[i] = x
        cache.length = start + t
        x = rms_norm(x, m.norm, m.eps)
        caught[self.num_layers - 1] = x  # as transformers' hidden_states[-1]: the final-normed output
        feats = torch.cat([caught[i] for i in features], -1) if features else None
        keep = x[:, -logits_to_keep:].contiguous() if 0 < logits_to_keep < t else x
        return m.head(keep), feats
