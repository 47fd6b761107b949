"""Adaptive speculation: each step, whether to draft at all and how many drafted tokens to verify, chosen for
the most committed tokens per second on this machine, with n-gram lookup as a free second proposer.

Costs are measured, not assumed: a verify forward over n tokens (all rows together) takes what it took
at that n, else a + b*n seconds fitted to the engine's own timings of speculative steps; a plain step (one token per row) is timed apart,
since going from one token per row to a few costs more than b on CPUs (matrix-vector to matrix-matrix
kernels); a draft call takes d. Acceptance is learned as it happens: the
draft's confidence at a block position (the peak of its distribution there) is mapped to the chance that
the verifier accepts that position, given it reached it, by a calibration table per confidence bin.

- Cut: drafted token i is verified while the chance that tokens 1..i are all accepted, P_i, is worth its
  verify cost: P_i >= b * R, where R = B / plain(B) is the plain decoding rate of the B running rows. Then
  every row is cut to the common length that commits the most per second (a shorter verify can sit below
  a cost step), and the step must beat a plain step: (B + expected accepted) / verify(block tokens) >= R,
  else it verifies nothing (a row exploring, below, still verifies its one token).
- Draft or not, per request: a draft step pays for a row when it is expected to commit more per second
  than a plain step; the running mean gain of the row's past draft steps decides. When it does not pay,
  the row waits (plain, or n-gram where the context repeats) and tries the draft again after 1, 2, 4,
  ... 64 steps. The step drafts when any row is ready. Every request starts ready, with the typical gain
  of all requests as a prior worth one step: one request where the draft does not pay (chat) does not
  make the next one (code, maths) timid. What is a property of the
  machine and the draft (costs, the draft's calibration) is kept across requests; n-gram lookup's
  calibration is the request's own (whether a context repeats is the request's nature), its confidence
  the length of the n-gram that matched, and it starts from what n-gram lookup achieved across requests,
  worth two observations per confidence bin.
- Explore: a row that verified nothing for EXPLORE steps verifies the likeliest first token on offer, so a
  source judged hopeless is measured again (calibration only learns from what is verified). In a batch it
  does so only on a step that verifies drafted tokens anyway: alone, its one token would cost every row one.

Lossless by construction: a prefix of a proposal is a proposal, and every decision depends on the draft's
distributions (their peaks), never on the tokens sampled from them nor on the target's answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from flashdraft.engine.proposers import NOTHING, DFlashProposer, NgramProposer, Proposer
from flashdraft.engine.sequence import Row

BINS = 10
EXPLORE = 16  # a row that verified nothing for this many steps verifies its likeliest drafted token
SPECULATION = ("fixed", "adaptive")  # what `--speculation` offers
DEFAULT_SPECULATION = "adaptive"


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


class Pick(NamedTuple):
    """What a row verifies this step: `tokens` from `source` ("none": nothing), cut to what pays."""

    source: str
    tokens: torch.Tensor
    q: torch.Tensor | None
    conf: torch.Tensor  # the confidences of the tokens kept
    table: Calibration | None  # the calibration that learns from them
    value: float = 0.0  # expected accepted tokens
    exploring: bool = False


NONE = Pick("none", NOTHING, None, torch.zeros(0), None)


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


class StepCost(LinearCost):
    """A LinearCost that also keeps what each size cost (EMA): CPU GEMM kernels take the rows of their
    input in tiles (torch's int8 one by 4: on SmolLM2 a verify of 2-4 tokens costs 1.1 plain steps, of
    5-8 1.6), so the cost rises in steps, and a line through all sizes misprices the sizes beside one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.by_size: dict[float, float] = {}

    def add(self, n: float, seconds: float) -> None:
        super().add(n, seconds)
        old = self.by_size.get(n)
        self.by_size[n] = seconds if old is None else 0.8 * old + 0.2 * seconds


class Calibration:
    """Per confidence bin, the chance that the verifier accepts a drafted token it reached: (accepted,
    reached) counts that decay as new ones come, from a prior of 1 in 2."""

    def __init__(self, prior: Calibration | None = None, weight: float = 2.0):
        """Chances start at 1 in 2, or at `prior`'s, worth `weight` observations per bin."""
        rate = torch.full((BINS,), 0.5) if prior is None else prior.hits / prior.seen
        self.hits, self.seen = rate * weight, torch.full((BINS,), weight)

    @staticmethod
    def bins(conf: torch.Tensor) -> torch.Tensor:
        return (conf.clamp(0, 1) * BINS).long().clamp(max=BINS - 1)

    def chances(self, conf: torch.Tensor) -> torch.Tensor:
        """P_i, the chance that drafted tokens 1..i are all accepted, from per-position confidences."""
        bins = self.bins(conf)
        return torch.cumprod(self.hits[bins] / self.seen[bins], 0)

    def update(self, conf: torch.Tensor, accepted: int) -> None:
        """len(conf) tokens were verified; the first `accepted` were accepted."""
        reached = min(accepted + 1, len(conf))
        bins = self.bins(conf[:reached])
        self.hits.mul_(0.999).index_add_(0, bins, (torch.arange(reached) < accepted).float())
        self.seen.mul_(0.999).index_add_(0, bins, torch.ones(reached))


@dataclass
class RowState:
    """One request's draft-or-not state, and its own n-gram calibration (whether its context repeats is a
    property of the request: code does, chat does not)."""

    gain: float | None = None  # drafted tokens accepted per draft step (running mean, then EMA)
    verified: float | None = None  # drafted tokens verified per draft step (likewise)
    steps: int = 0  # draft steps seen
    wait: int = 0  # steps before the draft is tried again
    backoff: int = 1  # the next wait when the draft does not pay
    idle: int = 0  # steps since the row last verified a proposal
    ngram: Calibration = field(default_factory=Calibration)


class AdaptiveProposer(Proposer):
    """A drafting proposer (`DFlashProposer`, whose draft logits give the confidences) and/or n-gram lookup
    behind the adaptive rule above. The engine tells it how each step went (`observe`); it keeps the costs
    and the calibration across requests, the draft-or-not state per request."""

    def __init__(self, dflash: Proposer | None = None, ngram: NgramProposer | None = None):
        if dflash is None and ngram is None:
            raise ValueError("an adaptive proposer needs a DFlash proposer, n-gram lookup, or both")
        self.dflash, self.ngram = dflash, ngram
        self.block_size = max(p.block_size for p in (dflash, ngram) if p is not None)
        self.feature_layers = dflash.feature_layers if dflash is not None else None
        self.verify_cost = StepCost()  # speculative verify forwards
        self.plain_cost = LinearCost()  # steps that verified no proposal: one token per row
        self.draft_s: float | None = None  # seconds of one draft call (EMA)
        self.calibration = Calibration()  # the draft's, across requests (n-gram lookup's is per request)
        self.ngram_typical = Calibration()  # n-gram lookup's across requests: a new request's prior
        self.rows: dict[Row, RowState] = {}  # the running rows only
        self.typical: RowState = RowState()  # gain and verified of all requests (slow EMA): a new one's prior
        self.last: list[tuple[str, torch.Tensor, Calibration | None]] = []  # per row: what it verified
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

    def costs(self, rows: int) -> tuple[float, float, float] | None:
        """(seconds of a plain step of `rows` rows, a, b of a speculative verify), or None before any timing.
        What is not measured yet comes from what is."""
        spec, plain = self.verify_cost.fit(), self.plain_cost.fit()
        if spec is None and plain is None:
            return None
        a, b = spec or plain
        return (plain[0] + plain[1] * rows if plain else a + b * rows), a, b

    def threshold(self, rows: int) -> float:
        """The chance of acceptance one more verified token must have: b * (plain rate of the batch)."""
        costs = self.costs(rows)
        if costs is None:
            return 0.0
        plain, _, b = costs
        return b * rows / plain

    def verify_s(self, tokens: int) -> float | None:
        """Seconds of a verify forward over `tokens` tokens (all rows together): as measured at that size
        where it was (see `StepCost`), else from the line a + b * tokens."""
        if tokens in self.verify_cost.by_size:
            return self.verify_cost.by_size[tokens]
        costs = self.costs(1)
        return None if costs is None else costs[1] + costs[2] * tokens

    def pays(self, rows: int, gain: float, tokens: int) -> bool:
        """Whether a verify of `tokens` tokens for `rows` rows, expected to accept `gain` drafted tokens,
        commits more per second than a plain step (what the draft cost is already spent)."""
        costs = self.costs(rows)
        if costs is None:
            return True
        return (rows + gain) / self.verify_s(tokens) >= rows / costs[0]

    def cut(self, picks: list[Pick]) -> list[Pick]:
        """Every row cut to the verify length that commits the most per second, since a shorter verify can
        sit below a cost step; a plain step (but for rows that explore) when no length beats one."""
        rows, longest = len(picks), max(len(p.tokens) for p in picks)
        if not longest:
            return picks
        chances = [p.table.chances(p.conf) if len(p.tokens) else torch.zeros(0) for p in picks]
        sums = [[0.0, *c.cumsum(0).tolist()] for c in chances]  # expected accepted, by length: once per row
        best, best_gain, best_rate = longest, sum(p.value for p in picks), 0.0
        for length in range(1, longest + 1):
            gain = sum(x[min(length, len(x) - 1)] for x in sums)
            seconds = self.verify_s(rows * (1 + length))
            if seconds is not None and (rows + gain) / seconds > best_rate:
                best, best_gain, best_rate = length, gain, (rows + gain) / seconds
        if not self.pays(rows, best_gain, rows * (1 + best)):
            # An exploring row verifies its token on its own only at batch 1: the verify pads every row to
            # the longest, so in a batch it would make all rows verify one more token (B=16: 0.78x plain).
            return [p if p.exploring and rows == 1 else NONE for p in picks]
        return [
            p if len(p.tokens) <= best else _trim(p, c, best) for p, c in zip(picks, chances, strict=True)
        ]

    def wants_draft(self, state: RowState, rows: int) -> bool:
        """Whether draft steps are expected to commit more per second than plain ones, for a row whose
        neighbours fare as it does."""
        if self.dflash is None:
            return False
        costs = self.costs(rows)
        if state.gain is None or self.draft_s is None or costs is None:
            return True  # nothing measured yet
        plain = costs[0]
        tokens = rows * (1 + state.verified)  # the costs at the neighbouring sizes, interpolated
        lo, hi = self.verify_s(int(tokens)), self.verify_s(int(tokens) + 1)
        verify = lo + (hi - lo) * (tokens - int(tokens))
        return (1 + state.gain) / (self.draft_s + verify) > 1 / plain

    def propose(self, rows, ks):
        batch = len(rows)  # a new request's prior depends on the batch it joins
        self.rows = {r: self.rows.get(r) or self._new_row(batch) for r in rows}  # by Row: ids may be reused
        states = list(self.rows.values())
        self.drafted = self.dflash is not None and any(s.wait == 0 for s in states)
        for s in states:
            s.wait = max(0, s.wait - 1)
        ng = None
        if self.ngram is not None:
            ng = [self.ngram.lookup(r, k) if k else (NOTHING, 0) for r, k in zip(rows, ks, strict=True)]
        df = self.dflash.propose(rows, ks) if self.drafted else None
        theta = self.threshold(len(rows))
        picks = []
        for b, (row, k) in enumerate(zip(rows, ks, strict=True)):
            st, options = self.rows[row], []
            if ng is not None and len(ng[b][0]):
                # n-gram confidence: the length of the n-gram that matched (a longer match repeats more often)
                conf = torch.full((len(ng[b][0]),), ng[b][1] / (self.ngram.max_ngram + 1))
                options.append(("ngram", ng[b][0], None, conf, st.ngram))
            if df is not None and k:
                tokens, q = df[b]
                options.append(("dflash", tokens, q, self._confidence(b, k, q), self.calibration))
            picks.append(self._choose(options, theta, st))
        picks = self.cut(picks)
        out, self.last = [], []
        for row, p in zip(rows, picks, strict=True):
            self._settle(self.rows[row], p.source)
            if p.source != "none":
                self.stats[f"{p.source}_rows"] += 1
            out.append((p.tokens, p.q))
            self.last.append((p.source, p.conf, p.table))
        self.stats["draft_steps" if self.drafted else "skipped_steps"] += 1
        return out

    def _new_row(self, rows: int) -> RowState:
        """A request starts ready to draft, with what draft steps typically gained as its prior: one
        observation's worth, so its own first steps soon outweigh it. Where the draft typically does not
        pay, a first step that confirms it waits EXPLORE steps, not 1, 2, 4, ...: a short chat request
        would otherwise spend several draft calls to learn what the requests before it showed. Its n-gram
        calibration starts from all requests' (two observations per bin)."""
        st = RowState(
            gain=self.typical.gain, verified=self.typical.verified, ngram=Calibration(self.ngram_typical)
        )
        if st.gain is not None and not self.wants_draft(st, rows):
            st.backoff = EXPLORE
        return st

    @staticmethod
    def _choose(options, theta: float, st: RowState):
        """The option expected to commit the most drafted tokens, cut where one more token stops paying
        (chance < theta).
        A row that verified nothing for EXPLORE steps verifies the likeliest first token of its options,
        so that a source judged hopeless (whose calibration nothing would update) gets another chance:
        about 1/EXPLORE of one token's verify cost."""
        best, first = NONE, []
        for source, tokens, q, conf, table in options:
            p = table.chances(conf)
            keep = int((p >= theta).long().cumprod(0).sum())
            value = float(p[:keep].sum())
            first.append(float(p[0]))
            if keep and value > best.value:
                best = Pick(
                    source, tokens[:keep], None if q is None else q[:, :keep], conf[:keep], table, value
                )
        if best.value == 0.0 and options and st.idle >= EXPLORE:
            source, tokens, q, conf, table = options[first.index(max(first))]
            best = Pick(
                source, tokens[:1], None if q is None else q[:, :1], conf[:1], table, max(first), True
            )
        return best

    @staticmethod
    def _settle(st: RowState, source: str) -> None:
        """The row's idle count after the step verified `source` ("none": nothing)."""
        st.idle = 0 if source != "none" else st.idle + 1

    def _confidence(self, b: int, k: int, q: torch.Tensor | None) -> torch.Tensor:
        """The peak of the distribution each position was drafted from (never the sampled token's own q).
        A proposer with neither q nor logits (a test oracle) gets one bin."""
        logits = getattr(self.dflash, "last_logits", None)
        if q is None and logits is None:
            return torch.full((k,), 0.5)
        dist = q[0] if q is not None else torch.softmax(logits[b, :k].float(), -1)
        return dist.max(-1).values.float().cpu()

    def observe(self, rows, ks, n, draft_s: float, verify_s: float, verify_tokens: int) -> None:
        """After the verify: row b verified ks[b] drafted tokens and committed n[b]."""
        (self.plain_cost if verify_tokens == len(rows) else self.verify_cost).add(verify_tokens, verify_s)
        if self.drafted:
            self.draft_s = draft_s if self.draft_s is None else 0.9 * self.draft_s + 0.1 * draft_s
        for (source, conf, table), k, got in zip(self.last, ks, n, strict=True):
            if source != "none" and k:
                table.update(conf, min(got - 1, k))
                if source == "ngram":
                    self.ngram_typical.update(conf, min(got - 1, k))
        if not self.drafted:
            return
        # Every row saw the draft: each keeps its turn while the draft pays for it, else waits 1, 2, 4, ... 64.
        for row, (source, _, _), k, got in zip(rows, self.last, ks, n, strict=True):
            st = self.rows[row]
            gain, used = (min(got - 1, k), k) if source == "dflash" else (0, 0)
            st.steps += 1
            _average(st, gain, used, max(0.2, 1 / (st.steps + 1)))
            _average(self.typical, gain, used, 0.05)
            if self.wants_draft(st, len(rows)):
                st.wait, st.backoff = 0, 1
            elif st.wait == 0:
                st.wait, st.backoff = st.backoff, min(64, 2 * st.backoff)


def _trim(p: Pick, chances: torch.Tensor, length: int) -> Pick:
    """The pick's first `length` tokens, with their expected accepted count."""
    q = None if p.q is None else p.q[:, :length]
    value = float(chances[:length].sum())
    return p._replace(tokens=p.tokens[:length], q=q, conf=p.conf[:length], value=value)


def _average(st: RowState, gain: float, verified: float, weight: float) -> None:
    """Move st's gain and verified towards one draft step's, by `weight` (all the way when unset)."""
    w = 1.0 if st.gain is None else weight
    st.gain = gain if st.gain is None else (1 - w) * st.gain + w * gain
    st.verified = verified if st.verified is None else (1 - w) * st.verified + w * verified
