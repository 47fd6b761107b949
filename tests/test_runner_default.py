"""Which target `load_target` gives by default for an HF checkpoint: the native runner with q8_0 weights on
our kernels in bf16 (exact; torch's int8 where the kernels cannot be built; a GGUF keeps its own types,
tests/test_models.py),
dense in float32 and float64, the transformers target on request and for architectures the runner does
not cover; the weights quantized from the checkpoint's own values."""

import pytest
import torch
import transformers as tf
from conftest import make_hf_model

from flashdraft import Target, load_target
from flashdraft.models.compute import choose
from flashdraft.models.runner import Quantization, RunnerTarget, kernels
from flashdraft.models.runner.quant import BlockLinear
from flashdraft.models.target import TargetError, cpu_has_fast_bf16


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("default")
    make_hf_model("llama", dtype=torch.float32).save_pretrained(root / "llama")
    small = dict(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2
    )
    tf.OlmoForCausalLM(tf.OlmoConfig(**small)).save_pretrained(root / "olmo")
    return root


def test_the_default_is_the_exact_native_runner_in_bf16(dirs):
    t = load_target(dirs / "llama", "bfloat16")
    assert isinstance(t, RunnerTarget) and t.exact
    ours = "q8_0" if kernels.available() else "int8"  # torch's int8 where no compiler is found
    assert t.quantization == Quantization(ours, ours) and t.dtype == torch.bfloat16
    on = f", {kernels.path_name()} kernels" if kernels.available() else ""
    assert t.describe() == f"native runner, {ours} weights, bfloat16{on}"
    assert t.model.dtype == torch.bfloat16  # the transformers model beside it (bench's peers) too
    for dtype in ("float32", "float64"):
        dense = load_target(dirs / "llama", dtype)
        assert isinstance(dense, RunnerTarget) and not dense.exact
        assert dense.quantization == Quantization() and str(dense.dtype) == f"torch.{dtype}"
    assert not load_target(dirs / "llama", "bfloat16", quantize="none").exact
    assert load_target(dirs / "llama", "float32", quantize="int4").quantization == Quantization(
        "int4", "int4"
    )


def test_without_our_kernels_the_default_is_torchs_int8(dirs, monkeypatch, caplog):
    """No compiler (or a failed build, tests/test_kernels.py): the default is torch's int8, still exact;
    asking for q8_0 / q4_1 then is a clear error."""
    monkeypatch.setitem(kernels._state, "ok", False)
    t = load_target(dirs / "llama", "bfloat16")
    assert t.quantization == Quantization("int8", "int8") and t.exact
    with pytest.raises(TargetError, match="needs flashdraft's CPU kernels.*--quantize int8"):
        load_target(dirs / "llama", "bfloat16", quantize="q4_1")


@pytest.mark.skipif(not kernels.available(), reason="our kernels could not be built here")
def test_q8_0_weights_come_from_the_checkpoints_values_not_a_bf16_copy(dirs):
    """The checkpoint is float32; quantizing its bf16 rounding would give other blocks."""
    t = load_target(dirs / "llama", "bfloat16")
    w = Target.from_pretrained(dirs / "llama", dtype=torch.float32).model.model.layers[0].mlp.down_proj.weight
    want = BlockLinear(w, None, torch.bfloat16, "q8_0")
    got = t.runner.layers[0].down
    assert torch.equal(got.packed, want.packed) and torch.equal(got.scales, want.scales)
    bf16 = BlockLinear(w.bfloat16(), None, torch.bfloat16, "q8_0")
    assert not torch.equal(got.packed, bf16.packed)


def test_transformers_on_request_and_where_the_runner_cannot(dirs):
    t = load_target(dirs / "llama", "bfloat16", runner="transformers")
    assert type(t) is Target and t.dtype == torch.bfloat16 and not t.exact
    fallback = load_target(dirs / "olmo", "bfloat16")  # auto: OLMo is not covered
    assert type(fallback) is Target and fallback.dtype == torch.bfloat16
    with pytest.raises(TargetError, match="covers llama.*not 'olmo': use --runner transformers"):
        load_target(dirs / "olmo", "bfloat16", runner="native")
    with pytest.raises(TargetError, match="needs the native runner"):
        load_target(dirs / "llama", "bfloat16", runner="transformers", quantize="int8")
    with pytest.raises(TargetError, match="runner must be one of"):
        load_target(dirs / "llama", runner="fast")
    with pytest.raises(TargetError, match="quantize must be auto or one of"):
        load_target(dirs / "llama", quantize="int3")


def test_our_cpu_kernels_are_not_the_default_on_other_devices():
    """On a GPU the default stays torch's int8 (our kernels read CPU memory), and asking for q8_0 there
    is a clear error, before any model loads."""
    gpu = choose("cuda", "auto", "auto", "native", "llama")
    assert gpu.quantization == Quantization("int8", "int8") and gpu.dtype == torch.bfloat16
    assert gpu.kernels == "torch"
    with pytest.raises(TargetError, match="--quantize q4_1 runs on our CPU kernels: use --device cpu"):
        choose("cuda:0", "bfloat16", "q4_1")
    ours = "q8_0" if kernels.available() else "int8"
    assert choose("cpu", torch.bfloat16, "auto", "native", "llama").quantization == Quantization(ours, ours)


@pytest.mark.skipif(not kernels.available(), reason="our kernels could not be built here")
@pytest.mark.parametrize("native_bf16", [True, False])
def test_on_any_cpu_our_kernels_run_the_default_in_bf16(native_bf16, monkeypatch):
    """Our kernels and C++ layers never use torch's bf16 matmuls, so a CPU without native bf16 (AVX2 only)
    gets them too: bf16 activations on a GGUF's own blocks, Gemma 3's as well as a Llama's. Only where
    torch's ops carry the layers (the transformers target, no compiler) does `auto` follow torch's bf16
    (float32 without it)."""
    import flashdraft.models.target as target_mod

    monkeypatch.setattr(target_mod, "cpu_has_fast_bf16", lambda: native_bf16)
    torch_dtype = torch.bfloat16 if native_bf16 else torch.float32
    stored = Quantization("q4_1", "q8_0")
    for family in ("llama", "qwen3", "gemma3_text"):
        c = choose("cpu", "auto", "auto", "native", family, stored)
        assert (c.dtype, c.quantization, c.kernels) == (torch.bfloat16, stored, kernels.path_name())
        assert choose("cpu", "auto", "auto", "native", family).quantization == Quantization("q8_0", "q8_0")
        dense = choose("cpu", "auto", "none", "native", family)  # torch's dense GEMMs
        assert (dense.dtype, dense.quantization, dense.kernels) == (torch_dtype, Quantization(), "torch")
    hf = choose("cpu", "auto", "auto", "transformers", "llama")
    assert (hf.runner, hf.dtype, hf.quantization) == ("transformers", torch_dtype, None)
    assert choose("cpu", "float32", "auto", "native", "llama").quantization == Quantization()  # as asked
    monkeypatch.setitem(kernels._state, "ok", False)  # no compiler: torch's ops everywhere
    none = choose("cpu", "auto", "auto", "native", "llama")
    assert none.dtype == torch_dtype and none.kernels == "torch"
    assert none.quantization == (Quantization("int8", "int8") if native_bf16 else Quantization())


@pytest.mark.skipif(not kernels.available(), reason="our kernels could not be built here")
def test_forcing_the_avx2_path_makes_auto_act_as_on_an_avx2_cpu(dirs, monkeypatch):
    """FLASHDRAFT_KERNEL=avx2: the kernels' path and the auto rules as on a CPU without native bf16;
    the default is still our kernels in bf16, and says so."""
    if kernels.best() == "reference":
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv("FLASHDRAFT_KERNEL", "avx2")
    monkeypatch.setitem(kernels._state, "path", kernels.PATHS["avx2"])
    assert not cpu_has_fast_bf16()
    t = load_target(dirs / "llama")
    assert isinstance(t, RunnerTarget) and t.exact and t.dtype == torch.bfloat16
    assert t.describe() == "native runner, q8_0 weights, bfloat16, avx2 kernels"
    assert load_target(dirs / "llama", runner="transformers").dtype == torch.float32
