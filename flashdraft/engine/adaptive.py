"""Adaptive speculation: each step, whether to draft at all and how many drafted tokens to verify, chosen for
the most committed tokens per second on this machine, with n-gram lookup as a free second proposer for a
request alone (in a batch a verified token costs about a plain one on a CPU, and n-gram matches were
accepted too rarely to pay there: docs/speed.md).

Costs are measured, not assumed: a verify forward over n tokens (all rows together) takes what it took
at that n, else a + b*n seconds fitted to the engine's own timings of speculative steps; a plain step (one
token per row) is timed apart, since going from one token per row to a few costs more than b on CPUs
(matrix-vector to matrix-matrix kernels); a draft call takes d + e*m for the m tokens it runs (the rows'
blocks and the context they committed since the last call: after many plain steps, catching up costs more
than drafting). Acceptance is learned as it happens: the draft's confidence at a block position (the peak
of its distribution there) is mapped to the chance that the verifier accepts that position, given it
reached it, by a calibration table per confidence bin.

- Cut: drafted token i is verified while the chance that tokens 1..i are all accepted, P_i, is worth its
  verify cost: P_i >= b * R, where R = B / plain(B) is the plain decoding rate of the B running rows. Then
  every row is cut to the common length that commits the most per second (a shorter verify can sit below
  a cost step), and the step must beat a plain step: (B + expected accepted) / verify(block tokens) >= R,
  else it verifies nothing (a row exploring, below, still verifies its one token).
- Depth: a draft call drafts one block position more than the deepest DFlash cut of its last DEPTH_MEMORY
  draft steps (the whole block before a request alone has cut any): its cost grows with the positions it
  drafts, and a cut that keeps them all lets the next call go one deeper.
- Draft or not: a draft call serves every row of the batch at once, so the batch decides: the step drafts
  when the rows' expected gains together (each the running mean of its own past draft steps) are worth
  the draft call and the longer verify, against a plain step of the batch. When they are not, the batch
  steps plain (alone: or n-gram where a context repeats) and tries the draft again after 1, 2, 4, ... 64
  steps, and every row updates its gain from that probe. In a batch, a probe also waits for credit: what draft
  steps won against plain decoding plus PROBE_BUDGET of the time, less what they lost, so that where
  drafting never pays (chat at batch 4-16 on a CPU, where a verify's cost grows with its tokens) probes
  cost at most that share of the run. A probe is made only where a draft step could pay at
  all (every drafted token accepted) against the draft call as priced now, catch-up included: at 16 rows
  the first draft call reads every prompt. In a batch a probe waits until the credit covers what it
  loses if nothing is accepted: its draft call and a verify of one drafted token a row (`probe_loss`).
  A request starts with the typical gain of all requests as its prior, worth one step (a row never
  measured counts as accepting whole blocks; in a batch, drafting on that alone is a probe); alone in the batch it
  starts a fresh probe schedule, its first step a draft step, so one request where the draft does not
  pay (chat) does not make the next one (code, maths) timid. Joining a batch it waits for the batch's
  next probe: there a probe drafts for every row, and one row's first step must not cost the whole
  batch a draft call. What is a property of the
  machine and the draft (costs, the draft's calibration) is kept across requests; n-gram lookup's
  calibration is the request's own (whether a context repeats is the request's nature), its confidence
  the length of the n-gram that matched, and it starts from what n-gram lookup achieved across requests,
  worth two observations per confidence bin.
- Explore: a row that verified nothing for EXPLORE steps verifies the likeliest first token on offer, so a
  source judged hopeless is measured again (calibration only learns from what is verified). In a batch it
  does so only on a step that verifies drafted tokens anyway: its one token would cost every row one on
  a padded verify, and about a plain token even on a ragged one.

Lossless by construction: a prefix of a proposal is a proposal, and every decision depends on the draft's
distributions (their peaks), never on the tokens sampled from them nor on the target's answer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple

import torch

from flashdraft.engine.proposers import NOTHING, DFlashProposer, NgramProposer, Proposer
from flashdraft.engine.sequence import Row

BINS = 10
# The share of its time a batch where drafting never pays may spend on probes (`credit`). At 2%, probes
# whose credit covered only their draft call cost chat at batch 4 3.5% (a verify of every row's drafts
# costs more than a plain step, and a draft call after many plain steps catches up with their context).
PROBE_BUDGET = 0.005
CREDIT_STEPS = 64  # the most credit kept, in plain steps of the batch
EXPLORE = 16  # a row that verified nothing for this many steps verifies its likeliest drafted token
SPECULATION = ("fixed", "adaptive", "tree")  # what `--speculation` offers
DEFAULT_SPECULATION = "adaptive"
TREE_NODES = 4  # drafted tokens per tree (docs/speed.md, "Tree verification at run time")
DEPTH_MEMORY = 8  # draft steps whose deepest DFlash cut sets the next draft call's depth


def make_proposer(
    draft,
    target,
    proposal: str = "draft",
    speculation: str = DEFAULT_SPECULATION,
    tree_nodes: int = TREE_NODES,
) -> Proposer | None:
    """What the verbs run for a draft: DFlash at a fixed block size ("fixed"), DFlash trees of `tree_nodes`
    tokens from the block's marginals ("tree", `flashdraft.engine.tree`), or DFlash and n-gram lookup
    behind the adaptive rule ("adaptive"). No draft: None (plain decoding)."""
    if speculation not in SPECULATION:
        raise ValueError(f"speculation must be one of {', '.join(SPECULATION)}, got {speculation!r}")
    if tree_nodes < 1:
        raise ValueError(f"tree_nodes must be >= 1, got {tree_nodes}")
    if draft is None:
        return None
    if speculation == "tree":
        return DFlashProposer(draft, target, proposal, tree=tree_nodes)
    dflash = DFlashProposer(draft, target, proposal)
    if speculation == "fixed":
        return dflash
    return AdaptiveProposer(dflash, NgramProposer(block_size=dflash.block_size))


class Pick(NamedTuple):
    """What a row verifies this step: `tokens` from `source` ("none": nothing), cut to what pays."""

    source: str
    tokens: torch.Tensor
    q: torch.Tensor | None
    conf: list[float]  # the confidences of the tokens kept
    table: Calibration | None  # the calibration that learns from them
    value: float = 0.0  # expected accepted tokens
    exploring: bool = False


NONE = Pick("none", NOTHING, None, [], None)


class LinearCost:
    """seconds(n) = a + b*n by exponentially weighted least squares (recent timings count most)."""

    def __init__(self, halflife: float = 64.0, prior_b_over_a: float = 0.08):
        self.decay = 0.5 ** (1 / halflife)
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.prior = prior_b_over_a
        # fit()'s answer until the next add (asked ~70 times a step)
        self._fit: tuple[float, float] | None = None

    def add(self, n: float, seconds: float) -> None:
        self._fit = None
        d = self.decay
        self.w, self.sx, self.sy = self.w * d + 1, self.sx * d + n, self.sy * d + seconds
        self.sxx, self.sxy = self.sxx * d + n * n, self.sxy * d + n * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before the first timing. With one size of forward seen so far, b comes from
        the prior ratio b/a."""
        if self._fit is None and self.w:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float]:
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
    5-8 1.6), so the cost rises in steps, and a line through all sizes misprices the sizes beside one.
    Kept by rows too: 9 tokens of one row (a batch's drained tail) cost less than 8 rows' anchors and
    one drafted token (each row's cache is read in the attention)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.by_size: dict[tuple[int, float], float] = {}  # (rows, tokens) -> seconds

    def add(self, n: float, seconds: float, rows: int = 1) -> None:
        super().add(n, seconds)
        old = self.by_size.get((rows, n))
        self.by_size[rows, n] = seconds if old is None else 0.8 * old + 0.2 * seconds


class Calibration:
    """Per confidence bin, the chance that the verifier accepts a drafted token it reached: (accepted,
    reached) counts that decay as new ones come, from a prior of 1 in 2. Plain Python floats: a step asks
    every row's tables a few questions of at most a block's length, where tensor ops would cost more in
    dispatch (about 0.2 ms a row and step) than the arithmetic."""

    def __init__(self, prior: Calibration | None = None, weight: float = 2.0):
        """Chances start at 1 in 2, or at `prior`'s, worth `weight` observations per bin."""
        rates = (
            [0.5] * BINS if prior is None else [h / n for h, n in zip(prior.hits, prior.seen, strict=True)]
        )
        self.hits, self.seen = [r * weight for r in rates], [weight] * BINS

    @staticmethod
    def bin(conf: float) -> int:
        return min(int(min(max(conf, 0.0), 1.0) * BINS), BINS - 1)

    def chances(self, conf: list[float]) -> list[float]:
        """P_i, the chance that drafted tokens 1..i are all accepted, from per-position confidences."""
        out, p = [], 1.0
        for c in conf:
            b = self.bin(c)
            p *= self.hits[b] / self.seen[b]
            out.append(p)
        return out

    def update(self, conf: list[float], accepted: int) -> None:
        """len(conf) tokens were verified; the first `accepted` were accepted."""
        self.hits = [h * 0.999 for h in self.hits]
        self.seen = [n * 0.999 for n in self.seen]
        for i, c in enumerate(conf[: accepted + 1]):
            b = self.bin(c)
            self.hits[b] += i < accepted
            self.seen[b] += 1


@dataclass
class RowState:
    """What one request's draft steps gained, and its own n-gram calibration (whether its context repeats
    is a property of the request: code does, chat does not)."""

    gain: float | None = None  # drafted tokens accepted per draft step (running mean, then EMA)
    verified: float | None = None  # drafted tokens verified per draft step (likewise)
    steps: int = 0  # draft steps seen
    idle: int = 0  # steps since the row last verified a proposal
    ngram: Calibration = field(default_factory=Calibration)


class AdaptiveProposer(Proposer):
    """A drafting proposer (`DFlashProposer`, whose draft logits give the confidences) and/or n-gram lookup
    behind the adaptive rule above. The engine tells it how each step went (`observe`); it keeps the costs
    and the calibration across requests, what each request's draft steps gained, and the batch's probe
    schedule."""

    def __init__(
        self, dflash: Proposer | None = None, ngram: NgramProposer | None = None, trees: bool = True
    ):
        if dflash is None and ngram is None:
            raise ValueError("an adaptive proposer needs a DFlash proposer, n-gram lookup, or both")
        self.dflash, self.ngram = dflash, ngram
        # greedy rows' DFlash chains verified as trees of as many tokens (`_tree`), where the draft offers them
        self.trees = trees and hasattr(dflash, "tree_of")
        # whether the target verifies each row's own tokens only (`BatchState.ragged`): then a row's
        # drafts cost their own tokens, not one more token for every row of the batch
        self.ragged = bool(getattr(getattr(dflash, "target", None), "ragged", False))
        self.block_size = max(p.block_size for p in (dflash, ngram) if p is not None)
        self.feature_layers = dflash.feature_layers if dflash is not None else None
        self.verify_cost = StepCost()  # speculative verify forwards
        self.plain_cost = LinearCost()  # steps that verified no proposal: one token per row
        self.prefill_cost = LinearCost()  # prefills: the only forwards timed before the first step
        self.draft_cost = LinearCost()  # draft calls, by the tokens they ran (`Proposer.draft_tokens`)
        # seconds a verified token costs beyond a plain step of the same rows (EMA; `verify_s`)
        self.per_token: float | None = None
        self.draft_tokens = 0  # what this step's draft call runs
        self.calibration = Calibration()  # the draft's, across requests (n-gram lookup's is per request)
        self.ngram_typical = Calibration()  # n-gram lookup's across requests: a new request's prior
        self.rows: dict[Row, RowState] = {}  # the running rows only
        self.typical: RowState = RowState()  # gain and verified of all requests (slow EMA): a new one's prior
        self.wait = 0  # steps before the draft is tried again, where it does not pay
        self.backoff = 1  # the next wait when a probe shows the draft still does not pay
        # Seconds the next probe may lose (`_account`): what draft steps won, plus PROBE_BUDGET of all time
        self.credit = 0.0
        # per row: what it verified (source, confidences, calibration, and a tree's chain, else None)
        self.last: list[tuple[str, list[float], Calibration | None, list[int] | None]] = []
        self.drafted = False
        self.cuts: deque[int] = deque(maxlen=DEPTH_MEMORY)  # the last DFlash cuts (`depth`)
        self.stats = {"draft_steps": 0, "skipped_steps": 0, "ngram_rows": 0, "dflash_rows": 0, "tree_rows": 0}

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
        What is not measured yet comes from what is. Before the first verify, one costs a plain step plus,
        per token beyond one a row, b: the prefills' cost per token (a plain fit has no slope in tokens,
        its steps all had one a row; at batch 15-16 it priced a verify of 120 tokens like a plain step)."""
        spec, plain = self.verify_cost.fit(), self.plain_cost.fit()
        pre = self.prefill_cost.fit() if spec is None else None  # needed only until a verify is timed
        base = plain or spec or pre
        if base is None:
            return None
        plain_s = base[0] + base[1] * rows
        if spec is not None:
            return plain_s, *spec
        b = (pre or base)[1]
        return plain_s, plain_s - b * rows, b

    def threshold(self, rows: int) -> float:
        """The chance of acceptance one more verified token must have: b * (plain rate of the batch), b
        what a token costs beyond a plain step (`per_token`, else the verify line's slope)."""
        costs = self.costs(rows)
        if costs is None:
            return 0.0
        plain, _, b = costs
        return (self.per_token or b) * rows / plain

    def verify_s(self, tokens: int, rows: int = 1) -> float | None:
        """Seconds of a verify forward over `tokens` tokens (`rows` rows together): as measured at that size
        and batch where it was (see `StepCost`), else from the line a + b * tokens."""
        if (rows, tokens) in self.verify_cost.by_size:
            return self.verify_cost.by_size[rows, tokens]
        costs = self.costs(rows)
        if costs is not None and self.per_token is not None:
            return costs[0] + self.per_token * (tokens - rows)  # a plain step of these rows, and the rest
        return None if costs is None else costs[1] + costs[2] * tokens

    def pays(self, rows: int, gain: float, tokens: int) -> bool:
        """Whether a verify of `tokens` tokens for `rows` rows, expected to accept `gain` drafted tokens,
        commits more per second than a plain step (what the draft cost is already spent)."""
        costs = self.costs(rows)
        if costs is None:
            return True
        return (rows + gain) / self.verify_s(tokens, rows) >= rows / costs[0]

    def cut(self, picks: list[Pick]) -> list[Pick]:
        """Every row cut to the verify length that commits the most per second, since a shorter verify can
        sit below a cost step; a plain step (but for rows that explore) when no length beats one."""
        rows, longest = len(picks), max(len(p.tokens) for p in picks)
        if not longest:
            return picks
        chances = [p.table.chances(p.conf) if len(p.tokens) else [] for p in picks]
        sums = [[0.0, *accumulate(c)] for c in chances]  # expected accepted, by length: once per row
        best, best_gain, best_rate, best_tokens = longest, sum(p.value for p in picks), 0.0, 0
        for length in range(1, longest + 1):
            gain = sum(x[min(length, len(x) - 1)] for x in sums)
            tokens = self.verified(picks, length)
            seconds = self.verify_s(tokens, rows)
            if seconds is not None and (rows + gain) / seconds > best_rate:
                best, best_gain, best_rate, best_tokens = length, gain, (rows + gain) / seconds, tokens
        if not self.pays(rows, best_gain, best_tokens or self.verified(picks, best)):
            # An exploring row verifies its token on its own only alone: a padded verify would make all
            # rows verify one more token (B=16: 0.78x plain), and even a ragged one costs about a plain
            # token a row from 4 rows on (the verify is bound by its arithmetic), so rows exploring every
            # EXPLORE steps would cost the batch ~B/EXPLORE tokens a step (B=8: 0.90x plain).
            return [p if p.exploring and rows == 1 else NONE for p in picks]
        return [
            p if len(p.tokens) <= best else _trim(p, c, best) for p, c in zip(picks, chances, strict=True)
        ]

    def verified(self, picks: list[Pick], length: int) -> int:
        """Tokens a verify computes with every row cut to `length`: each row's own on a ragged target,
        else every row padded to the longest."""
        if self.ragged:
            return sum(1 + min(length, len(p.tokens)) for p in picks)
        return len(picks) * (1 + min(length, max(len(p.tokens) for p in picks)))

    def draft_s(self, tokens: int) -> float | None:
        """Seconds of a draft call over `tokens` tokens: the line fitted to the draft calls timed; before
        the first, the prefills' line scaled by the draft's relative cost per token; else None."""
        fit = self.draft_cost.fit()
        if fit is None:
            ratio, pre = getattr(self.dflash, "relative_cost", None), self.prefill_cost.fit()
            if ratio is None or pre is None:
                return None
            fit = (ratio * pre[0], ratio * pre[1])
        return fit[0] + fit[1] * tokens

    def wants_draft(self, states: list[RowState], draft_s: float | None) -> bool:
        """Whether a draft step is expected to commit more per second than a plain step for these rows: their
        expected gains together against the draft call (`draft_s` seconds) and the verify of their expected
        lengths. A row not measured yet counts as accepting a whole block."""
        if self.dflash is None:
            return False
        whole = self.block_size - 1
        gain = sum(whole if s.gain is None else s.gain for s in states)
        tokens = len(states) + sum(whole if s.gain is None else s.verified for s in states)
        return self._draft_pays(len(states), gain, tokens, draft_s)

    def _draft_pays(self, rows: int, gain: float, tokens: float, draft_s: float | None) -> bool:
        """Whether a draft call of `draft_s` seconds and a verify of `tokens` tokens (a mean: the costs at
        the neighbouring sizes interpolated) that accepts `gain` drafted tokens beat a plain step."""
        costs = self.costs(rows)
        if draft_s is None or costs is None:
            return True  # nothing measured yet
        lo, hi = self.verify_s(int(tokens), rows), self.verify_s(int(tokens) + 1, rows)
        verify = lo + (hi - lo) * (tokens - int(tokens))
        return (rows + gain) / (draft_s + verify) > rows / costs[0]

    def could_pay(self, rows: int, draft_s: float | None) -> bool:
        """Whether a draft step could beat a plain step at all: every drafted token accepted, at the best
        verify length, against the draft call as priced now (its catch-up with the context the rows
        committed since the last call included). A probe that could not pay even so is not made: at 16
        rows a fresh proposer's first draft call read every prompt (0.1-0.6 s against a 41 ms step)."""
        return self.dflash is not None and any(
            self._draft_pays(rows, rows * j, rows * (1 + j), draft_s) for j in range(1, self.block_size)
        )

    def probe_loss(self, rows: int, draft_s: float | None) -> float:
        """What a probe of `rows` rows loses against a plain step when nothing is accepted: its draft call
        and a verify of one drafted token a row, the least it verifies to measure each row."""
        costs = self.costs(rows)
        verify = self.verify_s(2 * rows, rows) if costs is not None else None
        return (draft_s or 0.0) + (0.0 if verify is None else max(0.0, verify - costs[0]))

    def depth(self) -> int:
        """Block positions the next draft call drafts: one more than the deepest DFlash cut of the last
        DEPTH_MEMORY draft steps (so it grows by one whenever a cut keeps them all), the whole block
        before any. A shallower call costs less (the shipped draft at batch 1: 1.4 ms for 3 positions,
        1.9 for 7) and drafts its first positions as well (offline, held-out sets: 0.519 / 0.228 /
        0.109 of steps accepted positions 1 / 2 / 3 drafting 3, 0.519 / 0.222 / 0.101 drafting 7)."""
        if not self.cuts:
            return self.block_size - 1
        return min(self.block_size - 1, max(2, max(self.cuts) + 1))

    def propose(self, rows, ks):
        alone = len(rows) == 1 and rows[0] not in self.rows  # a request alone: a fresh probe schedule, depth
        if alone:
            self.cuts.clear()
        depth = self.depth()
        full_ks, ks = ks, [min(k, depth) for k in ks]  # n-gram lookup: the full block; DFlash: `depth`
        self.draft_tokens = 0 if self.dflash is None else self.dflash.draft_tokens(ks)
        draft_s = self.draft_s(self.draft_tokens)
        if alone:
            self.rows = {rows[0]: self._new_row()}
            self.wait, self.backoff = 0, (1 if self.wants_draft([self.rows[rows[0]]], draft_s) else EXPLORE)
        self.rows = {r: self.rows.get(r) or self._new_row() for r in rows}  # by Row: ids may be reused
        # Alone, a request probes on its schedule: its first draft step reads its prompt, an investment a
        # row that drafts pays back (humaneval: tau 1.92 -> 1.55 when its probes waited for credit).
        # In a batch a probe waits until the credit covers what it would lose, and so does a draft step on no
        # evidence (a row never measured counts as accepting whole blocks): a fresh proposer's first draft
        # call at batch 4 read every prompt (4 plain steps) and left the rows' slots unaligned for the
        # rest of a short run (0.94x plain on 16 chat prompts).
        paid = len(rows) == 1 or self.credit >= self.probe_loss(len(rows), draft_s)
        probe = self.wait == 0 and paid and self.could_pay(len(rows), draft_s)
        states = list(self.rows.values())
        # While the batch waits out its backoff, its rows' gains are those its last draft step judged not
        # to pay (a gain changes only on a draft step): no need to weigh them again every step.
        evidence = self.wait == 0 and (paid or all(s.gain is not None for s in states))
        self.drafted = self.dflash is not None and (probe or (evidence and self.wants_draft(states, draft_s)))
        self.wait = max(0, self.wait - 1)
        if not self.drafted and len(rows) > 1:
            # A batch that does not draft has nothing to verify (n-gram lookup serves a row alone): every
            # row just counts an idle step, as the loop below would, without its per-row work.
            for st in states:
                self._settle(st, NONE.source)
            self.last = [(NONE.source, NONE.conf, NONE.table, None)] * len(rows)
            self.stats["skipped_steps"] += 1
            return [(NONE.tokens, NONE.q)] * len(rows)
        theta = self.threshold(len(rows))
        ng = None
        if self.ngram is not None and len(rows) == 1:
            # Alone only: in a batch a verified token costs about what a plain one does (the verify is
            # bound by its arithmetic from 4 rows on) and n-gram tokens are accepted too rarely to pay
            # (humaneval, 64 prompts at batch 8: 65% of them, 0.95x plain; without them 1.00x).
            ng = [self.ngram.lookup(rows[0], full_ks[0]) if full_ks[0] else (NOTHING, 0)]
        df = self.dflash.propose(rows, ks) if self.drafted else None
        picks = []
        for b, (row, k) in enumerate(zip(rows, ks, strict=True)):
            st, options = self.rows[row], []
            if ng is not None and len(ng[b][0]):
                # n-gram confidence: the length of the n-gram that matched (a longer match repeats more often)
                conf = [ng[b][1] / (self.ngram.max_ngram + 1)] * len(ng[b][0])
                options.append(("ngram", ng[b][0], None, conf, st.ngram))
            if df is not None and k:
                tokens, q = df[b]
                options.append(("dflash", tokens, q, self._confidence(b, k, q), self.calibration))
            picks.append(self._choose(options, theta, st))
        picks = self.cut(picks)
        out, self.last = [], []
        for b, (row, p) in enumerate(zip(rows, picks, strict=True)):
            self._settle(self.rows[row], p.source)
            if p.source != "none":
                self.stats[f"{p.source}_rows"] += 1
            shaped = self._tree(b, row, p, ks[b])
            out.append(shaped or (p.tokens, p.q))
            self.last.append((p.source, p.conf, p.table, p.tokens.tolist() if shaped else None))
        self.stats["draft_steps" if self.drafted else "skipped_steps"] += 1
        return out

    def _tree(self, b: int, row: Row, p: Pick, k: int):
        """The pick as a tree of as many tokens, where it is a greedy row's DFlash chain of 2 or more and
        the tree differs: the same verify cost, the likeliest paths by the draft's marginals instead of
        the argmax of each position (tau 1.88 against 1.75 for 3 tokens, docs/speed.md). The cut itself
        stays a chain's: what the calibration knows."""
        n = len(p.tokens)
        if not (self.trees and p.source == "dflash" and n >= 2 and row.sampling.greedy):
            return None
        drafted = self.dflash.tree_of(b, min(k, n), n)
        if drafted.parents == list(range(-1, n - 1)):
            return None
        self.stats["tree_rows"] += 1
        return torch.tensor(drafted.tokens, dtype=torch.long), None, drafted

    def _new_row(self) -> RowState:
        """A request starts with what draft steps typically gained as its prior: one observation's worth, so
        its own first steps soon outweigh it. Its n-gram calibration starts from all requests' (two
        observations per bin)."""
        return RowState(
            gain=self.typical.gain, verified=self.typical.verified, ngram=Calibration(self.ngram_typical)
        )

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
            keep = next((i for i, x in enumerate(p) if x < theta), len(p))
            value = sum(p[:keep])
            first.append(p[0])
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

    def _confidence(self, b: int, k: int, q: torch.Tensor | None) -> list[float]:
        """The peak of the distribution each position was drafted from (never the sampled token's own q).
        A proposer with neither q nor logits (a test oracle) gets one bin."""
        if q is not None:
            return q[0].max(-1).values.float().cpu().tolist()
        marginals = self.dflash.marginals()  # made once per draft call, shared with the rows' trees
        if marginals is None:
            return [0.5] * k
        return marginals[b, :k].max(-1).values.cpu().tolist()

    def timed(self, tokens: int, seconds: float) -> None:
        """A prefill is a forward like a verify: its timing prices the first step's verify (at batch 16, a
        fresh proposer verified every row's whole block on its first step: 4-6 plain steps). Only until a
        verify is timed: a prefill's many tokens cost less each than a verify's few, so its line would
        price small verifies too low."""
        self.prefill_cost.add(tokens, seconds)

    def observe(self, rows, ks, n, draft_s: float, verify_s: float, verify_tokens: int) -> None:
        """After the verify: row b verified ks[b] drafted tokens and committed n[b]."""
        if verify_tokens == len(rows):
            self.plain_cost.add(verify_tokens, verify_s)
        else:
            self.verify_cost.add(verify_tokens, verify_s, len(rows))
            # What the tokens beyond one a row cost beyond a plain step of these rows: a line through
            # verifies of every batch size priced 8 rows' verifies by the drained tail's one-row ones (a
            # token at 0.5 ms where it cost 1.2-1.5 on the CPU of docs/speed.md).
            costs = self.costs(len(rows))
            if costs is not None:
                extra = max(0.0, verify_s - costs[0]) / (verify_tokens - len(rows))
                self.per_token = extra if self.per_token is None else 0.9 * self.per_token + 0.1 * extra
        self._account(len(rows), sum(n), draft_s + verify_s)
        if self.drafted:
            self.draft_cost.add(self.draft_tokens, draft_s)
        for row, (source, conf, table, chain), k, got in zip(rows, self.last, ks, n, strict=True):
            if source != "none" and k:
                # A tree's row: what its chain would have accepted (the committed tokens against the chain's)
                accepted = min(got - 1, k) if chain is None else _leading(row.tokens[-got:], chain)
                table.update(conf, accepted)
                if source == "ngram":
                    self.ngram_typical.update(conf, accepted)
        if not self.drafted:
            return
        # Every row saw the draft: each learns what it gained; the batch keeps drafting while that pays,
        # else waits 1, 2, 4, ... 64 steps before the next probe.
        self.cuts.extend(k for (source, *_), k in zip(self.last, ks, strict=True) if source == "dflash")
        for row, (source, *_), k, got in zip(rows, self.last, ks, n, strict=True):
            st = self.rows[row]
            gain, used = (min(got - 1, k), k) if source == "dflash" else (0, 0)
            st.steps += 1
            _average(st, gain, used, max(0.2, 1 / (st.steps + 1)))
            _average(self.typical, gain, used, 0.05)
        next_call = self.draft_s(self.dflash.draft_tokens(ks))  # the context is what this step committed
        if self.wants_draft([self.rows[r] for r in rows], next_call):
            self.wait, self.backoff = 0, 1
        else:
            self.wait, self.backoff = self.backoff, min(64, 2 * self.backoff)

    def _account(self, rows: int, committed: int, seconds: float) -> None:
        """The probes' purse (see `credit`): every step adds PROBE_BUDGET of its time, a draft step what it
        won (or lost) against plain decoding's time for its `committed` tokens; capped at CREDIT_STEPS
        plain steps, so that winnings long past do not pay for probes in a batch where drafting loses."""
        costs = self.costs(rows)
        if costs is None:
            return
        self.credit += PROBE_BUDGET * seconds
        if self.drafted:
            self.credit += costs[0] * committed / rows - seconds
        self.credit = min(self.credit, CREDIT_STEPS * costs[0])


def _leading(committed: list[int], chain: list[int]) -> int:
    """How many of the chain's tokens the committed tokens begin with."""
    return next(
        (i for i, (a, b) in enumerate(zip(committed, chain, strict=False)) if a != b),
        min(len(committed), len(chain)),
    )


def _trim(p: Pick, chances: list[float], length: int) -> Pick:
    """The pick's first `length` tokens, with their expected accepted count."""
    q = None if p.q is None else p.q[:, :length]
    value = sum(chances[:length])
    return p._replace(tokens=p.tokens[:length], q=q, conf=p.conf[:length], value=value)


def _average(st: RowState, gain: float, verified: float, weight: float) -> None:
    """Move st's gain and verified towards one draft step's, by `weight` (all the way when unset)."""
    w = 1.0 if st.gain is None else weight
    st.gain = gain if st.gain is None else (1 - w) * st.gain + w * gain
    st.verified = verified if st.verified is None else (1 - w) * st.verified + w * verified
