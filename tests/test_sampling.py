"""Sampling exactness: speculative sampling must draw from exactly the plain sampling distribution.

The first 3 tokens' joint distribution under plain sampling is computed exactly by enumeration and
compared with 20,000 speculative samples by a chi-square test. The same test run with a broken
acceptance rule must fail, so it demonstrably has power.
"""

import itertools

import numpy as np
import pytest
import torch
from conftest import engine_target, make_draft, make_hf_model
from scipy.stats import chisquare

import flashdraft.engine.sampling as sampling
from flashdraft import DFlashProposer, GenerationConfig, Proposer, SamplingConfig, generate
from flashdraft.engine.sampling import probs

V = 6
PROMPT = [1, 4, 2]
N_SAMPLES = 20_000


class MarkovTarget:
    """A cheap tiny-vocabulary target for the decode loop: next-token logits depend on the last two
    tokens through a table. Speaks the same interface as `flashdraft.models.target.Target`."""

    vocab_size, max_length = V, 64
    device, dtype = torch.device("cpu"), torch.float64

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(V, V, V, generator=g, dtype=torch.float64) * 1.5

    def new_cache(self, sliding=True):
        return []

    def forward(self, input_ids, positions, cache, logits_to_keep=0, features=None, attention_mask=None):
        start = len(cache)
        cache.extend(input_ids[0].tolist())
        prev = [cache[i - 1] if i else 0 for i in range(start, len(cache))]
        logits = self.table[prev, cache[start:]][None]
        return (logits[:, -logits_to_keep:] if logits_to_keep else logits), None

    @staticmethod
    def crop(cache, length):
        del cache[length:]

    def exact_joint(self, cfg: SamplingConfig) -> np.ndarray:
        """P(first three tokens) under plain sampling, by enumeration."""
        out = np.zeros((V, V, V))
        for seq in itertools.product(range(V), repeat=3):
            ctx, prob = list(PROMPT), 1.0
            for tok in seq:
                prob *= float(probs(self.table[ctx[-2], ctx[-1]], cfg)[tok])
                ctx.append(tok)
            out[seq] = prob
        return out


class MarkovDraft(Proposer):
    """Drafts every block position from a distribution that depends only on the anchor and the
    position (like DFlash: positions are drafted in parallel), deliberately different from the target."""

    def __init__(self, seed: int, proposal: str):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(V, 8, V, generator=g, dtype=torch.float64) * 1.5
        self.proposal = proposal

    def propose_row(self, row, k):
        logits = self.table[row.tokens[-1], :k][None]
        if self.proposal == "greedy":
            return logits.argmax(-1)[0], None
        q = probs(logits, row.sampling)
        return sampling.sample(q, row.generator)[0], q


def sample_joint(target, proposer, cfg: SamplingConfig, n: int, block: int = 4, seed: int = 0) -> np.ndarray:
    counts = np.zeros((V, V, V))
    run = GenerationConfig(max_new_tokens=3, block_size=block, sampling=cfg)
    gen_seed = seed * 1_000_003
    for i in range(n):
        run.seed = gen_seed + i
        res = generate(target, PROMPT, proposer, run)
        counts[tuple(res.tokens)] += 1
    return counts


def chi2_pvalue(counts: np.ndarray, exact: np.ndarray) -> float:
    n = counts.sum()
    assert counts[exact == 0].sum() == 0, "sampled a sequence that plain sampling can never produce"
    expected = exact.ravel() * n
    observed = counts.ravel()
    keep = expected >= 5  # pool the rare cells into one
    exp = np.append(expected[keep], expected[~keep].sum())
    obs = np.append(observed[keep], observed[~keep].sum())
    if exp[-1] == 0:
        exp, obs = exp[:-1], obs[:-1]
    return float(chisquare(obs, exp).pvalue)


CONFIGS = [
    pytest.param(SamplingConfig(0.7, top_k=3), "draft", id="t0.7-topk3-draftq"),
    pytest.param(SamplingConfig(1.0, top_p=0.8), "draft", id="t1.0-topp0.8-draftq"),
    pytest.param(SamplingConfig(1.0), "draft", id="t1.0-draftq"),
    pytest.param(SamplingConfig(0.7, top_p=0.9), "greedy", id="t0.7-topp0.9-onehot"),
]


@pytest.mark.parametrize("cfg, proposal", CONFIGS)
def test_speculative_sampling_matches_plain_distribution(cfg, proposal):
    target = MarkovTarget(seed=0)
    exact = target.exact_joint(cfg)
    counts = sample_joint(target, MarkovDraft(seed=1, proposal=proposal), cfg, N_SAMPLES)
    p = chi2_pvalue(counts, exact)
    assert p > 1e-3, f"p-value {p:.2e}: speculative samples do not follow the plain sampling distribution"


def test_plain_sampling_loop_matches_enumeration():
    cfg = SamplingConfig(0.7, top_k=4)
    target = MarkovTarget(seed=0)
    counts = sample_joint(target, None, cfg, 5_000, block=1)
    assert chi2_pvalue(counts, target.exact_joint(cfg)) > 1e-3


def _resample_from_p(draft, p, q, generator=None):
    """A classic bug: after a rejection, sample from p instead of the residual max(0, p - q)."""
    k = draft.shape[1]
    p_x = p[:, :k].gather(-1, draft[..., None])[..., 0]
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, draft[..., None])[..., 0]
    u = torch.rand(p_x.shape, generator=generator, dtype=p_x.dtype)
    a = int((u * q_x < p_x).cumprod(-1).sum())
    return a, sampling.sample(p[0, a], generator)


def _accept_if_likely(draft, p, q, generator=None):
    """Another: accept whenever the target gives the token at least 10% (no randomness in acceptance)."""
    k = draft.shape[1]
    p_x = p[:, :k].gather(-1, draft[..., None])[..., 0]
    a = int((p_x > 0.1).cumprod(-1).sum())
    return a, sampling.sample(p[0, a], generator)


@pytest.mark.parametrize("broken", [_resample_from_p, _accept_if_likely])
def test_distribution_test_has_power(monkeypatch, broken):
    monkeypatch.setattr(sampling, "verify_sampling", broken)
    cfg = SamplingConfig(1.0, top_p=0.8)
    target = MarkovTarget(seed=0)
    counts = sample_joint(target, MarkovDraft(seed=1, proposal="draft"), cfg, N_SAMPLES)
    exact = target.exact_joint(cfg)
    with pytest.raises(AssertionError):
        assert chi2_pvalue(counts, exact) > 1e-3


def test_dflash_draft_sampling_on_hf_target():
    """End to end with a real (tiny, 6-token vocabulary) HF target and a random DFlash draft."""
    model = make_hf_model("llama", vocab=V, layers=2)
    target = engine_target(model)
    draft = make_draft(model, layers=1, mask_token_id=5)
    with torch.no_grad():
        draft.fc.weight.mul_(20)  # a confident, wrong draft: many rejections
    cfg = SamplingConfig(1.0, top_k=5)
    exact = np.zeros((V, V, V))
    with torch.no_grad():
        seqs = torch.tensor(list(itertools.product(range(V), repeat=3)))
        ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
        p = probs(model(ids).logits[:, len(PROMPT) - 1 : -1], cfg)
        joint = p.gather(-1, seqs[..., None])[..., 0].prod(-1)
    exact[tuple(seqs.T)] = joint.numpy()
    counts = sample_joint(target, DFlashProposer(draft, target), cfg, 4_000, block=4)
    assert chi2_pvalue(counts, exact) > 1e-3


def test_probs_match_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g, dtype=torch.float64) * 3
    for t, k, p in [(0.7, 0, 1.0), (1.0, 10, 1.0), (1.3, 0, 0.9), (0.5, 20, 0.7)]:
        scores = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1:
            scores = TopPLogitsWarper(p)(None, scores)
        torch.testing.assert_close(probs(logits, SamplingConfig(t, k, p)), torch.softmax(scores, -1))


def test_verify_sampling_residual_is_exact():
    """Marginal of one verification step, exactly: P(first emitted token) must equal p[0]."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(1, 2, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(1, 1, V, generator=g, dtype=torch.float64), -1)
    # Sum over the drafted token x ~ q of: accept prob * 1[x] + reject prob * residual.
    first = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        acc = min(1.0, float(p[0, 0, x] / q[0, 0, x]))
        resid = (p[0, 0] - q[0, 0]).clamp_min(0)
        first[x] += q[0, 0, x] * acc
        first += q[0, 0, x] * (1 - acc) * resid / resid.sum()
    torch.testing.assert_close(first, p[0, 0])
    # And the implementation agrees with that analysis by simulation on the drafted token alone.
    hits = torch.zeros(V)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20_000):
        x = sampling.sample(q[0], gen)[None]
        a, bonus = sampling.verify_sampling(x, p, q, gen)
        hits[int(x[0, 0]) if a else int(bonus)] += 1
    assert chisquare(hits.numpy(), p[0, 0].numpy() * 20_000).pvalue > 1e-3


@pytest.mark.parametrize(
    "scale, low, high",
    [(6.0, 1, 64), (3.0, 65, 1024), (0.3, 1025, 5_000)],
    ids=["nucleus-in-top-64", "nucleus-in-top-1024", "nucleus-needs-a-sort"],
)
def test_top_p_equals_a_full_sort_on_a_large_vocabulary(scale, low, high):
    """top_p takes its candidates from the top 64, else the top 1,024, else sorts all 5,000 tokens: each
    stage must keep exactly the nucleus that transformers' full sort keeps."""
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 5_000, generator=g, dtype=torch.float64) * scale
    ours = probs(logits, SamplingConfig(1.0, top_p=0.9))
    theirs = torch.softmax(TopPLogitsWarper(0.9)(None, logits.clone()), -1)
    torch.testing.assert_close(ours, theirs)
    widest = int((ours > 0).sum(-1).max())  # the batch's widest nucleus picks the stage
    assert low <= widest <= high, "the case misses its stage"


def test_sample_draws_each_row_from_its_distribution():
    """Inverse-CDF sampling: per row of a (2, 2, V) batch, frequencies follow p and tokens of probability
    0 (the first, the last, one in between) are never drawn."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 2, V, generator=g, dtype=torch.float64), -1)
    p[..., [0, 3, V - 1]] = 0.0
    p = p / p.sum(-1, keepdim=True)
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([sampling.sample(p, gen) for _ in range(20_000)])  # (n, 2, 2)
    assert draws.shape == (20_000, 2, 2)
    for i, j in itertools.product(range(2), range(2)):
        hits = torch.bincount(draws[:, i, j], minlength=V).double()
        assert hits[p[i, j] == 0].sum() == 0
        keep = p[i, j] > 0
        assert chisquare(hits[keep].numpy(), (p[i, j, keep] * 20_000).numpy()).pvalue > 1e-3


def test_sample_never_draws_past_the_last_token_with_mass(monkeypatch):
    """A uniform draw that rounds up to the whole mass must still land on a token of positive probability."""
    p = torch.tensor([[0.25, 0.75, 0.0, 0.0]], dtype=torch.float64)
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **kw: torch.ones(1, 1, dtype=torch.float64))
    assert sampling.sample(p).tolist() == [1]


@pytest.mark.parametrize("bad", [0.0, float("nan")])
def test_sample_refuses_a_row_without_mass(bad):
    p = torch.tensor([[0.5, 0.5], [bad, bad]], dtype=torch.float64)
    with pytest.raises(ValueError, match="sums to 0, inf or nan"):
        sampling.sample(p)
