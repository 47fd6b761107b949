import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from flashdraft.models.draft import DFlashDraft, init_draft_config  # noqa: E402
from flashdraft.models.target import Target  # noqa: E402

# One thread: the tiny test models are dominated by per-op overhead, and two threads on a busy
# 2-core machine were measured far slower.
torch.set_num_threads(1)

ARCHS = ("llama", "qwen3", "gemma3")


def make_hf_model(
    arch: str, vocab: int = 128, layers: int = 4, seed: int = 0, dtype=torch.float64, max_pos: int = 256
):
    """A tiny randomly initialised HF causal LM. Gemma3 gets a short sliding window (6) so that
    cache cropping across the window is exercised; Qwen3 has untied embeddings, the others tied."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_pos,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=True))
    elif arch == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, tie_word_embeddings=False))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=False))
    elif arch == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None))
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(
            **common,
            sliding_window=6,
            sliding_window_pattern=2,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
            query_pre_attn_scalar=16,
        )
        model = tf.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # Random init is near-uniform; widen it so greedy decoding is not a constant and drafts disagree.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    return model.to(dtype).eval()


DRAFT_STD = 0.15  # the test targets' weight scale (make_hf_model)

# Every option a draft config can carry beyond its shapes (DraftConfig: the extras of dflash_config,
# the norm's eps, the rotary settings, sliding-window layers, which target layers it reads), each set to
# a value that changes what the draft computes; "plain" has none. Tests of the equality of two code
# paths (training and inference, batched and alone) run on every one, so a path that drops one is seen.
DRAFT_OPTIONS = {
    "plain": lambda cfg: {},
    "input_embedding_scale": lambda cfg: {"extra": {"input_embedding_scale": 3.0}},
    "output_multiplier": lambda cfg: {"extra": {"output_multiplier": 1.7}},
    "final_logit_softcapping": lambda cfg: {"extra": {"final_logit_softcapping": 2.0}},
    "rms_norm_eps": lambda cfg: {"rms_norm_eps": 0.5},
    "rope_theta": lambda cfg: {"rope_theta": 500.0},
    "rope_scaling": lambda cfg: {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    },
    "sliding_window": lambda cfg: {
        "layer_types": ["sliding_attention"] + ["full_attention"] * (cfg.num_hidden_layers - 1),
        "sliding_window": 3,
    },
    "three_features": lambda cfg: {
        "target_layer_ids": [0, cfg.num_target_layers // 2, cfg.num_target_layers - 1]
    },
}


def make_draft(
    target_model,
    layers: int = 2,
    block_size: int = 16,
    seed: int = 1,
    mask_token_id: int = 3,
    dtype=torch.float64,
    target_layer_ids=None,
    option: str = "plain",
) -> DFlashDraft:
    """A random draft; by default it reads target layers 1 and the last one (whose HF hidden state is
    the final-normed output, a case the feature hooks must get right). Its weights are as wide as the
    test targets' (std DRAFT_STD): with the default 0.02 a draft on a tied-embedding target drafts the
    mask token whatever the context, and every test of context handling would be empty. `option`
    turns on one of DRAFT_OPTIONS (the same weights otherwise)."""
    torch.manual_seed(seed)
    n = target_model.config.num_hidden_layers
    ids = target_layer_ids or [1, n - 1]
    cfg = init_draft_config(target_model.config, layers, mask_token_id, block_size, ids)
    cfg = cfg.replace(**DRAFT_OPTIONS[option](cfg))
    draft = DFlashDraft(cfg)
    draft.reset_parameters(std=DRAFT_STD, generator=torch.Generator().manual_seed(seed))
    return draft.to(dtype)


def engine_target(model, tokenizer=None):
    """The target `load_target` runs for this model by default: the native runner where it covers the
    family (dense weights in the model's float64), else the transformers target. The exactness and
    sampling tests run through it; `Target(model)` stays the reference."""
    from flashdraft.models.runner import RunnerTarget, supports

    target = Target(model, tokenizer)
    return RunnerTarget.from_target(target) if supports(model.config) is None else target


@pytest.fixture(scope="session", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def tiny_llama():
    return Target(make_hf_model("llama"))


def smollm2_tokenizer_dir():
    """The converted SmolLM2 directory (its tokenizer and chat template); skips where the package is missing."""
    from flashdraft.models.load import ensure_converted

    try:
        return ensure_converted("smollm2-135m-instruct")
    except Exception as e:  # the package is not installed
        pytest.skip(f"needs the SmolLM2 tokenizer: {e}")


def make_chat_target(directory, hidden: int = 32, layers: int = 2, seed: int = 0):
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template, saved to
    `directory`: prompts go through a real chat template without any download. Returns the model
    and the tokenizer; call `model.save_pretrained(directory)` again after changing it."""
    import shutil

    import transformers as tf

    src = smollm2_tokenizer_dir()
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    model.eval().save_pretrained(directory)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, directory)
    return model, tf.AutoTokenizer.from_pretrained(src)
