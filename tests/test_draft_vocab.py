"""The draft vocabulary: a draft that proposes only from a subset of tokens (its LM head computes just
those rows) stays lossless, greedy and sampled, alone and batched; the subset travels inside the
published files as vLLM and SGLang read an EAGLE-3 draft's (`d2t`, `lm_head.weight`,
`draft_vocab_size`), and drafts saved the old way (a file beside them) still load."""

import itertools
import json

import numpy as np
import pytest
import torch
from conftest import engine_target, make_draft, make_hf_model
from safetensors.torch import load_file, save_file
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
from flashdraft.engine.sampling import probs
from flashdraft.models.draft import OLD_VOCAB_NAME, DraftError


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
    target = engine_target(model)
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


def test_a_rows_context_joins_its_vocabulary_and_only_its_own():
    model = make_hf_model("qwen3")
    target = engine_target(model)
    draft = make_draft(model)
    hidden = torch.randn(2, 6, 64, dtype=torch.float64)[:, 1:]
    full = draft.logits(hidden, target.lm_head)
    draft.set_vocab([90, 3, 17, 64])
    sub = draft.propose_logits(hidden, target.lm_head, [torch.tensor([5, 90, 7]), torch.tensor([11, 3])])
    for row, own in ((0, [3, 5, 7, 17, 64, 90]), (1, [3, 11, 17, 64, 90])):
        inside = torch.zeros(128, dtype=torch.bool)
        inside[own] = True
        torch.testing.assert_close(sub[row][:, inside], full[row][:, inside], rtol=0, atol=1e-12)
        assert torch.isneginf(sub[row][:, ~inside]).all()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_with_a_draft_vocabulary_equals_plain_decoding(arch):
    model = make_hf_model(arch)
    target = engine_target(model)
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
    # Each request's own tokens join the vocabulary: it then drafts some of them, and stays exact.
    spy = Spy(draft, target, context_vocab=True)
    assert [generate(target, p, spy, cfg).tokens for p in prompts] == plain
    outside = set(spy.drafted) - set(vocab.tolist())
    assert outside and outside <= {t for p, out in zip(prompts, plain, strict=True) for t in p + out}


def test_sampling_with_a_draft_vocabulary_is_exact():
    """A 6-token target, a draft restricted to 3 of them: q is 0 on the other 3, and the joint law of
    the first three tokens still equals plain sampling's (chi-square against enumeration)."""
    model = make_hf_model("llama", vocab=V, layers=2)
    target = engine_target(model)
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


def test_the_vocabulary_travels_inside_the_published_files_as_engines_read_it(tmp_path):
    model = make_hf_model("llama")
    head = model.get_output_embeddings().weight.detach()
    draft = make_draft(model)
    draft.set_vocab([7, 5, 9], head)
    draft.save_pretrained(tmp_path / "d")
    saved = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert sorted(saved) == sorted([*draft.state_dict(), "d2t", "lm_head.weight"])
    # vLLM: target id = draft id + d2t[draft id]; its draft head computes the target's rows of those ids
    assert (torch.arange(3) + saved["d2t"]).tolist() == [5, 7, 9] and saved["d2t"].dtype == torch.int64
    assert torch.equal(saved["lm_head.weight"], head[[5, 7, 9]])
    assert json.loads((tmp_path / "d" / "config.json").read_text())["draft_vocab_size"] == 3
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
    again = DFlashDraft.from_pretrained(tmp_path / "d")
    assert again.vocab.tolist() == [5, 7, 9] and torch.equal(again.vocab_rows, head[[5, 7, 9]])
    assert DFlashDraft.from_pretrained(tmp_path / "d", vocab=False).vocab is None
    again.save_pretrained(tmp_path / "e")  # loaded, then saved: the rows come along
    assert torch.equal(
        load_file(str(tmp_path / "e" / "model.safetensors"))["lm_head.weight"], head[[5, 7, 9]]
    )
    draft.set_vocab(None)
    draft.save_pretrained(tmp_path / "d")  # re-saved without one: the published files alone
    assert sorted(load_file(str(tmp_path / "d" / "model.safetensors"))) == sorted(draft.state_dict())
    assert "draft_vocab_size" not in (tmp_path / "d" / "config.json").read_text()
    draft.set_vocab([5, 7])
    with pytest.raises(DraftError, match="LM head rows"):
        draft.save_pretrained(tmp_path / "f")
    with pytest.raises(DraftError, match="distinct"):
        draft.set_vocab([1, 1])
    with pytest.raises(DraftError, match="past the LM head"):
        draft.set_vocab([5, 500], head)
    draft.set_vocab([5, 500])
    with pytest.raises(DraftError, match="draft vocabulary has token id 500"):
        draft.check_target(Target(model))


def test_a_draft_saved_the_old_way_still_loads_and_saves_the_new_way(tmp_path):
    model = make_hf_model("llama")
    head = model.get_output_embeddings().weight.detach()
    draft = make_draft(model)
    draft.save_pretrained(tmp_path / "old")
    save_file({"token_ids": torch.tensor([9, 5, 7])}, str(tmp_path / "old" / OLD_VOCAB_NAME))
    old = DFlashDraft.from_pretrained(tmp_path / "old")
    assert old.vocab.tolist() == [5, 7, 9] and old.vocab_rows is None
    old.set_vocab(old.vocab, head)
    old.save_pretrained(tmp_path / "old")
    assert not (tmp_path / "old" / OLD_VOCAB_NAME).exists()  # no second file for an engine to trip on
    assert DFlashDraft.from_pretrained(tmp_path / "old").vocab.tolist() == [5, 7, 9]


def test_an_inconsistent_vocabulary_is_refused_with_the_fix(tmp_path):
    model = make_hf_model("llama")
    draft = make_draft(model)
    draft.set_vocab([5, 7, 9], model.get_output_embeddings().weight)
    draft.save_pretrained(tmp_path / "d")
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"][:2].contiguous()
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(DraftError, match="inconsistent.*re-save"):
        DFlashDraft.from_pretrained(tmp_path / "d")
