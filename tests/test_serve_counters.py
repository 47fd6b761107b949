"""The server's speculative counters against the exact values an oracle proposer implies, and
`ignore_eos`, on an in-process server (`flashdraft.serve.App` over uvicorn on a thread) whose proposer
and stop tokens the test chooses.

The oracle proposes the target's true greedy continuation with its first wrong token at a scheduled
place, so every verify step accepts a known number of drafted tokens.
"""

import contextlib
import socket
import threading
import time
import urllib.request

import pytest
import torch
from conftest import make_hf_model
from test_serve import KEY, _http, make_tokenizer

from flashdraft import GenerationConfig, Proposer, Target, generate
from flashdraft.engine.engine import Engine
from flashdraft.serve import App, EngineThread

PROMPT = [5, 17, 42, 7, 99, 3, 64]


@pytest.fixture(scope="module")
def target():
    return Target(make_hf_model("llama", vocab=320, layers=2, max_pos=256), make_tokenizer())


def truth(target, n):
    """The target's greedy continuation of PROMPT (no stop tokens)."""
    return generate(target, PROMPT, None, GenerationConfig(max_new_tokens=n, stop_ids=[])).tokens


class Scheduled(Proposer):
    """Step s drafts k tokens of the true continuation with the one at index `right[s]` made wrong (none
    when right[s] >= k): the verifier accepts exactly min(right[s], k) of them. right[s] = None: it
    drafts nothing (the step verifies the anchor alone, which is no draft)."""

    def __init__(self, true: list[int], right: list[int | None], vocab: int):
        self.true, self.right, self.vocab, self.step = true, right, vocab, 0

    def propose_row(self, row, k):
        done = len(row.tokens)  # generated so far, the anchor included
        guess = list(self.true[done : done + k])
        j = self.right[self.step]
        self.step += 1
        if j is None:
            return torch.zeros(0, dtype=torch.long), None
        if j < k:
            guess[j] = (guess[j] + 1) % self.vocab
        return torch.tensor(guess), None


@contextlib.contextmanager
def serving(target, proposer: Proposer | None, block_size: int, stop_ids: list[int]):
    """The server's App around an Engine with this proposer, on a free loopback port: its base URL."""
    import uvicorn

    sched = EngineThread(lambda: Engine(target, proposer=proposer, block_size=block_size, max_batch_size=2))
    app = App(sched, target.tokenizer, "tiny", target.max_length, target.vocab_size, stop_ids, KEY).build()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def post(base, body):
    return _http(base + "/v1/completions", {"model": "tiny", **body}, {"Authorization": f"Bearer {KEY}"})


def metrics(base):
    return _http(base + "/metrics.json", headers={"Authorization": f"Bearer {KEY}"})[1]


def prometheus(base) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_speculative_counters_equal_what_the_oracle_implies(target):
    """Block 5 (4 drafted per step), 16 tokens: the prefill commits 1; steps accepting 0, 3, nothing
    drafted, 1 and 4 of 4 commit 1, 4, 1, 2, 5 (2 left); the last step drafts only the 2 left, both
    right. So 5 drafts (the empty step is none), 4+4+4+4+2 = 18 drafted tokens, 0+3+1+4+2 = 10
    accepted, per block position the steps that accepted at least that many: [4, 3, 2, 1]; 6 verify
    steps committed 15 tokens."""
    true = truth(target, 24)
    oracle = Scheduled(true, [0, 3, None, 1, 4, 4], target.vocab_size)
    with serving(target, oracle, block_size=5, stop_ids=[]) as base:
        fresh = metrics(base)  # before any request: nothing counted, no tau yet
        assert (fresh["requests_total"], fresh["drafts"], fresh["tau"]) == (0, 0, None)
        code, r = post(base, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        assert code == 200, r
        assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
        assert r["choices"][0]["text"] == target.tokenizer.decode(true[:16], skip_special_tokens=True)
        m = metrics(base)
        assert (m["drafts"], m["draft_tokens"], m["accepted_tokens"]) == (5, 18, 10)
        assert m["accepted_per_position"] == [4, 3, 2, 1]
        assert (m["verify_steps"], m["committed"], m["tau"]) == (6, 15, 2.5)
        assert (m["requests_total"], m["prompt_tokens_total"], m["completion_tokens_total"]) == (1, 7, 16)
        p = prometheus(base)
    assert p[("flashdraft:spec_decode_num_drafts_total", ())] == 5
    assert p[("flashdraft:spec_decode_num_draft_tokens_total", ())] == 18
    assert p[("flashdraft:spec_decode_num_accepted_tokens_total", ())] == 10
    per_pos = {
        int(k[1][0][1]): v
        for k, v in p.items()
        if k[0] == "flashdraft:spec_decode_num_accepted_tokens_per_pos_total"
    }
    assert per_pos == {1: 4, 2: 3, 3: 2, 4: 1}
    assert p[("flashdraft:generation_tokens_total", ())] == 16
    assert p[("flashdraft:request_success_total", (("finished_reason", "length"),))] == 1


def test_ignore_eos_ignores_the_stop_token(target):
    """The stop token is the one the greedy path emits third, inside a fully accepted block: without
    ignore_eos the answer ends there ("stop"); with it, generation runs to max_tokens ("length")."""
    true = truth(target, 24)
    eos = true[2]
    assert eos not in true[:2]
    oracle = Scheduled(true, [99] * 24, target.vocab_size)  # always right
    with serving(target, oracle, block_size=6, stop_ids=[eos]) as base:
        code, r = post(base, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
        assert code == 200, r
        assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (3, "stop")
        oracle.step = 0
        code, r = post(base, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert code == 200, r
        assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) == (12, "length")
        assert r["choices"][0]["text"] == target.tokenizer.decode(true[:12], skip_special_tokens=True)
