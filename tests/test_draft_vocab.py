"""The draft vocabulary: a draft that proposes only from a subset of tokens (its LM head computes just
those rows) stays lossless, greedy and sampled, alone and batched; the subset travels beside the
published checkpoint files without changing them."""

import itertools

import numpy as np
import pytest
import torch
from conftest import make_draft, make_hf_model
from safetensors.torch import load_file
from test_sampling import PROMPT, V, chi2_pvalue, sample_joint

from flashdraft import (
    DFlashDraft,
    DFlashProposer,
    GenerationConfig,
    SamplingConfig,
    Target,
    generate,
    generate_batch,
)
from flashdraft.draft import VOCAB_NAME, DraftError
from flashdraft.sampling import probs


class Spy(DFlashProposer):
    """Records every proposal and its q."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.drafted, self.qs = [], []

    def propose(self, rows, ks):
        out = super().propose(rows, ks)
        for d, q in out:
            self.drafted += d.flatten().tolist()
            if q is not None:
                self.qs.append(q)
        return out


def test_propose_logits_are_the_full_logits_on_the_vocabulary_and_minus_inf_elsewhere():
    model = make_hf_model("qwen3")
    target = Target(model)
    draft = make_draft(model)
    # A slice of longer blocks, as the proposer passes (the head runs on a 2D view of it).
    hidden = torch.randn(2, 6, 64, dtype=torch.float64)[:, 1:]
    full = draft.logits(hidden, target.lm_head)
    assert full.shape == (2, 5, 128)
    draft.set_vocab([90, 3, 17, 64])
    sub = draft.propose_logits(hidden, target.lm_head)
    inside = torch.zeros(128, dtype=torch.bool)
    inside[[3, 17, 64, 90]] = True
    torch.testing.assert_close(sub[..., inside], full[..., inside], rtol=0, atol=1e-12)
    assert torch.isneginf(sub[..., ~inside]).all()
    draft.set_vocab(None)
    torch.testing.assert_close(draft.propose_logits(hidden, target.lm_head), full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_with_a_draft_vocabulary_equals_plain_decoding(arch):
    model = make_hf_model(arch)
    target = Target(model)
    draft = make_draft(model, block_size=4)
    vocab = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:48]
    draft.set_vocab(vocab)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 128, (3 + i,), generator=g).tolist() for i in range(6)]
    cfg = GenerationConfig(max_new_tokens=24, stop_ids=[])
    spy = Spy(draft, target)
    plain = [generate(target, p, None, cfg).tokens for p in prompts]
    spec = [generate(target, p, spy, cfg).tokens for p in prompts]
    assert spec == plain
    assert spy.drafted and set(spy.drafted) <= set(vocab.tolist())
    assert [r.tokens for r in generate_batch(target, prompts, draft, cfg)] == plain


def test_sampling_with_a_draft_vocabulary_is_exact():
    """A 6-token target, a draft restricted to 3 of them: q is 0 on the other 3, and the joint law of
    the first three tokens still equals plain sampling's (chi-square against enumeration)."""
    model = make_hf_model("llama", vocab=V, layers=2)
    target = Target(model)
    draft = make_draft(model, layers=1, mask_token_id=5)
    with torch.no_grad():
        draft.fc.weight.mul_(20)  # a confident draft: many rejections, and q far from p
    draft.set_vocab([0, 2, 3])
    cfg = SamplingConfig(1.0, top_k=5)
    with torch.no_grad():
        seqs = torch.tensor(list(itertools.product(range(V), repeat=3)))
        ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
        p = probs(model(ids).logits[:, len(PROMPT) - 1 : -1], cfg)
    exact = np.zeros((V, V, V))
    exact[tuple(seqs.T)] = p.gather(-1, seqs[..., None])[..., 0].prod(-1).numpy()
    spy = Spy(draft, target)
    counts = sample_joint(target, spy, cfg, 2_500, block=4)
    q = torch.cat([x.reshape(-1, V) for x in spy.qs])
    assert (q[:, [1, 4, 5]] == 0).all() and (q[:, [0, 2, 3]] > 0).any()
    assert chi2_pvalue(counts, exact) > 1e-3


def test_the_vocabulary_travels_beside_the_published_files(tmp_path):
    model = make_hf_model("llama")
    draft = make_draft(model)
    draft.set_vocab([7, 5, 9])
    draft.save_pretrained(tmp_path / "d")
    assert sorted(load_file(str(tmp_path / "d" / "model.safetensors"))) == sorted(draft.state_dict())
    assert load_file(str(tmp_path / "d" / VOCAB_NAME))["token_ids"].tolist() == [5, 7, 9]
    assert "draft_vocab" not in (tmp_path / "d" / "config.json").read_text()  # the published config as it was
    assert DFlashDraft.from_pretrained(tmp_path / "d").vocab.tolist() == [5, 7, 9]
    assert DFlashDraft.from_pretrained(tmp_path / "d", vocab=False).vocab is None
    draft.set_vocab(None)
    draft.save_pretrained(tmp_path / "d")  # re-saved without one: no stale file restricts it
    assert not (tmp_path / "d" / VOCAB_NAME).exists()
    with pytest.raises(DraftError, match="distinct"):
        draft.set_vocab([1, 1])
    draft.set_vocab([5, 500])
    with pytest.raises(DraftError, match="draft vocabulary has token id 500"):
        draft.check_target(Target(model))
