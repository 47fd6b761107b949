"""Greedy losslessness of the decode loop against transformers' own greedy `generate`, in float64."""

import random

import pytest
import torch
from conftest import ARCHS, engine_target, make_draft, make_hf_model

from flashdraft import (
    DFlashProposer,
    GenerationConfig,
    NgramProposer,
    Proposer,
    SamplingConfig,
    generate,
)
from flashdraft.engine.sequence import Row

N_PROMPTS = 50
NEW = 16
BLOCKS = (1, 2, 4, 16)


class OracleProposer(Proposer):
    """Proposes the target's true greedy continuation, corrupted at random places, so that full,
    partial and zero acceptance all occur; also counts what it sees."""

    def __init__(self, prompt_len: int, truth: list[int], vocab: int, rng: random.Random):
        self.prompt_len, self.truth, self.vocab, self.rng = prompt_len, truth, vocab, rng

    def propose_row(self, row, k):
        done = len(row.tokens)  # generated tokens so far, anchor included
        guess = self.truth[done : done + k]
        guess += [self.rng.randrange(self.vocab) for _ in range(k - len(guess))]
        mode = self.rng.random()
        if mode < 0.3:
            pass  # fully correct
        elif mode < 0.8:
            i = self.rng.randrange(k)
            guess[i] = (guess[i] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        else:
            guess[0] = (guess[0] + 1) % self.vocab
        return torch.tensor(guess), None


def hf_greedy(model, prompt: list[int], new: int, eos: int | None) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0 if eos is None else eos,
    )
    seq = out[0, len(prompt) :].tolist()
    if eos is not None and eos in seq:  # generate pads after EOS; keep up to and including it
        seq = seq[: seq.index(eos) + 1]
    return seq


@pytest.mark.parametrize("arch_name", ARCHS)
def test_greedy_equals_transformers_generate(arch_name):
    model = make_hf_model(arch_name)
    target = engine_target(model)
    vocab = model.config.vocab_size
    draft = DFlashProposer(make_draft(model), target)
    rng = random.Random(1234)
    stats = {"full": 0, "partial": 0, "zero": 0, "stop_inside_block": 0}
    for n in range(N_PROMPTS):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        truth = hf_greedy(model, prompt, NEW + 16, None)
        # Half the prompts stop on a token that occurs mid-continuation, so stops land inside blocks.
        eos = truth[rng.randint(1, NEW - 2)] if n % 2 else None
        expected = hf_greedy(model, prompt, NEW, eos)
        for block in BLOCKS:
            cfg = GenerationConfig(
                max_new_tokens=NEW, block_size=block, stop_ids=[] if eos is None else [eos]
            )
            oracle = OracleProposer(len(prompt), truth, vocab, rng)
            # Block size 1 is plain decoding whatever the proposer: run it once.
            for proposer in (draft, oracle) if block > 1 else (oracle,):
                streamed = []
                res = generate(target, prompt, proposer, cfg, on_tokens=streamed.extend)
                assert res.tokens == expected, (arch_name, n, block, type(proposer).__name__)
                assert streamed == res.tokens
                assert sum(res.acceptance_lengths) == len(res.tokens) - 1
                assert all(1 <= a <= block for a in res.acceptance_lengths)
                if proposer is oracle and block > 1:
                    for a in res.acceptance_lengths[:-1]:
                        stats["full" if a == block else "partial" if a > 1 else "zero"] += 1
                    if (
                        res.stop_reason == "stop"
                        and res.acceptance_lengths
                        and res.acceptance_lengths[-1] > 1
                    ):
                        stats["stop_inside_block"] += 1
    assert min(stats.values()) > 0, stats


@pytest.mark.parametrize("arch_name", ["qwen2", "mistral"])
def test_more_architectures_lossless(arch_name):
    model = make_hf_model(arch_name, layers=4)
    target = engine_target(model)
    proposer = DFlashProposer(make_draft(model), target)
    rng = random.Random(7)
    for _ in range(5):
        prompt = [rng.randrange(128) for _ in range(rng.randint(1, 10))]
        expected = hf_greedy(model, prompt, NEW, None)
        for block in (1, 4, 16):
            assert generate(target, prompt, proposer, GenerationConfig(NEW, block)).tokens == expected


def test_ngram_proposer_is_lossless_and_accepts_on_repetition(tiny_llama):
    rng = random.Random(3)
    accepted = 0
    for _ in range(10):
        prompt = [rng.randrange(128) for _ in range(rng.randint(2, 10))] * 3
        plain = generate(tiny_llama, prompt, None, GenerationConfig(40)).tokens
        res = generate(tiny_llama, prompt, NgramProposer(), GenerationConfig(40, block_size=8))
        assert res.tokens == plain
        accepted += sum(a - 1 for a in res.acceptance_lengths)
    assert accepted > 0


def _lookup(seq: list[int], k: int, max_ngram: int = 3, split: int = 4) -> tuple[list[int], int]:
    """NgramProposer.lookup on a row whose prompt is seq[:split] and whose generated tokens the rest."""
    row = Row("x", seq[:split], GenerationConfig(), 8, None, tokens=seq[split:])
    tokens, n = NgramProposer(max_ngram=max_ngram, min_ngram=1).lookup(row, k)
    return tokens.tolist(), n


def test_ngram_index_follows_the_row_as_it_grows():
    """The per-row index answers as a scan of the whole sequence would, after every commit of 0-4
    tokens (small vocabulary: many repeats; `Row.commit`, as the engine grows rows), and for a row
    found shorter than its index (indexed again)."""
    rng = random.Random(4)
    proposer = NgramProposer(max_ngram=3, min_ngram=1)
    for trial in range(20):
        seq = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        row = Row("x", seq, GenerationConfig(200), 8, None)
        for _ in range(25):
            if rng.random() < 0.1 and row.tokens:
                del row.tokens[rng.randrange(len(row.tokens)) :]  # shorter than its index
            else:
                row.commit([rng.randrange(4) for _ in range(rng.randint(0, 4))])
            full = row.prompt + row.tokens
            k = rng.randint(1, 6)
            want, got = _scan(full, k), proposer.lookup(row, k)
            assert (got[0].tolist(), got[1]) == want, (trial, full, k)


def _scan(seq: list[int], k: int, max_ngram: int = 3) -> tuple[list[int], int]:
    """The rule by brute force: the longest trailing n-gram seen before with a successor, its latest one."""
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        for i in range(len(seq) - n - 1, -1, -1):
            if seq[i : i + n] == seq[-n:]:
                return seq[i + n : i + n + k], n
    return [], 0


def test_ngram_lookup_copies_the_latest_earlier_occurrence_of_the_longest_match():
    """Its documented rule: the longest trailing n-gram (max_ngram down to min_ngram) that occurred
    before, at its latest earlier occurrence, and up to k tokens of what followed that one, across the
    prompt/generated boundary. Earlier occurrences here continue differently, so each rule shows."""
    # [1, 2, 3] occurred twice: followed by 9, 5, 6 first, by 8, 7 last; the latest wins.
    seq = [1, 2, 3, 9, 5, 6, 1, 2, 3, 8, 7, 1, 2, 3]
    assert _lookup(seq, 5) == ([8, 7, 1, 2, 3], 3)
    assert _lookup(seq, 2) == ([8, 7], 3)
    assert _lookup(seq, 5, split=12) == ([8, 7, 1, 2, 3], 3)  # the n-gram spans prompt and output
    # a longer match beats a more recent shorter one: [1, 2, 3] -> 9; [2, 3] -> 7; [3] -> 5
    seq = [4, 1, 2, 3, 9, 2, 3, 7, 3, 5, 1, 2, 3]
    assert _lookup(seq, 3) == ([9, 2, 3], 3)
    assert _lookup(seq, 3, max_ngram=2) == ([7, 3, 5], 2)
    assert _lookup(seq, 3, max_ngram=1) == ([5, 1, 2], 1)
    # the trailing n-gram itself is no occurrence (nothing follows it); overlapping ones are
    assert _lookup([1, 2, 3, 4, 5, 6], 3) == ([], 0)
    assert _lookup([6, 7, 7, 7], 3) == ([7], 2)


def test_max_new_tokens_and_stats(tiny_llama):
    draft = DFlashProposer(make_draft(tiny_llama.model), tiny_llama)
    for new in (1, 2, 5, 17):
        res = generate(tiny_llama, [5, 6, 7], draft, GenerationConfig(new, 16))
        assert len(res.tokens) == new and res.stop_reason == "length"
        assert len(res.draft_s) == len(res.verify_s) == len(res.step_s) == len(res.acceptance_lengths)
        assert res.prefill_s > 0 and res.decode_s >= sum(res.step_s) - 1e-9


def test_stop_on_first_token(tiny_llama):
    first = generate(tiny_llama, [9, 9, 9], None, GenerationConfig(1)).tokens[0]
    res = generate(tiny_llama, [9, 9, 9], None, GenerationConfig(10, stop_ids=[first]))
    assert res.tokens == [first] and res.stop_reason == "stop" and res.acceptance_lengths == []


@pytest.mark.parametrize(
    "prompt, cfg, match",
    [
        ([], GenerationConfig(4), "prompt is empty"),
        ([1, 2], GenerationConfig(0), "max_new_tokens"),
        ([1, 2], GenerationConfig(4, block_size=0), "block_size"),
        ([1] * 200, GenerationConfig(100), "exceeds the target's context of 256"),
        ([1, 999], GenerationConfig(4), "token ids must lie in 0..127"),
    ],
)
def test_bad_generation_input(tiny_llama, prompt, cfg, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny_llama, prompt, None, cfg)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
    ],
)
def test_bad_sampling_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_generate_accepts_what_tokenizers_return(tiny_llama):
    """A list, a (n,) or (1, n) tensor, and a BatchEncoding (what `apply_chat_template(...,
    return_dict=True)` and tokenizer calls return) are one prompt; a batch of two is refused."""
    from transformers import BatchEncoding

    from flashdraft import generate_batch

    cfg = GenerationConfig(max_new_tokens=6)
    ids = [5, 9, 17, 3]
    want = generate(tiny_llama, ids, None, cfg).tokens
    for form in (
        torch.tensor(ids),
        torch.tensor([ids]),
        BatchEncoding({"input_ids": [ids], "attention_mask": [[1] * 4]}),
        {"input_ids": torch.tensor([ids])},
    ):
        assert generate(tiny_llama, form, None, cfg).tokens == want
    assert generate_batch(tiny_llama, [BatchEncoding({"input_ids": ids})], config=cfg)[0].tokens == want
    with pytest.raises(ValueError, match="generate takes one prompt.*generate_batch"):
        generate(tiny_llama, torch.tensor([ids, ids]), None, cfg)
    with pytest.raises(ValueError, match="the prompt must be token ids"):
        generate(tiny_llama, "hello", None, cfg)
