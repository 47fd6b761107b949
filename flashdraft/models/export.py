"""Export a draft for engines that do not read our checkpoint folder as it is.

    flashdraft export --to transformers DRAFT_DIR OUT_DIR --target TARGET
    flashdraft export --to gguf DRAFT_DIR OUT.gguf --target TARGET

`transformers` writes transformers' DFlash assistant model, so that stock transformers runs it:

    assistant = MuseGlimmerAssistantModel.from_pretrained(OUT_DIR)
    target_model.generate(ids, assistant_model=assistant, speculation_type="dflash")

`gguf` writes the draft as llama.cpp's DFlash loader reads it (`llama-server -m TARGET.gguf -md OUT.gguf
--spec-type draft-dflash`), draft vocabulary included; the target must be a GGUF (a built-in name or a
.gguf file), whose tokenizer the draft file carries.

vLLM and SGLang read our checkpoint folder as it is (docs/at-scale.md); nothing to export for them.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from flashdraft.files import atomic_write, atomic_write_dir
from flashdraft.models.draft import DFlashDraft
from flashdraft.models.target import Target


class ExportError(ValueError):
    """The draft cannot be exported as asked (the message says why)."""


def computes_otherwise(draft: DFlashDraft, target: Target) -> str | None:
    """Why another engine's DFlash would compute another draft than ours, or None. transformers and
    llama.cpp embed the block with the target's raw embedding rows and apply only the target's LM head:
    drafts with an embedding scale, an output multiplier or logit soft-capping, targets whose embedding
    module scales its output (Gemma) and rope scaling (neither export writes it) are refused."""
    c = draft.config
    extras = sorted(set(c.extra) & {"input_embedding_scale", "output_multiplier", "final_logit_softcapping"})
    if extras:
        return f"the draft config has {extras}, which the engine's DFlash does not apply"
    emb = target.model.get_input_embeddings()
    if type(emb) is not torch.nn.Embedding:
        return (
            f"the target's embedding module is {type(emb).__name__} (it scales or normalises its output), "
            "while DFlash drafts read raw embedding rows"
        )
    if c.rope_scaling:
        return "the draft uses rope_scaling"
    return None


def hf_dflash_assistant(draft: DFlashDraft, target: Target):
    """Our draft as transformers' DFlash assistant (transformers 5.24: `MuseGlimmerAssistantModel`,
    used by `generate(..., speculation_type="dflash")`), or (None, reason) when that is not a pure
    renaming.

    The layers are the same (Qwen3-style, KV injection, non-causal block, final norm); the only
    differences are names: `fc` -> `encoder.fc`, `hidden_norm` -> `encoder.output_norm_enc`, and
    `rope_theta` -> `rope_parameters`. What transformers would compute otherwise is refused with the
    reason (`computes_otherwise`)."""
    try:
        from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
    except ImportError:
        return None, (
            "this transformers has no DFlash assistant model (MuseGlimmerAssistantModel); "
            "transformers 5.24 has one"
        )
    reason = computes_otherwise(draft, target)
    if reason:
        return None, f"not a pure renaming: {reason}"
    c = draft.config
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


# -- GGUF, for llama.cpp ----------------------------------------------------------------------------

GGUF_LAYER = {  # our layer tensor names -> llama.cpp's (blk.{i}.*), as its DFlash loader creates them
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GGUF_TOP = {"fc": "fc", "hidden_norm": "enc.output_norm", "norm": "output_norm"}


def gguf_name(name: str) -> str:
    """`layers.0.mlp.up_proj.weight` -> `blk.0.ffn_up.weight` (KeyError for a tensor llama.cpp has no name for)."""
    stem = name.removesuffix(".weight")
    if stem.startswith("layers."):
        _, i, rest = stem.split(".", 2)
        return f"blk.{i}.{GGUF_LAYER[rest]}.weight"
    return f"{GGUF_TOP[stem]}.weight"


def not_a_gguf_target(target_spec: str) -> str | None:
    """Why --to gguf cannot take this --target (checked without loading anything), or None."""
    from flashdraft.models.load import target_kind

    if target_kind(target_spec) in ("builtin", "gguf"):
        return None
    return (
        f"--to gguf needs the target as a GGUF (a built-in name or a .gguf file), not {target_spec!r}: the "
        "draft file carries the target's tokenizer. Convert the target with llama.cpp's convert_hf_to_gguf.py "
        "and pass --target that.gguf"
    )


def target_gguf(target_spec: str, scratch: Path) -> Path:
    """The GGUF file of a --target (built-in name or .gguf path): the draft file copies its tokenizer."""
    from flashdraft.models.load import get_spec, known_names, local_dir

    reason = not_a_gguf_target(target_spec)
    if reason:
        raise ExportError(reason)
    if str(target_spec) in known_names():
        spec = get_spec(str(target_spec))
        return spec.find_gguf(spec, scratch).path
    return local_dir(target_spec)


def _gguf_refusal(draft: DFlashDraft, target: Target) -> str | None:
    c = draft.config
    if c.sliding_window is not None and "sliding_attention" in c.layer_types:
        return "the draft has sliding-window layers, which this export does not write"
    return computes_otherwise(draft, target)


def export_gguf(draft: DFlashDraft, target: Target, target_file: Path, out: str | os.PathLike) -> Path:
    """Write `draft` to the file `out` as llama.cpp's DFlash draft GGUF: its layers in their dtype (norms
    float32), `dflash.target_layers` as llama.cpp counts them (our ids + 1: it taps the input of the next
    layer, the same features), the block size and mask token, the tokenizer of `target_file`, and with a
    draft vocabulary `d2t` (int64 target ids, absolute) and `output.weight` (the head's rows)."""
    import gguf

    draft.check_target(target)
    reason = _gguf_refusal(draft, target)
    if reason:
        raise ExportError(f"cannot export for llama.cpp: {reason}")
    c = draft.config
    params = {k: v.detach().cpu() for k, v in draft.state_dict().items()}
    dtype = params["fc.weight"].dtype
    kinds = {torch.bfloat16: gguf.GGMLQuantizationType.BF16, torch.float16: gguf.GGMLQuantizationType.F16,
             torch.float32: gguf.GGMLQuantizationType.F32}  # fmt: skip
    if dtype not in kinds:
        raise ExportError(
            f"cannot export {dtype} weights to GGUF: save the draft in bfloat16, float16 or float32"
        )
    files = {torch.bfloat16: gguf.LlamaFileType.MOSTLY_BF16, torch.float16: gguf.LlamaFileType.MOSTLY_F16,
             torch.float32: gguf.LlamaFileType.ALL_F32}  # fmt: skip
    source = gguf.GGUFReader(target_file)

    def write(path: str) -> None:
        w = gguf.GGUFWriter(path, "dflash")
        w.add_name(f"{Path(str(target_file)).stem} DFlash draft")
        w.add_file_type(files[dtype])
        _gguf_metadata(w, c, source)
        for name, t in params.items():
            w.add_tensor(gguf_name(name), **_gguf_array(t if t.dim() > 1 else t.float(), kinds))
        if draft.vocab is not None:
            rows = draft.vocab_rows if draft.vocab_rows is not None else target.lm_head.weight[draft.vocab]
            w.add_tensor("output.weight", **_gguf_array(rows.detach().cpu().to(dtype), kinds))
            w.add_tensor("d2t", draft.vocab.numpy().astype(np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    out = Path(out)
    if out.is_dir():
        raise ExportError(
            f"{out} is a directory: --to gguf writes one file (for example {out / 'draft.gguf'})"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, write)
    return out


def _gguf_metadata(w, c, source) -> None:
    """The keys llama.cpp's DFlash loader reads (its converter writes the same), and the tokenizer of the
    target's GGUF `source` (a reader) with the draft's mask token."""
    import gguf

    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_uint32("dflash.block_size", c.block_size)
    w.add_array("dflash.target_layers", [i + 1 for i in c.target_layer_ids])
    for field in source.fields.values():
        if field.name.startswith("tokenizer.") and field.name != gguf.Keys.Tokenizer.MASK_ID:
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, field.contents(), field.types[0], sub)
    w.add_mask_token_id(c.mask_token_id)


def _gguf_array(t: torch.Tensor, kinds: dict) -> dict:
    """A tensor as gguf's writer takes it: numpy, with bfloat16 passed as its raw 16 bits."""
    if t.dtype == torch.bfloat16:
        return {
            "tensor": t.contiguous().view(torch.int16).numpy().view(np.uint16),
            "raw_dtype": kinds[t.dtype],
        }
    return {"tensor": t.contiguous().numpy()}
