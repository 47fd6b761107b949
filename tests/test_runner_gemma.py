"""The native runner's Gemma 3 (flashdraft/models/runner/gemma.py): the checks of tests/test_runner.py on Gemma
models whose sequences outrun the sliding window, so that windows, the two RoPE tables and the masks
of both layer kinds all matter.

float64: logits and features equal transformers' Target (the reference); DFlash through the runner
equals plain decoding, alone and batched. Quantized (int8, int4) with bfloat16 activations: a verify
row equals the one-token steps bitwise, a row does not depend on its batch, and DFlash equals plain
decoding of the same quantized runner. Also: the text part of an image-text Gemma 3, and the refusal of
the variants gemma.py does not compute.
"""

import pytest
import torch
import transformers as tf
from conftest import make_draft
from test_runner import (
    OURS,
    QUANT,
    check_dflash_equals_plain,
    check_float64_equals_transformers,
    check_native_agrees_with_the_torch_layers,
    check_ragged_verify,
    check_row_does_not_depend_on_its_batch,
    check_same_bits_on_every_path,
    check_verify_rows_equal_one_token_steps,
    dflash_cases,
)

from flashdraft import Target
from flashdraft.models.runner import RunnerTarget, kernels

# The float64 models' layers, with a window of 4 positions (`gemma`).
KINDS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def gemma(
    dtype=torch.float64, window: int = 4, std: tuple[float, float] = (0.15, 0.3), multimodal=False, **shapes
) -> Target:
    """A random Gemma 3 with nothing left trivial: the norms' weights random (transformers starts them
    at 0, where 1 + w and w hardly differ in effect), query_pre_attn_scalar unequal to head_dim, a hidden
    size whose square root float32 rounds (transformers holds the embedding scale as a float32 buffer
    before the model moves to float64), and local and global RoPE bases of its config. `std`: of the
    matrices and of the norms' weights. `multimodal`: the same text model inside a (tiny) image-text
    Gemma 3, Gemma3ForConditionalGeneration, whose config holds the text config."""
    torch.manual_seed(0)
    kw = dict(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        max_position_embeddings=256,
        layer_types=KINDS,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    kw.update(shapes, sliding_window=window)
    if multimodal:  # image tokens past the ids the checks use (0..127)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
        cfg = tf.Gemma3Config(
            text_config={**kw, "vocab_size": 300},
            vision_config={**vision, "image_size": 28, "patch_size": 14},
            mm_tokens_per_image=4,
            boi_token_index=297,
            eoi_token_index=298,
            image_token_index=299,
        )
        model = tf.Gemma3ForConditionalGeneration(cfg)
    else:
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**kw))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std[0] if p.dim() >= 2 else std[1])
    return Target(model.to(dtype).eval())


def gemma_270m_shaped(quantize: str) -> RunnerTarget:
    """Four layers (sliding, full, sliding, sliding) of Gemma-3-270M's shapes (640 wide, 4 heads of 256,
    1 kv head, MLP 2048), random, with a window of 16: the kernels' blocking depends on the shapes (see
    test_runner.smol_shaped), and the ~100-token caches of the checks outrun the window.

    Small matrices (std 0.02) and wide norm weights (std 1): Gemma normalises every sublayer's output
    before adding it to the residual, and with the weights of `gemma()` that residual (embedding rows
    times sqrt(640)) is so much larger that a one-bit difference in a sublayer rounds away before it
    reaches the logits. With these, the bitwise checks (between them) were seen failing on a dense bf16
    GEMM, on sums over slots in bf16 and on SDPA; with the weights of `gemma()`, on SDPA only."""
    shapes = dict(vocab_size=256, hidden_size=640, intermediate_size=2048, num_hidden_layers=4)
    shapes.update(num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256)
    kinds = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    ref = gemma(torch.float32, 16, (0.02, 1.0), **shapes, layer_types=kinds)
    return RunnerTarget.from_target(ref, quantize, torch.bfloat16)


def test_float64_logits_and_features_equal_transformers():
    ref = gemma(attention_bias=True)  # Gemma 3 checkpoints have none, its config allows them
    check_float64_equals_transformers(ref, RunnerTarget.from_target(ref), "gemma3")


def test_float64_text_part_of_a_multimodal_gemma_equals_transformers():
    """An image-text checkpoint (what AutoModelForCausalLM loads for model_type "gemma3") runs its text
    model here: the runner reads the text config inside the model's config."""
    ref = gemma(multimodal=True)
    assert isinstance(ref.model, tf.Gemma3ForConditionalGeneration)
    check_float64_equals_transformers(ref, RunnerTarget.from_target(ref), "gemma3 image-text")


@pytest.mark.parametrize("quantize", QUANT)
def test_quantized_verify_rows_equal_one_token_steps_bitwise(quantize):
    check_verify_rows_equal_one_token_steps(gemma_270m_shaped(quantize), quantize)


@pytest.mark.parametrize("quantize", QUANT)
def test_quantized_row_does_not_depend_on_its_batch(quantize):
    check_row_does_not_depend_on_its_batch(gemma_270m_shaped(quantize), quantize)


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
@torch.inference_mode()
def test_native_layers_agree_with_the_torch_layers():
    """Gemma 3's layers in the C++ call (kernels/layers.cpp: norms of 1 + weight in float32 before and
    after each block and on every head's q and k, gelu_tanh, the embedding rows scaled, the sliding
    layers' own RoPE table and window) compute what `Layer`'s torch ops compute: against the dense float32
    model, their features and logits are as close as the torch ops' on the same q8_0 weights. 48 tokens
    over a window of 16, so the window and both tables matter."""
    check_native_agrees_with_the_torch_layers(gemma_270m_shaped("q8_0"), 48, [0, 1, 2])


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
def test_native_layers_give_the_same_bits_on_every_path():
    """Gemma 3's C++ layers on the scalar reference path, AVX2 and AVX-512 (where the CPU runs them):
    equal logits and features, in causal order and with masks (odd rows left-padded)."""
    check_same_bits_on_every_path(gemma_270m_shaped("q4_1"), 4, 40)


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_the_mlps_gate_gives_one_set_of_bits_on_every_path_and_the_functions_values(gelu):
    """The MLP's gate in the C++ layers (SiLU for Llama, gelu_tanh for Gemma 3, each with our own exp), on
    every bf16 value: the vector paths give the scalar reference's bits (a whole forward hides a last-bit
    difference here: the product is rounded to bf16, then quantized to int8 for the next GEMM), and the
    values are the functions' (float64) to bf16's rounding wherever an activation can be (|x| < 64)."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = gate[torch.isfinite(gate)]
    up = torch.ones_like(gate)  # the gate's own value comes out (times 1)
    gu = torch.cat([gate, up])[None]
    outs = {path: torch.ops.flashdraft.gated(gu, gelu, kernels.PATHS[path]) for path in kernels.runnable()}
    for path, out in outs.items():
        assert torch.equal(out, outs["reference"]), path
    a = gate.double()
    z = 2 * (2 / torch.pi) ** 0.5 * (a + 0.044715 * a**3) if gelu else a
    exact = a * torch.sigmoid(z)
    near = a.abs() < 64
    err = (outs["reference"][0].double() - exact).abs()[near]
    assert (err <= 2**-8 * exact.abs()[near] + 1e-30).all(), err.max().item()


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
def test_a_ragged_verify_gives_each_row_the_bits_of_the_padded_one():
    """As tests/test_runner.py's, on Gemma's C++ call: rows' padding not computed, both kinds of masks read
    by each query's own row (41 cached tokens over a window of 16)."""
    check_ragged_verify(gemma_270m_shaped("q4_1"), "gemma3")


def test_float64_dflash_through_runner_equals_plain_decoding():
    ref = gemma()
    prompts, configs = dflash_cases(ref, 11, 6)
    run = RunnerTarget.from_target(ref)
    check_dflash_equals_plain(run, make_draft(ref.model), ref, prompts, configs, "gemma3")


@pytest.mark.parametrize("quantize", QUANT)
def test_quantized_dflash_equals_plain_decoding_of_the_same_weights(quantize):
    ref = gemma(torch.float32)
    run = RunnerTarget.from_target(ref, quantize, torch.bfloat16)
    prompts, configs = dflash_cases(run, 12, 6)
    draft = make_draft(ref.model, dtype=torch.bfloat16)
    check_dflash_equals_plain(run, draft, run, prompts, configs, quantize)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(attn_logit_softcapping=50.0), "soft-capping"),
        (dict(final_logit_softcapping=30.0), "soft-capping"),
        (dict(use_bidirectional_attention=True), "bidirectional"),
        (dict(hidden_activation="silu"), "'silu' MLP"),
        (dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0}}), "'dynamic' RoPE"),
    ],
    ids=["attn-softcap", "final-softcap", "bidirectional", "silu", "dynamic-rope"],
)
def test_refuses_the_gemma_variants_it_does_not_run(change, match):
    """What gemma.py does not compute is refused before any forward, with the way out."""
    small = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4
    )
    model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**small, head_dim=16, layer_types=KINDS[1:3], **change))
    with pytest.raises(ValueError, match=f"{match}.*: use --runner transformers$"):
        RunnerTarget.from_target(Target(model))
