"""Adaptive speculation (`flashdraft.engine.adaptive`): lossless whatever it decides (greedy equality in float64,
sampling against exact enumeration), and its decisions follow the measured costs and acceptance: a
useless draft is mostly skipped, a perfect proposer keeps drafting long blocks."""

import math
import random

import numpy as np
import pytest
import torch
from conftest import make_draft, make_hf_model
from test_batch import V, chi2_pvalue, exact_joint
from test_decode import OracleProposer
from test_sampling import sample_joint

from flashdraft import (
    DFlashProposer,
    GenerationConfig,
    NgramProposer,
    Proposer,
    SamplingConfig,
    Target,
    generate,
    generate_batch,
)
from flashdraft.engine import adaptive as A
from flashdraft.engine.adaptive import EXPLORE, AdaptiveProposer, Calibration, LinearCost, RowState

# What the engine's clock would say of each step, in a CPU-like ratio: a plain step (one token per row)
# PLAIN_S (its weights read once for all of a few rows), a speculative verify of n tokens VERIFY_S +
# PER_TOKEN_S * n (more than a plain step even at one token: matrix-vector kernels give way to
# matrix-matrix ones), a draft call DRAFT_S (a step that drafted nothing spent nothing on drafting).
PLAIN_S, VERIFY_S, PER_TOKEN_S, DRAFT_S = 1.0, 1.2, 0.05, 0.4


@pytest.fixture(autouse=True)
def fixed_costs(monkeypatch):
    """A unit test must not time anything: the timings the engine hands the adaptive proposer are
    replaced by the fixed cost model above, so every decision follows from acceptance alone and a
    loaded machine (whose steps take 1 to 40 times their cost) changes nothing."""
    observe = AdaptiveProposer.observe

    def fixed(self, rows, ks, n, draft_s, verify_s, verify_tokens):
        plain = verify_tokens == len(rows)
        verify = PLAIN_S if plain else VERIFY_S + PER_TOKEN_S * verify_tokens
        observe(self, rows, ks, n, DRAFT_S if self.drafted else 0.0, verify, verify_tokens)

    monkeypatch.setattr(AdaptiveProposer, "observe", fixed)
    timed = AdaptiveProposer.timed
    monkeypatch.setattr(
        AdaptiveProposer,
        "timed",
        lambda self, tokens, s: timed(self, tokens, VERIFY_S + PER_TOKEN_S * tokens),
    )


@pytest.mark.parametrize("arch_name", ["llama", "gemma3"])
def test_greedy_adaptive_hybrid_equals_plain_alone_and_batched(arch_name):
    model = make_hf_model(arch_name)
    target = Target(model)
    adaptive = AdaptiveProposer(DFlashProposer(make_draft(model, block_size=8), target), NgramProposer())
    rng = random.Random(3)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(2, 6))] * rng.randint(1, 3) for _ in range(8)]
    cfg = GenerationConfig(30)
    plain = [generate(target, p, None, cfg).tokens for p in prompts]
    for p, want in zip(prompts, plain, strict=True):
        assert generate(target, p, adaptive, cfg).tokens == want
    batched = generate_batch(target, prompts, config=cfg, proposer=adaptive, max_batch_size=3)
    assert [r.tokens for r in batched] == plain
    s = adaptive.stats
    assert s["dflash_rows"] and s["ngram_rows"], s  # both proposers were used
    assert s["tree_rows"], s  # and some DFlash chains went out as trees


def test_sampling_adaptive_is_exact():
    """The cut depends on the peaks of the draft's distributions, never on the sampled tokens: exact."""
    model = make_hf_model("llama", vocab=V, layers=2)
    target = Target(model)
    draft = make_draft(model, layers=1, mask_token_id=5, block_size=4)
    cfg = SamplingConfig(1.0)
    adaptive = AdaptiveProposer(DFlashProposer(draft, target))
    adaptive.verify_cost.add(1, 1.0)
    adaptive.verify_cost.add(4, 1.9)  # verifying costs: unlikely tokens are cut from the first step on
    # A calibration that keeps confident positions (peak >= 0.3: chance 0.9) and cuts unsure ones (0.1),
    # frozen, so the cut follows the confidences alone: a cut that looked at the sampled token's own q
    # instead of the peak would keep only the likelier samples, a bias this test sees.
    table = adaptive.calibration
    table.hits, table.seen = [0.1] * 3 + [0.9] * 7, [1.0] * 10
    table.update = lambda conf, accepted: None
    # and a fixed threshold (0.3), whatever the timings: plain steps timed on this tiny model would make
    # every verify look dear and leave the draft unused
    adaptive.verify_cost.add = adaptive.plain_cost.add = lambda *timing: None
    counts = sample_joint(target, adaptive, cfg, 2_500, block=4)
    assert chi2_pvalue(counts, exact_joint(model, cfg)) > 1e-3
    assert adaptive.stats["dflash_rows"] > 1000  # the draft was verified in most requests


def test_a_useless_draft_is_mostly_skipped(tiny_llama):
    draft = make_draft(tiny_llama.model, block_size=8)
    adaptive = AdaptiveProposer(DFlashProposer(draft, tiny_llama))
    res = generate(tiny_llama, [5, 6, 7], adaptive, GenerationConfig(120))
    s = adaptive.stats
    assert sum(res.acceptance_lengths) - len(res.acceptance_lengths) < 10  # it really is useless
    assert s["skipped_steps"] > 3 * s["draft_steps"], s


def test_a_perfect_proposer_keeps_drafting_long_blocks(tiny_llama):
    prompt = [9, 8, 7]
    truth = generate(tiny_llama, prompt, None, GenerationConfig(80)).tokens
    oracle = OracleProposer(len(prompt), truth, 128, random.Random(0))
    oracle.rng.random = lambda: 0.0  # always the true continuation
    adaptive = AdaptiveProposer(oracle)
    adaptive.block_size = 8
    res = generate(tiny_llama, prompt, adaptive, GenerationConfig(80, block_size=8))
    assert res.tokens == truth
    assert adaptive.stats["skipped_steps"] == 0
    assert np.mean(res.acceptance_lengths[3:-1]) > 6  # once calibrated, nearly whole blocks


class ConfidentOracle(OracleProposer):
    """An oracle whose draft distributions peak at `confidence` (what the adaptive rule reads)."""

    confidence = 0.5

    def propose(self, rows, ks):
        out = super().propose(rows, ks)
        c, v = self.confidence, self.vocab
        self.last_logits = torch.zeros(len(rows), max(ks), v)
        self.last_logits[..., 0] = math.log(c * (v - 1) / (1 - c))  # softmax peak c
        return out


def test_draft_or_not_is_decided_per_request(tiny_llama):
    """A request where the draft never pays (it backs off for up to 64 steps) leaves the next request, where
    it pays, free to draft from its first step: the wait is the request's, not the proposer's."""
    useless_prompt, good_prompt = [5, 6, 7], [9, 8, 7]
    oracle = ConfidentOracle(
        3, generate(tiny_llama, useless_prompt, None, GenerationConfig(80)).tokens, 128, random.Random(0)
    )
    oracle.rng.random, oracle.confidence = (lambda: 0.9), 0.15  # first drafted token always wrong, unsure
    adaptive = AdaptiveProposer(oracle)
    adaptive.block_size = 8
    cfg = GenerationConfig(80, block_size=8)
    generate(tiny_llama, useless_prompt, adaptive, cfg)
    assert adaptive.stats["skipped_steps"] > 3 * adaptive.stats["draft_steps"]  # it backed off
    truth = generate(tiny_llama, good_prompt, None, cfg).tokens
    oracle.truth, oracle.rng.random, oracle.confidence = truth, (lambda: 0.0), 0.95  # always right, sure
    skipped = adaptive.stats["skipped_steps"]
    res = generate(tiny_llama, good_prompt, adaptive, cfg)
    assert res.tokens == truth
    assert res.acceptance_lengths[0] > 1 and adaptive.stats["skipped_steps"] == skipped


def test_a_source_judged_hopeless_is_tried_again():
    """Calibration learns only from verified tokens, so a source whose chances fell below the cut would never
    be measured again; every EXPLORE idle steps the row verifies its likeliest first token instead."""
    table = Calibration()
    for _ in range(40):
        table.update([0.5] * 3, 0)  # three failures at the first token: hopeless
    st = RowState()
    option = ("ngram", torch.tensor([4, 5, 6]), None, [0.5] * 3, table)
    picks = []
    for _ in range(2 * EXPLORE + 2):
        picks.append(AdaptiveProposer._choose([option], 0.1, st))
        AdaptiveProposer._settle(st, picks[-1][0])  # what the step does once it verified the pick
    tried = [i for i, (source, tokens, *_) in enumerate(picks) if source != "none"]
    assert tried == [EXPLORE, 2 * EXPLORE + 1]
    assert picks[EXPLORE][1].tolist() == [4]  # one token, the cheapest measurement


def test_linear_cost_fits_and_falls_back_to_its_prior():
    c = LinearCost()
    assert c.fit() is None
    c.add(1, 2.0)
    a, b = c.fit()
    assert a + b == pytest.approx(2.0) and b == pytest.approx(0.08 * a)
    c = LinearCost()
    for n in (1, 16, 1, 16, 4):
        c.add(n, 1.0 + 0.1 * n)
    a, b = c.fit()
    assert b == pytest.approx(0.1, rel=0.05) and a == pytest.approx(1.0, rel=0.05)
    with pytest.raises(ValueError, match="needs"):
        AdaptiveProposer()
    assert Calibration().chances([0.5] * 3) == [0.5, 0.25, 0.125]  # the prior


@pytest.mark.parametrize("jump", [True, False])
def test_a_step_that_does_not_beat_a_plain_step_verifies_nothing(tiny_llama, monkeypatch, jump):
    """On CPUs a verify of two tokens can cost far more than a plain step of one (matrix-vector kernels give
    way to matrix-matrix ones), more than a + b*n fitted to the speculative steps says: the plain step is
    timed apart, and a step whose expected tokens per second fall below it verifies nothing."""
    monkeypatch.setattr(Calibration, "update", lambda self, conf, accepted: None)  # chances stay 0.3
    adaptive = AdaptiveProposer(None, NgramProposer())
    adaptive.ngram_typical.hits = [n * 0.3 for n in adaptive.ngram_typical.seen]
    adaptive.plain_cost.add(1, 1.0)
    a = 1.5 if jump else 1.0  # one token per row: 1.0 s; speculative verifies: a + 0.01 s per token
    for n in (2, 10):
        adaptive.verify_cost.add(n, a + 0.01 * n)
    adaptive.plain_cost.add = adaptive.verify_cost.add = lambda *timing: None
    res = generate(tiny_llama, [5, 6, 7, 8] * 4, adaptive, GenerationConfig(64))
    used, steps = adaptive.stats["ngram_rows"], len(res.acceptance_lengths)
    if jump:  # (1 + 0.3 + 0.09 + ...) / 1.5 < 1 / 1.0: only the exploring steps verify
        assert used <= steps // EXPLORE + 1, (used, steps)
    else:
        assert used > steps // 2, (used, steps)


def test_ngram_calibration_starts_from_all_requests():
    """Whether a context repeats is a request's own nature, but a new request starts from what n-gram lookup
    achieved across requests (worth two observations), not from 1 in 2: chat after chat starts timid."""
    adaptive = AdaptiveProposer(None, NgramProposer())
    conf = [0.5] * 3
    for _ in range(30):
        adaptive.ngram_typical.update(conf, 0)
    fresh = adaptive._new_row().ngram
    assert fresh.chances(conf)[0] < 0.1
    fresh.update(conf, 3)  # the request's own successes soon outweigh the prior
    fresh.update(conf, 3)
    assert fresh.chances(conf)[0] > 0.5


def test_where_the_draft_does_not_pay_a_new_request_backs_off_at_once(tiny_llama):
    """A request still drafts its first step (the test above), but where the draft typically does not pay,
    one failure sends it EXPLORE steps away rather than through waits of 1, 2, 4, ...: a short chat request
    after others would spend several draft calls to learn what they showed."""
    prompt = [5, 6, 7]
    oracle = ConfidentOracle(
        3, generate(tiny_llama, prompt, None, GenerationConfig(80)).tokens, 128, random.Random(0)
    )
    oracle.rng.random, oracle.confidence = (lambda: 0.9), 0.15  # first drafted token always wrong, unsure
    adaptive = AdaptiveProposer(oracle)
    adaptive.block_size = 8
    calls = []
    for _ in range(2):
        before = adaptive.stats["draft_steps"]
        generate(tiny_llama, prompt, adaptive, GenerationConfig(80, block_size=8))
        calls.append(adaptive.stats["draft_steps"] - before)
    assert calls[0] >= 6 and calls[1] <= 3, calls  # 1, 2, 4, ... 64 steps apart; then 16, 32


def test_rows_joining_a_batch_wait_for_its_next_probe(tiny_llama):
    """A draft call drafts every row, so a row joining a running batch must not make it draft at once: with
    a useless draft, 16 requests of different lengths through 4 slots (a row joins every few steps), the
    batch probes 1, 2, 4, ... steps apart whatever joins, and its output stays plain decoding's."""
    draft = make_draft(tiny_llama.model, block_size=8)
    adaptive = AdaptiveProposer(DFlashProposer(draft, tiny_llama))
    rng = random.Random(5)
    prompts = [[rng.randrange(128) for _ in range(4)] for _ in range(16)]
    configs = [GenerationConfig(rng.randint(12, 40)) for _ in prompts]
    plain = [generate(tiny_llama, p, None, c).tokens for p, c in zip(prompts, configs, strict=True)]
    res = generate_batch(tiny_llama, prompts, config=configs, proposer=adaptive, max_batch_size=4)
    assert [r.tokens for r in res] == plain
    s = adaptive.stats
    assert s["draft_steps"] <= 12 and s["skipped_steps"] > 8 * s["draft_steps"], s


def test_in_a_batch_where_the_draft_never_pays_probes_cost_at_most_their_budget(tiny_llama, monkeypatch):
    """Each probe of a useless draft loses at least its draft call against a plain step; in a batch the
    probes wait for credit (PROBE_BUDGET of the time plus what drafting won), so they cost at most that
    share of the run. Here a draft call costs a plain step (at batch 4 on the CPU of docs/speed.md, a
    probe reading 64 steps of context cost 1.5 of them): the backoff alone made 9-10 probes in ~240
    steps, the budget allows 1 + 0.02 * 240 / 1.0. The output stays plain decoding's."""
    monkeypatch.setitem(globals(), "DRAFT_S", 1.0)  # what the `fixed_costs` fixture reports
    draft = make_draft(tiny_llama.model, block_size=8)
    adaptive = AdaptiveProposer(DFlashProposer(draft, tiny_llama))
    rng = random.Random(5)
    prompts = [[rng.randrange(128) for _ in range(4)] for _ in range(16)]
    cfg = GenerationConfig(60)
    res = generate_batch(tiny_llama, prompts, config=cfg, proposer=adaptive, max_batch_size=4)
    assert [r.tokens for r in res] == [generate(tiny_llama, p, None, cfg).tokens for p in prompts]
    s = adaptive.stats
    steps = s["draft_steps"] + s["skipped_steps"]
    assert s["draft_steps"] <= 1 + A.PROBE_BUDGET * steps * PLAIN_S / DRAFT_S, s


def test_in_a_batch_a_probe_waits_until_the_credit_covers_its_verify_too(tiny_llama):
    """A probe that accepts nothing loses its draft call and its verify's drafted tokens. Here the draft is
    priced nearly free (relative_cost 0.001) and a verify of one drafted token a row (8 tokens at batch
    4), priced from the prefill's line before any verify, costs 0.28 plain steps beyond a plain one: the
    first probe waits until PROBE_BUDGET of the run covers both (with credit that covered only the draft
    call, it came on the 2nd step)."""
    from flashdraft.engine.engine import Engine

    adaptive = AdaptiveProposer(DFlashProposer(make_draft(tiny_llama.model, block_size=8), tiny_llama))
    adaptive.dflash.relative_cost = 0.001
    engine = Engine(tiny_llama, adaptive, max_batch_size=4)
    for i in range(4):
        engine.add(str(i), [5 + i, 6, 7, 8], GenerationConfig(200))
    engine.step()  # the prefill
    steps = 0
    while adaptive.stats["draft_steps"] == 0 and engine.pending():
        engine.step()
        steps += 1
    assert adaptive.stats["draft_steps"] == 1 and steps >= 0.25 / (A.PROBE_BUDGET * PLAIN_S), steps


def test_a_fresh_proposer_prices_its_first_verify_from_the_prefill(tiny_llama):
    """Before any verify, the prefill's timing prices one: a fresh proposer at batch 4 cuts its first blocks
    (with nothing timed it verified every row's whole block: at batch 16, 4-6 plain steps' worth)."""
    from flashdraft.engine.engine import Engine

    adaptive = AdaptiveProposer(DFlashProposer(make_draft(tiny_llama.model, block_size=8), tiny_llama))
    engine = Engine(tiny_llama, adaptive, max_batch_size=4)
    for i in range(4):
        engine.add(str(i), [5 + i, 6, 7, 8], GenerationConfig(8))
    engine.step()  # the prefill
    adaptive.credit = 1e9  # a draft step on no evidence waits for credit in a batch (test below)
    engine.step()  # the first draft and verify
    assert adaptive.stats["draft_steps"] == 1 and 0 < engine.stats["draft_tokens"] < 4 * 7, engine.stats


def test_in_a_batch_a_fresh_proposer_drafts_only_when_its_credit_covers_the_draft_call(tiny_llama):
    """Rows never measured count as accepting whole blocks, but in a batch that optimism is a probe: it waits
    until the credit (PROBE_BUDGET of the time) covers the draft call (a fresh proposer at batch 4 read
    every prompt on its first step and left the slots unaligned: 0.94x plain on 16 chat prompts)."""
    from flashdraft.engine.engine import Engine

    adaptive = AdaptiveProposer(DFlashProposer(make_draft(tiny_llama.model, block_size=8), tiny_llama))
    engine = Engine(tiny_llama, adaptive, max_batch_size=4)
    for i in range(4):
        engine.add(str(i), [5 + i, 6, 7, 8], GenerationConfig(8))
    engine.step()  # the prefill
    engine.step()
    assert adaptive.stats["draft_steps"] == 0 and adaptive.stats["skipped_steps"] == 1, adaptive.stats
    adaptive.credit = 1e9
    engine.step()
    assert adaptive.stats["draft_steps"] == 1, adaptive.stats


def test_the_draft_call_is_part_of_what_a_draft_step_costs():
    """Draft or not weighs a draft step's whole cost, draft call included, against a plain step, from the
    costs given (no clock): a row that gains 0.5 tokens per draft step, verifying one, pays with a cheap
    draft call (1.5 / (0.01 + 1.2 + 2 * 0.05) > 1 / 1.0) and not with a dear one (1.5 / (0.4 + 1.3) < 1)."""
    adaptive = AdaptiveProposer(Proposer())  # a drafting proposer; its calls are not made here
    adaptive.plain_cost.add(1, PLAIN_S)
    for n in (2, 8):
        adaptive.verify_cost.add(n, VERIFY_S + PER_TOKEN_S * n)
    row = RowState(gain=0.5, verified=1.0)
    assert adaptive.wants_draft([row], 0.01)
    assert not adaptive.wants_draft([row], DRAFT_S)


def test_a_draft_call_serves_the_batch_so_the_rows_gains_together_decide():
    """A draft call drafts every row: at batch 4 one row gaining 2 tokens per draft step does not pay for
    it when the other three gain nothing ((4 + 2) / (0.4 + 1.2 + 0.05 * 6) = 3.2 < 4 / 1.0 rows per
    second), though alone it would ((1 + 2) / (0.4 + 1.2 + 0.05 * 3) = 1.7 > 1); four such rows do."""
    adaptive = AdaptiveProposer(Proposer())
    adaptive.plain_cost.add(1, PLAIN_S)
    adaptive.plain_cost.add(4, PLAIN_S)  # a plain step of 1 to 4 rows: one matrix-vector pass
    for n in range(2, 17):
        adaptive.verify_cost.add(n, VERIFY_S + PER_TOKEN_S * n)
    good, idle = RowState(gain=2.0, verified=2.0), RowState(gain=0.0, verified=0.0)
    assert adaptive.wants_draft([good], DRAFT_S)
    assert not adaptive.wants_draft([good, idle, idle, idle], DRAFT_S)
    assert adaptive.wants_draft([good] * 4, DRAFT_S)


@pytest.mark.parametrize("relative_cost, drafts", [(0.5, False), (0.001, True)])
def test_a_probe_that_could_not_pay_is_not_made(tiny_llama, relative_cost, drafts):
    """A draft call first reads the context its rows committed since the last one: for a fresh proposer,
    every prompt. At 16 rows of 40-token prompts, priced from the prefills (a draft token at half a target
    token's cost), that call could not pay even if every drafted token were accepted, so the batch steps
    plain throughout and makes no probe (before: its first step read all 16 prompts, 0.1-0.6 s on the
    CPU of docs/speed.md against a 41 ms plain step). A cheap draft is probed; the output is plain's. (The
    credit, which a probe in a batch also waits for, is ample here: the draft call's price decides.)"""
    adaptive = AdaptiveProposer(DFlashProposer(make_draft(tiny_llama.model, block_size=8), tiny_llama))
    adaptive.dflash.relative_cost = relative_cost
    adaptive.credit = 1e9
    rng = random.Random(3)
    prompts = [[rng.randrange(128) for _ in range(40)] for _ in range(16)]
    res = generate_batch(
        tiny_llama, prompts, config=GenerationConfig(12), proposer=adaptive, max_batch_size=16
    )
    assert [r.tokens for r in res] == [
        generate(tiny_llama, p, None, GenerationConfig(12)).tokens for p in prompts
    ]
    assert (adaptive.stats["draft_steps"] > 0) == drafts, adaptive.stats


def test_rows_are_cut_below_a_cost_step():
    """Verifies of 2-4 tokens cost 1.1 plain steps, of 5-8 2.5 (a kernel that takes rows by 4, more
    steeply than on our CPU). With chances 0.9 per position the per-token threshold keeps all 7 drafted
    tokens; the measured costs cut them to 3 (3.4 tokens for 1.1 s, against 4.1 for 2.5 s with 4); a line
    through those costs (0.41 + 0.30 n) prices 5 tokens at 1.9 s and would keep 4."""
    adaptive = AdaptiveProposer(None, NgramProposer())
    adaptive.plain_cost.add(1, 1.0)
    for n in range(2, 9):
        adaptive.verify_cost.add(n, 1.1 if n <= 4 else 2.5)
    table = Calibration()
    table.hits = [n * 0.9 for n in table.seen]
    conf = [0.5] * 7
    options = [("dflash", torch.arange(7), None, conf, table)]
    pick = AdaptiveProposer._choose(options, adaptive.threshold(1), RowState())
    assert len(pick.tokens) == 7  # what the per-token threshold alone keeps
    (cut,) = adaptive.cut([pick])
    assert cut.tokens.tolist() == [0, 1, 2] and cut.value == pytest.approx(0.9 + 0.81 + 0.729)
    assert len(cut.conf) == 3
    adaptive.verify_cost.by_size.clear()  # the line alone
    assert len(adaptive.cut([pick])[0].tokens) == 4


def test_in_a_batch_that_does_not_draft_every_row_counts_its_idle_steps(tiny_llama, monkeypatch):
    """A batch that does not draft skips the per-row choice (a fast path), but each row still counts the
    steps it verified nothing, so that it explores on the batch's next draft step (`EXPLORE`)."""
    from flashdraft.engine.engine import Engine

    monkeypatch.setitem(globals(), "DRAFT_S", 1.0)  # what the `fixed_costs` fixture reports
    adaptive = AdaptiveProposer(DFlashProposer(make_draft(tiny_llama.model, block_size=8), tiny_llama))
    engine = Engine(tiny_llama, adaptive, max_batch_size=4)
    for i in range(4):
        engine.add(str(i), [5 + i, 6, 7, 8], GenerationConfig(40))
    engine.step()  # the prefill
    adaptive.credit = -1e9  # no probe, and no draft step on no evidence
    for _ in range(EXPLORE + 2):
        engine.step()
    assert adaptive.stats["draft_steps"] == 0, adaptive.stats
    assert [st.idle for st in adaptive.rows.values()] == [EXPLORE + 2] * 4


def test_in_a_batch_a_row_explores_only_when_the_step_verifies_drafts_anyway():
    """The verify pads every row to the longest: at batch 4 one exploring row's single token makes all four
    rows verify two tokens, a cost of four tokens for one measurement (at batch 16 that cost adaptive
    speculation 22% of plain throughput). Alone, the row explores; beside a row whose drafts pay, too."""
    adaptive = AdaptiveProposer(None, NgramProposer())
    adaptive.plain_cost.add(4, 1.0)
    adaptive.plain_cost.add(1, 1.0)
    for n in range(2, 41):
        adaptive.verify_cost.add(n, 1.0 if n <= 4 else 2.0)  # a kernel that takes rows 4 at a time
    hopeless, sure = Calibration(), Calibration()
    hopeless.hits, sure.hits = [n * 0.01 for n in hopeless.seen], [n * 0.99 for n in sure.seen]
    explore = AdaptiveProposer._choose(
        [("ngram", torch.tensor([7]), None, [0.5] * 1, hopeless)], 0.5, RowState(idle=EXPLORE)
    )
    assert explore.exploring and len(explore.tokens) == 1
    assert [p.source for p in adaptive.cut([explore, A.NONE, A.NONE, A.NONE])] == ["none"] * 4
    assert adaptive.cut([explore])[0].exploring  # alone: one token costs one row
    good = AdaptiveProposer._choose(
        [("dflash", torch.arange(7), None, [0.5] * 7, sure)], adaptive.threshold(4), RowState()
    )
    kept = adaptive.cut([explore, good, A.NONE, A.NONE])
    assert kept[0].exploring and kept[1].source == "dflash"  # the drafts pay: the exploring row rides along


def test_a_tree_row_teaches_the_calibration_what_its_chain_would_have_accepted():
    """Where a chain went out as a tree, the calibration learns how many of the chain's tokens the
    committed ones begin with: the chain's acceptance, not the tree's (its confidences are the chain's)."""
    assert A._leading([5, 6, 7], [5, 6, 8]) == 2  # the tree accepted 5, 6 and gave 7: the chain stops at 8
    assert A._leading([5, 9], [5, 6, 8]) == 1  # a sibling of the chain's second token was accepted
    assert A._leading([4, 6], [5, 6]) == 0
    assert A._leading([5, 6], [5, 6, 8]) == 2  # as far as the committed tokens tell


def test_on_a_ragged_target_a_rows_drafts_cost_its_own_tokens():
    """At batch 4, one row's 3 drafted tokens are sure (chance 0.99 each), the other rows have none; a
    verify of n tokens costs 0.6 + 0.1 n plain steps. Padded to the longest it computes 16 tokens for
    4 + 2.97 ((4 + 2.97) / 2.2 < 4 rows a step), so the cut verifies nothing; on a ragged target
    (`BatchState.ragged`: each row's own tokens only) it computes 7 ((4 + 2.97) / 1.3 > 4)."""
    adaptive = AdaptiveProposer(None, NgramProposer())
    adaptive.plain_cost.add(4, 1.0)
    for n in range(5, 33):
        adaptive.verify_cost.add(n, 0.6 + 0.1 * n)
    sure = Calibration()
    sure.hits = [n * 0.99 for n in sure.seen]
    pick = AdaptiveProposer._choose(
        [("ngram", [7, 8, 9], None, [0.5] * 3, sure)], adaptive.threshold(4), RowState()
    )
    assert len(pick.tokens) == 3
    picks = [pick, A.NONE, A.NONE, A.NONE]
    assert [p.source for p in adaptive.cut(picks)] == ["none"] * 4
    adaptive.ragged = True
    assert [len(p.tokens) for p in adaptive.cut(picks)] == [3, 0, 0, 0]


def test_in_a_batch_ngram_lookup_verifies_nothing(tiny_llama, monkeypatch):
    """In a batch a verified token costs about what a plain one does on a CPU, and n-gram matches were
    accepted too rarely to pay there (docs/speed.md): n-gram lookup proposes for a row alone only. Here
    verified tokens are made cheap (a verify of 8 tokens costs 1.08 plain steps), so a batch would verify
    matches if lookups were made: four repetitive prompts of one length run together and verify none,
    on the batch's draft steps too (a useless, unsure draft, whose first step is a probe: nothing is
    timed yet); the first of them alone does."""
    monkeypatch.setitem(globals(), "VERIFY_S", 1.0)
    monkeypatch.setitem(globals(), "PER_TOKEN_S", 0.01)
    prompts = [[5, 6, 7, 8] * 4, [9, 6, 7, 8] * 4, [5, 10, 7, 8] * 4, [5, 6, 11, 8] * 4]
    cfg = GenerationConfig(24, block_size=8)
    truth = [generate(tiny_llama, p, None, cfg).tokens for p in prompts]
    oracle = ConfidentOracle(len(prompts[0]), truth[0], 128, random.Random(0))
    oracle.rng.random, oracle.confidence = (lambda: 0.9), 0.15  # first drafted token always wrong, unsure
    adaptive = AdaptiveProposer(oracle, NgramProposer())
    adaptive.block_size = 8
    res = generate_batch(tiny_llama, prompts, config=cfg, proposer=adaptive, max_batch_size=4)
    assert [r.tokens for r in res] == truth
    assert adaptive.stats["draft_steps"] > 0 and adaptive.stats["ngram_rows"] == 0, adaptive.stats
    generate(tiny_llama, prompts[0], adaptive, cfg)
    assert adaptive.stats["ngram_rows"] > 0, adaptive.stats


class FirstRightOracle(OracleProposer):
    """Drafts the true next token, sure of it (peak 0.95), then wrong tokens it is unsure of (peak 0.35): once
    calibrated, every cut keeps one token. Records the depth of every draft call (`ks`)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls: list[int] = []

    def propose(self, rows, ks):
        if rows[0].room > 7:  # not a call that the request's end cut short
            self.calls.append(max(ks))
        out = super().propose(rows, ks)
        v = self.vocab
        self.last_logits = torch.zeros(len(rows), max(ks), v)
        for i, c in enumerate([0.95] + [0.35] * (max(ks) - 1)):
            self.last_logits[:, i, 0] = math.log(c * (v - 1) / (1 - c))  # softmax peak c
        return out

    def propose_row(self, row, k):
        guess = self.truth[len(row.tokens) : len(row.tokens) + k]
        return torch.tensor([guess[0]] + [(t + 1) % self.vocab for t in guess[1:]]), None


@pytest.mark.parametrize("right", [1, 7])
def test_the_draft_call_drafts_one_position_beyond_the_deepest_recent_cut(tiny_llama, right):
    """A draft call's cost grows with its positions, so it drafts as deep as the last draft steps' cuts
    went, plus one to grow: where only the first drafted token is ever accepted, calls of 2 positions;
    where all are, whole blocks (7). A request's first call, before any cut of its own, drafts the whole
    block."""
    prompt = [9, 8, 7]
    truth = generate(tiny_llama, prompt, None, GenerationConfig(60)).tokens
    oracle = FirstRightOracle(len(prompt), truth, 128, random.Random(0))
    if right == 7:  # every drafted token right and sure
        oracle.propose_row = lambda row, k: (torch.tensor(truth[len(row.tokens) : len(row.tokens) + k]), None)
        oracle.rng.random = lambda: 0.0
    adaptive = AdaptiveProposer(oracle)
    adaptive.block_size = 8
    res = generate(tiny_llama, prompt, adaptive, GenerationConfig(60, block_size=8))
    assert res.tokens == truth
    calls = oracle.calls
    assert calls[0] == 7 and len(calls) > 5, calls
    assert calls[-3:] == ([2] * 3 if right == 1 else [7] * 3), calls
    oracle.calls = []  # the next request alone starts from the whole block again
    assert generate(tiny_llama, prompt, adaptive, GenerationConfig(60, block_size=8)).tokens == truth
    assert oracle.calls[0] == 7, oracle.calls
