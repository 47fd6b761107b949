"""Export a draft for engines that do not read our format: transformers' own DFlash assisted generation.

    flashdraft export --to transformers DRAFT_DIR OUT --target TARGET

writes OUT as transformers' DFlash assistant model, so that stock transformers runs it:

    assistant = MuseGlimmerAssistantModel.from_pretrained(OUT)
    target_model.generate(ids, assistant_model=assistant, speculation_type="dflash")

vLLM and SGLang read our checkpoint as it is (README, "At scale"); nothing to export for them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .draft import DFlashDraft
from .files import atomic_write_dir
from .target import Target


class ExportError(ValueError):
    """The draft cannot be exported as asked (the message says why)."""


def hf_dflash_assistant(draft: DFlashDraft, target: Target):
    """Our draft as transformers' DFlash assistant (transformers 5.24: `MuseGlimmerAssistantModel`,
    used by `generate(..., speculation_type="dflash")`), or (None, reason) when that is not a pure
    renaming.

    The layers are the same (Qwen3-style, KV injection, non-causal block, final norm); the only
    differences are names: `fc` -> `encoder.fc`, `hidden_norm` -> `encoder.output_norm_enc`, and
    `rope_theta` -> `rope_parameters`. transformers embeds the block with the target's embedding
    module and applies only the target's LM head, so drafts with an embedding scale, an output
    multiplier or logit soft-capping, and targets whose embedding module scales its output (Gemma),
    would compute something else: those are refused with the reason."""
    try:
        from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
    except ImportError:
        return None, (
            "this transformers has no DFlash assistant model (MuseGlimmerAssistantModel); "
            "transformers 5.24 has one"
        )
    c = draft.config
    extras = sorted(set(c.extra) & {"input_embedding_scale", "output_multiplier", "final_logit_softcapping"})
    if extras:
        return None, f"not a pure renaming: the draft config has {extras}, which transformers' DFlash ignores"
    emb = target.model.get_input_embeddings()
    if type(emb) is not torch.nn.Embedding:
        return None, (
            f"not a pure renaming: the target's embedding module is {type(emb).__name__} (it scales or "
            "normalises its output), while DFlash drafts read raw embedding rows"
        )
    if c.rope_scaling:
        return None, "not a pure renaming: the draft uses rope_scaling"
    cfg = MuseGlimmerAssistantConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=c.max_position_embeddings,
        sliding_window=c.sliding_window or c.max_position_embeddings,  # unused without sliding layers
        layer_types=list(c.layer_types),
        block_size=c.block_size,
        mask_token_id=c.mask_token_id,
        target_layer_ids=list(c.target_layer_ids),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = MuseGlimmerAssistantModel(cfg)
    rename = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    model.load_state_dict({rename.get(k, k): v for k, v in draft.state_dict().items()}, strict=True)
    param = next(draft.parameters())
    return model.to(device=param.device, dtype=param.dtype).eval(), None


def export_transformers(draft: DFlashDraft, target: Target, out: str | os.PathLike) -> Path:
    """Write `draft` to `out` as transformers' DFlash assistant model (safetensors); returns `out`."""
    draft.check_target(target)
    model, reason = hf_dflash_assistant(draft, target)
    if model is None:
        raise ExportError(f"cannot export for transformers: {reason}")
    out = Path(out)
    atomic_write_dir(out, model.save_pretrained)  # files of the usual mode, each whole (transformers: 0600)
    return out
