"""A GGUF's weight matrices as stored: their quantized blocks, under transformers' parameter names.

Converting a GGUF (`flashdraft.models.load.convert_gguf`) dequantizes it to float32. To run a K-quant
file's blocks as they are on our own kernels, we need those blocks themselves: `read_blocks` gives every
matrix's bytes, one row of blocks per output feature, named as transformers names the dequantized
weight and with its rows in the same order, so that `dequantize(read_blocks(f)[name])` is bitwise the
converted checkpoint's `name`. `dequantize` is written from the ggml block layouts and is the
reference the kernels are tested against.

A damaged file must never reach a kernel, nor give a traceback from deep inside a GGUF reader:
`check_blocks` walks the header itself (the tokenizer's arrays are skipped, not parsed, so it takes
well under a second on a 250 MB file) and checks every tensor's type, shape and extent in the file and
every block's fp16 scales; whatever is wrong becomes one line naming the file, the tensor and the fix.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class Blocks:
    """One weight matrix as the file stores it."""

    ggml_type: str  # "Q4_K", "Q6_K", "Q8_0", "F16", ...
    shape: tuple[int, int]  # (out_features, in_features), as the HF weight
    data: torch.Tensor  # uint8 (out_features, bytes per row): each row is that output's blocks, in order


@dataclass(frozen=True)
class Layout:
    """A ggml block: `size` values in `nbytes` bytes, with fp16 scales at these byte offsets."""

    size: int
    nbytes: int
    scales: tuple[tuple[str, int], ...]  # (name in ggml's block struct, byte offset in the block)


# The types `dequantize` computes (and whose scales `check_blocks` checks): ggml's block structs,
# ggml-common.h. Q5_0 is here because the built-in Gemma file (Q4_K_M) stores most matrices in it.
LAYOUTS = {
    "Q8_0": Layout(32, 34, (("d", 0),)),  # d, qs[32] int8
    "Q4_1": Layout(32, 20, (("d", 0), ("m", 2))),  # d, m, qs[16] (two 4-bit values a byte)
    "Q5_0": Layout(32, 22, (("d", 0),)),  # d, qh[4] (fifth bits), qs[16]
    "Q4_K": Layout(256, 144, (("d", 0), ("dmin", 2))),  # d, dmin, scales[12] (6-bit), qs[128]
    "Q5_K": Layout(256, 176, (("d", 0), ("dmin", 2))),  # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": Layout(256, 210, (("d", 208),)),  # ql[128], qh[64], scales[16] int8, d
}
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


# -- checking a file -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's entry in the header, with where its data lies in the file."""

    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is a row's length (in_features of a matrix)
    ggml_type: str
    start: int  # offset of its first byte in the file
    nbytes: int


class _Truncated(Exception):
    """The header runs past the end of the file."""


class _BadHeader(Exception):
    """The header holds something no GGUF writer writes."""


class _Header:
    """A cursor over a GGUF header (little-endian, versions 2 and 3), bounds-checked at every read."""

    # GGUF metadata value types (gguf.constants.GGUFValueType) of fixed size: their struct format
    SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    STRING, ARRAY = 8, 9

    def __init__(self, buf: np.ndarray):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str):
        n = struct.calcsize("<" + fmt)
        if self.pos + n > len(self.buf):
            raise _Truncated
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return values[0] if len(values) == 1 else values

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise _Truncated
        self.pos += n

    def string(self) -> str:
        n = self.take("Q")
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        """A metadata value; arrays are skipped (None): we need none, and the tokenizer's are huge."""
        if kind in self.SCALARS:
            return self.take(self.SCALARS[kind])
        if kind == self.STRING:
            return self.string()
        if kind == self.ARRAY:
            item, count = self.take("IQ")
            if item in self.SCALARS:
                self.skip(count * struct.calcsize("<" + self.SCALARS[item]))
            else:
                for _ in range(count):
                    self.value(item)
            return None
        raise _BadHeader(f"a metadata value of unknown type {kind} at byte {self.pos}")


def _refuse(path: Path, problem: str, tensor: str | None = None, fix: str | None = None, todo: str = ""):
    """The one-line ModelError for a file we cannot use: `problem` is a clause about `tensor` when one
    is named, about the file ("it ...") otherwise; `todo` replaces the default fix (get a good copy)."""
    from flashdraft.models.load import ModelError  # lazily: load.py calls this module

    where = f"tensor {tensor!r} " if tensor is not None else ""
    todo = todo or (f"run `{fix}`" if fix else "re-download the file")
    return ModelError(f"could not load the GGUF file {path}: {where}{problem}; {todo}".replace("\n", " "))


def scan(path: str | os.PathLike, fix: str | None = None) -> tuple[dict, list[TensorInfo]]:
    """The header of a GGUF file: (its scalar and string metadata, its tensors), every tensor's type,
    shape and extent checked (not yet its scales: `check_blocks`). A file that is not a GGUF, has a
    truncated or inconsistent header, or holds a tensor of an unknown type raises the one-line
    ModelError (`fix`: the command that gets a good copy, when there is one)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise _refuse(path, f"it cannot be read ({e.strerror})", fix=fix) from None
    if size < 4 or _magic(path) != b"GGUF":
        start = _magic(path) if size else b""
        raise _refuse(path, f"it is not a GGUF file (it starts with {start!r}, not b'GGUF')", fix=fix)
    head = _Header(np.memmap(path, mode="r"))
    head.pos = 4
    try:
        version = head.take("I")
        if version & 0xFFFF == 0:
            raise _refuse(
                path, "it is a big-endian GGUF, which is not supported", todo="use a little-endian copy"
            )
        if version not in (2, 3):
            raise _refuse(
                path,
                f"its GGUF version is {version}, not 2 or 3 (the header is damaged, or the file too old)",
                fix=fix,
            )
        n_tensors, n_kv = head.take("QQ")
        meta = {}
        for _ in range(n_kv):
            key = head.string()
            meta[key] = head.value(head.take("I"))
        entries = []
        for _ in range(n_tensors):
            name = head.string()
            n_dims = head.take("I")
            if not 1 <= n_dims <= 4:
                raise _refuse(
                    path, f"has {n_dims} dimensions (ggml has 1 to 4): the header is damaged", name, fix
                )
            dims = head.take("Q" * n_dims)
            entries.append((name, dims if n_dims > 1 else (dims,), *head.take("IQ")))
    except _Truncated:
        raise _refuse(
            path, f"its header runs past the end of the file ({size} bytes): the file is truncated", fix=fix
        ) from None
    except _BadHeader as e:
        raise _refuse(path, f"its header is damaged ({e})", fix=fix) from None

    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise _refuse(
            path, f"its general.alignment is {align!r}, not a power of two: the header is damaged", fix=fix
        )
    data_start = -(-head.pos // align) * align
    known = {t.value: t for t in GGMLQuantizationType}
    tensors, seen = [], set()
    for name, dims, type_id, offset in entries:
        if name in seen:
            raise _refuse(path, "appears twice in the header", name, fix)
        seen.add(name)
        kind = known.get(type_id)
        if kind is None or kind not in GGML_QUANT_SIZES:
            raise _refuse(
                path,
                f"has an unknown ggml type id {type_id}: the header is damaged, or the type newer than gguf "
                f"{_gguf_version()}",
                name,
                fix,
            )
        block, nbytes = GGML_QUANT_SIZES[kind]
        if len(dims) == 2 and block == 1 and kind.name not in FLOATS:
            raise _refuse(path, f"is a matrix of type {kind.name}, which is no weight type", name, fix)
        if dims[0] % block:
            raise _refuse(
                path,
                f"has rows of {dims[0]} values, not a multiple of {kind.name}'s block of {block}",
                name,
                fix,
            )
        if offset % align:
            raise _refuse(path, f"has its data at offset {offset}, not aligned to {align}", name, fix)
        count = math.prod(dims)
        tensors.append(TensorInfo(name, tuple(dims), kind.name, data_start + offset, count // block * nbytes))
    # Each tensor's size follows from its type and shape: its data must fit in the file and end before
    # the next tensor's begins (wrong sizes in the header show up as overlaps, a cut file as a short end).
    ordered = sorted(tensors, key=lambda t: t.start)
    for t, after in zip(ordered, ordered[1:] + [None], strict=True):
        end = t.start + t.nbytes
        if after is not None and end > after.start:
            raise _refuse(
                path,
                f"({t.ggml_type}, shape {tuple(reversed(t.dims))}: {t.nbytes} bytes from byte {t.start}) overlaps "
                f"tensor {after.name!r} at byte {after.start}: the header's shapes or types are wrong",
                t.name,
                fix,
            )
        if end > size:
            raise _refuse(
                path,
                f"({t.ggml_type}, {t.nbytes} bytes) ends at byte {end} but the file has {size}: it is truncated",
                t.name,
                fix,
            )
    return meta, tensors


def _gguf_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("gguf")


def _magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def check_blocks(path: str | os.PathLike, fix: str | None = None) -> list[TensorInfo]:
    """Refuse a damaged GGUF with one line before anything reads it: `scan`'s checks, then every
    block's fp16 scales (d, dmin, m) finite, over whole tensors at once. Returns the tensors."""
    path = Path(path)
    _, tensors = scan(path, fix)
    data = np.memmap(path, mode="r")
    for t in tensors:
        layout = LAYOUTS.get(t.ggml_type)
        if layout is None:
            continue
        blocks = data[t.start : t.start + t.nbytes].reshape(-1, layout.nbytes)
        for field, at in layout.scales:
            scale = blocks[:, at : at + 2].view(np.float16)[:, 0]
            bad = ~np.isfinite(scale)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                row, block = divmod(i, t.dims[0] // layout.size)
                what = "a NaN" if np.isnan(scale[i]) else "an infinite"
                raise _refuse(
                    path,
                    f"({t.ggml_type}) has {what} fp16 scale {field} in block {block} of row {row} "
                    f"({int(bad.sum())} such blocks): its data is damaged",
                    t.name,
                    fix,
                )
    return tensors


# -- reading the blocks ----------------------------------------------------------------------------


def read_blocks(path: str | os.PathLike) -> dict[str, Blocks]:
    """Every weight matrix of a GGUF as stored, keyed by the HF parameter name transformers' GGUF loader
    gives it, with its rows in the order of that loader's weight (see `hf_names`). Checked first
    (`check_blocks`)."""
    path = Path(path)
    tensors = check_blocks(path)
    names = hf_names(path)
    data = np.memmap(path, mode="r")
    out = {}
    for t in tensors:
        if len(t.dims) != 2 or t.name not in names:
            continue  # norms, biases; a matrix transformers does not load is no weight of the model
        name, rows = names[t.name]
        raw = torch.from_numpy(np.array(data[t.start : t.start + t.nbytes]).reshape(t.dims[1], -1))
        out[name] = Blocks(t.ggml_type, (t.dims[1], t.dims[0]), raw if rows is None else raw[rows])
    return out


def hf_names(path: str | os.PathLike) -> dict[str, tuple[str, torch.Tensor | None]]:
    """{GGUF tensor name: (HF parameter name, row order or None)} for the 2-D tensors that transformers'
    GGUF loader (`load_gguf_checkpoint`) puts into the model.

    The names come from transformers' own map (`get_gguf_hf_weights_map` over the model the file's config
    builds, on the meta device: no weights). The row order is that of its tensor processor: for
    `general.architecture` "llama" (Llama, SmolLM2, Mistral) it undoes the row permutation llama.cpp's
    converter applies to attn_q and attn_k, per head (qwen2, qwen3 and gemma3 files are not permuted).
    Blocks run along the input dimension, so a row permutation moves whole rows of bytes: rather than
    copying its formula we hand the processor the row numbers as a (rows, 1) weight and read back where
    each went. A processor that does anything but reorder rows (a transpose, an offset) is refused."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers.integrations.gguf import is_gguf_arch_supported
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    path = Path(path)
    meta, tensors = scan(path)
    arch = meta.get("general.architecture")
    if is_gguf_arch_supported(arch):  # its other loader keeps blocks packed and maps names its own way
        raise _refuse(
            path,
            f"it has architecture {arch!r}, which transformers loads packed",
            todo="read_blocks covers the architectures of its legacy loader (llama, qwen2, qwen3, gemma3, ...)",
        )
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    config = CONFIG_MAPPING[parsed["model_type"]].from_dict(parsed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed)
    mapping = get_gguf_hf_weights_map(model, processor)
    names = {}
    for t in tensors:
        if len(t.dims) != 2:
            continue
        n = t.dims[1]
        result = processor.process(
            weights=np.arange(n, dtype=np.float64)[:, None],
            name=t.name,
            tensor_key_mapping=mapping,
            parsed_parameters={"tensors": {}},
        )
        if result.name not in mapping:
            continue
        rows = np.asarray(result.weights)
        if rows.shape != (n, 1) or not np.array_equal(np.sort(rows[:, 0]), np.arange(n)):
            raise _refuse(
                path,
                "is transformed by transformers' GGUF loader in a way other than reordering its rows",
                t.name,
                todo="read_blocks cannot give its blocks",
            )
        rows = torch.from_numpy(rows[:, 0].astype(np.int64))
        same = bool(torch.equal(rows, torch.arange(n)))
        names[t.name] = (mapping[result.name], None if same else rows)
    return names


# -- dequantizing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parts:
    """A quantized matrix taken apart, as ggml defines its values: integer codes `q` (out, in) and the
    scales of each sub-block of `sub` inputs. Q8_0, Q5_0 (q - 16), Q4_1: w = d q (+ m), d and m per 32.
    Q4_K, Q5_K: w = (d sc) q - (dmin mk), d and dmin per 256, sc and mk per 32. Q6_K: w = (d sc) q, d per
    256, sc per 16. Our kernels run these parts as they are (kernels.pack_parts)."""

    kind: str
    q: torch.Tensor  # int16 (out, in)
    d: torch.Tensor  # float32 (fp16 values): (out, in / 32), or (out, in / 256) for the K-quants
    m: torch.Tensor | None = None  # Q4_1: (out, in / 32)
    sc: torch.Tensor | None = None  # K-quants: float32 integers (out, in / sub)
    dmin: torch.Tensor | None = None  # Q4_K, Q5_K: (out, in / 256)
    mk: torch.Tensor | None = None  # Q4_K, Q5_K: (out, in / 32)

    @property
    def sub(self) -> int:
        return 16 if self.kind == "Q6_K" else 32

    def values(self) -> torch.Tensor:
        """float32 (out, in): each product and difference rounded as ggml and the gguf package do."""
        n, k = self.q.shape
        q = self.q.float().reshape(n, -1, self.sub)
        if self.sc is None:
            w = self.d.unsqueeze(2) * q
            return (w if self.m is None else w + self.m.unsqueeze(2)).reshape(n, k)
        per = 256 // self.sub  # sub-blocks a super-block
        scale = self.d.repeat_interleave(per, 1) * self.sc
        w = scale.unsqueeze(2) * q
        if self.dmin is not None:
            w = w - (self.dmin.repeat_interleave(per, 1) * self.mk).unsqueeze(2)
        return w.reshape(n, k)


def parts(blocks: Blocks) -> Parts:
    """`blocks` taken apart (`Parts`); ValueError for a type that has none here (floats, others)."""
    out, cols = blocks.shape
    if blocks.ggml_type not in LAYOUTS:
        raise ValueError(f"no parts for ggml type {blocks.ggml_type} (there are for {', '.join(LAYOUTS)})")
    b = blocks.data.reshape(-1, LAYOUTS[blocks.ggml_type].nbytes)
    found = _PARTS[blocks.ggml_type](b)  # per block; each field reshaped to per output row below
    fields = {k: v.reshape(out, -1) for k, v in found.items()}
    return Parts(blocks.ggml_type, **fields)


def dequantize(blocks: Blocks) -> torch.Tensor:
    """The float32 (out_features, in_features) values of `blocks`, bitwise those of
    `gguf.quants.dequantize` (each product and difference rounded to float32 in the same order)."""
    out, cols = blocks.shape
    kind = blocks.ggml_type
    if kind in FLOATS:
        return blocks.data.reshape(-1).view(FLOATS[kind]).float().reshape(out, cols)
    if kind not in LAYOUTS:
        raise ValueError(
            f"dequantize does not compute ggml type {kind} (it does {', '.join([*FLOATS, *LAYOUTS])})"
        )
    return parts(blocks).values()


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block, as float32 (blocks, 1)."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """4-bit values packed two a byte, ggml's way: in every `group` bytes, the low nibbles are `group`
    values, then the high nibbles the next `group`. (n, bytes) -> (n, 2 * bytes) uint8."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, group)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, -1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """Bit i (0..count-1) of every byte of qh (n, bytes) -> (n, count, bytes) uint8 in {0, 1}."""
    shifts = torch.arange(count, dtype=torch.uint8).reshape(1, count, 1)
    return (qh.unsqueeze(1) >> shifts) & 1


def _q8_0(b):
    return {"q": b[:, 2:34].contiguous().view(torch.int8).short(), "d": _f16(b, 0)}


def _q4_1(b):
    return {"q": _nibbles(b[:, 4:20], 16).short(), "d": _f16(b, 0), "m": _f16(b, 2)}  # 0..15, then 16..31


def _q5_0(b):
    # qh: a little-endian uint32 whose bit j is value j's fifth bit; byte k holds values 8k..8k+7.
    high = _bits(b[:, 2:6], 8).transpose(1, 2).reshape(-1, 32)
    return {"q": (_nibbles(b[:, 6:22], 16) | (high << 4)).short() - 16, "d": _f16(b, 0)}


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 8 sub-block scales and mins, 6 bits each in 12 bytes (ggml's get_scale_min_k4):
    bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3; scales and mins 4-7 keep their low 4 bits in
    bytes 8-11 (scale low nibble, min high nibble) and their top 2 bits in the top bits of bytes 0-3 / 4-7."""
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 6) << 4)], dim=1)
    mins = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _q4_k(b):
    sc, mk = _k_scales(b[:, 4:16])
    q = _nibbles(b[:, 16:144], 32).short()  # 8 sub-blocks of 32
    return {"q": q, "d": _f16(b, 0), "sc": sc, "dmin": _f16(b, 2), "mk": mk}


def _q5_k(b):
    sc, mk = _k_scales(b[:, 4:16])
    low = _nibbles(b[:, 48:176], 32).reshape(-1, 8, 32)
    high = _bits(b[:, 16:48], 8)  # bit j of qh[l]: value l of sub-block j
    q = (low | (high << 4)).short().reshape(-1, 256)
    return {"q": q, "d": _f16(b, 0), "sc": sc, "dmin": _f16(b, 2), "mk": mk}


def _q6_k(b):
    n = b.shape[0]
    # Each half of 128 values: ql's 64 bytes give values 0-31 and 32-63 (low nibbles), 64-127 (high);
    # qh's 32 bytes give their top two bits, bits 2g..2g+1 for the g-th group of 32.
    low = _nibbles(b[:, 0:128], 64).reshape(n, 2, 4, 32)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)) & 3
    q = ((low | (high << 4)).short() - 32).reshape(n, 256)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    return {"q": q, "d": _f16(b, 208), "sc": sc}


_PARTS = {"Q8_0": _q8_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
