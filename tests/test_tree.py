"""Tree verification (flashdraft.engine.tree): trees built best-first, a node's logits equal to the one-token
step of its path bit for bit (the native runner's default weights, Llama, Qwen3 and Gemma 3 shapes, rows
with different trees in one batch), greedy tree decoding equal to plain decoding in float64 (alone and
batched, DFlash trees and trees that hide the truth among siblings), and sampled tree decoding distributed
as plain sampling (chi-square on a 6-token vocabulary; with the rule broken, the test fails).
"""

import itertools
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import engine_target, make_draft, make_hf_model
from test_batch import run_decoder
from test_runner import EXACT, smol_shaped
from test_runner_gemma import gemma_270m_shaped
from test_sampling import N_SAMPLES, MarkovTarget, V, chi2_pvalue, sample_joint

import flashdraft.engine.sampling as sampling
import flashdraft.models.batch as batch_module
from flashdraft import DFlashProposer, Engine, GenerationConfig, Proposer, SamplingConfig, generate
from flashdraft.engine import tree
from flashdraft.engine.sampling import probs
from flashdraft.engine.tree import Tree
from flashdraft.models import masks
from flashdraft.models.masks import DEAD

DEFAULT = EXACT[-1]  # the built-in target's weights where our kernels build (Q4_1 layers, Q8_0 head)


def test_build_takes_the_likeliest_paths():
    """The tree of N nodes holds the N likeliest paths (each path's probability the product of its
    tokens' marginals), parents before children, siblings with different tokens."""
    rng = random.Random(3)
    for _ in range(200):
        depth, top = rng.randint(1, 4), rng.randint(1, 4)
        probs_ = [sorted((rng.random() for _ in range(top)), reverse=True) for _ in range(depth)]
        tokens = [rng.sample(range(50), top) for _ in range(depth)]
        paths = {}  # rank tuple -> probability, every path up to `depth`
        for d in range(1, depth + 1):
            for ranks in itertools.product(range(top), repeat=d):
                paths[ranks] = float(np.prod([probs_[i][r] for i, r in enumerate(ranks)]))
        budget = rng.randint(1, 12)
        t = tree.build(probs_, tokens, budget)
        ranks, seen = [], {}
        for tok, parent in zip(t.tokens, t.parents, strict=True):
            assert parent < len(ranks)
            up = ranks[parent] if parent >= 0 else ()
            d = len(up)
            ranks.append((*up, tokens[d].index(tok)))
            assert (parent, tok) not in seen
            seen[parent, tok] = True
        best = sorted(paths.values(), reverse=True)[: len(t)]
        assert len(t) == min(budget, len(paths))
        assert sorted((paths[r] for r in ranks), reverse=True) == pytest.approx(best)


def test_a_node_sees_the_context_its_ancestors_and_itself():
    t = Tree([5, 6, 7, 8], [-1, -1, 0, 2])  # slots: 0 anchor, 1 and 2 its children, 3 under 1, 4 under 3
    anc = masks.tree_ancestors([t.parents], 6)
    assert anc[0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 1, 1, 0],
        [1, 0, 0, 0, 0, 1],  # padding past the tree hangs from the anchor
    ]
    # restrict_to_tree cuts only the block's columns: the 2 context slots keep what positions made them
    low = torch.finfo(torch.float32).min
    mask = torch.zeros(1, 1, 6, 8)
    mask[0, 0, 2, 1] = low  # a context slot a position rule hid
    for got in (
        masks.restrict_to_tree(mask.clone(), anc),
        masks.restrict_to_tree({"full": mask.clone()}, anc)["full"],
    ):
        seen = (got[0, 0] == 0).int().tolist()
        assert [row[:2] for row in seen] == [[1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1]]
        assert [row[2:] for row in seen] == anc[0].int().tolist()


# -- a node's logits are the one-token step of its path -------------------------------------------------

TREES = [
    Tree([3, 9, 4, 17, 2, 30, 8, 11], [-1, -1, 0, 0, 1, 2, 5, -1]),
    Tree([21, 40, 5, 6, 77], [-1, 0, 0, 1, 3]),  # 3 slots of padding in the batch
]


@pytest.mark.parametrize(
    "make",
    [
        *(pytest.param(lambda q=q: smol_shaped("llama", q), id=f"llama-{q}") for q in EXACT),
        pytest.param(lambda: smol_shaped("qwen3", DEFAULT), id="qwen3"),
        pytest.param(lambda: gemma_270m_shaped(DEFAULT), id="gemma3"),
    ],
)
def test_tree_node_logits_equal_the_one_token_steps_of_its_path(make):
    run = make()
    check_tree_nodes(run, TREES)  # two rows with different trees in one verify
    check_tree_nodes(run, TREES[:1])  # batch 1


@torch.inference_mode()
def check_tree_nodes(run, trees: list[Tree]) -> None:
    """Rows of 97 prompt tokens verify their trees in one forward, masked and placed as the engine does;
    every node's logits (and the anchor's) equal those of its row alone fed the node's path one token at
    a time, bit for bit."""
    g = torch.Generator().manual_seed(7)
    rows, n, width = len(trees), 97, 1 + max(len(t) for t in trees)
    prompt, anchors = (
        torch.randint(0, 128, (rows, n), generator=g),
        torch.randint(0, 128, (rows,), generator=g),
    )
    cache = run.new_cache()
    run.forward(prompt, torch.arange(n).expand(rows, -1), cache)
    block = torch.zeros(rows, width, dtype=torch.long)
    depth = torch.zeros(rows, width, dtype=torch.long)
    for b, t in enumerate(trees):
        block[b, 0], block[b, 1 : len(t) + 1] = anchors[b], torch.tensor(t.tokens)
        depth[b, 1 : len(t) + 1] = torch.tensor(t.depths())
    q_pos = n + depth
    live = torch.arange(width) <= torch.tensor([len(t) for t in trees])[:, None]
    kpos = torch.cat([torch.arange(n).expand(rows, -1), torch.where(live, q_pos, DEAD)], 1)
    mask = masks.restrict_to_tree(
        run.attention_mask(q_pos, kpos), masks.tree_ancestors([t.parents for t in trees], width)
    )
    verify, _ = run.forward(block, q_pos, cache, attention_mask=mask)
    for b, t in enumerate(trees):
        alone = run.new_cache()
        run.forward(prompt[b : b + 1], torch.arange(n)[None], alone)
        for slot in range(len(t) + 1):
            path, node = [], slot - 1
            while node >= 0:
                path.insert(0, t.tokens[node])
                node = t.parents[node]
            run.crop(alone, n)
            for j, token in enumerate([int(anchors[b]), *path]):
                step, _ = run.forward(torch.tensor([[token]]), torch.tensor([[n + j]]), alone)
            assert torch.equal(step[0, 0], verify[b, slot]), (b, slot)


# -- greedy tree decoding is plain decoding ---------------------------------------------------------------


class TreeOracle(Proposer):
    """Proposes trees that hide each row's true greedy continuation among 0-2 wrong siblings per depth, at a
    random rank, with dead branches under wrong siblings, sometimes corrupted at one depth; now and then a
    chain (full, partial and zero acceptance, paths that are not the block's front, chains beside trees)."""

    def __init__(self, truths: dict[str, list[int]], vocab: int, rng: random.Random):
        self.truths, self.vocab, self.rng = truths, vocab, rng

    def propose(self, rows, ks):
        out = []
        for row, k in zip(rows, ks, strict=True):
            done = len(row.tokens)
            truth = self.truths[row.request_id][done : done + k]
            if k == 0 or not truth:
                out.append((torch.zeros(0, dtype=torch.long), None))
            elif self.rng.random() < 0.2:
                out.append((torch.tensor(truth, dtype=torch.long), None))  # a chain
            else:
                t = self.tree(truth)
                out.append((torch.tensor(t.tokens, dtype=torch.long), None, t))
        return out

    def tree(self, truth: list[int]) -> Tree:
        rng, tokens, parents, parent = self.rng, [], [], -1
        for want in truth:
            if rng.random() < 0.15:
                want = (want + 1) % self.vocab  # the walk stops at this depth
            wrong = rng.sample([v for v in range(self.vocab) if v != want], rng.randint(0, 2))
            siblings = list(wrong)
            siblings.insert(rng.randint(0, len(wrong)), want)
            first = len(tokens)
            tokens += siblings
            parents += [parent] * len(siblings)
            if wrong and rng.random() < 0.3:  # a dead branch under a wrong sibling
                tokens.append(rng.randrange(self.vocab))
                parents.append(first + siblings.index(wrong[0]))
            parent = first + siblings.index(want)
        return Tree(tokens, parents)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_tree_decoding_equals_plain_decoding_in_float64(arch, monkeypatch):
    model = make_hf_model(arch)
    target = engine_target(model)
    rng = random.Random(5)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    configs = [GenerationConfig(rng.randint(4, 24)) for _ in prompts]
    want = [generate(target, p, None, c).tokens for p, c in zip(prompts, configs, strict=True)]
    moved = []  # per tree step: whether an accepted path had to move to the front of its block
    real = batch_module.path_order

    def path_order(*args):
        order = real(*args)
        moved.append(order is not None)
        return order

    monkeypatch.setattr(batch_module, "path_order", path_order)
    draft = make_draft(model)
    for name in ("dflash", "oracle"):
        alone = []
        for i, (p, c) in enumerate(zip(prompts, configs, strict=True)):
            prop = (
                DFlashProposer(draft, target, tree=6)
                if name == "dflash"
                else TreeOracle({"0": want[i]}, 128, rng)
            )
            res = generate(target, p, prop, GenerationConfig(c.max_new_tokens, 8))
            assert res.tokens == want[i], (name, "alone", i)
            alone.append(res.acceptance_lengths)
        truths = {str(i): t for i, t in enumerate(want)}
        prop = DFlashProposer(draft, target, tree=6) if name == "dflash" else TreeOracle(truths, 128, rng)
        seen = run_decoder(Engine(target, prop, 8, max_batch_size=3), prompts, configs)  # joins, leaves
        for i in range(len(prompts)):
            assert seen[str(i)]["tokens"] == want[i], (name, "batched", i)
            if name == "dflash":  # each row's trees are its own, in a batch as alone: so its acceptance
                assert seen[str(i)]["accepted"] == alone[i], ("dflash", "batched", i)
    assert sum(moved) > 5, moved


# -- sampled tree decoding is plain sampling ------------------------------------------------------------


class TreeMarkovTarget(MarkovTarget):
    """MarkovTarget (next-token logits from the last two tokens) that reads a tree block's mask: a token's
    predecessor is the last slot it sees before its own. Its cache holds the token ids in the layout the
    engine edits (layers[0].keys, (1, 1, S, 1))."""

    def new_cache(self, sliding=True):
        return SimpleNamespace(layers=[SimpleNamespace(keys=torch.zeros(1, 1, 0, 1), values=None)])

    def forward(self, input_ids, positions, cache, logits_to_keep=0, features=None, attention_mask=None):
        layer = cache.layers[0]
        start, new = layer.keys.shape[2], input_ids.shape[1]
        layer.keys = torch.cat([layer.keys, input_ids[:, None, :, None].float()], 2)
        ids = layer.keys[0, 0, :, 0].long().tolist()
        prev = []
        for i in range(start, start + new):
            seen = (
                range(i) if attention_mask is None else (attention_mask[0, 0, i - start, :i] == 0).nonzero()
            )
            seen = [int(j) for j in seen]
            prev.append(ids[seen[-1]] if seen else 0)
        logits = self.table[prev, ids[start:]][None]
        return (logits[:, -logits_to_keep:] if logits_to_keep else logits), None

    @staticmethod
    def crop(cache, length):
        cache.layers[0].keys = cache.layers[0].keys[:, :, :length]

    def attention_mask(self, q_pos, k_pos):
        diff = q_pos[:, None, :, None] - k_pos[:, None, None, :]
        low = torch.tensor(torch.finfo(torch.float64).min, dtype=torch.float64)
        return torch.where(diff >= 0, torch.zeros((), dtype=torch.float64), low)


class MarkovTreeDraft(Proposer):
    """Trees of up to 5 tokens built best-first from per-position distributions that depend on the anchor
    alone (as a DFlash draft's), under the row's sampling settings."""

    def __init__(self, seed: int, budget: int = 5):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(V, 8, V, generator=g, dtype=torch.float64) * 1.5
        self.budget = budget

    def propose_row(self, row, k):
        t = tree.from_probs(probs(self.table[row.tokens[-1], :k], row.sampling), self.budget)
        return torch.tensor(t.tokens, dtype=torch.long), None, t


def retrying_walk(t: Tree, next_token):
    """A broken walk: where the target's token is in no child, it draws once more (a bias toward drafts)."""
    children = t.children()

    def twice(i: int) -> int:  # slot i: the anchor (0) or node i - 1
        token = next_token(i)
        return token if token in children.get(i - 1, {}) else next_token(i)

    return tree.walk(t, twice)


@pytest.mark.parametrize(
    "cfg", [SamplingConfig(0.7, top_k=3), SamplingConfig(1.0, top_p=0.8)], ids=["t0.7-topk3", "t1.0-topp0.8"]
)
def test_sampled_tree_decoding_matches_plain_sampling(cfg):
    target = TreeMarkovTarget(seed=0)
    assert target.exact_joint(cfg).sum() == pytest.approx(1.0)
    counts = sample_joint(target, MarkovTreeDraft(seed=1), cfg, N_SAMPLES)
    p = chi2_pvalue(counts, target.exact_joint(cfg))
    assert p > 1e-3, f"p-value {p:.2e}: tree samples do not follow the plain sampling distribution"


def test_the_tree_sampling_test_has_power(monkeypatch):
    monkeypatch.setattr(sampling, "walk", retrying_walk)
    cfg = SamplingConfig(1.0)
    target = TreeMarkovTarget(seed=0)
    counts = sample_joint(target, MarkovTreeDraft(seed=1), cfg, N_SAMPLES // 4)
    assert chi2_pvalue(counts, target.exact_joint(cfg)) < 1e-3
