"""Batched decoding (flashdraft.engine.engine): every row must come out exactly as batch-1 decoding would give it.

Greedy, in float64: each row's tokens equal plain `decode.generate` for that row alone, with rows of
mixed prompt lengths, lengths and stop tokens, joining and leaving the batch at different steps;
with a random DFlash draft each row's acceptance lengths also equal batch-1 DFlash (so the draft's
batched context cache is right, not merely harmless). Sampling: the joint distribution of the first
3 tokens of many rows, sampled in batches, passes a chi-square test against exact enumeration.
"""

import collections
import itertools
import random

import numpy as np
import pytest
import torch
from conftest import ARCHS, DRAFT_OPTIONS, engine_target, make_draft, make_hf_model
from scipy.stats import chisquare
from test_sampling import _resample_from_p  # the same broken rule the batch-1 power test uses

import flashdraft.engine.sampling as sampling
from flashdraft import (
    DFlashProposer,
    Engine,
    GenerationConfig,
    NgramProposer,
    Proposer,
    SamplingConfig,
    generate,
    generate_batch,
)
from flashdraft.engine.engine import fill_holes
from flashdraft.engine.sampling import probs
from flashdraft.engine.scheduler import PAD_WASTE, prefill_groups
from flashdraft.engine.sequence import Row
from flashdraft.models.masks import DEAD


class BatchOracle(Proposer):
    """Proposes each row's true greedy continuation, corrupted at random places and sometimes cut
    short, so that full, partial and zero acceptance and uneven block lengths all occur."""

    def __init__(self, truths: dict[str, list[int]], vocab: int, rng: random.Random):
        self.truths, self.vocab, self.rng = truths, vocab, rng

    def propose(self, rows, ks):
        out = []
        for row, k in zip(rows, ks, strict=True):
            if k == 0:
                out.append((torch.zeros(0, dtype=torch.long), None))
                continue
            done = len(row.tokens)
            guess = self.truths[row.request_id][done : done + k]
            guess += [self.rng.randrange(self.vocab) for _ in range(k - len(guess))]
            mode = self.rng.random()
            if mode < 0.3:
                pass  # fully correct
            elif mode < 0.7:
                i = self.rng.randrange(k)
                guess[i] = (guess[i] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
            elif mode < 0.85:
                guess[0] = (guess[0] + 1) % self.vocab
            else:
                guess = guess[: self.rng.randrange(k + 1)]  # fewer than asked, maybe none
            out.append((torch.tensor(guess, dtype=torch.long), None))
        return out


class RecordingDFlash(DFlashProposer):
    """Records every block it drafts and the logits it drafted from, per request (`generate` runs its one
    request as "0")."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.drafted = collections.defaultdict(list)
        self.logits = collections.defaultdict(list)
        self.qs = []
        self.q_expected = []

    def propose(self, rows, ks):
        out = super().propose(rows, ks)
        for b, (row, (d, q)) in enumerate(zip(rows, out, strict=True)):
            if len(d):
                self.drafted[row.request_id].append(d.tolist())
                self.logits[row.request_id].append(self.last_logits[b, : len(d)])
            if q is not None:
                self.qs.append(q)
                # q must be the distribution this block was sampled from, position by position
                self.q_expected.append(probs(self.last_logits[b : b + 1, : len(d)], row.sampling))
        return out


def assert_same_logits(batched: list[torch.Tensor], alone: list[torch.Tensor], what) -> None:
    """Logit level, not only argmax: a batched row's draft logits equal its batch-1 logits (float64)."""
    assert len(batched) == len(alone), what
    for x, y in zip(batched, alone, strict=True):
        finite = torch.isfinite(y)
        assert torch.equal(finite, torch.isfinite(x)), what
        assert (x[finite] - y[finite]).abs().max() < 1e-9, what


def check_caches(dec: Engine) -> None:
    """Every running row's live target slots hold exactly positions 0..anchor-1, once each; the draft's
    live slots plus its pending context cover the same positions."""
    kpos = dec.batch.slots.positions()
    assert kpos.shape == (len(dec.rows), dec.batch.slots.length) and dec.batch.rows == len(dec.rows)
    if dec.rows:
        assert dec.batch.cache.layers[0].keys.shape[:3:2] == kpos.shape
    for b, row in enumerate(dec.rows):
        live = sorted(p for p in kpos[b].tolist() if p != DEAD)
        assert live == list(range(row.anchor)), (row.request_id, live, row.anchor)
    prop = dec.proposer
    if isinstance(prop, DFlashProposer):
        prop._split()  # the steps' features accepted whole, into their rows' chunks
        kpos = prop.slots.positions()
        assert kpos.shape[0] == len(prop.pending) == len(dec.rows)
        for b, row in enumerate(dec.rows):
            ctx = prop.pending[b]
            assert sum(len(c) for c in ctx.chunks) == len(ctx) == (len(ctx.features()) if ctx.chunks else 0)
            live = sorted(p for p in kpos[b].tolist() if p != DEAD)
            assert live + list(range(ctx.start, ctx.start + len(ctx))) == list(range(row.anchor))


def plain_greedy(truth: list[int], cfg: GenerationConfig) -> list[int]:
    """What batch-1 plain greedy decoding gives under cfg, from its unlimited continuation `truth`."""
    out = truth[: cfg.max_new_tokens]
    stops = [i for i, t in enumerate(out) if t in cfg.stop_ids]
    return out[: stops[0] + 1] if stops else out


def run_decoder(dec: Engine, prompts, configs) -> dict[str, dict]:
    """Add everything, step to the end while checking the caches; what each request streamed."""
    for i, (p, c) in enumerate(zip(prompts, configs, strict=True)):
        dec.add(str(i), p, c)
    seen = {str(i): {"tokens": [], "finished": None, "accepted": []} for i in range(len(prompts))}
    while dec.pending():
        assert len(dec.rows) <= dec.max_batch_size
        for o in dec.step():
            s = seen[o.request_id]
            assert s["finished"] is None, "output after the request finished"
            s["tokens"] += o.tokens
            s["finished"] = o.finished
            if o.accepted is not None:
                s["accepted"].append(o.accepted)
        check_caches(dec)
    return seen


@pytest.mark.parametrize("arch_name", ARCHS)
def test_greedy_batch_equals_single_row(arch_name):
    model = make_hf_model(arch_name)
    target = engine_target(model)
    vocab = model.config.vocab_size
    draft = make_draft(model)
    rng = random.Random(42)
    stats = {"full": 0, "partial": 0, "zero": 0, "stop_inside_block": 0, "joined_later": 0}
    for _ in range(4):
        max_batch = rng.randint(2, 8)
        n = max_batch + rng.randint(0, 4)  # more prompts than slots: rows join as others finish
        block = rng.choice([2, 4, 16])
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(n)]
        truths = {
            str(i): generate(target, p, None, GenerationConfig(21)).tokens for i, p in enumerate(prompts)
        }
        configs = []
        for i in range(n):
            new = rng.randint(1, 20)
            stop = [truths[str(i)][rng.randint(0, new)]] if rng.random() < 0.5 else []
            row_block = rng.choice([None, None, 1, 3])  # a row may draft less than the decoder's block
            configs.append(GenerationConfig(new, row_block, stop_ids=stop))
        expected = [plain_greedy(truths[str(i)], c) for i, c in enumerate(configs)]
        # Batch-1 DFlash, with every block it drafts: the batched draft must draft the same ones.
        dflash_1, drafted_1, logits_1 = [], [], []
        for p, c in zip(prompts, configs, strict=True):
            single = RecordingDFlash(draft, target)
            cfg = GenerationConfig(c.max_new_tokens, c.block_size or block, stop_ids=c.stop_ids)
            dflash_1.append(generate(target, p, single, cfg))
            drafted_1.append(single.drafted["0"])
            logits_1.append(single.logits["0"])
        dflash = RecordingDFlash(draft, target)
        oracle = BatchOracle(truths, vocab, rng)
        for name, kw in [("plain", {}), ("dflash", {"proposer": dflash}), ("oracle", {"proposer": oracle})]:
            dec = Engine(
                target, block_size=None if name == "plain" else block, max_batch_size=max_batch, **kw
            )
            seen = run_decoder(dec, prompts, configs)
            for i in range(n):
                s, want = seen[str(i)], expected[i]
                assert s["tokens"] == want, (arch_name, name, i)
                assert s["finished"] == ("stop" if want[-1] in configs[i].stop_ids else "length")
                assert sum(s["accepted"]) == len(want) - 1
                if name == "plain":
                    assert set(s["accepted"]) <= {1}
                if name == "dflash":
                    assert s["accepted"] == dflash_1[i].acceptance_lengths, (arch_name, i)
                    assert dflash.drafted[str(i)] == drafted_1[i], (arch_name, i)
                    assert_same_logits(dflash.logits[str(i)], logits_1[i], (arch_name, i))
                if name == "oracle":
                    b = configs[i].block_size or block
                    assert all(1 <= a <= b for a in s["accepted"])
                    for a in s["accepted"][:-1]:
                        stats["full" if a == b else "partial" if a > 1 else "zero"] += 1
                    if s["finished"] == "stop" and s["accepted"] and s["accepted"][-1] > 1:
                        stats["stop_inside_block"] += 1
            stats["joined_later"] += dec.stats["prefills"] > 1
            assert dec.stats["committed"] == sum(len(t) - 1 for t in expected)
    assert min(stats.values()) > 0, stats


def test_generate_batch_results_and_ngram(tiny_llama):
    rng = random.Random(5)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(2, 6))] * 3 for _ in range(5)]
    cfg = GenerationConfig(24)
    plain = [generate(tiny_llama, p, None, cfg) for p in prompts]
    res = generate_batch(tiny_llama, prompts, config=cfg, proposer=NgramProposer(), max_batch_size=3)
    for r, want in zip(res, plain, strict=True):
        assert r.tokens == want.tokens and r.stop_reason == "length"
        assert len(r.acceptance_lengths) == len(r.step_s) == len(r.draft_s) == len(r.verify_s)
        assert r.prefill_s > 0 and r.decode_s >= 0
    assert sum(sum(a - 1 for a in r.acceptance_lengths) for r in res) > 0  # the n-gram drafts were used


def test_prompts_of_different_lengths_prefill_in_runs_that_pad_little(tiny_llama):
    """Joining rows are cut, in order, into runs padded by at most PAD_WASTE: a 2-token prompt does not
    pay for a 40-token one's length (one forward per run), and every row still decodes as alone."""
    lens = [53, 78, 87, 70, 52, 60, 62, 61]  # MT-Bench's first 8 chat prompts on SmolLM2
    groups = prefill_groups([Row(str(i), [1] * n, GenerationConfig(4), 1, None) for i, n in enumerate(lens)])
    assert [[len(r.prompt) for r in g] for g in groups] == [[53, 78, 87, 70], [52, 60, 62, 61]]
    for g in groups:
        n = [len(r.prompt) for r in g]
        assert max(n) * len(n) <= (1 + PAD_WASTE) * sum(n)
    prompts = [[5, 9], [7] * 40, [3, 4, 5], [8] * 38]
    dec = Engine(tiny_llama, max_batch_size=4)
    for i, p in enumerate(prompts):
        dec.add(str(i), p, GenerationConfig(6))
    got: dict[str, list[int]] = {}
    while dec.pending():
        for o in dec.step():
            got.setdefault(o.request_id, []).extend(o.tokens)
    assert dec.stats["prefills"] == 4  # 2 | 40 | 3 | 38: no two neighbours pad little together
    assert [got[str(i)] for i in range(4)] == [
        generate(tiny_llama, p, None, GenerationConfig(6)).tokens for p in prompts
    ]


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_leaving_rows_places_go_to_the_last_rows(n):
    """fill_holes: every staying row exactly once; a row stays in its place unless it is past the new
    end, and only such rows move (into the places of rows that left, lowest first)."""
    for left in itertools.chain.from_iterable(itertools.combinations(range(n), k) for k in range(n + 1)):
        index = [b for b in range(n) if b not in left]
        order = fill_holes(index)
        assert sorted(order) == index, (index, order)
        assert all(order[b] == b for b in index if b < len(index)), (index, order)
        assert [b for b in order if b >= len(index)] == [b for b in index if b >= len(index)]


def test_a_cancel_that_races_the_finish_does_not_hit_a_later_request(tiny_llama, monkeypatch):
    """A client cancels while its request's last step runs (the server's disconnect, on another
    thread): the request ends as it finished, and a new request with the same id is not cancelled."""
    dec = Engine(tiny_llama, max_batch_size=2)
    prefill = dec._prefill

    def cancel_during_the_step(rows):
        dec.cancel("a")  # arrives after the step took its cancellations
        return prefill(rows)

    monkeypatch.setattr(dec, "_prefill", cancel_during_the_step)
    dec.add("a", [5, 6, 7], GenerationConfig(1))
    assert [(o.request_id, o.finished) for o in dec.step()] == [("a", "length")]
    monkeypatch.setattr(dec, "_prefill", prefill)
    dec.add("a", [5, 6, 7], GenerationConfig(3))
    ends = {}
    while dec.pending():
        ends.update({o.request_id: o.finished for o in dec.step() if o.finished})
    assert ends == {"a": "length"}


def test_join_midway_and_cancel(tiny_llama):
    draft = make_draft(tiny_llama.model, block_size=4)
    dec = Engine(tiny_llama, DFlashProposer(draft, tiny_llama), max_batch_size=3)
    prompts = {f"r{i}": [7 + i] * (2 + 3 * i) for i in range(6)}
    want = {k: generate(tiny_llama, p, None, GenerationConfig(30)).tokens for k, p in prompts.items()}
    got = {k: [] for k in prompts}
    ended = {}

    def step():
        for o in dec.step():
            got[o.request_id] += o.tokens
            if o.finished:
                ended[o.request_id] = o.finished
        check_caches(dec)

    for k in ("r0", "r1"):
        dec.add(k, prompts[k], GenerationConfig(30))
    assert dec.pending() == 2 and not dec.rows
    step()  # prefill of r0, r1
    assert [r.request_id for r in dec.rows] == ["r0", "r1"] and all(len(t) == 1 for t in got.values() if t)
    step()
    for k in ("r2", "r3", "r4"):  # r2 fills the third slot, r3 and r4 wait
        dec.add(k, prompts[k], GenerationConfig(30))
    step()
    assert [r.request_id for r in dec.rows] == ["r0", "r1", "r2"] and dec.pending() == 5
    dec.cancel("r1")  # running
    dec.cancel("r4")  # waiting
    dec.cancel("nobody")  # ignored
    assert dec.pending() == 5  # cancels take effect at the next step
    step()
    assert ended == {"r1": "cancelled", "r4": "cancelled"}
    assert [r.request_id for r in dec.rows] == ["r0", "r2", "r3"]  # r3 took r1's slot
    with pytest.raises(ValueError, match="already in the batch"):
        dec.add("r0", [1], GenerationConfig(4))
    dec.add("r5", prompts["r5"], GenerationConfig(30))
    while dec.pending():
        step()
    for k in ("r0", "r2", "r3", "r5"):
        assert got[k] == want[k] and ended[k] == "length", k
    assert want["r1"][: len(got["r1"])] == got["r1"] and got["r4"] == []
    assert dec.batch.cache is None and dec.batch.slots.aligned and dec.batch.slots.length == 0


def test_long_run_compacts_and_stays_exact(tiny_llama):
    """Rows of very different lengths over many steps: dead slots are compacted away (the cache never
    grows far past the longest row), and outputs and drafts stay exact through the compactions."""
    rng = random.Random(9)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    configs = [GenerationConfig(rng.randint(30, 90)) for _ in prompts]
    truths = {
        str(i): generate(tiny_llama, p, None, GenerationConfig(90)).tokens for i, p in enumerate(prompts)
    }
    draft = make_draft(tiny_llama.model, block_size=8)
    drafted_1, logits_1 = [], []
    for p, c in zip(prompts, configs, strict=True):
        single = RecordingDFlash(draft, tiny_llama)
        generate(tiny_llama, p, single, c)
        drafted_1.append(single.drafted["0"])
        logits_1.append(single.logits["0"])
    dflash = RecordingDFlash(draft, tiny_llama)
    for proposer in (BatchOracle(truths, 128, rng), dflash):
        dec = Engine(tiny_llama, block_size=8, max_batch_size=3, proposer=proposer)
        for i, (p, c) in enumerate(zip(prompts, configs, strict=True)):
            dec.add(str(i), p, c)
        got = collections.defaultdict(list)
        while dec.pending():
            for o in dec.step():
                got[o.request_id] += o.tokens
            check_caches(dec)
            if dec.rows:
                longest = max(r.anchor for r in dec.rows)
                assert dec.batch.slots.length <= longest + max(32, longest // 4) + 8
        for i, c in enumerate(configs):
            assert got[str(i)] == truths[str(i)][: c.max_new_tokens], (type(proposer).__name__, i)
        assert dec.stats["compactions"] > 0
    assert dflash.compactions > 0
    for i in range(len(prompts)):
        assert dflash.drafted[str(i)] == drafted_1[i], i
        assert_same_logits(dflash.logits[str(i)], logits_1[i], i)


@pytest.mark.parametrize(
    "prompt, cfg, match",
    [
        ([], GenerationConfig(4), "prompt is empty"),
        ([1, 2], GenerationConfig(0), "max_new_tokens"),
        ([1, 2], GenerationConfig(4, block_size=0), "block_size"),
        ([1] * 200, GenerationConfig(100), "exceeds the target's context of 256"),
        ([1, 999], GenerationConfig(4), "token ids must lie in 0..127"),
        ([1, 2], GenerationConfig(4, sampling=0.7), "SamplingConfig"),
    ],
)
def test_bad_input(tiny_llama, prompt, cfg, match):
    dec = Engine(tiny_llama)
    with pytest.raises(ValueError, match=match):
        dec.add("x", prompt, cfg)
    assert dec.pending() == 0


def test_bad_decoder_settings(tiny_llama):
    with pytest.raises(ValueError, match="max_batch_size"):
        Engine(tiny_llama, max_batch_size=0)
    with pytest.raises(ValueError, match="block_size"):
        Engine(tiny_llama, block_size=0)
    with pytest.raises(ValueError, match="proposal"):
        DFlashProposer(make_draft(tiny_llama.model), tiny_llama, proposal="best")
    with pytest.raises(ValueError, match="one per prompt"):
        generate_batch(tiny_llama, [[1], [2]], config=[GenerationConfig(2)])


# -- sampling -------------------------------------------------------------------------------------

V = 6
PROMPT = [1, 4, 2]


def exact_joint(model, cfg: SamplingConfig) -> np.ndarray:
    """P(first three tokens) under plain sampling, by enumeration."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=3)))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        p = probs(model(ids).logits[:, len(PROMPT) - 1 : -1], cfg)
    out = np.zeros((V, V, V))
    out[tuple(seqs.T)] = p.gather(-1, seqs[..., None])[..., 0].prod(-1).numpy()
    return out


def chi2_pvalue(counts: np.ndarray, exact: np.ndarray) -> float:
    n = counts.sum()
    assert counts[exact == 0].sum() == 0, "sampled a sequence that plain sampling can never produce"
    expected, observed = exact.ravel() * n, counts.ravel()
    keep = expected >= 5  # pool the rare cells into one
    exp = np.append(expected[keep], expected[~keep].sum())
    obs = np.append(observed[keep], observed[~keep].sum())
    if exp[-1] == 0:
        exp, obs = exp[:-1], obs[:-1]
    return float(chisquare(obs, exp).pvalue)


@pytest.fixture(scope="module")
def sampling_setup():
    model = make_hf_model("llama", vocab=V, layers=2)
    target = engine_target(model)
    draft = make_draft(model, layers=1, mask_token_id=5, block_size=4)
    with torch.no_grad():
        draft.fc.weight.mul_(20)  # a confident, wrong draft: many rejections
    return model, target, draft


def sample_counts(target, draft, configs, proposal="draft", rows=2000, seed=0):
    """Rows of every config interleaved in the same batches; counts of the first 3 tokens per config.
    A config is a SamplingConfig, or (SamplingConfig, block_size) for rows that draft less (1: none)."""
    configs = [c if isinstance(c, tuple) else (c, None) for c in configs]
    cfgs = [
        GenerationConfig(3, configs[i % len(configs)][1], configs[i % len(configs)][0], seed=seed + i)
        for i in range(rows * len(configs))
    ]
    res = generate_batch(target, [PROMPT] * len(cfgs), draft, cfgs, max_batch_size=256, proposal=proposal)
    counts = [np.zeros((V, V, V)) for _ in configs]
    for i, r in enumerate(res):
        counts[i % len(configs)][tuple(r.tokens)] += 1
    return counts


def test_batched_sampling_matches_plain_distribution(sampling_setup):
    model, target, draft = sampling_setup
    configs = [
        SamplingConfig(0.7, top_k=3),
        SamplingConfig(1.0, top_p=0.8),
        SamplingConfig(1.0),
        (SamplingConfig(0.7, top_k=3), 1),  # plain sampling rows in the same batches
    ]
    for cfg, counts in zip(configs, sample_counts(target, draft, configs, rows=1500), strict=True):
        cfg = cfg[0] if isinstance(cfg, tuple) else cfg
        p = chi2_pvalue(counts, exact_joint(model, cfg))
        assert p > 1e-3, f"{cfg}: p-value {p:.2e}"
    # One-hot (argmax) proposals, with a greedy row mixed in: it must be plain greedy decoding.
    cfg = SamplingConfig(0.7, top_p=0.9)
    counts = sample_counts(target, draft, [cfg, SamplingConfig()], proposal="greedy", rows=1000)
    assert chi2_pvalue(counts[0], exact_joint(model, cfg)) > 1e-3
    greedy = generate(target, PROMPT, None, GenerationConfig(3)).tokens
    assert counts[1][tuple(greedy)] == counts[1].sum()


def test_seeded_row_ignores_its_batch(sampling_setup):
    """A seeded request samples the same tokens whatever else shares its batch (its own generator)."""
    _, target, draft = sampling_setup
    cfg = GenerationConfig(12, sampling=SamplingConfig(0.9, top_p=0.95), seed=7)
    alone = generate_batch(target, [PROMPT], draft, cfg)[0].tokens
    others = [GenerationConfig(s, sampling=SamplingConfig(1.0), seed=s) for s in range(1, 6)]
    crowd = generate_batch(
        target, [[2, 3], PROMPT, [5] * 9, [1], [4, 4], [0]], draft, [others[0], cfg, *others[1:]]
    )
    assert crowd[1].tokens == alone


def test_distribution_test_has_power(sampling_setup, monkeypatch):
    model, target, draft = sampling_setup
    monkeypatch.setattr(sampling, "verify_sampling", _resample_from_p)
    cfg = SamplingConfig(1.0, top_p=0.8)
    (counts,) = sample_counts(target, draft, [cfg], rows=1000)
    assert chi2_pvalue(counts, exact_joint(model, cfg)) < 1e-3


def test_padding_equal_to_the_true_next_token_is_never_accepted(tiny_llama):
    """Drafts of uneven length are padded with id 0 up to the longest. Row "0" proposes its true
    continuation cut right before a true 0, while row "1" proposes long correct blocks: were the
    padding compared like a draft, row "0" would accept it, count a token its cache never kept, and
    drift (the cache check and the outputs catch it)."""
    target = tiny_llama
    g = torch.Generator().manual_seed(0)
    truths = {}
    for _ in range(400):
        prompt = torch.randint(1, 128, (5,), generator=g).tolist()
        truth = generate(target, prompt, None, GenerationConfig(max_new_tokens=40)).tokens
        if 0 in truth[2:30]:
            break
    assert 0 in truth[2:30], "no prompt continues with token 0"
    other = [7, 8, 9, 10]
    truths = {"0": truth, "1": generate(target, other, None, GenerationConfig(max_new_tokens=40)).tokens}
    cuts = []

    class CutBeforeZero(Proposer):
        def propose(self, rows, ks):
            out, cut = {}, None
            for row, k in zip(rows, ks, strict=True):
                t = truths[row.request_id][len(row.tokens) : len(row.tokens) + k]
                if row.request_id == "0" and 0 in t:
                    t = cut = t[: t.index(0)]
                out[row.request_id] = t
            if cut is not None and len(out.get("1", [])) > len(cut):
                cuts.append(len(cut))  # row "0" is padded where its true token is 0: the case under test
            return [(torch.tensor(out[r.request_id], dtype=torch.long), None) for r in rows]

    cfg = GenerationConfig(max_new_tokens=40, block_size=6)
    dec = Engine(target, proposer=CutBeforeZero(), block_size=6, max_batch_size=2)
    seen = run_decoder(dec, [prompt, other], [cfg, cfg])
    assert cuts
    assert seen["0"]["tokens"] == truths["0"] and seen["1"]["tokens"] == truths["1"]


@pytest.mark.parametrize("option", [*DRAFT_OPTIONS, "draft_vocab", "context_vocab"])
def test_draft_options_batched_equal_single_row(tiny_llama, option):
    """A draft with each config option on (conftest.DRAFT_OPTIONS: embedding scale, logit multiplier and
    softcap, norm eps, rotary settings, a sliding-window layer of window 3 (shorter than its block), three
    target features) or a draft vocabulary runs in batches of rows of mixed lengths: every row drafts
    exactly the blocks and logits it drafts alone, and outputs stay plain greedy. The option must matter:
    the plain draft (the same weights otherwise) drafts other logits."""
    kw = {"context_vocab": True} if option == "context_vocab" else {}  # each row's own tokens join
    if option in ("draft_vocab", "context_vocab"):
        draft = make_draft(tiny_llama.model, block_size=4)
        draft.set_vocab(list(range(1, 128, 2)))
    else:
        draft = make_draft(tiny_llama.model, block_size=4, option=option)
    plain_draft = make_draft(tiny_llama.model, block_size=4)
    if option == "context_vocab":  # the comparison: the same vocabulary without the rows' context
        plain_draft = draft
    rng = random.Random(11)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(1, 15))] for _ in range(5)]
    configs = [GenerationConfig(rng.randint(5, 20)) for _ in prompts]
    alone, alone_logits, plain_logits = [], [], []
    for p, c in zip(prompts, configs, strict=True):
        for d, blocks, logits in ((draft, alone, alone_logits), (plain_draft, None, plain_logits)):
            single = RecordingDFlash(d, tiny_llama, **(kw if blocks is not None else {}))
            res = generate(tiny_llama, p, single, c)
            assert res.tokens == generate(tiny_llama, p, None, c).tokens
            if blocks is not None:
                blocks.append(single.drafted["0"])
            logits.append(single.logits["0"])
    assert option == "plain" or any(
        x.shape != y.shape or not torch.allclose(x, y, atol=1e-6)
        for xs, ys in zip(alone_logits, plain_logits, strict=True)
        for x, y in zip(xs, ys, strict=False)
    ), f"{option} changed no drafted logit: the test cannot see it"
    batched = RecordingDFlash(draft, tiny_llama, **kw)
    seen = run_decoder(Engine(tiny_llama, proposer=batched, max_batch_size=3), prompts, configs)
    for i, (p, c) in enumerate(zip(prompts, configs, strict=True)):
        assert seen[str(i)]["tokens"] == generate(tiny_llama, p, None, c).tokens
        assert batched.drafted[str(i)] == alone[i], i
        assert_same_logits(batched.logits[str(i)], alone_logits[i], (option, i))


def test_sampling_with_a_spread_draft_alone_and_batched():
    """The proposal probabilities q must matter: with a draft whose q is spread (its most likely token gets
    well under 0.9 on average), a verifier that used the wrong q would sample the wrong distribution.
    Batch 1 (`generate`) and batched (`generate_batch`), against exact enumeration."""
    from test_sampling import sample_joint

    model = make_hf_model("llama", vocab=V, layers=2)
    target = engine_target(model)
    # seed 2: the two drafted positions' q differ (total variation 0.10; seed 0's differ by 0.01, and a
    # verifier that swapped them went unseen)
    draft = make_draft(model, layers=1, mask_token_id=5, block_size=4, seed=2)
    cfg = SamplingConfig(1.0)
    exact = exact_joint(model, cfg)
    alone = RecordingDFlash(draft, target)
    assert chi2_pvalue(sample_joint(target, alone, cfg, 2_500, block=4), exact) > 1e-3
    batched = RecordingDFlash(draft, target)
    cfgs = [GenerationConfig(3, sampling=cfg, seed=i) for i in range(2_000)]
    res = generate_batch(target, [PROMPT] * len(cfgs), config=cfgs, proposer=batched, max_batch_size=256)
    counts = np.zeros((V, V, V))
    for r in res:
        counts[tuple(r.tokens)] += 1
    assert chi2_pvalue(counts, exact) > 1e-3
    for spy in (alone, batched):
        top = torch.cat([q.reshape(-1, V) for q in spy.qs]).max(-1).values
        assert top.mean() < 0.9, f"q is nearly one-hot (mean top probability {top.mean():.3f})"
        assert all(torch.equal(q, e) for q, e in zip(spy.qs, spy.q_expected, strict=True)), (
            "the verifier got a q other than the block's sampling distribution"
        )
    q = alone.qs[0].reshape(-1, V)
    assert (q[0] - q[1]).abs().sum() / 2 > 0.05, "q is the same at both positions: a swap would go unseen"


def test_speculative_counters_match_the_commits(tiny_llama):
    """The vLLM-style counters that /metrics exports, exactly as the oracle's proposals imply: every
    row-step with a non-empty proposal is a draft, its tokens are drafted tokens, and (greedy) the
    accepted ones are its longest prefix that agrees with the row's true continuation, counted per
    block position; accepted drafted tokens are the commits beyond one per verify step, bar the
    ones a row's length cut."""
    rng = random.Random(4)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(2, 9))] for _ in range(5)]
    truths = {
        str(i): generate(tiny_llama, p, None, GenerationConfig(40)).tokens for i, p in enumerate(prompts)
    }
    proposed = []  # (request, tokens committed before, proposal)

    class Recording(BatchOracle):
        def propose(self, rows, ks):
            out = super().propose(rows, ks)
            proposed.extend(
                (r.request_id, len(r.tokens), d.tolist()) for r, (d, _) in zip(rows, out, strict=True)
            )
            return out

    dec = Engine(tiny_llama, proposer=Recording(truths, 128, rng), block_size=6, max_batch_size=3)
    configs = [GenerationConfig(rng.randint(20, 40)) for _ in prompts]
    run_decoder(dec, prompts, configs)
    drafts = [(rid, done, d) for rid, done, d in proposed if d]
    accepted = []
    for rid, done, d in drafts:
        truth = truths[rid][done : done + len(d)]
        accepted.append(next((i for i, (x, y) in enumerate(zip(d, truth, strict=True)) if x != y), len(d)))
    st = dec.stats
    assert st["drafts"] == len(drafts) and st["draft_tokens"] == sum(len(d) for _, _, d in drafts)
    assert st["accepted_tokens"] == sum(accepted) > 0
    top = max(accepted)
    assert st["accepted_per_position"] == [sum(a > k for a in accepted) for k in range(top)]
    committed = sum(c.max_new_tokens - 1 for c in configs)  # no stop ids: every row runs to its length
    assert st["committed"] == committed and st["verify_steps"] == len(proposed)
    cut = st["accepted_tokens"] - (committed - st["verify_steps"])  # drafts accepted past a row's length
    assert 0 <= cut <= len(prompts)
    assert any(len(d) < 5 for _, _, d in drafts) and len(drafts) < len(proposed)  # short and empty proposals
