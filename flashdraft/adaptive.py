"""Adaptive speculation: each step, whether to draft at all and how many drafted tokens to verify, chosen for
the most committed tokens per second on this machine, with n-gram lookup as a free second proposer.

Costs are measured, not assumed: a target forward over n tokens (all rows together) takes a + b*n seconds,
fitted to the engine's own timings, and a draft call takes d. Acceptance is learned as it happens: the
draft's confidence at a block position (the peak of its distribution there) is mapped to the chance that
the verifier accepts that position, given it reached it, by a calibration table per confidence bin.

- Cut: drafted token i is verified while the chance that tokens 1..i are all accepted, P_i, is worth its
  verify cost: P_i >= b * R, where R = B / (a + b*B) is the plain decoding rate of the B running rows.
- Draft or not: a draft step pays when it is expected to commit more per second than a plain step; the
  running mean gain of past draft steps decides. When it does not pay, the step is plain (or n-gram
  where the context repeats), and the draft is tried again after 1, 2, 4, ... 64 steps.

Lossless by construction: a prefix of a proposal is a proposal, and every decision depends on the draft's
distributions (their peaks), never on the tokens sampled from them nor on the target's answer.
"""

from __future__ import annotations

import torch

from .proposers import DFlashProposer, NgramProposer, Proposer

BINS = 10
SPECULATION = ("fixed", "adaptive")  # what `--speculation` offers
DEFAULT_SPECULATION = "fixed"


def make_proposer(
    draft, target, proposal: str = "draft", speculation: str = DEFAULT_SPECULATION
) -> Proposer | None:
    """What the verbs run for a draft: DFlash at a fixed block size ("fixed"), or DFlash and n-gram lookup
    behind the adaptive rule ("adaptive"). No draft: None (plain decoding)."""
    if speculation not in SPECULATION:
        raise ValueError(f"speculation must be one of {', '.join(SPECULATION)}, got {speculation!r}")
    if draft is None:
        return None
    dflash = DFlashProposer(draft, target, proposal)
    if speculation == "fixed":
        return dflash
    return AdaptiveProposer(dflash, NgramProposer(block_size=dflash.block_size))


class LinearCost:
    """seconds(n) = a + b*n by exponentially weighted least squares (recent timings count most)."""

    def __init__(self, halflife: float = 64.0, prior_b_over_a: float = 0.08):
        self.decay = 0.5 ** (1 / halflife)
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.prior = prior_b_over_a

    def add(self, n: float, seconds: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = self.w * d + 1, self.sx * d + n, self.sy * d + seconds
        self.sxx, self.sxy = self.sxx * d + n * n, self.sxy * d + n * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before the first timing. With one size of forward seen so far, b comes from
        the prior ratio b/a."""
        if self.w == 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var > 1e-6 * max(1.0, mx * mx):
            b = max(0.0, (self.sxy / self.w - mx * my) / var)
            a = max(my - b * mx, 1e-9)
            return a, b
        a = my / (1 + self.prior * mx)
        return a, self.prior * a


class AdaptiveProposer(Proposer):
    """A drafting proposer (`DFlashProposer`, whose draft logits give the confidences) and/or n-gram lookup
    behind the adaptive rule above. The engine tells it how each step went (`observe`); it keeps the costs,
    the calibration and the draft-or-not state across requests."""

    def __init__(self, dflash: Proposer | None = None, ngram: NgramProposer | None = None):
        if dflash is None and ngram is None:
            raise ValueError("an adaptive proposer needs a DFlash proposer, n-gram lookup, or both")
        self.dflash, self.ngram = dflash, ngram
        self.block_size = max(p.block_size for p in (dflash, ngram) if p is not None)
        self.feature_layers = dflash.feature_layers if dflash is not None else None
        self.verify_cost = LinearCost()
        self.draft_s: float | None = None  # seconds of one draft call (EMA)
        # per source and confidence bin: (accepted, reached) counts, decaying; a prior of 1 in 2 per bin
        self.calibration = {src: (torch.ones(BINS), torch.full((BINS,), 2.0)) for src in ("dflash", "ngram")}
        self.gain: float | None = None  # drafted tokens accepted per row per draft step (EMA)
        self.verified: float | None = None  # drafted tokens verified per row per draft step (EMA)
        self.wait, self.backoff = 0, 1  # plain steps before the draft is tried again
        self.last: list[tuple[str, torch.Tensor]] = []  # per row: (source, confidences) of this step
        self.drafted = False
        self.stats = {"draft_steps": 0, "skipped_steps": 0, "ngram_rows": 0, "dflash_rows": 0}

    # -- the engine's batch events go to the DFlash proposer ------------------------------------

    def reset(self):
        if self.dflash is not None:
            self.dflash.reset()

    def join(self, rows, features):
        if self.dflash is not None:
            self.dflash.join(rows, features)

    def accept(self, features, n):
        if self.dflash is not None:
            self.dflash.accept(features, n)

    def keep(self, index):
        if self.dflash is not None:
            self.dflash.keep(index)

    # -- the rule ---------------------------------------------------------------------------------

    def threshold(self, rows: int) -> float:
        """The chance of acceptance one more verified token must have: b * (plain rate of the batch)."""
        fit = self.verify_cost.fit()
        if fit is None:
            return 0.0
        a, b = fit
        return b * rows / (a + b * rows)

    def chances(self, source: str, conf: torch.Tensor) -> torch.Tensor:
        """P_i, the chance that drafted tokens 1..i are all accepted, from per-position confidences."""
        accepted, reached = self.calibration[source]
        bins = (conf.clamp(0, 1) * BINS).long().clamp(max=BINS - 1)
        return torch.cumprod(accepted[bins] / reached[bins], 0)

    def wants_draft(self, rows: int) -> bool:
        """Whether a draft step is expected to commit more per second than a plain one."""
        if self.dflash is None:
            return False
        fit = self.verify_cost.fit()
        if self.gain is None or self.draft_s is None or fit is None:
            return True  # nothing measured yet
        a, b = fit
        plain = a + b * rows
        spec = self.draft_s + a + b * rows * (1 + self.verified)
        return (1 + self.gain) / spec > 1 / plain

    def propose(self, rows, ks):
        self.drafted = self.dflash is not None and self.wait == 0
        self.wait = max(0, self.wait - 1)
        ng = None
        if self.ngram is not None:
            ng = [self.ngram.propose_row(r, k) if k else (None, None) for r, k in zip(rows, ks, strict=True)]
        df = self.dflash.propose(rows, ks) if self.drafted else None
        theta = self.threshold(len(rows))
        out, self.last = [], []
        for b, k in enumerate(ks):
            best = (0.0, torch.zeros(0, dtype=torch.long), None, "none", torch.zeros(0))
            if ng is not None and ng[b][0] is not None and len(ng[b][0]):
                conf = torch.full((len(ng[b][0]),), 0.5)  # one bin for n-gram: its own acceptance rate
                best = max(best, self._option("ngram", ng[b][0], None, conf, theta), key=lambda o: o[0])
            if df is not None and k:
                tokens, q = df[b]
                conf = self._confidence(b, k, q)
                best = max(best, self._option("dflash", tokens, q, conf, theta), key=lambda o: o[0])
            _, tokens, q, source, conf = best
            if source != "none":
                self.stats[f"{source}_rows"] += 1
            out.append((tokens, q))
            self.last.append((source, conf))
        self.stats["draft_steps" if self.drafted else "skipped_steps"] += 1
        return out

    def _confidence(self, b: int, k: int, q: torch.Tensor | None) -> torch.Tensor:
        """The peak of the distribution each position was drafted from (never the sampled token's own q).
        A proposer with neither q nor logits (a test oracle) gets one bin."""
        logits = getattr(self.dflash, "last_logits", None)
        if q is None and logits is None:
            return torch.full((k,), 0.5)
        dist = q[0] if q is not None else torch.softmax(logits[b, :k].float(), -1)
        return dist.max(-1).values.float().cpu()

    def _option(self, source, tokens, q, conf, theta):
        """(expected drafted tokens accepted, the proposal cut where it stops paying, ...)."""
        p = self.chances(source, conf)
        keep = int((p >= theta).long().cumprod(0).sum())
        value = float(p[:keep].sum())
        return value, tokens[:keep], None if q is None else q[:, :keep], source, conf[:keep]

    def observe(self, rows, ks, n, draft_s: float, verify_s: float, verify_tokens: int) -> None:
        """After the verify: row b verified ks[b] drafted tokens and committed n[b]."""
        self.verify_cost.add(verify_tokens, verify_s)
        if self.drafted:
            self.draft_s = draft_s if self.draft_s is None else 0.9 * self.draft_s + 0.1 * draft_s
        gained = []
        for (source, conf), k, got in zip(self.last, ks, n, strict=True):
            if source == "none" or not k:
                continue
            accepted = min(got - 1, k)
            reached = min(accepted + 1, k)
            hits, seen = self.calibration[source]
            bins = (conf[:reached].clamp(0, 1) * BINS).long().clamp(max=BINS - 1)
            hits.mul_(0.999).index_add_(0, bins, (torch.arange(reached) < accepted).float())
            seen.mul_(0.999).index_add_(0, bins, torch.ones(reached))
            if source == "dflash":
                gained.append(accepted)
        if self.drafted:  # the draft keeps its turn while it pays, else it waits 1, 2, 4, ... 64 steps
            step_gain = sum(gained) / max(1, len(rows))
            self.gain = step_gain if self.gain is None else 0.8 * self.gain + 0.2 * step_gain
            used = [k for (source, _), k in zip(self.last, ks, strict=True) if source == "dflash"]
            mean_k = sum(used) / len(used) if used else 0.0
            self.verified = mean_k if self.verified is None else 0.8 * self.verified + 0.2 * mean_k
            if self.wants_draft(len(rows)):
                self.backoff = 1
            else:
                self.wait, self.backoff = self.backoff, min(64, 2 * self.backoff)
