"""Sampling settings, the token distribution they define, and lossless verification of a drafted block.

Every emitted token is either the target's argmax (temperature 0) or a sample from exactly the
distribution plain sampling would use (`probs`): speculative rejection sampling accepts a drafted
token x with probability min(1, p(x)/q(x)) and otherwise samples the normalised residual
max(0, p - q). A proposer that drafts greedily passes q=None, a one-hot at its token; the same
rule then reduces to "accept x with probability p(x)", i.e. accept iff the target's own sample is x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.engine.tree import Tree, walk
from flashdraft.models.runner import kernels


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """The distribution plain sampling draws from: temperature, then top-k, then top-p (HF's order).

    Computed in float32 at least (float64 stays float64), so that p and q ratios are not bf16-rounded.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = logits.to(dtype) / cfg.temperature
    vocab = scores.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return top_p(p, cfg.top_p) if cfg.top_p < 1 else p


TOP_P_CANDIDATES = (64, 1024)  # top-p's candidates per row, tried in turn before sorting the vocabulary


def top_p(p: torch.Tensor, mass: float) -> torch.Tensor:
    """p (..., V) restricted to its most likely tokens, renormalised: a token stays while the mass strictly
    above it is below `mass` (the first always stays). The candidates come from `topk` when every row's
    top 64 (else 1,024) hold `mass`, so that every token outside them is dropped; only a wider nucleus
    sorts the whole vocabulary. On a 2-core CPU, for 8 rows of 49k: topk 0.4 / 2.1 ms, sort 15 ms."""
    vocab = p.shape[-1]
    for k in (*TOP_P_CANDIDATES, vocab):
        top, index = p.topk(k, dim=-1) if k < vocab else p.sort(dim=-1, descending=True)
        total = top.cumsum(-1)
        if k >= vocab or bool((total[..., -1] >= mass).all()):
            break
    drop = (total - top) >= mass
    kept = torch.zeros_like(p).scatter_(-1, index, top.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def sample(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of p (..., V) -> (...), by inverting the cumulative distribution (in float64)
    at one uniform draw per row. `torch.multinomial` draws one exponential per vocabulary entry
    instead: 7 ms for a drafted block of 7 rows of 49k on a 2-core CPU."""
    cdf = p.reshape(-1, p.shape[-1]).cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    if not bool((total > 0).all() and total.isfinite().all()):
        raise ValueError("cannot sample: a row of probabilities sums to 0, inf or nan")
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=torch.float64, device=cdf.device) * total
    # Token i covers [cdf[i-1], cdf[i]): a token of probability 0 covers nothing and is never drawn. u
    # stays below the total even where the product rounds up, so the token found always exists.
    u = torch.minimum(u, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).view(p.shape[:-1])


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1), the first of equal maxima as torch gives it. bf16 logits on the CPU go to our
    kernel (`kernels.argmax`: 5 us over 49k, where torch's cast and float32 argmax took 0.11 ms of a
    5 ms step); other half-precision logits are cast to float32 first (the same values, the same ids:
    torch's bf16 argmax is slower still)."""
    if logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and kernels.available():
        return kernels.argmax(logits)
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return logits.argmax(-1)


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None):
    """Plain decoding's choice from logits (..., V)."""
    return argmax(logits) if cfg.greedy else sample(probs(logits, cfg), generator)


def verify_block(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    ks: list[int],
    samplings: list[SamplingConfig],
    qs: list[torch.Tensor | None],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[int]]:
    """The verifier of a batch of rows, greedy and sampled mixed: per row b, how many of its ks[b]
    drafted tokens are accepted, and the token that follows them (the correction or the bonus).

    logits (B, k_max + 1, V) at every row's [anchor, drafts]; drafts (B, k_max), a row's padding after
    its own ks[b] never counting as accepted; qs[b] the proposer's probabilities of row b's drafts, or
    None for a greedy proposal. Greedy rows take one argmax and one host transfer for the whole batch.
    Sampled rows run rejection sampling one by one, each with its own generator, so that a seeded
    request draws the same numbers alone or beside others."""
    accepted, bonus = [0] * len(ks), [0] * len(ks)
    if any(s.greedy for s in samplings):
        # The matches are counted in Python: a few tokens a row, where torch's compare, cumprod and sum
        # ran as ops with cold caches after every verify (0.05 ms of a plain step).
        choice = argmax(logits).tolist()
        drafted = drafts.tolist() if drafts.shape[1] else [[]] * len(ks)
    for b, (k, cfg) in enumerate(zip(ks, samplings, strict=True)):
        if cfg.greedy:  # a row's padding after its own k drafts never counts as accepted
            a, mine, target = 0, drafted[b], choice[b]
            while a < k and mine[a] == target[a]:
                a += 1
            accepted[b], bonus[b] = a, target[a]
        else:
            p = probs(logits[b : b + 1, : k + 1], cfg)
            a, token = verify_sampling(drafts[b : b + 1, :k], p, qs[b], generators[b])
            accepted[b], bonus[b] = a, int(token)
    return accepted, bonus


def verify_sampling(
    draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None = None
) -> tuple[int, torch.Tensor]:
    """Speculative rejection sampling for one row.

    draft (1, k); p (1, k+1, V) target probabilities at [anchor, draft] positions; q (1, k, V) the
    proposer's probabilities for its drafted tokens, or None for a one-hot (greedy) proposal.
    """
    k = draft.shape[1]
    p_x = p[:, :k].gather(-1, draft[..., None])[..., 0]
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, draft[..., None])[..., 0]
    # On the row's device, where its generator lives (an H200 datagen at temperature > 0 failed here).
    u = torch.rand(p_x.shape, generator=generator, dtype=p_x.dtype, device=p_x.device)
    a = int((u * q_x < p_x).cumprod(-1).sum())
    if a == k:
        return a, sample(p[0, k], generator)
    if q is None:
        residual = p[0, a].scatter(0, draft[0, a : a + 1], 0.0)
    else:
        residual = (p[0, a] - q[0, a]).clamp_min(0)
    total = residual.sum()
    if total <= 0:  # only reachable through rounding when p == q
        return a, sample(p[0, a], generator)
    return a, sample(residual / total, generator)


def verify_trees(
    logits: torch.Tensor,
    trees: list[Tree],
    samplings: list[SamplingConfig],
    generators: list[torch.Generator | None],
) -> tuple[list[list[int]], list[int]]:
    """The verifier of a batch of drafted trees (`flashdraft.engine.tree`): per row b, the nodes it
    accepts and the token that follows them. logits (B, T, V) at every row's [anchor, nodes].

    At each node of the walk the target's own next token is chosen as plain decoding chooses it (the
    argmax, or a sample from `probs` with the row's generator), and the walk goes on to the child that
    carries it: every emitted token is distributed exactly as plain decoding's, whatever the tree. With
    deterministic candidates this is rejection sampling of one-hot proposals over siblings (a sibling
    rejected, the residual is p without it: the next sibling is tried on that, and so on)."""
    choice = argmax(logits).tolist() if any(s.greedy for s in samplings) else None
    paths, bonus = [], []
    for b, (t, cfg, gen) in enumerate(zip(trees, samplings, generators, strict=True)):
        if cfg.greedy:
            path, token = walk(t, choice[b].__getitem__)
        else:
            path, token = walk(t, lambda i, b=b, cfg=cfg, gen=gen: int(sample(probs(logits[b, i], cfg), gen)))
        paths.append(path)
        bonus.append(token)
    return paths, bonus
