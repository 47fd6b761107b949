"""Which target `load_target` gives by default: the native runner with int8 weights in bf16 (exact),
dense in float32 and float64, the transformers target on request and for architectures the runner does
not cover; the weights quantized from the checkpoint's own values."""

import pytest
import torch
import transformers as tf
from conftest import make_hf_model

from flashdraft import Target, load_target
from flashdraft.models.runner import Quantization, RunnerTarget
from flashdraft.models.runner.quant import Int8Linear
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
    assert t.quantization == Quantization("int8", "int8") and t.dtype == torch.bfloat16
    assert t.describe() == "native runner, int8 weights, bfloat16"
    assert t.model.dtype == torch.bfloat16  # the transformers model beside it (bench's peers) too
    for dtype in ("float32", "float64"):
        dense = load_target(dirs / "llama", dtype)
        assert isinstance(dense, RunnerTarget) and not dense.exact
        assert dense.quantization == Quantization() and str(dense.dtype) == f"torch.{dtype}"
    assert not load_target(dirs / "llama", "bfloat16", quantize="none").exact
    assert load_target(dirs / "llama", "float32", quantize="int4").quantization == Quantization(
        "int4", "int4"
    )


def test_int8_weights_come_from_the_checkpoints_values_not_a_bf16_copy(dirs):
    """The checkpoint is float32; quantizing its bf16 rounding would give other int8 values."""
    t = load_target(dirs / "llama", "bfloat16")
    w = Target.from_pretrained(dirs / "llama", dtype=torch.float32).model.model.layers[0].mlp.down_proj.weight
    want = Int8Linear(w, None, torch.bfloat16)
    got = t.runner.layers[0].down
    assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scale, want.scale)


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
