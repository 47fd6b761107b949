"""`flashdraft export --to gguf`: the draft as llama.cpp's DFlash loader reads it (src/models/dflash.cpp of
the llama.cpp vendored in llama-cpp-python 0.3.36; its convert_hf_to_gguf.py writes the same keys and names).
Read back with the `gguf` package: every key the loader needs, every tensor under llama.cpp's name and in
its `ne` order (our shape reversed), the values unchanged, and the draft vocabulary as llama.cpp's runtime
takes it (`d2t`: absolute target ids, int64; `output.weight`: the head's rows)."""

import numpy as np
import pytest
import torch
from conftest import make_draft, make_hf_model

from flashdraft import Target
from flashdraft.models.export import ExportError, export_gguf

gguf = pytest.importorskip("gguf")
V = 128
# llama.cpp's names for a DFlash draft layer (llm_tensor names in src/llama-arch.cpp)
LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP = {
    "fc.weight": "fc.weight",
    "enc.output_norm.weight": "hidden_norm.weight",
    "output_norm.weight": "norm.weight",
}


@pytest.fixture(scope="module")
def target_file(tmp_path_factory):
    """A target GGUF with a tokenizer only (what the draft file copies), and a mask id of its own."""
    path = tmp_path_factory.mktemp("t") / "target.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_token_types([1] * V)
    w.add_token_merges(["t 1"])
    w.add_eos_token_id(2)
    w.add_mask_token_id(99)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read(path):
    r = gguf.GGUFReader(path)
    return {f.name: f.contents() for f in r.fields.values()}, {t.name: t for t in r.tensors}


def export(tmp_path, target_file, dtype, vocab):
    model = make_hf_model("llama", vocab=V, layers=4)
    draft = make_draft(model, layers=2, block_size=8, mask_token_id=5, target_layer_ids=[0, 2])
    head = model.get_output_embeddings().weight.detach()
    if vocab:
        draft.set_vocab([40, 3, 17, 90, 64], head)
    draft = draft.to(dtype)
    out = export_gguf(draft, Target(model), target_file, tmp_path / "draft.gguf")
    return draft, head, *read(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_export_has_every_key_and_tensor_llamacpp_reads(tmp_path, target_file, dtype):
    draft, head, kv, tensors = export(tmp_path, target_file, dtype, vocab=True)
    c = draft.config
    assert kv["general.architecture"] == "dflash"
    want = {
        "dflash.block_count": 2,
        "dflash.context_length": c.max_position_embeddings,
        "dflash.embedding_length": 64,
        "dflash.feed_forward_length": 96,
        "dflash.attention.head_count": 4,
        "dflash.attention.head_count_kv": 2,
        "dflash.attention.key_length": 16,
        "dflash.attention.value_length": 16,
        "dflash.block_size": 8,
        "dflash.target_layers": [1, 3],  # llama.cpp taps the input of layer id + 1: our ids 0 and 2
        "tokenizer.ggml.mask_token_id": 5,  # the draft's, not the target file's 99
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.eos_token_id": 2,
    }
    assert {k: kv.get(k) for k in want} == want
    assert kv["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(V)]
    assert kv["dflash.rope.freq_base"] == pytest.approx(c.rope_theta)
    assert kv["dflash.attention.layer_norm_rms_epsilon"] == pytest.approx(c.rms_norm_eps)
    ours = {k: v.float() for k, v in draft.state_dict().items()}
    names = {f"blk.{i}.{g}.weight": f"layers.{i}.{h}.weight" for i in range(2) for g, h in LAYER.items()}
    names |= TOP
    assert sorted(tensors) == sorted([*names, "output.weight", "d2t"])
    matrix = gguf.GGMLQuantizationType.BF16 if dtype == torch.bfloat16 else gguf.GGMLQuantizationType.F32
    for name, ours_name in names.items():
        t, w = tensors[name], ours[ours_name]
        assert list(t.shape) == list(reversed(w.shape)), name  # ggml's ne: the torch shape reversed
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if w.dim() == 1 else matrix), name
        assert torch.equal(_values(t, w.shape), w), name
    d2t = tensors["d2t"]
    assert d2t.tensor_type == gguf.GGMLQuantizationType.I64
    assert np.asarray(d2t.data).tolist() == [3, 17, 40, 64, 90]  # absolute target ids, in draft-id order
    out = tensors["output.weight"]
    assert list(out.shape) == [64, 5]
    assert torch.equal(_values(out, (5, 64)), head[[3, 17, 40, 64, 90]].to(dtype).float())


def test_a_draft_without_a_vocabulary_shares_the_targets_head(tmp_path, target_file):
    _, _, _, tensors = export(tmp_path, target_file, torch.bfloat16, vocab=False)
    assert "d2t" not in tensors and "output.weight" not in tensors and "token_embd.weight" not in tensors
    assert len(tensors) == 3 + 2 * 11


def test_drafts_llamacpp_would_compute_otherwise_are_refused(tmp_path, target_file):
    model = make_hf_model("llama", vocab=V, layers=4)
    base = make_draft(model, layers=1, block_size=8)
    draft = type(base)(base.config.replace(extra={"output_multiplier": 2.0})).to(torch.float64)
    draft.load_state_dict(base.state_dict())
    with pytest.raises(ExportError, match=r"the draft config has \['output_multiplier'\]"):
        export_gguf(draft, Target(model), target_file, tmp_path / "x.gguf")
    gemma = make_hf_model("gemma3", vocab=V, layers=4)
    with pytest.raises(ExportError, match="embedding module is Gemma3"):
        export_gguf(
            make_draft(gemma, layers=1, block_size=8), Target(gemma), target_file, tmp_path / "x.gguf"
        )
    assert not (tmp_path / "x.gguf").exists()


def _values(t, shape) -> torch.Tensor:
    """A read-back tensor's values as float32 in our (torch) shape."""
    data = np.asarray(t.data)
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1).view(np.int16).copy()
        return torch.from_numpy(raw).view(torch.bfloat16).float().reshape(shape)
    return torch.from_numpy(data.copy()).float().reshape(shape)
