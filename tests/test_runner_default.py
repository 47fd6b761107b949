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
from flashdraft.models.runner import Quantization, RunnerTarget, kernels
from flashdraft.models.runner.quant import BlockLinear
from flashdraft.models.target import TargetError


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
    assert t.describe() == f"native runner, {ours} weights, bfloat16"
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
    from flashdraft.models.load import default_quantization

    assert default_quantization(torch.bfloat16, "auto", "cuda") == Quantization("int8", "int8")
    with pytest.raises(TargetError, match="--quantize q4_1 runs on our CPU kernels: use --device cpu"):
        default_quantization(torch.bfloat16, "q4_1", "cuda:0")
    ours = "q8_0" if kernels.available() else "int8"
    assert default_quantization(torch.bfloat16, "auto", "cpu") == Quantization(ours, ours)
