"""The draft model: architecture invariants, the published checkpoint format, and bad checkpoints."""

import json

import pytest
import torch
from conftest import ARCHS, make_draft, make_hf_model
from safetensors.torch import load_file, save_file

from flashdraft import (
    DFlashDraft,
    DFlashProposer,
    DraftConfig,
    DraftError,
    GenerationConfig,
    Target,
    generate,
)
from flashdraft.engine.sequence import Row
from flashdraft.models import ops
from flashdraft.models.draft import default_target_layer_ids


@pytest.mark.parametrize(
    "layers, n, expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (32, 5, [1, 8, 15, 22, 29]),
        (30, 5, [1, 8, 14, 20, 27]),
        (30, 1, [15]),
        (28, 3, [1, 13, 25]),
        (8, 5, [1, 2, 3, 4, 5]),  # the published rule, down to the shallowest target it serves
        (2, 2, [0, 1]),  # tiny targets: spread over all layers, never layer -1 nor one layer twice
        (4, 2, [0, 3]),
        (6, 5, [0, 1, 2, 4, 5]),
    ],
)
def test_default_target_layer_ids(layers, n, expected):
    ids = default_target_layer_ids(layers, n)
    assert ids == expected and len(set(ids)) == n and 0 <= min(ids) and max(ids) < layers


def test_more_features_than_target_layers_is_a_clear_error():
    with pytest.raises(DraftError, match="--num-features 2 or fewer"):
        default_target_layer_ids(2, 3)


def published_dir(
    tmp_path, target_model, layers=2, hidden=None, extra_config=None, drop=(), add=None, reshape=None
):
    """A draft directory written with nothing but json + safetensors, the way published drafts look."""
    tc = target_model.config
    h = hidden or tc.hidden_size
    heads, kv, hd = tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim
    n_feat = 2
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 8,
        "num_target_layers": tc.num_hidden_layers,
        "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, tc.num_hidden_layers - 2]},
        "hidden_size": h,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "intermediate_size": 80,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 256,
        "attention_bias": False,
        "layer_types": ["full_attention"] * layers,
        "sliding_window": None,
        "vocab_size": tc.vocab_size,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    config.update(extra_config or {})
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (h, n_feat * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(layers):
        a, m = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        shapes.update(
            {
                f"{a}.q_proj.weight": (heads * hd, h),
                f"{a}.k_proj.weight": (kv * hd, h),
                f"{a}.v_proj.weight": (kv * hd, h),
                f"{a}.o_proj.weight": (h, heads * hd),
                f"{a}.q_norm.weight": (hd,),
                f"{a}.k_norm.weight": (hd,),
                f"{m}.gate_proj.weight": (80, h),
                f"{m}.up_proj.weight": (80, h),
                f"{m}.down_proj.weight": (h, 80),
                f"layers.{i}.input_layernorm.weight": (h,),
                f"layers.{i}.post_attention_layernorm.weight": (h,),
            }
        )
    shapes.update(reshape or {})
    tensors = {
        k: (torch.randn(s, generator=g) * 0.1 + (1 if "norm" in k else 0)).to(torch.bfloat16)
        for k, s in shapes.items()
        if k not in drop
    }
    tensors.update(add or {})
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.fixture(scope="module")
def llama():
    return make_hf_model("llama")


def test_published_layout_loads_and_drafts(tmp_path, llama):
    d = DFlashDraft.from_pretrained(published_dir(tmp_path, llama), dtype=torch.float64)
    assert d.config.block_size == 8 and d.config.mask_token_id == 3 and d.config.target_layer_ids == [1, 2]
    raw = load_file(str(tmp_path / "model.safetensors"))
    for k, v in d.state_dict().items():
        assert torch.equal(v, raw[k].to(torch.float64)), k
    target = Target(llama)
    plain = generate(target, [5, 6, 7], None, GenerationConfig(12))
    res = generate(target, [5, 6, 7], DFlashProposer(d, target), GenerationConfig(12))
    assert res.tokens == plain.tokens and len(res.acceptance_lengths) >= 1


def test_nested_block_size_and_sliding_layers_load(tmp_path, llama):
    d = DFlashDraft.from_pretrained(
        published_dir(
            tmp_path,
            llama,
            extra_config={
                "block_size": None,
                "dflash_config": {"mask_token_id": 7, "target_layer_ids": [0, 2], "block_size": 10},
                "layer_types": ["sliding_attention", "full_attention"],
                "sliding_window": 4,
            },
        )
    )
    assert d.config.block_size == 10 and d.config.mask_token_id == 7
    assert d.layers[0].self_attn.window == 4 and d.layers[1].self_attn.window is None


def test_save_load_round_trip_is_bit_identical(tmp_path, llama):
    d = make_draft(llama, dtype=torch.bfloat16)
    d.save_pretrained(tmp_path / "a")
    e = DFlashDraft.from_pretrained(tmp_path / "a")
    assert e.config == d.config
    for (k, v), (k2, v2) in zip(d.state_dict().items(), e.state_dict().items(), strict=True):
        assert k == k2 and v.dtype == v2.dtype and torch.equal(v, v2)
    e.save_pretrained(tmp_path / "b")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and saved["model_type"] == "qwen3"
    assert set(saved["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    assert sorted(load_file(str(tmp_path / "a" / "model.safetensors"))) == sorted(d.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in d.state_dict())


def test_a_bfloat16_draft_keeps_its_rope_frequencies_in_float32(tmp_path, llama):
    """`.to(bfloat16)` and loading in bf16 leave RoPE's frequencies as training computed them: rounded to
    8 bits they turned the angle between a query and a key 300 positions apart by up to 0.4 radians."""
    ref = make_draft(llama, dtype=torch.float32)
    ref.save_pretrained(tmp_path / "d")
    for d in (
        make_draft(llama, dtype=torch.bfloat16),
        DFlashDraft.from_pretrained(tmp_path / "d", dtype=torch.bfloat16),
    ):
        assert d.inv_freq.dtype == torch.float32 and torch.equal(d.inv_freq, ref.inv_freq)
        pos = torch.arange(600, 620)[None]
        want = ops.rope_tables(pos, ref.inv_freq, ref.rope_scale, torch.float32)
        got = ops.rope_tables(pos, d.inv_freq, d.rope_scale, torch.float32)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_config_json_round_trip():
    cfg = DraftConfig(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=100,
        num_target_layers=12,
        mask_token_id=99,
        target_layer_ids=[1, 5, 9],
        block_size=8,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    assert DraftConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_cached_drafting_equals_one_shot(llama):
    """Feeding context in pieces through the draft's KV cache == all context at once, no cache."""
    d = make_draft(llama)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 11, 2 * 64, generator=g, dtype=torch.float64)
    block = torch.randn(1, 4, 64, generator=g, dtype=torch.float64)
    pos = torch.arange(15)[None]
    want = d(block, pos[:, 11:], feats, pos[:, :11])
    cache = d.new_cache()
    for a, b in [(0, 3), (3, 4), (4, 9), (9, 11)]:
        junk = torch.randn(1, 4, 64, generator=g, dtype=torch.float64)  # a block that is never kept
        d(junk, pos[:, b : b + 4], feats[:, a:b], pos[:, a:b], cache=cache)
        assert cache.length == b
    got = d(block, pos[:, 11:], None, None, cache=cache)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_context_reaches_the_block_only_as_keys_and_values(llama):
    """Changing the context changes the block's output; the block output is not causal."""
    d = make_draft(llama)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 5, 128, generator=g, dtype=torch.float64)
    block = torch.randn(1, 4, 64, generator=g, dtype=torch.float64)
    pos = torch.arange(9)[None]
    out = d(block, pos[:, 5:], feats, pos[:, :5])
    assert not torch.allclose(
        out, d(block, pos[:, 5:], feats.flip(1), pos[:, :5])
    )  # (scaling would not: hidden_norm)
    changed_last = block.clone()
    changed_last[:, -1] += 1
    assert not torch.allclose(out[:, 0], d(changed_last, pos[:, 5:], feats, pos[:, :5])[:, 0])


# -- bad input -------------------------------------------------------------------------------


def test_hidden_size_mismatch(tmp_path, llama):
    d = DFlashDraft.from_pretrained(published_dir(tmp_path, llama, hidden=32))
    with pytest.raises(DraftError, match="hidden_size: draft 32 vs target 64"):
        DFlashProposer(d, Target(llama))


def test_head_layout_mismatch(tmp_path, llama):
    d = DFlashDraft.from_pretrained(
        published_dir(
            tmp_path,
            llama,
            extra_config={"num_key_value_heads": 4},
            reshape={f"layers.{i}.self_attn.{p}_proj.weight": (64, 64) for i in range(2) for p in "kv"},
        )
    )
    with pytest.raises(DraftError, match=r"head layout .* draft \(4, 4, 16\) vs target \(4, 2, 16\)"):
        DFlashProposer(d, Target(llama))


def test_target_layer_id_outside_target(tmp_path, llama):
    with pytest.raises(DraftError, match="outside the target's layers 0..3"):
        DFlashDraft.from_pretrained(
            published_dir(
                tmp_path,
                llama,
                extra_config={"dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 4]}},
            )
        )
    # A draft made for a deeper target: its config is valid, but not for this target.
    deep = published_dir(
        tmp_path / "deep",
        llama,
        extra_config={
            "num_target_layers": 8,
            "dflash_config": {"mask_token_id": 3, "target_layer_ids": [1, 6]},
        },
    )
    with pytest.raises(DraftError, match="reach past the target's 4 layers"):
        DFlashProposer(DFlashDraft.from_pretrained(deep), Target(llama))


def test_mask_token_outside_vocabulary(tmp_path, llama):
    with pytest.raises(DraftError, match="mask_token_id 500 is outside the vocabulary"):
        DFlashDraft.from_pretrained(
            published_dir(
                tmp_path,
                llama,
                extra_config={"dflash_config": {"mask_token_id": 500, "target_layer_ids": [1, 2]}},
            )
        )
    # Declared vocabulary larger than the target's embedding table.
    big = published_dir(
        tmp_path / "big",
        llama,
        extra_config={
            "vocab_size": 1000,
            "dflash_config": {"mask_token_id": 500, "target_layer_ids": [1, 2]},
        },
    )
    with pytest.raises(DraftError, match="mask_token_id 500 is outside the target vocabulary of 128"):
        DFlashProposer(DFlashDraft.from_pretrained(big), Target(llama))


def test_missing_weights(tmp_path, llama):
    with pytest.raises(DraftError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        DFlashDraft.from_pretrained(published_dir(tmp_path, llama, drop=["layers.1.mlp.up_proj.weight"]))


def test_extra_weights(tmp_path, llama):
    with pytest.raises(DraftError, match=r"unexpected \['embed_tokens.weight'\]"):
        DFlashDraft.from_pretrained(
            published_dir(tmp_path, llama, add={"embed_tokens.weight": torch.zeros(128, 64)})
        )


def test_wrongly_shaped_weights(tmp_path, llama):
    with pytest.raises(DraftError, match=r"fc.weight: file \(64, 192\) vs config \(64, 128\)"):
        DFlashDraft.from_pretrained(published_dir(tmp_path, llama, reshape={"fc.weight": (64, 192)}))


def test_corrupt_and_truncated_safetensors(tmp_path, llama):
    d = published_dir(tmp_path, llama)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DraftError, match="corrupt or truncated"):
        DFlashDraft.from_pretrained(d)
    (d / "model.safetensors").write_bytes(b"\x00" * 64 + data[64:])
    with pytest.raises(DraftError, match="corrupt or truncated"):
        DFlashDraft.from_pretrained(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(DraftError, match="weights are missing"):
        DFlashDraft.from_pretrained(d)


def test_bad_config_json(tmp_path, llama):
    d = published_dir(tmp_path, llama)
    (d / "config.json").write_text("{not json")
    with pytest.raises(DraftError, match="not valid JSON"):
        DFlashDraft.from_pretrained(d)
    published_dir(tmp_path, llama, extra_config={"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(DraftError, match="DFlashDraftModel drafts only"):
        DFlashDraft.from_pretrained(d)
    with pytest.raises(DraftError, match="config.json not found"):
        DFlashDraft.from_pretrained(tmp_path / "nowhere")


def test_block_size_below_one(tmp_path, llama):
    with pytest.raises(DraftError, match="block_size must be >= 1"):
        DFlashDraft.from_pretrained(published_dir(tmp_path, llama, extra_config={"block_size": 0}))


@pytest.mark.parametrize("arch_name", ARCHS)
def test_test_drafts_depend_on_their_context(arch_name):
    """The test drafts must draft from the target's features, or the tests of context handling
    (positions, caches, batching) pass whatever the code does: with the target's true features and
    with noise of the same scale in their place, most drafted tokens must differ."""
    model = make_hf_model(arch_name)
    target = Target(model)
    draft = make_draft(model, block_size=8)
    g = torch.Generator().manual_seed(0)
    changed = total = 0
    for _ in range(10):
        prompt = torch.randint(0, model.config.vocab_size, (12,), generator=g).tolist()
        _, feats = target.forward(
            torch.tensor([prompt]),
            torch.arange(12)[None],
            target.new_cache(),
            features=draft.config.target_layer_ids,
        )
        noise = torch.randn(feats.shape, generator=g, dtype=feats.dtype) * feats.std()
        blocks = []
        for ctx in (feats[0, :-1], noise[0, :-1]):
            proposer = DFlashProposer(draft, target)
            row = Row("x", prompt[:-1], GenerationConfig(), 8, None, tokens=[prompt[-1]])
            proposer.join([row], [ctx])
            blocks.append(proposer.propose([row], [7])[0][0])
        changed += int((blocks[0] != blocks[1]).sum())
        total += blocks[0].numel()
    assert changed / total > 0.5, f"only {changed} of {total} drafted tokens depend on the context"


@pytest.mark.parametrize("arch_name", ARCHS)
@pytest.mark.parametrize("keep", [1, 3])
def test_logits_to_keep_are_the_last_positions_logits(arch_name, keep):
    """Target.forward passes logits_to_keep to transformers as positions (a gathered, foldable GEMM
    input): the logits must be those of the last `keep` positions of a full forward."""
    target = Target(make_hf_model(arch_name))
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(10).expand(2, -1)
    full, _ = target.forward(ids, pos, target.new_cache())
    kept, _ = target.forward(ids, pos, target.new_cache(), logits_to_keep=keep)
    assert kept.shape == (2, keep, 128)
    torch.testing.assert_close(kept, full[:, -keep:], rtol=0, atol=1e-12)
