"""The target model: any Hugging Face causal LM, seen through the few operations DFlash needs.

Prefill and verify are the same call (a forward over new tokens on a KV cache). Features of the
selected layers are caught with forward hooks on just those layers, so a long prefill never keeps
every layer's hidden states alive the way `output_hidden_states=True` does.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.models import masks

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class TargetError(ValueError):
    pass


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (avx512_bf16 / amx_bf16). Without it, torch
    emulates bf16 matmuls, measured 25x slower than float32 on our AVX2-only machines. False too where
    FLASHDRAFT_KERNEL forces our kernels below AVX-512 (avx2, reference): the auto rules then act as on a
    CPU of that kind (flashdraft.models.compute)."""
    if os.environ.get("FLASHDRAFT_KERNEL") in ("avx2", "reference"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return bool(set(line.split(":", 1)[1].split()) & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """ "auto" (or None): CUDA when torch sees a GPU, else the CPU. An explicit CUDA device that is not
    there is refused with the fix."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise TargetError(f"--device must be auto, cpu or cuda[:N], got {device!r} ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TargetError(f"--device {device}: this torch sees no CUDA device; use --device cpu (or auto)")
    return dev


def resolve_dtype(
    dtype: str | torch.dtype | None = "auto", device: str | torch.device = "cpu"
) -> torch.dtype:
    """ "auto" (or None): bfloat16 on GPUs and on CPUs with native bf16, float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        fast = torch.device(device).type == "cuda" or cpu_has_fast_bf16()
        return torch.bfloat16 if fast else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def check_model_dir(path: Path) -> None:
    """TargetError unless `path` looks like a target checkpoint: read without loading (the CLI checks this
    before anything loads), so a draft passed as the target is named as such."""
    if not (path / "config.json").is_file():
        raise TargetError(f"{path} is not a model directory (no config.json): pass a local HF checkpoint")
    try:
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (json.JSONDecodeError, AttributeError):
        architectures = []
    if "DFlashDraftModel" in architectures:
        raise TargetError(
            f"{path} is a DFlash draft, not a target model: pass it as --draft, and the model it was "
            "trained for as --target"
        )


class Target:
    def __init__(self, model: nn.Module, tokenizer=None):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.config = cfg
        self.num_layers: int = cfg.num_hidden_layers
        self.hidden_size: int = cfg.hidden_size
        heads = cfg.num_attention_heads
        self.head_layout = (
            heads,
            getattr(cfg, "num_key_value_heads", None) or heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        )
        self.embedding: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.vocab_size: int = self.embedding.weight.shape[0]
        self.max_length: int = cfg.max_position_embeddings
        decoder = model.get_decoder()
        self._layers = decoder.layers
        self._final_norm = decoder.norm
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._hooked: set[int] = set()  # layers with a capture hook
        self._wanted: frozenset[int] = frozenset()  # layers the running forward captures
        self._captured: dict[int, torch.Tensor] = {}

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: torch.dtype | str | None = "auto", device: str = "cpu"
    ):
        """Load a local transformers checkpoint directory (no hub access, no remote code)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path)
        check_model_dir(path)
        dtype = resolve_dtype(dtype, device)
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, output_loading_info=True
        )
        missing = sorted(info.get("missing_keys") or [])
        if missing:  # loading would go on with random weights there and print nonsense
            raise TargetError(
                f"{path} lacks {len(missing)} weight(s) of its architecture ({', '.join(missing[:4])}"
                f"{', ...' if len(missing) > 4 else ''}): a partial or mismatched checkpoint; re-save the model"
            )
        model = model.to(device)
        tokenizer = None
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return cls(model, tokenizer)

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    @property
    def stop_ids(self) -> list[int]:
        ids = []
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            ids += [src] if isinstance(src, int) else list(src or [])
        return sorted(set(ids))

    exact = False  # a verify rounds differently from one-token steps here (see RunnerTarget.exact)

    def describe(self) -> str:
        """Which model code, weights and dtype run, for the CLI's banners."""
        return f"transformers, dense weights, {str(self.dtype).removeprefix('torch.')}"

    def default_mask_token_id(self) -> tuple[int, str | None]:
        """The tokenizer's mask token, else the last vocabulary id, with a note saying so."""
        mask = getattr(self.tokenizer, "mask_token_id", None)
        if mask is not None:
            return mask, None
        mask = self.vocab_size - 1
        return mask, (
            f"note: the tokenizer has no mask token; using mask_token_id={mask} "
            "(pass --mask-token-id to choose a token that never occurs in outputs)"
        )

    # -- features --------------------------------------------------------------------------

    def _hook_layers(self, layer_ids: Sequence[int]) -> None:
        """Make sure these decoder layers (0-based) have a capture hook. Hooks stay installed and only
        capture while a forward asks for their layer, so callers never reset shared state."""
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise TargetError(
                f"target layer ids {bad} are outside the target's layers 0..{self.num_layers - 1}"
            )
        for i in sorted(set(layer_ids) - self._hooked):
            # HF's hidden_states[num_layers] is the final-normed output; match it for the last layer.
            module = self._final_norm if i == self.num_layers - 1 else self._layers[i]
            module.register_forward_hook(self._catcher(i))
            self._hooked.add(i)

    def _catcher(self, i: int):
        def hook(_module, _inputs, output):
            if i in self._wanted:
                self._captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    # -- forward and cache -----------------------------------------------------------------

    def new_cache(self, sliding: bool = True):
        """A KV cache for `forward`. `sliding=False` keeps every entry on every layer: batched decoding
        needs that, since its slots are not positions (it applies windows by position in its masks)."""
        from transformers import DynamicCache

        if not sliding:
            return DynamicCache()
        cache = DynamicCache(config=self.model.config)
        cache.activate_past_recording()  # sliding-window layers keep what a crop may need
        return cache

    def attention_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor):
        """Additive 4D attention masks for caches whose slots are not in position order (batched decoding).

        q_pos (B, Q) are the positions of the new tokens, k_pos (B, S) those of every cache slot (the new
        tokens' slots included). Query i of row b sees slot j iff k_pos[b, j] <= q_pos[b, i] and, on
        sliding-window layers, q_pos - k_pos < window: the window counts positions, not slots. A slot
        that holds nothing for a row gets a position larger than any query. Returns one (B, 1, Q, S)
        tensor, or a {layer type: mask} dict for models with both full and sliding layers (Gemma3).
        """
        window = getattr(self.config, "sliding_window", None)
        types = getattr(self.config, "layer_types", None)
        if types and "sliding_attention" not in types:
            window = None
        return masks.positional(q_pos, k_pos, self.dtype, window or None, kinds=bool(types))

    ragged = False  # a forward computes every row's padding too (see `forward`'s `lengths`)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache,
        logits_to_keep: int = 0,
        features: Sequence[int] | None = None,
        attention_mask=None,
        lengths: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T or logits_to_keep, V) and, if `features` lists decoder layers (0-based; the last
        one means the final-normed output), their outputs for the new tokens, concatenated in that order
        (B, T, n*H). `attention_mask`: None (causal) or what `attention_mask()` gives. `lengths` (B):
        only row b's first lengths[b] tokens are needed, the rest is padding whose outputs are not
        defined (here they are computed anyway: `ragged` is False)."""
        if features:
            self._hook_layers(features)
            self._wanted = frozenset(features)
        mask = {} if attention_mask is None else {"attention_mask": attention_mask}
        keep: int | torch.Tensor = logits_to_keep
        if 0 < keep < input_ids.shape[1]:
            # As positions, not a count: transformers then gathers the rows instead of slicing a view,
            # which a bf16 matmul at batch 1 does not fold into one GEMM; it would copy the whole LM head
            # first (SmolLM2's: 67 ms against 5 ms on a 2-core CPU, at every prefill).
            keep = torch.arange(input_ids.shape[1] - keep, input_ids.shape[1], device=input_ids.device)
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=keep,
                **mask,
                **{self._cache_kw: cache},
            )
            feats = torch.cat([self._captured[i] for i in features], dim=-1) if features else None
        finally:
            self._wanted = frozenset()
            self._captured = {}
        return out.logits, feats

    @staticmethod
    def crop(cache, length: int) -> None:
        """Keep the first `length` positions (transformers 5 crops by a negative count to remove)."""
        cache.crop(-(cache.get_seq_length() - length))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw embedding rows, without any model-specific scaling (what published drafts expect)."""
        return F.embedding(ids, self.embedding.weight)

    @property
    def embedding_table(self) -> torch.Tensor:
        """The token embeddings (vocab, hidden) that `embed` looks rows up in."""
        return self.embedding.weight
