"""The offline acceptance estimate (`flashdraft.train.acceptance`) against the real decode loop: on the target's
own greedy output, the anchors it walks and the tokens it commits at each must be the loop's, step for step."""

import pytest
import torch
from conftest import make_draft, make_hf_model

from flashdraft import DFlashProposer, Target
from flashdraft.engine.decode import GenerationConfig, generate
from flashdraft.train.acceptance import acceptance_lengths, greedy_references, offline_tau, walk
from flashdraft.train.loop import evaluate_tau


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    # A small vocabulary so that a random draft is right often enough to make multi-token commits.
    target = Target(make_hf_model("qwen3", vocab=8, layers=4, seed=3))
    draft = make_draft(target.model, layers=2, block_size=5, mask_token_id=7)
    return target, draft


def test_offline_walk_is_the_real_loop_step_for_step(setup):
    target, draft = setup
    g = torch.Generator().manual_seed(0)
    proposer = DFlashProposer(draft, target, proposal="greedy")
    refs, seen = [], []
    for i in range(6):
        prompt = torch.randint(0, 7, (3 + i,), generator=g).tolist()
        res = generate(
            target, prompt, proposer, GenerationConfig(max_new_tokens=30, block_size=5, stop_ids=[])
        )
        lengths = acceptance_lengths(draft, target, prompt, res.tokens, chunk=7)
        assert walk(lengths) == res.acceptance_lengths
        refs.append({"set": "x" if i % 2 else "y", "prompt_ids": prompt, "response_ids": res.tokens})
        seen += res.acceptance_lengths
    assert max(seen) >= 2 and min(seen) == 1  # accepted drafts and zero acceptance both occurred
    est = offline_tau(draft, target, refs)
    assert est["tau"] == pytest.approx(sum(seen) / len(seen))
    assert est["anchors"] == sum(len(r["response_ids"]) - 1 for r in refs)
    assert set(est) >= {"tau/x", "tau/y", "tau_all", "tau_all/x"}
    # Per block position k: the share of the loop's steps that committed more than k tokens.
    assert est["position_acceptance"] == pytest.approx(
        [sum(n > k for n in seen) / len(seen) for k in range(1, 5)], abs=1e-4
    )
    real = evaluate_tau(draft, target, {"x": [r["prompt_ids"] for r in refs]}, 5, 30)
    assert real["position_acceptance"] == est["position_acceptance"]


def test_greedy_references_are_plain_greedy_decoding(setup):
    """References are plain greedy decoding, cut at the target's stop token (one that really occurs)."""
    target, _ = setup
    prompts = [[1, 2, 3], [4, 5, 6, 1, 2], [0]]
    uncut = generate(target, prompts[0], None, GenerationConfig(max_new_tokens=12)).tokens
    gen_cfg = target.model.generation_config
    old, gen_cfg.eos_token_id = gen_cfg.eos_token_id, uncut[4]  # a token the first answer produces
    try:
        refs = greedy_references(target, {"a": prompts[:2], "b": prompts[2:]}, 12)
        assert [r["set"] for r in refs] == ["a", "a", "b"] and target.stop_ids == [uncut[4]]
        assert len(refs[0]["response_ids"]) <= 5  # cut at the stop token
        for r, p in zip(refs, prompts, strict=True):
            alone = generate(target, p, None, GenerationConfig(max_new_tokens=12, stop_ids=target.stop_ids))
            assert r["prompt_ids"] == p and r["response_ids"] == alone.tokens
    finally:
        gen_cfg.eos_token_id = old


def test_offline_walk_with_the_context_vocabulary_is_the_real_loop():
    """A 16-token target, a draft vocabulary of 4 of them, each request's own tokens joining it (prompts of
    6 tokens, so the context grows as the answer brings new ones): the offline walk (the tokens up to each
    anchor) commits what the real loop with DFlashProposer(context_vocab=True) commits, step for step."""
    target = Target(make_hf_model("qwen3", vocab=16, layers=4, seed=3))
    draft = make_draft(target.model, layers=2, block_size=5, mask_token_id=15)
    draft.set_vocab([0, 1, 2, 3], target.lm_head.weight)
    g = torch.Generator().manual_seed(4)
    plain, joined = [], []
    for i in range(8):
        prompt = torch.randint(0, 6, (3 + i,), generator=g).tolist()
        cfg = GenerationConfig(max_new_tokens=40, block_size=5, stop_ids=[])
        proposer = DFlashProposer(draft, target, proposal="greedy", context_vocab=True)
        res = generate(target, prompt, proposer, cfg)
        assert walk(acceptance_lengths(draft, target, prompt, res.tokens, context_vocab=True)) == (
            res.acceptance_lengths
        )
        joined += res.acceptance_lengths
        plain += walk(acceptance_lengths(draft, target, prompt, res.tokens))
    assert joined != plain  # the context's tokens changed what got accepted: the test can see them


def test_a_tree_from_the_blocks_marginals_is_built_best_first_and_accepts_its_deepest_match():
    """Marginals of 3 block positions (ranks 0.5 / 0.3 / 0.2, then 0.6 / 0.4, then 0.9 / 0.1): best-first,
    3 nodes give the paths (0), (0, 0) and (1): path probabilities 0.5, 0.3 and 0.3; 4 nodes add (0, 0, 0)
    (0.27) before (0, 1) (0.2). The verify commits the deepest node on the target's own path, plus one."""
    from flashdraft.train.acceptance import tree_accepted

    probs = [[0.5, 0.3, 0.2], [0.6, 0.4, 0.0], [0.9, 0.1, 0.0]]
    tokens = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert tree_accepted(probs, tokens, [1, 4, 7], 3) == 3  # (0, 0, 0) not in the tree yet
    assert tree_accepted(probs, tokens, [1, 4, 7], 4) == 4  # the whole block and the bonus token
    assert tree_accepted(probs, tokens, [2, 4, 7], 3) == 2  # the second-ranked first token: a sibling
    assert tree_accepted(probs, tokens, [1, 5, 7], 4) == 2  # (0, 1) comes only with the fifth node
    assert tree_accepted(probs, tokens, [1, 5, 7], 5) == 3
    assert tree_accepted(probs, tokens, [9, 9, 9], 16) == 1  # nothing matches: the bonus token alone
    assert tree_accepted(probs, tokens, [1, 4], 16) == 3  # the reference ends: no deeper than it
