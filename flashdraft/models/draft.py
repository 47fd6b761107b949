"""The DFlash draft model: a few Qwen3-style layers that draft a whole block in one pass.

The draft owns no embedding and no LM head: it reads token embeddings and writes hidden states
that the *target's* frozen embedding and LM head turn into logits (see `DFlashProposer`). Target
context enters every layer only as extra keys/values ("KV injection"), so the context never runs
through the draft's MLPs: drafting costs a handful of block tokens, whatever the context length.

The checkpoint format is the one of the published drafts, vLLM and SGLang (`config.json` with
`architectures: ["DFlashDraftModel"]`, `dflash_config`, and bare `layers.*` / `fc` / `norm` weights),
so module names below are load-bearing: they are the safetensors keys. A draft vocabulary adds `d2t` and
`lm_head.weight` as those engines read an EAGLE-3 draft's (`D2T`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from flashdraft.files import atomic_write
from flashdraft.models import masks
from flashdraft.models.ops import RopeTable, rms_norm, rotate

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# The draft vocabulary (optional), stored as vLLM and SGLang read an EAGLE-3 draft's reduced head: in
# model.safetensors, `d2t` (int64: target id minus draft id, for draft ids 0..n-1, the target ids in
# increasing order) and `lm_head.weight` (the target's LM head rows of those ids: an engine runs a
# draft whose head is smaller than the target's with the draft's own), and `draft_vocab_size` in
# config.json. flashdraft computes the proposals through the target's own head (the same rows).
D2T, HEAD = "d2t", "lm_head.weight"
# The layout before: the ids in a file of their own beside model.safetensors. Read, never written
# (vLLM loads every *.safetensors of a folder and refused it).
OLD_VOCAB_NAME = "draft_vocab.safetensors"


class DraftError(ValueError):
    """A draft checkpoint or config that cannot be used as given (the message says how to fix it)."""


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Spread `num_features` taps from shallow to deep, skipping the first and the last 3 layers (the
    published drafts' rule). A target too shallow for that (fewer than num_features + 3 layers, where the
    rule repeats layers or runs below layer 0) gets its taps spread over all of its layers instead."""
    if num_features < 1:
        raise DraftError(f"need at least one target layer to read features from, got {num_features}")
    if num_features > num_target_layers:
        raise DraftError(
            f"{num_features} target features asked of a target with {num_target_layers} layers: pass "
            f"--num-features {num_target_layers} or fewer"
        )
    if num_features == 1:
        return [num_target_layers // 2]
    if num_target_layers < num_features + 3:
        return [round(i * (num_target_layers - 1) / (num_features - 1)) for i in range(num_features)]
    return [int(round(1 + i * (num_target_layers - 4) / (num_features - 1))) for i in range(num_features)]


@dataclass
class DraftConfig:
    """Everything that defines a draft; `to_json`/`from_json` speak the published config.json dialect."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: list[int]
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # Optional extras some published drafts carry in dflash_config (kept when present).
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.validate()

    def validate(self) -> None:
        if self.block_size < 1:
            raise DraftError(f"block_size must be >= 1, got {self.block_size}")
        if not self.target_layer_ids:
            raise DraftError("target_layer_ids is empty: list at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise DraftError(
                f"target_layer_ids {bad} are outside the target's layers 0..{self.num_target_layers - 1}: "
                f"pick ids below num_target_layers={self.num_target_layers}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DraftError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1}): "
                "pick an id that is a real row of the target's embedding table"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise DraftError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise DraftError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise DraftError(
                f"unknown layer_types {sorted(unknown)}: use full_attention or sliding_attention"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise DraftError("layer_types has sliding_attention layers but sliding_window is not set")

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def to_json(self) -> dict:
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        dflash.update(self.extra)
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
        }

    @classmethod
    def read(cls, directory: str | os.PathLike) -> DraftConfig:
        """The config.json of a draft directory, without its weights."""
        cfg_path = Path(directory) / CONFIG_NAME
        if not cfg_path.is_file():
            raise DraftError(
                f"{cfg_path} not found: a draft directory needs config.json and model.safetensors"
            )
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise DraftError(f"{cfg_path} is not valid JSON ({e}): restore or re-save the draft") from e
        return cls.from_json(raw)

    @classmethod
    def from_json(cls, raw: dict) -> DraftConfig:
        archs = raw.get("architectures") or ["DFlashDraftModel"]
        if archs != ["DFlashDraftModel"]:
            raise DraftError(f"architectures is {archs}; flashdraft loads DFlashDraftModel drafts only")
        if raw.get("attention_bias"):
            raise DraftError("attention_bias is true; DFlash drafts have bias-free projections")
        dflash = dict(raw.get("dflash_config") or {})
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if k not in raw
        ]
        if missing:
            raise DraftError(f"config.json lacks {missing}")
        heads = raw["num_attention_heads"]
        num_target_layers = raw.get("num_target_layers")
        layer_ids = dflash.pop("target_layer_ids", raw.get("target_layer_ids"))
        if layer_ids is None:
            if num_target_layers is None:
                raise DraftError(
                    "config.json has neither dflash_config.target_layer_ids nor num_target_layers"
                )
            layer_ids = default_target_layer_ids(num_target_layers, raw["num_hidden_layers"])
        if num_target_layers is None:
            num_target_layers = max(layer_ids) + 1
        mask = dflash.pop("mask_token_id", raw.get("mask_token_id"))
        if mask is None:
            raise DraftError(
                "config.json lacks dflash_config.mask_token_id: set the id of the target's mask token"
            )
        block_size = dflash.pop("block_size", raw.get("block_size", 16))
        rope = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        return cls(
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            num_target_layers=num_target_layers,
            mask_token_id=int(mask),
            target_layer_ids=[int(i) for i in layer_ids],
            block_size=int(block_size),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 40960),
            layer_types=raw.get("layer_types"),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
            extra=dflash,
        )

    def replace(self, **changes) -> DraftConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return DraftConfig(**values)

    def to_hf(self):
        """A transformers Qwen3Config with the same fields (only used to build the rotary embedding)."""
        from transformers import Qwen3Config

        kw = {k: v for k, v in self.to_json().items() if k not in ("architectures", "dflash_config")}
        return Qwen3Config(**kw)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, float64=True)


class KVCache:
    """Per-layer context keys/values of the draft, preallocated and grown by doubling.

    Only target *context* is ever committed (`length`). Each draft call writes its block's K/V just
    past the committed length and attends over that view, so "cropping the block away" costs nothing.
    """

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [new context ; block] K/V after the committed length; return keys/values to attend over."""
        end = self.length + k.shape[2]
        self._room(layer, k.shape[0], k.shape[1], end, k.shape[3], k.dtype, k.device)
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def reserve(self, batch: int, kv_heads: int, head_dim: int, new: int, dtype, device) -> None:
        """Room for `new` slots after the committed length in every layer (for the native draft)."""
        for layer in range(len(self.k)):
            self._room(layer, batch, kv_heads, self.length + new, head_dim, dtype, device)

    def _room(self, layer: int, batch: int, kv_heads: int, end: int, head_dim: int, dtype, device) -> None:
        """Layer's buffers of at least `end` slots (grown by doubling), the committed ones kept."""
        buf_k = self.k[layer]
        if buf_k is not None and buf_k.shape[2] >= end and buf_k.dtype == dtype and buf_k.shape[0] == batch:
            return
        cap = max(end, 2 * (0 if buf_k is None else buf_k.shape[2]), 64)
        new_k = torch.empty(batch, kv_heads, cap, head_dim, dtype=dtype, device=device)
        new_v = torch.empty_like(new_k)
        if buf_k is not None and self.length:
            new_k[:, :, : self.length] = buf_k[:, :, : self.length]
            new_v[:, :, : self.length] = self.v[layer][:, :, : self.length]
        self.k[layer], self.v[layer] = new_k, new_v

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def map(self, fn) -> None:
        """Apply fn to the committed part of every layer (the buffer then holds just that): keep some
        rows, gather slots, append rows (`flashdraft.models.batch.Slots` says which)."""
        for i, k in enumerate(self.k):
            if k is not None:
                self.k[i] = fn(k[:, :, : self.length])
                self.v[i] = fn(self.v[i][:, :, : self.length])


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # Sliding-window layers of later published drafts are causal inside the window.
        self.window = cfg.sliding_window if cfg.layer_types[layer_idx] == "sliding_attention" else None

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.head_dim)

    def forward(
        self, x, ctx, rope_x, rope_ctx, cache: KVCache | None, mask: torch.Tensor | None, blocks: int = 0
    ):
        bsz, q_len, _ = x.shape
        c_len = ctx.shape[1]
        q = rotate(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), *rope_x).transpose(1, 2)
        # One projection over [context ; block] (the same k_proj/v_proj/k_norm serve both parts).
        kv_in = torch.cat([ctx, x], dim=1) if c_len else x
        cos = torch.cat([rope_ctx[0], rope_x[0]], dim=1) if c_len else rope_x[0]
        sin = torch.cat([rope_ctx[1], rope_x[1]], dim=1) if c_len else rope_x[1]
        k = rotate(self.k_norm(self._heads(self.k_proj(kv_in), self.n_kv)), cos, sin).transpose(1, 2)
        v = self._heads(self.v_proj(kv_in), self.n_kv).transpose(1, 2)
        if cache is not None:
            k, v = cache.extend(self.layer_idx, k, v)
        if isinstance(mask, dict):  # batched inference: one mask per layer type
            mask = mask["sliding_attention" if self.window is not None else "full_attention"]
        if blocks:
            out = block_attention(q, k, v, c_len, mask, blocks, self.head_dim**-0.5)
            return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))
        if self.window is not None and mask is None:  # aligned: the block's queries are the last keys
            ki = torch.arange(k.shape[2], device=x.device)[None]
            mask = masks.visible(ki[:, -q_len:], ki, self.window)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.head_dim**-0.5, enable_gqa=self.n_kv != self.n_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


def block_attention(q, k, v, c_len: int, ctx_visible, block_size: int, scale: float):
    """Attention of the training layout, where the queries are many blocks of `block_size` tokens: a
    block sees the context keys that `ctx_visible` (b, 1, Q, C) allows and every key of its own block,
    nothing of other blocks. Equal to dense attention under that mask, at O(Q (C + B)) cost instead
    of O(Q (C + Q)): with an anchor at every response position, Q is 16x the sequence length.
    `ctx_visible` may be a pair (context mask, own-block mask (b, 1, n_blocks, B, B)): sliding-window
    layers see only part of their own block.

    q (b, h, Q, d); k, v (b, kv, C + Q, d): context keys first, then the blocks' keys in query order."""
    ctx_visible, own_visible = ctx_visible if isinstance(ctx_visible, tuple) else (ctx_visible, None)
    b, h, n_q, d = q.shape
    n = n_q // block_size
    k = k.repeat_interleave(h // k.shape[1], 1)
    v = v.repeat_interleave(h // v.shape[1], 1)
    s_ctx = (q @ k[:, :, :c_len].transpose(-1, -2)) * scale
    s_ctx = s_ctx.masked_fill(~ctx_visible, float("-inf")).view(b, h, n, block_size, c_len)
    k_own = k[:, :, c_len:].reshape(b, h, n, block_size, d)
    v_own = v[:, :, c_len:].reshape(b, h, n, block_size, d)
    s_own = (q.view(b, h, n, block_size, d) @ k_own.transpose(-1, -2)) * scale
    if own_visible is not None:
        s_own = s_own.masked_fill(~own_visible, float("-inf"))
    p = torch.cat([s_ctx, s_own], -1).softmax(-1)
    out = p[..., :c_len].reshape(b, h, n_q, c_len) @ v[:, :, :c_len]
    return out + (p[..., c_len:] @ v_own).reshape(b, h, n_q, d)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_x, rope_ctx, cache, mask, blocks: int = 0):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_x, rope_ctx, cache, mask, blocks)
        return x + self.mlp(self.post_attention_layernorm(x))


def quantized_rows(lm_head: nn.Module, rows: torch.Tensor, kind: str) -> nn.Module:
    """These rows of the LM head as a `BlockLinear` of `kind`. From a head already on the kernels, its
    own blocks (dequantized in float32, so requantizing gives them back exactly); else its weights."""
    from flashdraft.models.runner import kernels
    from flashdraft.models.runner.quant import BlockLinear

    if isinstance(lm_head, BlockLinear):
        w = kernels.dequantize(*kernels.unpack(lm_head.packed, lm_head.scales, lm_head.kind))
        w, dtype = w[: lm_head.out_features, : lm_head.in_features], lm_head.dtype
    else:
        w, dtype = lm_head.weight.detach(), lm_head.weight.dtype
    bias = getattr(lm_head, "bias", None)
    return BlockLinear(w[rows], None if bias is None else bias.detach()[rows], dtype, kind)


def _not_savable(*args, **kwargs):
    raise DraftError(
        "this is a quantized copy of a draft for proposing (DFlashDraft.quantized): save the draft it came from"
    )


class DFlashDraft(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        # RoPE's frequencies (any scaling type transformers knows) kept in float32, not as a buffer:
        # `.to(bfloat16)` rounded a buffer's to 8 bits, and the positions' angles with them.
        rotary = Qwen3RotaryEmbedding(config.to_hf())
        self.inv_freq = rotary.inv_freq.detach().float()
        self.rope_scale = float(rotary.attention_scaling)
        self.ropes: dict[torch.dtype, RopeTable] = {}  # `rope`'s tables
        self.reset_parameters()
        # Token ids the draft proposes from (sorted), or None for the whole vocabulary, and the target's
        # head rows of those ids (saved as lm_head.weight). Not parameters: the draft trains no head.
        self.vocab: torch.Tensor | None = None
        self.vocab_rows: torch.Tensor | None = None
        self._vocab_head: tuple | None = None  # (key, head of the rows, rows) of the last LM head seen
        self.head_kind: str | None = None  # `quantized`: the vocabulary's head rows on the kernels too
        self.native = None  # `quantized`: the layers as one C++ call, where the kernels compute them
        # After `propose_logits` with a draft vocabulary (and no context tokens): (logits over the
        # vocabulary's ids only, those ids), else None.
        self.last_vocab_logits: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers))

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_features: torch.Tensor | None = None,
        ctx_positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
        blocks: int = 0,
        head: tuple[nn.Module, torch.Tensor] | None = None,
        embed: torch.Tensor | None = None,
    ):
        """Hidden states (after the final norm) for the block tokens.

        block_embeds: (B, Q, H) target embeddings of [anchor, MASK, ...]; ctx_features: (B, C, n*H)
        concatenated raw target features of new context tokens (added to `cache` when given);
        positions are absolute. `mask` (bool, broadcastable to (B, 1, Q, keys)) is for training,
        where blocks must not see each other, and for batched inference, where some slots hold nothing
        for a row (a {layer type: mask} dict when the draft has sliding-window layers); aligned
        inference (mask None) attends everywhere. With `blocks` = B the
        queries are consecutive blocks of B tokens and `mask` (b, 1, Q, C) says which context positions
        each may see; each block also sees itself, nothing else (the fast training layout).

        For proposing, where the native layers run (a quantized copy's, `quantized`) their one C++ call
        does what it can (in the engine's loop every torch op runs with caches the target's weights
        have just swept): `embed` (vocab, H), and block_embeds holds the block's token ids (B, Q) to
        look up in it; `head` (the draft vocabulary's head rows and their ids, `vocab_head`), and the
        result is (hidden, the logits of the block's positions after the anchor (B, Q - 1, rows), each
        position's greedy choice (B, Q - 1)), the last two None where the call did not make them.
        """
        native = self.native is not None and cache is not None and not blocks  # a quantized copy's, in C++
        if embed is not None and not native:
            block_embeds, embed = F.embedding(block_embeds, embed), None
        dtype = block_embeds.dtype if embed is None else embed.dtype
        b, raw = block_embeds.shape[0], native and self.native.fc is not None
        has_ctx = ctx_features is not None and ctx_features.shape[1]
        if not has_ctx:
            ctx = torch.empty(b, 0, self.config.hidden_size, dtype=dtype, device=block_embeds.device)
        elif raw:  # fc and the hidden norm in the native call
            ctx = ctx_features.to(dtype)
        else:
            ctx = self.hidden_norm(self.fc(ctx_features.to(dtype)))
        table = self.rope_table(dtype)
        if native:  # the C++ call looks the positions' rows up in the whole table itself
            whole = table.cos, table.sin
            rope_x, rope_ctx = (whole, block_positions), (whole, ctx_positions) if has_ctx else None
        else:
            rope_x = self.rope(block_positions, dtype)
            rope_ctx = self.rope(ctx_positions, dtype) if has_ctx else None
        if isinstance(mask, torch.Tensor) and "sliding_attention" in self.config.layer_types:
            mask = masks.window_masks(
                mask, block_positions, ctx_positions, self.config.sliding_window, blocks
            )
        x, logits, picks = block_embeds, None, None
        if native:
            fused = head if head is not None and self.native.fusable(head[0]) and x.shape[1] > 1 else None
            out = self.native(x, ctx, rope_x, rope_ctx, cache, mask, raw, fused, embed)
            if out is None:  # a position past the table (nothing written): grown to it, or made here
                # (a batch's context is padded to its longest row's: its padding may pass a row's block)
                rope_x = table.whole_or_rows(block_positions)
                rope_ctx = table.whole_or_rows(ctx_positions) if has_ctx else None
                out = self.native(x, ctx, rope_x, rope_ctx, cache, mask, raw, fused, embed)
            x, logits, picks = out
        else:
            for layer in self.layers:
                x = layer(x, ctx, rope_x, rope_ctx, cache, mask, blocks)
            x = self.norm(x)
        if cache is not None:
            cache.length += ctx.shape[1]
        return x if head is None else (x, logits, picks)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_tables` of these positions, looked up on the CPU in a `RopeTable` (making them took 0.04
        ms, twice a draft call)."""
        return self.rope_table(dtype)(positions)

    def rope_table(self, dtype: torch.dtype) -> RopeTable:
        if dtype not in self.ropes:
            self.ropes[dtype] = RopeTable(self.inv_freq, self.rope_scale, dtype)
        return self.ropes[dtype]

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module | None, raw: torch.Tensor | None = None):
        """The head's logits of `hidden` (or its output `raw`, already computed), scaled and capped as
        the target scales and caps its own."""
        logits = lm_head(hidden) if raw is None else raw
        multiplier = float(self.config.extra.get("output_multiplier", 1.0))
        if multiplier != 1.0:
            logits = logits * multiplier
        cap = self.config.extra.get("final_logit_softcapping")
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def set_vocab(self, token_ids: torch.Tensor | list[int] | None, head: torch.Tensor | None = None) -> None:
        """Restrict proposals to these token ids (the draft vocabulary), or lift it with None. `head`:
        the target's LM head weight (vocab, hidden), whose rows of these ids are saved with the draft
        (`save_pretrained` needs them), or already those rows (n, hidden) in the ids' sorted order."""
        if token_ids is None:
            self.vocab, self.vocab_rows, self._vocab_head = None, None, None
            return
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
        if not ids.numel() or int(ids.min()) < 0 or ids.unique().numel() != ids.numel():
            raise DraftError("a draft vocabulary is a non-empty list of distinct, non-negative token ids")
        ids = ids.sort().values
        rows = None
        if head is not None:
            head = head.detach()
            if head.dim() != 2 or head.shape[1] != self.config.hidden_size:
                raise DraftError(
                    f"the LM head for the draft vocabulary must be (vocab, {self.config.hidden_size}), "
                    f"got {tuple(head.shape)}"
                )
            if head.shape[0] == ids.numel():
                rows = head.cpu().clone()
            elif int(ids.max()) < head.shape[0]:
                rows = head[ids.to(head.device)].cpu()
            else:
                raise DraftError(
                    f"draft vocabulary id {int(ids.max())} is past the LM head's {head.shape[0]} rows"
                )
        self.vocab, self.vocab_rows, self._vocab_head = ids, rows, None

    def propose_logits(
        self,
        hidden: torch.Tensor,
        lm_head: nn.Module,
        context: list[torch.Tensor] | None = None,
        full: bool = True,
        raw: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Logits over the whole vocabulary for proposing: with a draft vocabulary, only its rows of the
        LM head are computed (the head dominates the draft's cost) and every other token gets -inf, so
        its proposal probability q is 0 and the verifier stays exact.

        `context`: per leading row of `hidden`, the token ids of that row's request so far. They join the
        row's vocabulary: a name or identifier the prompt contains can be proposed even when the draft
        vocabulary lacks it (most of the target's tokens outside a draft vocabulary occur in the request's
        own context).

        The head runs on a 2D view: torch counts a (1, n, H) slice of a longer block as contiguous but
        does not fold it into one GEMM, and bf16 then copies the whole head on every call (measured 7 ms
        of a 14 ms draft call on a 2-core CPU).

        `full` False, with a draft vocabulary and no context: None, and only `last_vocab_logits` is made
        (what a greedy proposal reads; `full_logits` makes the rest on demand): filling the whole
        vocabulary's columns took 0.14 ms of a 2 ms draft call of the shipped draft on a 2-core EPYC.

        `raw`: the draft vocabulary's head already applied to `hidden` (`forward`'s `head`); then
        `hidden` is needed (and may be None) only with `context`."""
        lead = (hidden if raw is None else raw).shape[:-1]
        if hidden is not None:
            hidden = hidden.reshape(-1, hidden.shape[-1])
        self.last_vocab_logits = None
        if self.vocab is None:
            return self.logits(hidden, lm_head).view(*lead, -1)
        head, rows = self.vocab_head(lm_head)
        sub = self.logits(hidden, head, None if raw is None else raw.reshape(-1, raw.shape[-1]))
        if context is not None:
            logits = self.full_logits(sub, rows, lm_head.weight.shape[0])
            self._context_logits(logits, hidden, lm_head, context)
            return logits.view(*lead, -1)
        # every finite logit is one of these: an argmax or top-k over them is 4x cheaper
        self.last_vocab_logits = (sub.view(*lead, -1), rows)
        return self.full_logits(sub, rows, lm_head.weight.shape[0]).view(*lead, -1) if full else None

    @staticmethod
    def full_logits(sub: torch.Tensor, rows: torch.Tensor, vocab: int) -> torch.Tensor:
        """The whole vocabulary's logits (..., vocab) from the draft vocabulary's `sub` (..., n) at ids
        `rows`: -inf in every other column."""
        full = sub.new_full((*sub.shape[:-1], vocab), float("-inf"))
        return full.index_copy_(-1, rows, sub)

    def vocab_head(self, lm_head: nn.Module) -> tuple:
        """(the draft vocabulary's rows of `lm_head` as a module, those rows' ids), made on first use for
        this head and kept. On our kernels making them takes a third of a second (the head's blocks
        dequantized and the rows requantized): `DFlashProposer` asks for them when it is built, so no
        request pays it."""
        weight = lm_head.weight
        key = (weight.data_ptr(), weight.dtype, weight.device, tuple(weight.shape))
        if self._vocab_head is None or self._vocab_head[0] != key:
            rows = self.vocab.to(weight.device)
            bias = getattr(lm_head, "bias", None)
            w, b = weight.detach()[rows], None if bias is None else bias.detach()[rows]
            head = lambda h, w=w, b=b: F.linear(h.to(w.dtype), w, b)  # noqa: E731
            if self.head_kind is not None:  # `quantized`: the rows on the kernels (the target's own blocks)
                head = quantized_rows(lm_head, rows, self.head_kind)
            self._vocab_head = (key, head, rows)
        return self._vocab_head[1:]

    def _context_logits(
        self, full: torch.Tensor, hidden: torch.Tensor, lm_head: nn.Module, context: list[torch.Tensor]
    ) -> None:
        """Fill in `full` (N, V) the logits of each row's context tokens outside the draft vocabulary: one
        small GEMM over the union of them, then -inf where a token is not in that row's own context."""
        vocab = self.vocab.to(full.device)
        extra = [c[~torch.isin(c, vocab)] for c in (torch.as_tensor(c, device=full.device) for c in context)]
        union = torch.unique(torch.cat(extra)) if extra else vocab[:0]
        if union.numel() == 0:
            return
        w = lm_head.weight.detach()[union]
        bias = getattr(lm_head, "bias", None)
        b = None if bias is None else bias.detach()[union]
        add = self.logits(hidden, lambda h: F.linear(h.to(w.dtype), w, b))
        mine = torch.stack([torch.isin(union, e) for e in extra])  # (rows, |union|)
        mine = mine.repeat_interleave(full.shape[0] // len(context), dim=0)
        full.index_copy_(-1, union, add.masked_fill(~mine, float("-inf")))

    # -- checkpoint format ------------------------------------------------------------------

    def save_pretrained(self, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Write config.json + model.safetensors atomically (temp files, then rename), the draft
        vocabulary inside them (see `D2T`)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if dtype else v).detach().contiguous() for k, v in self.state_dict().items()}
        cfg = self.config.to_json()
        cfg["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
        if self.vocab is not None:
            if self.vocab_rows is None:
                raise DraftError(
                    "this draft has a draft vocabulary but not the target's LM head rows to save with it: "
                    "call set_vocab(ids, target.lm_head.weight) first"
                )
            state[D2T] = (self.vocab - torch.arange(len(self.vocab))).contiguous()
            state[HEAD] = self.vocab_rows.to(state["fc.weight"].dtype).contiguous()
            cfg["draft_vocab_size"] = len(self.vocab)
        atomic_write(directory / WEIGHTS_NAME, lambda p: save_file(state, p, metadata={"format": "pt"}))
        atomic_write(directory / CONFIG_NAME, lambda p: Path(p).write_text(json.dumps(cfg, indent=2) + "\n"))
        (directory / OLD_VOCAB_NAME).unlink(missing_ok=True)  # a stale one would restrict the new weights

    @classmethod
    def from_pretrained(
        cls,
        directory: str | os.PathLike,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        vocab: bool = True,
    ) -> DFlashDraft:
        """Load a draft in the published layout; `vocab=False` ignores its draft vocabulary."""
        directory = Path(directory)
        config = DraftConfig.read(directory)
        state = _load_weights(directory)
        ids, rows = _read_vocab(directory, state)
        model = cls(config)
        expected = model.state_dict()
        missing = sorted(set(expected) - set(state))
        extra = sorted(set(state) - set(expected))
        if missing or extra:
            raise DraftError(
                f"weights in {directory} do not match config.json: missing {missing[:8]}"
                f"{'...' if len(missing) > 8 else ''}, unexpected {extra[:8]}{'...' if len(extra) > 8 else ''}. "
                "Check num_hidden_layers / target_layer_ids against the checkpoint, or re-save it."
            )
        wrong = [
            f"{k}: file {tuple(state[k].shape)} vs config {tuple(v.shape)}"
            for k, v in expected.items()
            if state[k].shape != v.shape
        ]
        if wrong:
            raise DraftError(
                f"weights in {directory} have shapes that config.json does not imply: {wrong[:6]}"
            )
        if dtype is None:
            dtype = next(iter(state.values())).dtype
        model.load_state_dict(state)
        if vocab and ids is not None:
            model.set_vocab(ids, rows)
        return model.to(device=device, dtype=dtype).eval()

    @torch.no_grad()
    def grown(self, layers: int) -> DFlashDraft:
        """This draft with `layers` layers: its own first, then new full-attention layers whose output
        projections (attention's o_proj, the MLP's down_proj) start at zero. A new layer then adds nothing
        to the residual stream, so the grown draft proposes exactly what this one does until training
        moves it; after the first step gradients reach the rest of the new layer through them."""
        n = self.config.num_hidden_layers
        if layers < n:
            raise DraftError(f"a draft grows, it does not shrink: it has {n} layers, asked for {layers}")
        cfg = self.config.replace(
            num_hidden_layers=layers,
            layer_types=[*self.config.layer_types, *["full_attention"] * (layers - n)],
        )
        p = next(self.parameters())
        grown = DFlashDraft(cfg).to(device=p.device, dtype=p.dtype)
        grown.load_state_dict(grown.state_dict() | self.state_dict())
        for layer in grown.layers[n:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        grown.vocab, grown.vocab_rows = self.vocab, self.vocab_rows
        return grown

    def quantized(self, kind: str) -> DFlashDraft:
        """A copy for proposing only, whose layers' and `fc`'s linears run on the runner's kernels in
        `kind` (q8_0 / q4_1, `flashdraft.models.runner.quant.BlockLinear`): a draft call on dense bf16
        matmuls of 8 rows cost 1.7 target steps once the target ran on those kernels. A draft only
        proposes, so this moves its acceptance a little, never the output. Not trainable, not savable."""
        import copy

        from flashdraft.models.runner import draft as native
        from flashdraft.models.runner.quant import BlockLinear

        q = copy.deepcopy(self)
        for module in [*q.layers.modules(), q]:
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    dtype = child.weight.dtype
                    setattr(module, name, BlockLinear(child.weight.detach(), child.bias, dtype, kind))
        q.requires_grad_(False)
        q.head_kind, q._vocab_head = kind, None
        if native.supports(self, self.fc.weight.dtype):
            q.native = native.NativeDraftLayers(q)
        q.save_pretrained = _not_savable  # its weights are no longer the draft's own
        return q

    def check_target(self, target) -> None:
        """Raise DraftError when this draft cannot run with `target` (a `flashdraft.models.target.Target`)."""
        c = self.config
        problems = []
        if c.hidden_size != target.hidden_size:
            problems.append(f"hidden_size: draft {c.hidden_size} vs target {target.hidden_size}")
        if (c.num_attention_heads, c.num_key_value_heads, c.head_dim) != target.head_layout:
            problems.append(
                "head layout (heads, kv heads, head_dim): draft "
                f"{(c.num_attention_heads, c.num_key_value_heads, c.head_dim)} vs target {target.head_layout}"
            )
        if c.num_target_layers != target.num_layers:
            problems.append(f"num_target_layers: draft {c.num_target_layers} vs target {target.num_layers}")
        if any(i >= target.num_layers for i in c.target_layer_ids):
            problems.append(
                f"target_layer_ids {c.target_layer_ids} reach past the target's {target.num_layers} layers"
            )
        if not 0 <= c.mask_token_id < target.vocab_size:
            problems.append(
                f"mask_token_id {c.mask_token_id} is outside the target vocabulary of {target.vocab_size}"
            )
        if self.vocab is not None and int(self.vocab.max()) >= target.vocab_size:
            problems.append(
                f"draft vocabulary has token id {int(self.vocab.max())} >= target vocab {target.vocab_size}"
            )
        if problems:
            raise DraftError(
                "draft and target do not match: "
                + "; ".join(problems)
                + ". Use a draft made for this target (`flashdraft init-draft --target ...` or train one)."
            )


def _load_weights(directory: Path) -> dict[str, torch.Tensor]:
    files = [directory / WEIGHTS_NAME]
    index = directory / "model.safetensors.index.json"
    if not files[0].is_file() and index.is_file():
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    state = {}
    for f in files:
        if not f.is_file():
            raise DraftError(f"{f} not found: the draft's weights are missing")
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise DraftError(f"{f} is corrupt or truncated ({e}): re-download or re-save the draft") from e
    return state


def _read_vocab(directory: Path, state: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The draft vocabulary's ids and head rows, taken out of `state` (or read from the old layout's
    file, which has no rows); (None, None) without one."""
    d2t, rows = state.pop(D2T, None), state.pop(HEAD, None)
    if d2t is None:
        if rows is not None:
            raise DraftError(f"{directory / WEIGHTS_NAME} has {HEAD} but no {D2T}: re-save the draft")
        old = directory / OLD_VOCAB_NAME
        if not old.is_file():
            return None, None
        try:
            return load_file(str(old))["token_ids"], None
        except (SafetensorError, OSError, KeyError) as e:
            raise DraftError(f"{old} is unreadable ({e}): delete it to use the full vocabulary") from e
    ids = torch.arange(len(d2t)) + d2t.long()
    declared = json.loads((directory / CONFIG_NAME).read_text()).get("draft_vocab_size", len(d2t))
    if rows is None or rows.shape[0] != len(d2t) or declared != len(d2t):
        raise DraftError(
            f"{directory}: the draft vocabulary is inconsistent ({D2T} {len(d2t)} ids, {HEAD} "
            f"{None if rows is None else tuple(rows.shape)}, draft_vocab_size {declared}): re-save the draft"
        )
    return ids, rows


def init_draft_config(
    target_config,
    num_layers: int,
    mask_token_id: int,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    num_features: int | None = None,
) -> DraftConfig:
    """A draft config shaped like `target_config` (a transformers config)."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    n_layers = tc.num_hidden_layers
    heads = tc.num_attention_heads
    rope = getattr(tc, "rope_parameters", None) or {}
    if isinstance(rope, dict) and "full_attention" in rope:  # per-layer-type rope (Gemma3)
        rope = rope["full_attention"]
    rope_theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    rope_scaling = (
        None
        if rope.get("rope_type", "default") == "default"
        else {k: v for k, v in rope.items() if k != "rope_theta"}
    )
    ids = target_layer_ids or default_target_layer_ids(n_layers, num_features or num_layers)
    return DraftConfig(
        hidden_size=tc.hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        intermediate_size=tc.intermediate_size,
        vocab_size=tc.vocab_size,
        num_target_layers=n_layers,
        mask_token_id=mask_token_id,
        target_layer_ids=list(ids),
        block_size=block_size,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=tc.max_position_embeddings,
    )
