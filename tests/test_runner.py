"""The native runner (flashdraft.models.runner) against transformers, and its batch-invariant quantized numerics.

float64: logits and features equal the transformers `Target`'s (the reference) on a prompt, on
incremental steps and on a padded batch with per-slot positions and the engine's masks; DFlash decoding
through the runner equals plain decoding, alone and batched. Quantized (int8, int4) with bfloat16
activations: a verify row equals the one-token step bitwise, a row does not depend on its batch, and
DFlash decoding equals plain decoding of the same quantized runner, alone and batched.
"""

import random

import numpy as np
import pytest
import torch
from conftest import make_draft, make_hf_model
from test_batch import BatchOracle, run_decoder

from flashdraft import DFlashProposer, Engine, GenerationConfig, Target, generate
from flashdraft.models import ops
from flashdraft.models.masks import DEAD
from flashdraft.models.runner import Quantization, RunnerTarget, kernels
from flashdraft.models.runner.quant import make_linear

ARCHS = ("llama", "qwen3", "qwen2")
# Our kernels' kinds where they could be built (a machine without a compiler runs torch's alone).
OURS = ("q8_0", "q4_1") if kernels.available() else ()
QUANT = ("int8", "int4", *OURS)
# The exactness tests also run the built-in SmolLM2's default: its GGUF's Q4_1 layers and Q8_0 head.
EXACT = (*QUANT, *([Quantization("q4_1", "q8_0")] if OURS else []))


def pair(arch: str) -> tuple[Target, RunnerTarget]:
    """The reference and the runner of one tiny model; biases (Qwen2's q/k/v) made non-zero, as trained
    ones are (the builder leaves them at zero)."""
    model = make_hf_model(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    ref = Target(model)
    return ref, RunnerTarget.from_target(ref)


def assert_close(a: torch.Tensor, b: torch.Tensor, what) -> None:
    assert a.shape == b.shape, what
    assert (a - b).abs().max() < 1e-10, (what, (a - b).abs().max().item())


@pytest.mark.parametrize("arch", ARCHS)
def test_float64_logits_and_features_equal_transformers(arch):
    check_float64_equals_transformers(*pair(arch), arch)


@torch.inference_mode()
def check_float64_equals_transformers(ref: Target, run: RunnerTarget, what) -> None:
    """Prompt, then a one-token step and a 3-token block, then a left-padded batch of three prompts
    with per-slot positions, a step where one row's slot is dead (a rejected draft) and the masks
    both targets build: the runner's logits and features equal transformers' at every step."""
    layers = [0, 2, ref.num_layers - 1, 2]  # the last layer: its final-normed output; 2 twice, as listed
    g = torch.Generator().manual_seed(3)
    caches = (ref.new_cache(sliding=False), run.new_cache(sliding=False))
    ids = torch.randint(0, 128, (1, 11), generator=g)
    steps = [(ids, torch.arange(11)[None])]
    steps.append((torch.randint(0, 128, (1, 1), generator=g), torch.tensor([[11]])))
    steps.append((torch.randint(0, 128, (1, 3), generator=g), torch.arange(12, 15)[None]))
    for n, (x, pos) in enumerate(steps):
        (la, fa), (lb, fb) = (
            t.forward(x, pos, c, features=layers) for t, c in zip((ref, run), caches, strict=True)
        )
        assert_close(la, lb, ("logits", what, n))
        assert_close(fa, fb, ("features", what, n))
    la, lb = (t.forward(x, pos + 3, c, logits_to_keep=1)[0] for t, c in zip((ref, run), caches, strict=True))
    assert lb.shape[1] == 1
    assert_close(la, lb, ("logits_to_keep", what))

    lens = torch.tensor([5, 9, 2])
    ids = torch.randint(0, 128, (3, 9), generator=g)
    pos = torch.arange(9) - (9 - lens)[:, None]
    kpos = torch.where(pos >= 0, pos, DEAD)
    caches = (ref.new_cache(sliding=False), run.new_cache(sliding=False))
    out = [
        t.forward(
            ids, pos.clamp_min(0), c, features=layers, attention_mask=t.attention_mask(pos.clamp_min(0), kpos)
        )
        for t, c in zip((ref, run), caches, strict=True)
    ]
    live = pos >= 0
    assert_close(out[0][0][live], out[1][0][live], ("padded prefill logits", what))
    assert_close(out[0][1][live], out[1][1][live], ("padded prefill features", what))
    for step in range(2):  # row 0 keeps only its first block slot after step 0: a dead slot in the middle
        q_pos = lens[:, None] + torch.arange(2) + (torch.tensor([1, 2, 2])[:, None] if step else 0)
        new = torch.randint(0, 128, (3, 2), generator=g)
        kall = torch.cat([kpos, q_pos], 1)
        out = [
            t.forward(new, q_pos, c, features=layers, attention_mask=t.attention_mask(q_pos, kall))
            for t, c in zip((ref, run), caches, strict=True)
        ]
        assert_close(out[0][0], out[1][0], ("padded step logits", what, step))
        assert_close(out[0][1], out[1][1], ("padded step features", what, step))
        kpos = kall.clone()
        if step == 0:
            kpos[0, -1] = DEAD


def dflash_cases(ref: Target, seed: int, n: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(ref.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    return prompts, [GenerationConfig(rng.randint(4, 24)) for _ in prompts]


def check_dflash_equals_plain(run, draft, plain_target, prompts, configs, what) -> None:
    """Speculative decoding through `run`, alone (blocks 4 and 16) and batched, equals plain decoding
    of `plain_target`. Twice: with the DFlash draft (features flow from the runner), and with an oracle
    that proposes the true continuation with errors, so that full and partial acceptance occur whatever
    a random draft manages."""
    want = [generate(plain_target, p, None, c).tokens for p, c in zip(prompts, configs, strict=True)]
    rng, accepted = random.Random(0), 0
    for name in ("dflash", "oracle"):
        for block in (4, 16):
            for i, (p, c) in enumerate(zip(prompts, configs, strict=True)):
                proposer = (
                    DFlashProposer(draft, run) if name == "dflash" else BatchOracle({"0": want[i]}, 128, rng)
                )
                res = generate(run, p, proposer, GenerationConfig(c.max_new_tokens, block))
                assert res.tokens == want[i], (what, name, "alone", block, i)
                accepted += sum(a - 1 for a in res.acceptance_lengths)
        truths = {str(i): t for i, t in enumerate(want)}
        proposer = DFlashProposer(draft, run) if name == "dflash" else BatchOracle(truths, 128, rng)
        dec = Engine(run, block_size=4, max_batch_size=3, proposer=proposer)  # joins, leaves, dead slots
        seen = run_decoder(dec, prompts, configs)
        for i in range(len(prompts)):
            assert seen[str(i)]["tokens"] == want[i], (what, name, "batched", i)
    assert accepted > 0, what


@pytest.mark.parametrize("arch", ("llama", "qwen3"))
def test_float64_dflash_through_runner_equals_plain_decoding(arch):
    ref, run = pair(arch)
    prompts, configs = dflash_cases(ref, 11, 6)
    check_dflash_equals_plain(run, make_draft(ref.model), ref, prompts, configs, arch)


def quantized(arch: str, quantize: str | Quantization) -> RunnerTarget:
    return RunnerTarget.from_target(
        Target(make_hf_model(arch, dtype=torch.float32)), quantize, torch.bfloat16
    )


def smol_shaped(arch: str, quantize: str | Quantization, sharp: float = 1.0) -> RunnerTarget:
    """Two layers of SmolLM2-135M's shapes (576 wide, 9 heads of 64, 3 kv heads, MLP 1536), random:
    the kernels' blocking depends on the shapes, and with the tiny test models' (heads of 16) even
    SDPA happens to round the same for 1 and 8 queries. `sharp` scales the queries and keys (their
    projections, and Qwen3's norms of them): random weights give attention scores near 1, where a
    score's last bit hardly ever reaches a bf16 output."""
    import transformers as tf

    torch.manual_seed(0)
    shapes = dict(
        vocab_size=256,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=512,
    )
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**shapes, tie_word_embeddings=True))
    elif arch == "qwen2":  # biases on q, k and v
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**shapes, tie_word_embeddings=False))
    else:
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**shapes, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name.endswith("bias"):
                p.normal_(0.0, 0.05)
            else:  # norms of their own (all ones would hide a norm applied with another's weights)
                p.uniform_(0.5, 1.5)
            if any(k in name for k in ("q_proj.weight", "k_proj.weight", "q_norm", "k_norm")):
                p.mul_(sharp)
    return RunnerTarget.from_target(Target(model.eval()), quantize, torch.bfloat16)


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
@pytest.mark.parametrize("arch", ("llama", "qwen3", "qwen2"))
@torch.inference_mode()
def test_native_layers_agree_with_the_torch_layers(arch):
    """The layers in one C++ call (kernels/layers.cpp) compute what `Layer`'s torch ops compute: against
    the dense float32 model, their features and logits are as close as the torch ops' on the same
    q8_0 weights (both round to bf16 and quantize activations to int8, in places of their own)."""
    check_native_agrees_with_the_torch_layers(smol_shaped(arch, "q8_0"), 24, [0, 1])


def check_native_agrees_with_the_torch_layers(run: RunnerTarget, tokens: int, features: list[int]) -> None:
    """Against the dense float32 model, the C++ call's logits and features (two rows of `tokens` tokens)
    are as close as the torch ops' (`fused` False) on the same weights: mean errors within 1.25x."""
    assert run.runner.handle is not None and run.runner.ragged
    dense = RunnerTarget.from_target(run.reference, "none", torch.float32)
    g = torch.Generator().manual_seed(3)
    ids, pos = torch.randint(0, 256, (2, tokens), generator=g), torch.arange(tokens).expand(2, -1)
    want = dense.forward(ids, pos, dense.new_cache(), features=features)
    errors = {}
    for fused in (True, False):
        run.runner.fused = fused
        got = run.forward(ids, pos, run.new_cache(), features=features)
        errors[fused] = [(g.float() - w).abs().mean().item() for g, w in zip(got, want, strict=True)]
    run.runner.fused = True
    for native, torch_ops in zip(errors[True], errors[False], strict=True):
        assert native < 1.25 * torch_ops, errors


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
def test_native_layers_give_the_same_bits_on_every_path():
    """The C++ layers on the scalar reference path, AVX2 and AVX-512 (where the CPU runs them): equal
    logits and features (`check_same_bits_on_every_path`), and the torch-kernel fallback has none."""
    # Sharp attention and many queries and slots, so that a score rounded differently shows in some bf16
    # output: with random weights' scores near 1 a dot product's lanes summed in another order never
    # did, and with sharper ones in 2 of 4 random batches of 2 rows, in 3 of 3 of 8 rows (test_teeth).
    check_same_bits_on_every_path(smol_shaped("qwen3", "q4_1", sharp=2.0), 8, 96)
    assert smol_shaped("llama", "int8").runner.handle is None


def check_same_bits_on_every_path(run: RunnerTarget, rows: int, tokens: int) -> None:
    """Logits and features of `rows` rows of `tokens` tokens on every kernel path this CPU runs equal the
    reference path's, bitwise: in causal order, and with a mask (odd rows left-padded by 10 slots)."""
    g = torch.Generator().manual_seed(0)
    ids, pos = torch.randint(0, 256, (rows, tokens), generator=g), torch.arange(tokens).expand(rows, -1)
    padded = pos - torch.tensor([[0], [10]]).repeat(rows // 2, 1)
    mask = run.attention_mask(padded.clamp_min(0), torch.where(padded >= 0, padded, DEAD))
    outs = []
    try:
        for path in kernels.runnable():
            kernels.force(path)
            outs.append(run.forward(ids, pos, run.new_cache(), features=[0, 1]))
            outs.append(run.forward(ids, padded.clamp_min(0), run.new_cache(), attention_mask=mask))
    finally:
        kernels.force("auto")
    for i, path in enumerate(kernels.runnable()):
        (logits, feats), (masked, _) = outs[2 * i], outs[2 * i + 1]
        assert torch.equal(logits, outs[0][0]) and torch.equal(feats, outs[0][1]), path
        assert torch.equal(masked, outs[1][0]), path


@pytest.mark.parametrize("quantize", EXACT, ids=str)
@pytest.mark.parametrize("arch", ("llama", "qwen3"))
def test_quantized_verify_rows_equal_one_token_steps_bitwise(arch, quantize):
    check_verify_rows_equal_one_token_steps(smol_shaped(arch, quantize), (arch, quantize))


@torch.inference_mode()
def check_verify_rows_equal_one_token_steps(run: RunnerTarget, what) -> None:
    """An 8-token verify of two rows over a cache of ~100 tokens: row b's logits and features equal,
    bit for bit, those of row b alone fed the same tokens one at a time (M = 1 in every GEMM), and
    those of row b alone verified (M = 8)."""
    g = torch.Generator().manual_seed(5)
    prompt, block = torch.randint(0, 128, (2, 97), generator=g), torch.randint(0, 128, (2, 8), generator=g)
    cache = run.new_cache()
    run.forward(prompt, torch.arange(97).expand(2, -1), cache)
    layers = [0, 1, 0]  # a layer listed twice (training's teacher can be the draft's last): read once
    verify, feats = run.forward(block, torch.arange(97, 105).expand(2, -1), cache, features=layers)
    first, _, again = feats.chunk(3, dim=-1)
    assert torch.equal(first, again), what
    for b in range(2):
        alone = run.new_cache()
        run.forward(prompt[b : b + 1], torch.arange(97)[None], alone)
        steps = [
            run.forward(block[b : b + 1, j : j + 1], torch.tensor([[97 + j]]), alone, features=layers)
            for j in range(8)
        ]
        assert torch.equal(verify[b], torch.cat([s[0][0] for s in steps])), (what, b)
        assert torch.equal(feats[b], torch.cat([s[1][0] for s in steps])), (what, b)
        run.crop(alone, 97)
        logits, _ = run.forward(block[b : b + 1], torch.arange(97, 105)[None], alone)
        assert torch.equal(logits[0], verify[b]), (what, b)


@pytest.mark.parametrize("quantize", EXACT, ids=str)
def test_quantized_row_does_not_depend_on_its_batch(quantize):
    check_row_does_not_depend_on_its_batch(smol_shaped("llama", quantize), quantize)


@torch.inference_mode()
def check_row_does_not_depend_on_its_batch(run: RunnerTarget, what) -> None:
    """A row (30, 47 or 59 prompt tokens) gives the same bits alone and in batches whose other rows
    are longer or shorter: left-padded by 0, 1, 2 or 37 dead slots (odd offsets matter: bf16 kernels
    pair neighbouring slots in their sums, which showed at 47 and 59 tokens here), in the prefill, in a 4-token step of which it keeps 2 (the
    other 2 slots stay in the cache, dead for it, as the engine leaves rejected drafts) and in a
    3-token step after them. Alone, it runs as plain decoding does: rejected slots cropped."""
    g = torch.Generator().manual_seed(6)
    for length in (30, 47, 59):
        row0 = torch.randint(0, 128, (1, length), generator=g)
        steps0 = torch.randint(0, 128, (1, 4), generator=g), torch.randint(0, 128, (1, 3), generator=g)
        alone = run.new_cache()
        want = [run.forward(row0, torch.arange(length)[None], alone)[0][0]]
        want.append(run.forward(steps0[0], torch.arange(length, length + 4)[None], alone)[0][0])
        run.crop(alone, length + 2)
        want.append(run.forward(steps0[1], torch.arange(length + 2, length + 5)[None], alone)[0][0])
        for others in ([length + 1], [length + 2, 7], [12, length + 37, 20, 5, length]):
            lens = torch.tensor([length, *others])
            width, n = int(lens.max()), len(lens)
            ids = torch.randint(0, 128, (n, width), generator=g)
            ids[0, width - length :] = row0
            pos = torch.arange(width) - (width - lens)[:, None]
            kpos = torch.where(pos >= 0, pos, DEAD)
            cache = run.new_cache()
            first, _ = run.forward(
                ids, pos.clamp_min(0), cache, attention_mask=run.attention_mask(pos.clamp_min(0), kpos)
            )
            got = [first[0, width - length :]]
            kept = torch.tensor([2] + [4] * len(others))
            for new, size in zip(steps0, (4, 3), strict=True):
                q_pos = lens[:, None] + torch.arange(size)
                new = torch.cat([new, torch.randint(0, 128, (len(others), size), generator=g)])
                kpos = torch.cat([kpos, q_pos], 1)
                logits, _ = run.forward(new, q_pos, cache, attention_mask=run.attention_mask(q_pos, kpos))
                got.append(logits[0])
                kpos[:, -size:] = torch.where(torch.arange(size) < kept[:, None], kpos[:, -size:], DEAD)
                lens, kept = lens + kept, torch.full_like(kept, size)
            for step, (x, w) in enumerate(zip(got, want, strict=True)):
                where = (what, length, others, step)
                assert torch.equal(x, w), (*where, (x.float() - w.float()).abs().max().item())


@pytest.mark.parametrize("quantize", EXACT, ids=str)
@pytest.mark.parametrize("arch", ("llama", "qwen3"))
def test_quantized_dflash_equals_plain_decoding_of_the_same_weights(arch, quantize):
    run = quantized(arch, quantize)
    prompts, configs = dflash_cases(run, 12, 6)
    draft = make_draft(run.reference.model, dtype=torch.bfloat16)
    check_dflash_equals_plain(run, draft, run, prompts, configs, (arch, quantize))


def test_quantized_long_batched_run_compacts_and_stays_exact():
    """Rows of very different lengths over many steps, so that the engine compacts dead slots (it
    gathers this cache's slots through its keys / values views): every row still equals plain
    decoding of the same weights."""
    run = quantized("llama", "int8")
    rng = random.Random(9)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    configs = [GenerationConfig(rng.randint(30, 90)) for _ in prompts]
    want = [generate(run, p, None, c).tokens for p, c in zip(prompts, configs, strict=True)]
    oracle = BatchOracle({str(i): t for i, t in enumerate(want)}, 128, rng)
    dec = Engine(run, block_size=8, max_batch_size=3, proposer=oracle)
    seen = run_decoder(dec, prompts, configs)
    assert dec.stats["compactions"] > 0
    for i in range(len(prompts)):
        assert seen[str(i)]["tokens"] == want[i], i


@pytest.mark.parametrize("quantize", QUANT)
@torch.inference_mode()
def test_quantized_weights_agree_with_the_float_weights(quantize):
    """Each quantized linear against the float one on random inputs, and the whole model's logits
    against the float runner's (float32 activations): close within what the bits allow."""
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(96, 64, generator=g), torch.randn(5, 64, generator=g)
    want = x @ w.T
    got = make_linear(w, None, quantize, torch.float32)(x)
    tol, model_tol = {"int8": (0.02, 0.05), "int4": (0.15, 0.5), "q8_0": (0.03, 0.08), "q4_1": (0.15, 0.5)}[
        quantize
    ]  # int4 errors compound; q8_0 and q4_1 quantize the activations to int8 too
    assert (got - want).norm() / want.norm() < tol, quantize
    ref = Target(make_hf_model("qwen3", dtype=torch.float32))
    ids, pos = torch.randint(0, 128, (1, 20), generator=g), torch.arange(20)[None]
    full, _ = RunnerTarget.from_target(ref).forward(ids, pos, RunnerTarget.from_target(ref).new_cache())
    run = RunnerTarget.from_target(ref, quantize)
    q, _ = run.forward(ids, pos, run.new_cache())
    assert (q - full).norm() / full.norm() < model_tol, quantize


def test_refuses_what_it_does_not_run():
    """Other architectures (OLMo, shaped like a Llama), sliding windows (a Mistral with one)
    and quantized weights with activations the kernels refuse: a clear error before any forward."""
    import transformers as tf

    small = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4
    )
    olmo = tf.OlmoForCausalLM(tf.OlmoConfig(**small))
    windowed = tf.MistralForCausalLM(tf.MistralConfig(**small, sliding_window=4))
    for model, match in ((olmo, "covers llama"), (windowed, "sliding")):
        with pytest.raises(ValueError, match=match):
            RunnerTarget.from_target(Target(model))
    with pytest.raises(ValueError, match="activations"):
        RunnerTarget.from_target(Target(make_hf_model("llama")), "int8")
    with pytest.raises(ValueError, match="quantize must be"):
        RunnerTarget.from_target(Target(make_hf_model("llama")), "int3")


@torch.inference_mode()
def test_the_cache_keeps_its_slots_when_it_grows():
    """A prompt that nearly fills the cache's first capacity (cache.CHUNK slots), then a block and steps
    past it: the buffers are reallocated and what they held is copied over, so the logits still equal
    transformers' in float64."""
    from flashdraft.models.runner.cache import CHUNK

    ref, run = pair("llama")
    caches = (ref.new_cache(sliding=False), run.new_cache())
    g = torch.Generator().manual_seed(8)
    n = CHUNK - 3
    steps = [(torch.randint(0, 128, (1, n), generator=g), torch.arange(n)[None])]
    steps.append((torch.randint(0, 128, (1, 5), generator=g), torch.arange(n, n + 5)[None]))
    steps += [(torch.randint(0, 128, (1, 1), generator=g), torch.tensor([[n + 5 + i]])) for i in range(3)]
    for x, pos in steps:
        la, lb = (t.forward(x, pos, c)[0] for t, c in zip((ref, run), caches, strict=True))
        assert_close(la, lb, ("growth", pos[0, 0].item()))
    assert caches[1].capacity == 2 * CHUNK


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_norms_give_the_bits_of_the_transformers_norms(dtype):
    """The runner's RMSNorms (torch's fused kernel on float32 statistics) equal transformers' Llama and
    Gemma 3 norms bitwise in every activation dtype: in bf16 the scaling must follow the cast back (Llama)
    or precede it (Gemma 3), and the statistics stay float32 even for float64 inputs."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from flashdraft.models.runner import gemma

    torch.manual_seed(0)
    for shape in [(1, 1, 64), (3, 5, 64), (2, 7, 576)]:
        x = torch.randn(*shape, dtype=dtype) * 3
        ref_l, ref_g = LlamaRMSNorm(shape[-1], eps=1e-6), Gemma3RMSNorm(shape[-1], eps=1e-6)
        with torch.no_grad():
            ref_l.weight.normal_()
            ref_g.weight.normal_()
        ref_l, ref_g = ref_l.to(dtype), ref_g.to(dtype)
        with torch.no_grad():
            assert torch.equal(ops.rms_norm(x, ref_l.weight, 1e-6), ref_l(x)), shape
            assert torch.equal(gemma.rms_norm(x, gemma.norm_scale(ref_g, dtype), 1e-6), ref_g(x)), shape


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
@torch.inference_mode()
def test_a_draft_beside_a_target_on_our_kernels_runs_on_them_too():
    """DFlashProposer gives a bf16 draft of a q8_0 / q4_1 target a copy whose linears (and vocabulary
    head) run on the kernels: the draft passed in keeps its own dense weights, the copy's hidden states
    stay close to the dense draft's, and the copy cannot be saved as if it were the draft."""
    from flashdraft.models.draft import DraftError
    from flashdraft.models.runner.quant import BlockLinear

    run = quantized("llama", "q8_0")
    draft = make_draft(run.reference.model, dtype=torch.bfloat16)
    draft.set_vocab(list(range(0, 128, 2)), run.lm_head.weight)
    proposer = DFlashProposer(draft, run)
    copy = proposer.draft
    assert copy is not draft and isinstance(copy.layers[0].mlp.down_proj, BlockLinear)
    assert isinstance(copy.fc, BlockLinear) and isinstance(draft.layers[0].mlp.down_proj, torch.nn.Linear)
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 8, 64, generator=g).bfloat16()
    ctx = torch.randn(1, 5, draft.fc.in_features, generator=g).bfloat16()
    args = (embeds, torch.arange(5, 13)[None], ctx, torch.arange(5)[None])
    want, got = draft(*args).float(), copy(*args).float()
    assert (got - want).norm() / want.norm() < 0.05
    logits = copy.propose_logits(got.bfloat16(), run.lm_head)
    assert torch.isinf(logits[..., 1::2]).all() and torch.isfinite(logits[..., ::2]).all()
    with pytest.raises(
        DraftError, match="quantized copy of a draft for proposing.*save the draft it came from"
    ):
        copy.save_pretrained("/nonexistent")
    assert DFlashProposer(draft, quantized("llama", "int8")).draft is draft  # torch's kernels: as it is


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
@torch.inference_mode()
def test_the_native_draft_layers_agree_with_the_torch_layers():
    """The quantized draft's layers as one C++ call (models/runner/draft.py) against the same copy's torch
    layers, draft call after draft call on one cache: context arriving 5, 3 and 0 tokens at a time, then
    two rows with a mask that hides dead slots. The hidden states stay within bf16 rounding of each other,
    and so do the keys and values left in the caches (the native call writes them itself; it also runs
    the draft's fc and hidden norm on the raw features). The vocabulary head the call applies gives the
    bits of that head applied to the call's own output, position by position after each anchor, and its
    greedy picks are the ids of those logits' first maxima; the block arrives as token ids, looked up in
    the call (the torch layers look them up with F.embedding)."""
    import copy as copying

    from flashdraft.models.draft import quantized_rows

    run = quantized("llama", "q8_0")
    dense = make_draft(run.reference.model, dtype=torch.bfloat16)
    with torch.no_grad():  # norms of their own (all ones would hide a norm applied with another's weights)
        for name, p in dense.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    draft = DFlashProposer(dense, run).draft
    assert draft.native is not None
    twin = copying.copy(draft)
    twin.native = None  # the same weights on torch's ops
    g = torch.Generator().manual_seed(1)
    caches = draft.new_cache(), twin.new_cache()
    ids = torch.arange(0, 128, 3)
    head = quantized_rows(run.lm_head, ids, "q8_0"), ids  # 43 rows: a partial last tile
    table = torch.randn(128, 64, generator=g).bfloat16()  # the block's embeddings, by token id

    def call(rows: int, ctx_len: int, block: int, mask=None) -> None:
        start = caches[0].length
        tokens = torch.randint(0, 128, (rows, block), generator=g)  # the native call looks them up
        ctx = torch.randn(rows, ctx_len, draft.fc.in_features, generator=g).bfloat16()
        ctx_pos = torch.arange(start, start + ctx_len).expand(rows, -1)
        pos = torch.arange(start + ctx_len, start + ctx_len + block).expand(rows, -1)
        (got, logits, picks), (want, *none) = (
            m(tokens, pos, ctx, ctx_pos, cache=c, mask=mask, head=head, embed=table)
            for m, c in zip((draft, twin), caches, strict=True)
        )
        assert none == [None, None]  # torch's layers leave the head to the caller
        assert (got.float() - want.float()).norm() / want.float().norm() < 0.02, (rows, ctx_len, block)
        assert torch.equal(logits, head[0](got[:, 1:])), (rows, ctx_len, block)
        assert torch.equal(picks, ids[logits.float().argmax(-1)]), (rows, ctx_len, block)
        assert caches[0].length == caches[1].length == start + ctx_len
        for k0, k1 in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True):
            a, b = k0[:, :, : start + ctx_len + block].float(), k1[:, :, : start + ctx_len + block].float()
            assert (a - b).norm() / b.norm() < 0.02

    for ctx_len in (5, 3, 0):
        call(1, ctx_len, 8)
    for c in caches:  # a second row, as the proposer's join makes it: the first row's slots dead for it
        for i in range(len(c.k)):
            c.k[i], c.v[i] = (torch.cat([t[:, :, : c.length]] * 2) for t in (c.k[i], c.v[i]))
    visible = torch.ones(2, 1, 1, caches[0].length + 4 + 6, dtype=torch.bool)
    visible[1, :, :, :5] = False
    call(2, 4, 6, visible)


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
@pytest.mark.parametrize("kind", OURS)
@torch.inference_mode()
def test_the_head_in_the_layers_call_gives_the_heads_own_bits(kind):
    """`forward_head` applies the LM head inside the C++ layers' call (a plain step's head as a torch op
    of its own ran with cold caches): its logits of every token, and of each row's last one (a prefill),
    are the head applied to the call's hidden states, bit for bit, at batch 1 and 3."""
    run = smol_shaped("qwen3", Quantization(kind, kind))
    runner = run.runner
    assert runner.fused_head and runner.ragged
    g = torch.Generator().manual_seed(4)
    for b, t in ((1, 1), (1, 5), (3, 4)):
        for keep in (t, 1):
            cache = run.new_cache()
            start = cache.reserve(b, t)
            ids = torch.randint(0, 256, (b, t), generator=g)
            pos = torch.arange(t).expand(b, -1)
            x, _, logits = runner.forward_head(ids, pos, cache, start, None, [], None, keep)
            assert torch.equal(logits, runner.head(x[:, t - keep :].contiguous())), (b, t, keep)


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
def test_the_cache_moves_a_trees_accepted_slots_as_the_torch_gather_does():
    """`KVCache.reorder` (one C++ call, `reorder_slots`) gives every layer's keys and values the bytes
    `_gather_block` (a gather and a copy per layer and tensor) gives them, paths of any order and
    length per row, and leaves the slots before `start` alone."""
    import copy

    from flashdraft.models.batch import _gather_block
    from flashdraft.models.runner.cache import KVCache

    g = torch.Generator().manual_seed(5)
    cache = KVCache(3, 2, 8, torch.bfloat16, "cpu")
    cache.reserve(3, 12)
    for buf in (cache.k, cache.v):
        for t in buf:
            t.copy_(torch.randn(t.shape, generator=g).bfloat16())
    cache.length = 12
    order = torch.tensor([[0, 3, 1, 1], [0, 1, 2, 3], [0, 4, 4, 4]])  # relative to start
    want = copy.deepcopy(cache)
    _gather_block(want, 7, order)
    assert cache.reorder(7, order)
    for a, b in zip(cache.k + cache.v, want.k + want.v, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
def test_a_trees_commit_on_the_runner_moves_its_features_with_its_slots():
    """After a tree verify on the native runner (whose cache moves slots in C++), `TargetBatch.commit`
    moves each row's accepted nodes to the front of its block in the cache and in the features it hands
    the draft, in the same order: a draft reading the rejected nodes' features proposes worse, which
    no output test would show."""
    import copy

    from flashdraft.models.batch import Slots, TargetBatch, _gather_block, path_order

    run = quantized("llama", "q8_0")
    g = torch.Generator().manual_seed(6)
    batch = TargetBatch(run, [0, 1])
    batch.cache = run.new_cache()
    batch.cache.reserve(2, 12)
    for buf in (batch.cache.k, batch.cache.v):
        for t in buf:
            t.copy_(torch.randn(t.shape, generator=g).bfloat16())
    batch.cache.length = 12
    batch.slots = Slots(2, 7)
    batch._block_pos = torch.arange(7, 12).expand(2, -1)
    feats = torch.randn(2, 5, 6, generator=g)
    paths = [[1, 3], [0]]  # row 0 kept nodes 1 and 3 (slots 2 and 4), row 1 its first node
    order = path_order(paths)
    want_cache = copy.deepcopy(batch.cache)
    _gather_block(want_cache, 7, order)
    got = batch.commit([3, 2], paths, feats)
    assert torch.equal(got, feats.gather(1, order[:, :, None].expand(-1, -1, 6)))
    for a, b in zip(batch.cache.k + batch.cache.v, want_cache.k + want_cache.v, strict=True):
        assert torch.equal(a[:, :, :10], b[:, :, :10])


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
@torch.inference_mode()
def test_a_native_draft_call_looks_up_every_position_it_is_given():
    """The C++ draft call looks RoPE rows up in the draft's table, grown to cover the call's positions:
    the context's too, which in a batch are padded to the longest row's and may pass a row's block
    (bench_batch at batch 16 once asked for row 256 of a table of 256)."""
    run = quantized("llama", "q8_0")
    draft = DFlashProposer(make_draft(run.reference.model, dtype=torch.bfloat16), run).draft
    g = torch.Generator().manual_seed(3)
    embeds = torch.randn(2, 4, 64, generator=g).bfloat16()
    ctx = torch.randn(2, 3, draft.fc.in_features, generator=g).bfloat16()
    block_pos = torch.tensor([[120, 121, 122, 123], [124, 125, 126, 127]])
    ctx_pos = torch.tensor([[117, 118, 119], [126, 127, 128]])  # the second row's last slot: padding
    draft(embeds, block_pos, ctx, ctx_pos, cache=draft.new_cache())
    assert draft.rope_table(torch.bfloat16).cos.shape[0] > 128


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
@pytest.mark.parametrize("kind", OURS)
@torch.inference_mode()
def test_layers_side_by_side_give_their_outputs_and_hold_their_weights_once(kind):
    """`BlockLinear.side_by_side` (the native draft's fused q / k / v and gate / up): the fused layer's
    output is the parts' outputs side by side, bit for bit, and the parts keep theirs while their weights
    become views of the fused layer's."""
    from flashdraft.models.runner.quant import BlockLinear

    g = torch.Generator().manual_seed(2)
    parts = [BlockLinear(torch.randn(n, 64, generator=g), None, torch.bfloat16, kind) for n in (32, 16, 40)]
    x = torch.randn(3, 64, generator=g).bfloat16()
    want = [p(x) for p in parts]
    fused = BlockLinear.side_by_side(*parts)
    assert torch.equal(fused(x), torch.cat(want, -1))
    for p, w, tile in zip(parts, want, (0, 2, 3), strict=True):
        assert torch.equal(p(x), w)
        assert p.packed.data_ptr() == fused.packed[tile].data_ptr()
    with pytest.raises(ValueError, match="whole tiles"):
        BlockLinear.side_by_side(parts[2], parts[0])  # 40 outputs: not whole tiles, then more


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
@pytest.mark.parametrize("quantize", [Quantization("q4_1", "q8_0")], ids=str)
@pytest.mark.parametrize("arch", ("llama", "qwen3"))
def test_a_ragged_verify_gives_each_row_the_bits_of_the_padded_one(arch, quantize):
    check_ragged_verify(smol_shaped(arch, quantize), (arch, quantize))


@torch.inference_mode()
def check_ragged_verify(run: RunnerTarget, what) -> None:
    """A verify of three rows that need 8, 3 and 1 of its 8 tokens (`lengths`: the rows' padding is not
    computed, `RunnerTarget.ragged`) gives every row's own tokens the logits and features of the padded
    verify, bit for bit, and the next step (the padding's slots dead, as the engine leaves them, and
    never written by the ragged verify) gives the same bits too."""
    assert run.ragged
    g = torch.Generator().manual_seed(7)
    prompt, block = torch.randint(0, 128, (3, 41), generator=g), torch.randint(0, 128, (3, 8), generator=g)
    nxt, lengths = torch.randint(0, 128, (3, 1), generator=g), [8, 3, 1]
    q_pos = torch.arange(41, 49).expand(3, -1)
    kpos = torch.cat([torch.arange(41).expand(3, -1), q_pos], 1)
    mask = run.attention_mask(q_pos, kpos)
    kpos = torch.where(torch.arange(8) < torch.tensor(lengths)[:, None], q_pos, DEAD)  # what rows keep
    kpos = torch.cat([torch.arange(41).expand(3, -1), kpos, torch.full((3, 1), 49)], 1)
    step_pos = torch.tensor([[49], [44], [42]])
    kpos[:, -1:] = step_pos
    outs = []
    for ragged in (False, True):
        cache = run.new_cache()
        run.forward(prompt, torch.arange(41).expand(3, -1), cache)
        logits, feats = run.forward(
            block, q_pos, cache, features=[0, 1], attention_mask=mask, lengths=lengths if ragged else None
        )
        after, _ = run.forward(nxt, step_pos, cache, attention_mask=run.attention_mask(step_pos, kpos))
        outs.append((logits, feats, after))
    for b, n in enumerate(lengths):
        for x, y in zip(outs[0], outs[1], strict=True):
            k = min(n, x.shape[1])
            assert torch.equal(x[b, :k], y[b, :k]), (what, b)
    assert not outs[1][0][2, 1:].any()  # the padding: not computed


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
@pytest.mark.parametrize("arch", ("llama", "qwen3"))
@torch.inference_mode()
def test_prompts_of_different_lengths_prefilled_together_get_the_bits_they_get_alone(arch):
    """On a ragged target the batch's prefill right-pads prompts of different lengths and computes only
    their own tokens: each row's last logits and every prompt token's features equal its prefill alone,
    bit for bit, and so does the next step on the joined cache (the padding's slots dead)."""
    from flashdraft.models.batch import TargetBatch

    run = smol_shaped(arch, Quantization("q4_1", "q8_0"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (23, 9, 40)]
    together = TargetBatch(run, [0, 1])
    logits, feats, batch = together.prefill(prompts)
    together.join(batch, [0, 1, 2])
    nxt = torch.tensor([[5], [6], [7]])
    after, _ = together.verify(nxt, [len(p) for p in prompts], [0, 0, 0])
    for b, p in enumerate(prompts):
        alone = TargetBatch(run, [0, 1])
        one, one_feats, single = alone.prefill([p])
        alone.join(single, [0])
        step, _ = alone.verify(nxt[b : b + 1], [len(p)], [0])
        assert torch.equal(logits[b], one[0]), (arch, b)
        assert torch.equal(feats[b], one_feats[0]), (arch, b)
        assert torch.equal(after[b, 0], step[0, 0]), (arch, b)


def test_a_rope_table_gives_the_bits_rope_tables_gives():
    """The runner and the draft look RoPE's tables up in a `RopeTable` (made once, grown when a position
    passes its end) instead of making them per forward: the same bits as `rope_tables`, for positions
    past the first block of the table, in any order, in batches, and negative (made directly)."""
    from flashdraft.models.ops import RopeTable, rope_tables

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        table = RopeTable(inv_freq, 1.25, dtype)
        for pos in (
            torch.tensor([[3]]),
            torch.tensor([[700, 5, 129], [1, 2, 3]]),
            torch.tensor([[-4, 0, 9]]),
        ):
            for got, want in zip(table(pos), rope_tables(pos, inv_freq, 1.25, dtype), strict=True):
                assert got.dtype == want.dtype and torch.equal(got, want), (dtype, pos)


def stored_model() -> tuple[Target, dict]:
    """A random Llama whose matrices are GGUF blocks as a Q4_K_M file mixes them (q, k, v Q4_K; o and
    down Q6_K; gate and up Q5_0; the tied head Q8_0), and the float32 model holding their values, as a
    converted GGUF does. Inputs in whole super-blocks: hidden 512, 8 heads of 64 (2 kv), MLP 1024."""
    import transformers as tf
    from test_gguf_blocks import random_blocks

    from flashdraft.models.gguf_blocks import LAYOUTS, Blocks, dequantize

    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)  # fmt: skip
    model = tf.LlamaForCausalLM(cfg).eval()
    kinds = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q4_K", "o_proj": "Q6_K", "down_proj": "Q6_K",
             "gate_proj": "Q5_0", "up_proj": "Q5_0", "embed_tokens": "Q8_0"}  # fmt: skip
    blocks, rng = {}, np.random.default_rng(0)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            kind = next((k for part, k in kinds.items() if f".{part}." in name), None)
            if kind is None:
                p.uniform_(0.5, 1.5)  # norms
                continue
            layout = LAYOUTS[kind]
            raw = random_blocks(kind, p.shape[0], p.shape[1] // layout.size, seed=i)
            # fp16 scales of every exponent would make sums of thousands: d (and dmin) within +-1e-3
            per_block = raw.reshape(-1, layout.nbytes)
            for _, at in layout.scales:
                small = (rng.uniform(-1e-3, 1e-3, len(per_block))).astype(np.float16)
                per_block[:, at : at + 2] = small.view(np.uint8).reshape(-1, 2)
            blocks[name] = Blocks(kind, tuple(p.shape), torch.from_numpy(raw))
            p.copy_(dequantize(blocks[name]))
    return Target(model), blocks


@pytest.mark.skipif(not OURS, reason="our kernels could not be built here")
@torch.inference_mode()
def test_a_ggufs_k_quant_blocks_run_as_stored_and_exact():
    """ "gguf" weights: each linear runs the file's blocks as stored (q4_k, q6_k, and Q5_0 as q8_0), holding
    the very values of the float checkpoint; the layers' C++ call gives the same bits on every path; a
    verify row equals one-token steps; DFlash equals plain decoding."""
    ref, blocks = stored_model()
    run = RunnerTarget.from_target(ref, Quantization("gguf", "gguf"), torch.bfloat16, blocks)
    assert run.runner.handle is not None and run.exact
    layer, w = run.runner.layers[1], dict(ref.model.named_parameters())
    want = {"qkv": "q4_k", "o": "q6_k", "gate_up": "q8_0", "down": "q6_k"}
    for name, kind in want.items():
        linear = getattr(layer, name)
        assert linear.kind == kind, name
    assert run.runner.head.kind == "q8_0"
    pre = "model.layers.1."
    qkv = torch.cat([w[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(kernels.values(layer.qkv.packed, layer.qkv.scales, "q4_k")[: qkv.shape[0]], qkv)
    down = w[pre + "mlp.down_proj.weight"]
    assert torch.equal(kernels.values(layer.down.packed, layer.down.scales, "q6_k")[: down.shape[0]], down)
    g = torch.Generator().manual_seed(0)
    ids, pos = torch.randint(0, 256, (3, 40), generator=g), torch.arange(40).expand(3, -1)
    outs = []
    try:
        for path in kernels.runnable():
            kernels.force(path)
            outs.append(run.forward(ids, pos, run.new_cache(), features=[0, 1]))
    finally:
        kernels.force("auto")
    for path, (logits, feats) in zip(kernels.runnable(), outs, strict=True):
        assert torch.equal(logits, outs[0][0]) and torch.equal(feats, outs[0][1]), path
    check_verify_rows_equal_one_token_steps(run, "gguf")
    prompts, configs = dflash_cases(run, 12, 4)
    check_dflash_equals_plain(run, make_draft(ref.model, dtype=torch.bfloat16), run, prompts, configs, "gguf")
