"""`RunnerTarget`: the native runner behind the interface of `flashdraft.models.target.Target`.

The engine, the proposers, the server and the CLI use a target through a few attributes and methods
(forward over new positions with features from chosen layers, a cache, crop, masks for per-slot
positions, the tokenizer). This class gives them those, computed by our own model code for the
target's family (`FAMILIES`), with weights stored as `quant.Quantization` says.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.models.runner import gemma, kernels, llama
from flashdraft.models.runner.cache import KVCache
from flashdraft.models.runner.quant import Quantization, StoredBlocks
from flashdraft.models.target import Target, TargetError

# model_type -> the model code that computes it
FAMILIES: dict[str, type[nn.Module]] = {name: m.Runner for m in (llama, gemma) for name in m.FAMILIES}


def supports(config) -> str | None:
    """None if the native runner computes models of this (transformers) config, else why not."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"the native runner covers {', '.join(FAMILIES)} models, not {family!r}"
    try:
        FAMILIES[family].check(config)
    except TargetError as e:
        return str(e).split(":")[0]
    return None


class RunnerTarget:
    """A `Target` look-alike that runs our model code with its own preallocated cache. Build it with
    `from_target`."""

    def __init__(
        self,
        target: Target,
        quantize: str | Quantization = "none",
        dtype: torch.dtype | None = None,
        blocks: dict | None = None,
    ):
        cfg = target.config
        why = supports(cfg)
        if why:
            raise TargetError(f"{why}: use --runner transformers")
        try:
            plan = Quantization.of(quantize)
        except ValueError as e:
            raise TargetError(str(e)) from None
        dtype = dtype or target.dtype
        if (plan.layers != "none" or plan.head != "none") and dtype not in (
            torch.bfloat16,
            torch.float16,
            torch.float32,
        ):
            raise TargetError(f"{plan} weights need float32, float16 or bfloat16 activations, not {dtype}")
        self.reference, self.quantization = target, plan
        self.tokenizer, self.config = target.tokenizer, cfg
        self.num_layers, self.hidden_size, self.head_layout = (
            target.num_layers,
            target.hidden_size,
            target.head_layout,
        )
        self.vocab_size, self.max_length = target.vocab_size, target.max_length
        stored = StoredBlocks(target.model, blocks)  # a GGUF's blocks, for "gguf" weights
        self.runner = FAMILIES[cfg.model_type](target.model, plan, dtype, stored).to(target.device)
        self.embedding = nn.Embedding.from_pretrained(self.runner.embed, freeze=True)
        self.lm_head = self.runner.head  # a draft proposes through it (a quantized head is faster)
        self.model = target.model  # generation_config and export still read it

    @classmethod
    def from_target(
        cls,
        target: Target,
        quantize: str | Quantization = "none",
        dtype: torch.dtype | None = None,
        blocks: dict | None = None,
    ) -> RunnerTarget:
        """The native runner for a loaded transformers target (HF directory or converted GGUF), with
        `quantize` weights ("none", "int8": per output channel, "int4": groups of 32, "gguf": the GGUF's
        `blocks` (`load.stored_blocks`) as stored, or a `Quantization` for layers and head apart) and
        activations in `dtype` (default: the target's)."""
        return cls(target, quantize, dtype, blocks)

    dtype = property(lambda self: self.runner.embed.dtype)
    device = property(lambda self: self.runner.embed.device)
    stop_ids = property(lambda self: self.reference.stop_ids)

    @property
    def exact(self) -> bool:
        """Whether verify rows equal one-token steps and rows do not depend on their batch, bitwise:
        every linear quantized (batch-invariant kernels) with bf16 activations (tests/test_runner.py)."""
        return self.quantization.quantized and self.dtype == torch.bfloat16

    def describe(self) -> str:
        """Which weights and numerics run, for the CLI's banners."""
        on = f", {kernels.path_name()} kernels" if self.quantization.ours else ""
        return f"native runner, {self.quantization} weights, {str(self.dtype).removeprefix('torch.')}{on}"

    def default_mask_token_id(self):
        return self.reference.default_mask_token_id()

    def new_cache(self, sliding: bool = True) -> KVCache:
        """`sliding` is accepted for the Target interface: this cache keeps every slot (windows are
        applied by the masks)."""
        return KVCache(self.num_layers, *self.head_layout[1:], self.dtype, self.device)

    @staticmethod
    def crop(cache: KVCache, length: int) -> None:
        cache.crop(length)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.runner.embed)

    @property
    def embedding_table(self) -> torch.Tensor:
        """The token embeddings (vocab, hidden) that `embed` looks rows up in."""
        return self.runner.embed

    def attention_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor):
        """Masks for slots that are not in position order (see `Target.attention_mask`)."""
        return self.runner.attention_mask(q_pos, k_pos)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        logits_to_keep: int = 0,
        features: Sequence[int] | None = None,
        attention_mask=None,
        lengths: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `Target.forward`: logits (B, T or logits_to_keep, V) and the features of the listed
        layers (the last one: the final-normed output), concatenated (B, T, n*H). `lengths`: as
        `Target.forward`; where the runner is `ragged`, a row's padding is not computed at all, and
        `logits_to_keep` then keeps each row's last tokens of its own (a right-padded prefill)."""
        bad = [i for i in features or () if not 0 <= i < self.num_layers]
        if bad:
            raise TargetError(
                f"target layer ids {bad} are outside the target's layers 0..{self.num_layers - 1}"
            )
        b, t = input_ids.shape
        start = cache.reserve(b, t)
        if attention_mask is None and (self.runner.windowed or (t > 1 and not self.runner.ragged)):
            # Causal over slots in position order: slot j holds position j + (positions[0] - start).
            # (The C++ layers take that order without a mask: each query reads only the slots it sees,
            # half of a prompt's square of scores, with the bits the mask gives; but a window needs one.)
            slots = torch.arange(start + t, device=input_ids.device)
            attention_mask = self.attention_mask(positions, slots[None] + (positions[:, :1] - start))
        n = None if lengths is None else torch.tensor(lengths, dtype=torch.long)
        wanted, logits = list(dict.fromkeys(features or ())), None  # a layer listed twice is read once
        if n is None and hasattr(self.runner, "forward_head"):  # the head in the layers' call, where it can
            keep = logits_to_keep if 0 < logits_to_keep < t else t
            x, feats, logits = self.runner.forward_head(
                input_ids, positions, cache, start, attention_mask, wanted, None, keep
            )
        else:
            x, feats = self.runner(input_ids, positions, cache, start, attention_mask, wanted, n)
        cache.length = start + t
        if features is not None and len(wanted) < len(features):  # as listed, repeats included
            parts = feats.chunk(len(wanted), dim=-1)
            feats = torch.cat([parts[wanted.index(i)] for i in features], dim=-1)
        if logits is not None:
            return logits, feats
        if n is not None and logits_to_keep and self.ragged:  # each row's own last tokens
            last = (n[:, None] - logits_to_keep + torch.arange(logits_to_keep)).clamp_min(0).to(x.device)
            return self.runner.head(x.gather(1, last[:, :, None].expand(-1, -1, x.shape[-1]))), feats
        if n is not None and not logits_to_keep:  # the head on the rows' own tokens alone
            live = (torch.arange(t) < n[:, None]).view(-1).nonzero().squeeze(1).to(x.device)
            logits = self.runner.head(x.reshape(b * t, -1).index_select(0, live))
            return logits.new_zeros(b * t, logits.shape[-1]).index_copy_(0, live, logits).view(
                b, t, -1
            ), feats
        keep = x[:, -logits_to_keep:].contiguous() if 0 < logits_to_keep < t else x
        return self.runner.head(keep), feats

    @property
    def ragged(self) -> bool:
        """Whether a forward with `lengths` computes only the rows' own tokens (its cost follows their
        sum, not rows x the longest)."""
        return self.runner.ragged
