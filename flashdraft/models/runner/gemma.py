"""Our own Gemma 3 (text: `Gemma3ForCausalLM`, model_type "gemma3_text", or the text part of an
image-text `Gemma3ForConditionalGeneration`) behind the interface of `flashdraft.models.target.Target`, next
to `llama.py`, whose attention core, RoPE and linears it shares.

What differs from a Llama, each op as transformers' Gemma3 code computes it (so that in float64 the
logits and features equal transformers' to rounding): RMSNorm scales by (1 + weight) in float32 before
the cast back (Llama casts back first), also on every head's q and k; a norm after attention and after
the MLP as well as before each; the embedding rows times sqrt(hidden) (the value transformers holds, in
the activation dtype: 640 ** 0.5 rounds to 25.25 in bf16); a gelu-tanh MLP; scores scaled by
query_pre_attn_scalar ** -0.5, not head_dim ** -0.5; and two kinds of layers, each with its own RoPE
table: sliding layers (the local base) see the last `sliding_window` positions, full layers (the global
base) everything. The cache keeps every slot on every layer (slots are not positions in a batch), so
the window is applied by the masks, counting positions as `Target.attention_mask` does.

On our kernels with bf16 activations the layers run as one C++ call (kernels/layers.cpp, as a Llama's):
the same ops with its own numerics (norm statistics, gelu_tanh through our own exp), so its bits are not
these torch ops' but agree with them as closely against float32 (tests/test_runner_gemma.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.models import masks
from flashdraft.models.ops import RopeTable, rope_tables, rotate
from flashdraft.models.runner import llama
from flashdraft.models.runner.cache import KVCache
from flashdraft.models.runner.quant import NO_BLOCKS, Quantization, StoredBlocks, make_linear
from flashdraft.models.target import TargetError

FAMILIES = ("gemma3_text",)
KINDS = ("sliding_attention", "full_attention")


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm, with `scale` = 1 + weight in float32 (`norm_scale`): statistics and scaling in
    float32 (even for float64 inputs), then the cast back."""
    return F.rms_norm(x.float(), x.shape[-1:], scale, eps).type_as(x)


def norm_scale(norm: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """1 + weight in float32, from the weight in the activation dtype (as transformers holds it there)."""
    return 1.0 + norm.weight.detach().to(dtype).float()


class Layer(nn.Module):
    def __init__(self, hf_layer: nn.Module, cfg, quantize: str, dtype: torch.dtype, stored: StoredBlocks):
        """`quantize`: how the layer's linears are stored (see `quant.make_linear`; `stored`: a GGUF's blocks)."""
        super().__init__()
        att, mlp = hf_layer.self_attn, hf_layer.mlp
        self.heads, self.kv_heads, self.head_dim = llama.Runner.layout(cfg)
        projs = (att.q_proj, att.k_proj, att.v_proj)
        bias = None if att.q_proj.bias is None else torch.cat([p.bias for p in projs])
        self.qkv = make_linear(torch.cat([p.weight for p in projs]), bias, quantize, dtype, stored.of(*projs))
        self.o = make_linear(att.o_proj.weight, att.o_proj.bias, quantize, dtype, stored.of(att.o_proj))
        gu = (mlp.gate_proj, mlp.up_proj)
        self.gate_up = make_linear(torch.cat([p.weight for p in gu]), None, quantize, dtype, stored.of(*gu))
        self.down = make_linear(mlp.down_proj.weight, None, quantize, dtype, stored.of(mlp.down_proj))
        self.q_norm, self.k_norm = norm_scale(att.q_norm, dtype), norm_scale(att.k_norm, dtype)
        self.pre_attn = norm_scale(hf_layer.input_layernorm, dtype)
        self.post_attn = norm_scale(hf_layer.post_attention_layernorm, dtype)
        self.pre_mlp = norm_scale(hf_layer.pre_feedforward_layernorm, dtype)
        self.post_mlp = norm_scale(hf_layer.post_feedforward_layernorm, dtype)
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.query_pre_attn_scalar**-0.5

    def forward(self, x, cos, sin, cache: KVCache, i: int, start: int, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h, kvh, eps = self.heads, self.kv_heads, self.eps
        qkv = self.qkv(rms_norm(x, self.pre_attn, eps)).view(b, t, h + 2 * kvh, self.head_dim)
        q = rotate(rms_norm(qkv[:, :, :h], self.q_norm, eps), cos, sin)
        k = rotate(rms_norm(qkv[:, :, h : h + kvh], self.k_norm, eps), cos, sin)
        out = llama.attend(q, k, qkv[:, :, h + kvh :], cache, i, start, mask, self.scale)
        x = x + rms_norm(self.o(out), self.post_attn, eps)
        gate, up = self.gate_up(rms_norm(x, self.pre_mlp, eps)).chunk(2, -1)
        return x + rms_norm(self.down(F.gelu(gate, approximate="tanh") * up), self.post_mlp, eps)


class Runner(llama.Runner):
    """The decoder: scaled embedding, sliding and full layers, final norm and head. On our kernels with
    bf16 activations the layers run as one C++ call, as a Llama's (kernels/layers.cpp computes Gemma's
    norms, MLP and two kinds of layers too); `Layer`'s torch ops otherwise."""

    windowed = True  # sliding layers: even a single query needs a mask (the window)

    @staticmethod
    def check(cfg) -> None:
        """Refuse (TargetError) a config whose model this code would compute wrongly."""

        def refuse(what: str):
            raise TargetError(f"the native runner has no Gemma 3 {what}: use --runner transformers")

        if cfg.attn_logit_softcapping is not None or cfg.final_logit_softcapping is not None:
            refuse("logit soft-capping")
        if getattr(cfg, "use_bidirectional_attention", False):
            refuse("bidirectional attention")
        if cfg.hidden_activation != "gelu_pytorch_tanh":
            refuse(f"{cfg.hidden_activation!r} MLP")
        for kind in cfg.layer_types:
            if kind not in KINDS:
                refuse(f"{kind!r} layers")
            rope = ((cfg.rope_parameters or {}).get(kind) or {}).get("rope_type", "default")
            if rope not in llama.ROPE_TYPES:
                refuse(f"{rope!r} RoPE")

    def __init__(
        self,
        hf_model: nn.Module,
        quantize: Quantization,
        dtype: torch.dtype,
        stored: StoredBlocks = NO_BLOCKS,
    ):
        nn.Module.__init__(self)
        cfg = hf_model.config.get_text_config()  # a multimodal Gemma 3's text part runs here too
        decoder = hf_model.get_decoder()
        self.embed = decoder.embed_tokens.weight.detach().to(dtype)  # raw rows: `RunnerTarget.embed`
        self.embed_scale = decoder.embed_tokens.embed_scale.detach().to(dtype)
        self.kinds = cfg.layer_types[: cfg.num_hidden_layers]
        self.layers = nn.ModuleList(Layer(lay, cfg, quantize.layers, dtype, stored) for lay in decoder.layers)
        self.norm = norm_scale(decoder.norm, dtype)
        self.eps = cfg.rms_norm_eps
        head = hf_model.get_output_embeddings()
        self.head = make_linear(head.weight, head.bias, quantize.head, dtype, stored.of(head))
        rotary = decoder.rotary_emb
        self.ropes = {  # layer kind -> (inv_freq, attention scaling): the local and the global table
            kind: (
                getattr(rotary, f"{kind}_inv_freq").detach().float(),
                float(getattr(rotary, f"{kind}_attention_scaling")),
            )
            for kind in set(self.kinds)
        }
        self.window = cfg.sliding_window
        self.tables = {kind: RopeTable(*rope, dtype) for kind, rope in self.ropes.items()}  # the C++ call's
        self.go_native(dtype)

    def native_layers(self, dtype: torch.dtype) -> int | None:
        """As `llama.Runner.native_layers`, with Gemma's norms (1 + weight, float32), its post-norms and
        which layers slide."""
        if not llama.on_our_kernels(self.layers, dtype):
            return None
        tensors, shapes = [], []
        for lay in self.layers:
            tensors += [lay.pre_attn, lay.pre_mlp, lay.q_norm, lay.k_norm]
            llama.linear_parts(lay, tensors, shapes)
            tensors += [lay.post_attn, lay.post_mlp]
        lay, sliding = self.layers[0], [kind == "sliding_attention" for kind in self.kinds]
        return torch.ops.flashdraft.gemma_new(
            tensors, shapes, sliding, lay.heads, lay.kv_heads, lay.head_dim, lay.eps, lay.scale,
            float(self.embed_scale),
        )  # fmt: skip

    def native_tables(self) -> list[RopeTable]:
        """The global layers' table, then the sliding layers' (if any)."""
        full, local = self.tables.get("full_attention"), self.tables.get("sliding_attention")
        return [full or local] + ([local] if local else [])

    def native_masks(self, mask: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        window = mask["sliding_attention"] if "sliding_attention" in self.kinds else None
        return mask["full_attention"], window

    def attention_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """{layer kind: (B, 1, Q, S) additive float32 mask}: query i of row b sees slot j iff
        k_pos[b, j] <= q_pos[b, i], and on sliding layers also q_pos - k_pos < window: the window
        counts positions, not slots (as `Target.attention_mask`; a dead slot has a position past every
        query)."""
        return masks.positional(q_pos, k_pos, window=self.window, kinds=True)

    def torch_forward(self, ids, positions, cache, start, mask, features):
        """`forward` as torch ops (`Layer`). `mask`: what `attention_mask` gives (`RunnerTarget.forward`
        always passes one: `windowed`)."""
        x = F.embedding(ids, self.embed) * self.embed_scale
        tables = {kind: rope_tables(positions, *rope, x.dtype) for kind, rope in self.ropes.items()}
        caught = {}
        for i, (layer, kind) in enumerate(zip(self.layers, self.kinds, strict=True)):
            x = layer(x, *tables[kind], cache, i, start, mask[kind])
            if i in features:
                caught[i] = x
        return llama.concat_features(caught, rms_norm(x, self.norm, self.eps), features, len(self.layers) - 1)
