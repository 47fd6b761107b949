"""`flashdraft serve`, end to end: a real server process on loopback, spoken to with the official `openai`
client (and raw HTTP for what that client cannot send).

The target is a tiny random float64 Llama saved with a byte-level BPE tokenizer (so multi-byte characters
arrive in pieces) and a ChatML chat template; the draft is random, with a sliding-window layer. Greedy
answers must equal `flashdraft.decode.generate` on the same prompt ids, whatever else the batch holds.
"""

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from conftest import make_draft, make_hf_model

from flashdraft import DFlashProposer, GenerationConfig, Target, generate
from flashdraft.draft import DFlashDraft
from flashdraft.serve import TextStream

KEY = "test-key-123"
CONTEXT = 1024
CHATML = (  # with a thinking switch, as Qwen3's template has (chat_template_kwargs reach it)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Café, naïve, über, señor: accents are two bytes in UTF-8.",
    "日本語のテキストは三バイトです。中文也是。",
    "Emoji take four bytes: 🙂 🚀 🎉, and so do some symbols 𝄞.",
    "def add(a, b):\n    return a + b\n",
] * 4


def make_tokenizer():
    """A small byte-level BPE tokenizer (about 300 tokens) with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        chat_template=CHATML,
        clean_up_tokenization_spaces=False,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url, body=None, headers=None, raw: bytes | None = None):
    """(status, parsed JSON) for a GET, or a POST of `body` (JSON) or `raw` bytes."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    tok = make_tokenizer()
    model = make_hf_model("llama", vocab=320, layers=4, max_pos=CONTEXT)
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    # The draft has a sliding-window layer (window 4, shorter than its block of 8): the engine serves
    # such drafts in batches like any other.
    draft = make_draft(model, layers=2, block_size=8, mask_token_id=tok.mask_token_id)
    windowed = draft.config.replace(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    sliding = DFlashDraft(windowed).to(torch.float64)
    sliding.load_state_dict(draft.state_dict())
    sliding.save_pretrained(root / "draft")

    port = _free_port()
    log = open(root / "server.log", "w")
    # fixed speculation: every step drafts, so the sliding-window draft is exercised in every batch
    cmd = [sys.executable, "-m", "flashdraft", "serve", "--target", str(root / "target"), "--draft",
           str(root / "draft"), "--dtype", "float64", "--port", str(port), "--api-key", KEY,
           "--max-batch-size", "4", "--model-name", "tiny", "--max-body-bytes", "100000",
           "--log-level", "warning", "--speculation", "fixed"]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    target = Target.from_pretrained(root / "target", dtype=torch.float64)  # while the server starts
    draft = DFlashDraft.from_pretrained(root / "draft", dtype=torch.float64)
    deadline = time.time() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{(root / 'server.log').read_text()}")
        try:
            if _http(base + "/health")[0] == 200:
                break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"the server did not come up:\n{(root / 'server.log').read_text()}")
        time.sleep(0.2)

    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield {"base": base, "client": client, "target": target, "draft": draft, "proc": proc}
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def reference(setup, ids, max_tokens):
    """What plain batch-1 speculative decoding gives: (text, token count, finish reason)."""
    t = setup["target"]
    cfg = GenerationConfig(max_new_tokens=max_tokens, stop_ids=t.stop_ids)
    res = generate(t, ids, DFlashProposer(setup["draft"], t), cfg)
    return t.tokenizer.decode(res.tokens, skip_special_tokens=True), len(res.tokens), res.stop_reason


def chat_ids(setup, content):
    tok = setup["target"].tokenizer
    return list(
        tok.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False
        )
    )


# -- the good paths ------------------------------------------------------------------------------


def test_health_and_models(setup):
    assert _http(setup["base"] + "/health") == (200, {"status": "ok"})
    fresh = _metrics(setup)  # before any request: no tau yet
    assert fresh["requests_total"] == 0 and fresh["tau"] is None
    models = setup["client"].models.list()
    assert [m.id for m in models.data] == ["tiny"]


@pytest.mark.parametrize("prompt", ["What is the capital of France?", "日本語で答えて 🙂"])
def test_chat_greedy_equals_generate(setup, prompt):
    client = setup["client"]
    text, n, reason = reference(setup, chat_ids(setup, prompt), 40)
    msgs = [{"role": "user", "content": prompt}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == reason
    assert r.usage.prompt_tokens == len(chat_ids(setup, prompt)) and r.usage.completion_tokens == n
    assert r.usage.total_tokens == r.usage.prompt_tokens + n

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text  # random bytes: invalid UTF-8 shows as U+FFFD on both sides
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == reason and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n


def test_completions_greedy_equals_generate(setup):
    client = setup["client"]
    tok = setup["target"].tokenizer
    prompt = "The quick brown fox"
    ids = tok(prompt, add_special_tokens=True)["input_ids"]
    text, n, reason = reference(setup, ids, 30)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0)
    assert r.object == "text_completion"
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (text, n, reason)
    # token-id prompts, streamed
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=ids,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == n and chunks[-1].usage.prompt_tokens == len(ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason


def test_concurrent_requests_each_equal_alone(setup):
    """Six streams at once on a batch of four: rows join and leave the batch mid-flight, and every
    answer is still what batch-1 decoding gives for that prompt alone."""
    client, tok = setup["client"], setup["target"].tokenizer
    prompts = [f"Prompt number {i}: {'über ' * i}count" for i in range(6)]
    lengths = [12, 30, 5, 25, 18, 40]
    want = [reference(setup, tok(p)["input_ids"], m) for p, m in zip(prompts, lengths, strict=True)]
    got = [None] * len(prompts)

    def ask(i):
        s = client.completions.create(
            model="tiny", prompt=prompts[i], max_tokens=lengths[i], temperature=0, stream=True
        )
        got[i] = "".join(c.choices[0].text for c in s)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == [w[0] for w in want]


def test_stop_string_truncates_and_frees_the_row(setup):
    client, tok = setup["client"], setup["target"].tokenizer
    prompt = "Café, naïve"
    full, _, _ = reference(setup, tok(prompt)["input_ids"], 40)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3, f"the random output is too short for this test: {full!r}"
    want = full[: full.index(stop)]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    s = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in s) == want


def test_sampling_runs_with_seed(setup):
    r = setup["client"].chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=20,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 50},
    )
    assert 1 <= r.usage.completion_tokens <= 20 and r.choices[0].finish_reason in ("stop", "length")


# -- bad input -----------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hello"}]
BAD = [
    # (id, endpoint, body, status, words the message must contain)
    ("unknown model", "chat/completions", {"model": "gpt-9", "messages": MSG}, 404, "does not exist"),
    ("missing messages", "chat/completions", {"model": "tiny", "max_tokens": 5}, 400, "messages"),
    ("empty messages", "chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("message without content", "chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 3}]}, 400, "content"),
    ("max_tokens 0", "chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens < 0", "completions", {"model": "tiny", "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens beyond context", "completions", {"model": "tiny", "prompt": "hi", "max_tokens": CONTEXT}, 400, "context"),
    ("max_tokens not a number", "completions", {"model": "tiny", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("temperature < 0", "chat/completions", {"model": "tiny", "messages": MSG, "temperature": -0.5}, 400, "temperature"),
    ("temperature > 2", "completions", {"model": "tiny", "prompt": "hi", "temperature": 7}, 400, "temperature"),
    ("top_p 0", "chat/completions", {"model": "tiny", "messages": MSG, "top_p": 0}, 400, "top_p"),
    ("top_p > 1", "completions", {"model": "tiny", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top_k < -1", "completions", {"model": "tiny", "prompt": "hi", "top_k": -4}, 400, "top_k"),
    ("empty prompt", "completions", {"model": "tiny", "prompt": ""}, 400, "empty"),
    ("token id outside vocab", "completions", {"model": "tiny", "prompt": [1, 99999]}, 400, "vocabulary"),
    ("n > 1", "completions", {"model": "tiny", "prompt": "hi", "n": 2}, 400, "n must be 1"),
    ("logprobs", "chat/completions", {"model": "tiny", "messages": MSG, "logprobs": True}, 400, "not supported"),
    ("repetition_penalty", "completions", {"model": "tiny", "prompt": "hi", "repetition_penalty": 1.3}, 400, "not supported"),
    ("min_p", "chat/completions", {"model": "tiny", "messages": MSG, "min_p": 0.1}, 400, "not supported"),
    ("chat_template_kwargs not an object", "chat/completions", {"model": "tiny", "messages": MSG, "chat_template_kwargs": "x"}, 400, "chat_template_kwargs"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error(setup, case):
    _, path, body, status, words = case
    code, reply = _http(f"{setup['base']}/v1/{path}", body, {"Authorization": f"Bearer {KEY}"})
    assert code == status, reply
    err = reply["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"


def test_bad_input_through_the_openai_client(setup):
    client = setup["client"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=MSG, temperature=-1)


def test_malformed_and_oversize_bodies(setup):
    url, auth = f"{setup['base']}/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}
    code, reply = _http(url, headers=auth, raw=b'{"model": "tiny", "messages": [')
    assert code == 400 and "not valid JSON" in reply["error"]["message"]
    code, reply = _http(url, headers=auth, raw=b"[1, 2]")
    assert code == 400 and "JSON object" in reply["error"]["message"]
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 200_000}]}
    code, reply = _http(url, big, auth)
    assert code == 413 and "larger than 100000 bytes" in reply["error"]["message"]
    # still serving
    r = setup["client"].completions.create(model="tiny", prompt="ok", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_api_key_is_required(setup):
    base = setup["base"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        code, reply = _http(base + "/v1/chat/completions", {"model": "tiny", "messages": MSG}, headers)
        assert code == 401 and reply["error"]["code"] == "invalid_api_key"
        assert _http(base + "/v1/models", headers=headers)[0] == 401
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert _http(base + "/health")[0] == 200  # health needs no key


def _metrics(setup):
    return _http(setup["base"] + "/metrics.json", headers={"Authorization": f"Bearer {KEY}"})[1]


def test_chat_template_kwargs_reach_the_template(setup):
    """Thinking mode off, as Qwen3-style templates take it: the prompt the server builds is the one the
    template renders with those options; a neutral repetition_penalty (1.0) is accepted."""
    tok, client = setup["target"].tokenizer, setup["client"]
    msgs = [{"role": "user", "content": "Say hi."}]
    off = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False, enable_thinking=False)
    assert len(off) > len(chat_ids(setup, "Say hi."))
    r = client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=2,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "repetition_penalty": 1.0},
    )
    assert r.usage.prompt_tokens == len(off)


def test_prometheus_metrics(setup):
    """/metrics speaks Prometheus' text format (read back by its own parser) with vLLM-style names."""
    from prometheus_client.parser import text_string_to_metric_families

    setup["client"].completions.create(model="tiny", prompt="Count: one two", max_tokens=12, temperature=0)
    deadline = time.time() + 30
    while _metrics(setup)["requests_in_flight"] and time.time() < deadline:
        time.sleep(0.1)
    code_and_text = urllib.request.urlopen(
        urllib.request.Request(setup["base"] + "/metrics", headers={"Authorization": f"Bearer {KEY}"}),
        timeout=30,
    )
    assert code_and_text.headers["Content-Type"].startswith("text/plain")
    text = code_and_text.read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            samples[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    m = _metrics(setup)
    assert samples[("flashdraft:spec_decode_num_accepted_tokens_total", ())] == m["accepted_tokens"]
    assert samples[("flashdraft:spec_decode_num_draft_tokens_total", ())] == m["draft_tokens"] > 0
    assert samples[("flashdraft:spec_decode_num_drafts_total", ())] == m["drafts"] > 0
    assert samples[("flashdraft:generation_tokens_total", ())] == m["completion_tokens_total"]
    assert ("flashdraft:request_success_total", (("finished_reason", "length"),)) in samples
    per_pos = {k[1][0][1]: v for k, v in samples.items() if k[0].endswith("accepted_tokens_per_pos_total")}
    assert sum(per_pos.values()) == m["accepted_tokens"]


def test_disconnect_mid_stream_frees_the_slot(setup):
    before = _metrics(setup)
    stream = setup["client"].completions.create(
        model="tiny",
        prompt="A long story:",
        max_tokens=CONTEXT - 32,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    got = 0
    for chunk in stream:
        got += len(chunk.choices[0].text) > 0
        if got == 3:
            break
    stream.close()
    deadline = time.time() + 30
    while (m := _metrics(setup))["requests_in_flight"] and time.time() < deadline:
        time.sleep(0.1)
    assert m["requests_in_flight"] == 0
    assert m["requests_finished"]["disconnected"] == before["requests_finished"]["disconnected"] + 1
    assert m["completion_tokens_total"] - before["completion_tokens_total"] < CONTEXT - 64  # cut short
    r = setup["client"].completions.create(model="tiny", prompt="still there?", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_disconnect_before_a_whole_answer_frees_the_slot(setup):
    """A non-streaming client that goes away is noticed too (the server polls for it)."""
    before = _metrics(setup)
    host, port = setup["base"].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {
        "model": "tiny",
        "prompt": "Go on:",
        "max_tokens": CONTEXT - 32,
        "temperature": 0,
        "ignore_eos": True,
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {KEY}"})
    time.sleep(0.3)
    conn.close()
    deadline = time.time() + 30
    while (m := _metrics(setup))["requests_in_flight"] and time.time() < deadline:
        time.sleep(0.1)
    assert m["requests_in_flight"] == 0
    assert m["requests_finished"]["disconnected"] == before["requests_finished"]["disconnected"] + 1
    assert m["completion_tokens_total"] - before["completion_tokens_total"] < CONTEXT - 64


def test_metrics(setup):
    m = _metrics(setup)
    assert m["requests_total"] >= 1 and m["completion_tokens_total"] >= 1 and m["tokens_per_s"] > 0
    assert m["tau"] is not None and 1 <= m["tau"] <= 8
    assert m["requests_rejected"] >= len(BAD)


# -- incremental text ----------------------------------------------------------------------------


def test_text_stream_never_splits_characters():
    tok = make_tokenizer()
    text = "Café 日本語 🙂🚀 über 𝄞 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and len(ids) > len(text.split())  # characters span tokens
    s = TextStream(tok)
    pieces = [s.push([i], final=k == len(ids) - 1)[0] for k, i in enumerate(ids)]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert sum(p == "" for p in pieces) > 0  # some tokens had to wait for the rest of their character


def test_text_stream_ends_with_the_whole_decode():
    """A tokenizer that rewrites earlier text as more arrives (space clean-up before punctuation):
    the final text is still the decode of the whole output."""
    base = make_tokenizer()

    class Tidy:  # what WordPiece-style clean-up does: " ," -> ","
        def decode(self, ids, skip_special_tokens=True):
            text = base.decode(ids, skip_special_tokens=skip_special_tokens)
            return text.replace(" ,", ",").replace(" .", ".").replace(" !", "!")

    ids = base("Paris , the fox . Done !", add_special_tokens=False)["input_ids"]
    full = Tidy().decode(ids)
    assert full == "Paris, the fox. Done!"
    s = TextStream(Tidy())
    for k, i in enumerate(ids):
        s.push([i], final=k == len(ids) - 1)
    assert s.result == full


def test_text_stream_stop_strings_are_held_back():
    tok = make_tokenizer()
    ids = tok("The quick brown fox jumps", add_special_tokens=False)["input_ids"]
    s = TextStream(tok, stops=["fox"])
    out, stopped = "", False
    for i in ids:
        piece, stopped = s.push([i])
        out += piece
        assert "f" not in out  # nothing that could start "fox" is sent before it is ruled out
        if stopped:
            break
    assert stopped and out == "The quick brown "
