"""`flashdraft serve`, end to end: a real server process on loopback, spoken to with the official `openai`
client (and raw HTTP for what that client cannot send).

The target is a tiny random float64 Llama saved with a byte-level BPE tokenizer (so multi-byte characters
arrive in pieces) and a ChatML chat template; the draft is random, with a sliding-window layer. Greedy
answers must equal `flashdraft.engine.decode.generate` on the same prompt ids, whatever else the batch holds.
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
from flashdraft.models.draft import DFlashDraft
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
    yield {
        "base": base,
        "client": client,
        "target": target,
        "draft": draft,
        "proc": proc,
        "log": root / "server.log",
    }
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
    banner = [line for line in setup["log"].read_text().splitlines() if line.startswith("flashdraft serve:")]
    assert len(banner) == 1 and banner[0].endswith(f" on {setup['base']}/v1"), banner
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
    # strict types, as OpenAI's: no quietly converted strings
    ("max_tokens a string", "completions", {"model": "tiny", "prompt": "hi", "max_tokens": "8"}, 400, 'invalid `max_tokens`: got "8", send a valid integer'),
    ("max_tokens a float", "chat/completions", {"model": "tiny", "messages": MSG, "max_tokens": 8.5}, 400, "invalid `max_tokens`: got 8.5"),
    ("temperature a string", "chat/completions", {"model": "tiny", "messages": MSG, "temperature": "0.5"}, 400, "invalid `temperature`"),
    ("seed a string", "completions", {"model": "tiny", "prompt": "hi", "seed": "7"}, 400, "invalid `seed`"),
    ("stream a string", "completions", {"model": "tiny", "prompt": "hi", "stream": "true"}, 400, "invalid `stream`: got \"true\", send a valid boolean"),
    ("ignore_eos a number", "completions", {"model": "tiny", "prompt": "hi", "ignore_eos": 1}, 400, "invalid `ignore_eos`"),
    ("stop a number", "completions", {"model": "tiny", "prompt": "hi", "stop": 3}, 400, "invalid `stop`: got 3, send a valid string or a valid list"),
    ("stream_options unknown key", "completions", {"model": "tiny", "prompt": "hi", "stream": True, "stream_options": {"usage": True}}, 400, "unknown field `stream_options.usage`: leave it out"),
    ("missing model", "completions", {"prompt": "hi"}, 400, "`model` is required"),
    ("unknown role", "chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role is 'wizard': send one of system, developer, user, assistant"),
    ("null content", "chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": None}]}, 400, "messages[0].content is null or missing: send a string"),
    ("missing content", "chat/completions", {"model": "tiny", "messages": [MSG[0], {"role": "user"}]}, 400, "messages[1].content is null or missing"),
    ("text part without text", "chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "string `text`"),
    ("message field", "chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400, "messages[0].name is not supported"),
    ("unknown field", "completions", {"model": "tiny", "prompt": "hi", "max_new_tokens": 5}, 400, "unknown field `max_new_tokens`: leave it out"),
    ("unknown field (chat)", "chat/completions", {"model": "tiny", "messages": MSG, "temprature": 0}, 400, "unknown field `temprature`"),
    ("chat option on completions", "completions", {"model": "tiny", "prompt": "hi", "chat_template_kwargs": {}}, 400, "unknown field `chat_template_kwargs`"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error(setup, case):
    _, path, body, status, words = case
    code, reply = _http(f"{setup['base']}/v1/{path}", body, {"Authorization": f"Bearer {KEY}"})
    assert code == status, reply
    err = reply["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error", err["message"]


def test_harmless_openai_fields_are_accepted(setup):
    """What OpenAI's clients send that changes no output: bookkeeping fields, n=1, nulls for optional
    parameters, a developer message, and an earlier reply sent back with its empty fields."""
    reply = {"role": "assistant", "content": "Hello.", "refusal": None, "tool_calls": None, "annotations": []}
    body = {
        "model": "tiny",
        "messages": [{"role": "developer", "content": "Be brief."}, MSG[0], reply, MSG[0]],
        "max_tokens": 2,
        "temperature": None,
        "stop": None,
        "n": 1,
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "stream_options": None,
        "logprobs": False,
    }
    auth = {"Authorization": f"Bearer {KEY}"}
    code, r = _http(setup["base"] + "/v1/chat/completions", body, auth)
    assert code == 200, r
    system = [
        {"role": "system", "content": "Be brief."},
        MSG[0],
        {"role": "assistant", "content": "Hello."},
        MSG[0],
    ]
    tok = setup["target"].tokenizer
    want = tok.apply_chat_template(system, add_generation_prompt=True, return_dict=False)
    assert r["usage"]["prompt_tokens"] == len(want)  # developer is rendered as system
    code, r = _http(
        setup["base"] + "/v1/completions",
        {"model": "tiny", "prompt": "hi", "max_tokens": 2, "user": "u"},
        auth,
    )
    assert code == 200, r


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


AUTH = [
    # (id, Authorization header or None, accepted): RFC 6750's `Bearer` 1*SP token; the scheme is
    # case-insensitive (RFC 7235) and a header value's surrounding whitespace is not part of it.
    ("missing", None, False),
    ("empty token", "Bearer ", False),
    ("scheme only", "Bearer", False),
    ("a prefix of the key", f"Bearer {KEY[:-1]}", False),
    ("an extension of the key", f"Bearer {KEY}4", False),
    ("the key twice", f"Bearer {KEY} {KEY}", False),
    ("another scheme", f"Basic {KEY}", False),
    ("no scheme", KEY, False),
    ("no space", f"Bearer{KEY}", False),
    ("lowercase scheme", f"bearer {KEY}", True),
    ("uppercase scheme", f"BEARER {KEY}", True),
    ("whitespace around the token", f"Bearer   {KEY}  ", True),
    ("right", f"Bearer {KEY}", True),
]


@pytest.mark.parametrize("case", AUTH, ids=[a[0] for a in AUTH])
def test_every_wrong_authorization_is_refused(setup, case):
    _, header, accepted = case
    headers = {} if header is None else {"Authorization": header}
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    for code, reply in (
        _http(setup["base"] + "/v1/models", headers=headers),
        _http(setup["base"] + "/v1/completions", body, headers),
        _http(setup["base"] + "/metrics.json", headers=headers),
    ):
        if accepted:
            assert code == 200, reply
        else:
            assert code == 401 and reply["error"]["code"] == "invalid_api_key", reply


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
    """What this test's own requests add (whatever ran before it): one request, its tokens, one refusal."""
    before = _metrics(setup)
    body = {"model": "tiny", "prompt": "Count:", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    assert _http(setup["base"] + "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert (
        _http(setup["base"] + "/v1/completions", {**body, "top_p": 7}, {"Authorization": f"Bearer {KEY}"})[0]
        == 400
    )
    m = _metrics(setup)
    assert m["requests_total"] - before["requests_total"] == 1
    assert m["completion_tokens_total"] - before["completion_tokens_total"] == 9
    assert m["requests_finished"]["length"] - before["requests_finished"]["length"] == 1
    assert m["requests_rejected"] - before["requests_rejected"] == 1
    assert m["tokens_per_s"] > 0 and m["tau"] is not None and 1 <= m["tau"] <= 8


# -- defaults, rare flags and exact limits --------------------------------------------------------


def _post(setup, path, body):
    return _http(f"{setup['base']}/v1/{path}", body, {"Authorization": f"Bearer {KEY}"})


def _long_chat(setup, room: int) -> tuple[list[dict], int]:
    """Messages whose prompt leaves at least `room` tokens of the context (a dozen more at most), and
    their prompt length."""
    words = "The quick brown fox jumps over the lazy dog. "
    n = 1
    while len(chat_ids(setup, words * n)) <= CONTEXT - room:
        n *= 2
    lo, hi = n // 2, n
    while hi - lo > 1:  # the most repeats that still leave `room`: lo does, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(chat_ids(setup, words * mid)) <= CONTEXT - room else (lo, mid)
    return [{"role": "user", "content": words * lo}], len(chat_ids(setup, words * lo))


def test_omitted_max_tokens_takes_openai_defaults(setup):
    """16 tokens on /v1/completions, the rest of the context on chat: the prompt leaves more than 16, and
    chat then ends exactly at the context (which is also the largest request that fits)."""
    msgs, n = _long_chat(setup, 40)
    room = CONTEXT - n
    assert 16 < room < 64
    code, r = _post(
        setup, "chat/completions", {"model": "tiny", "messages": msgs, "temperature": 0, "ignore_eos": True}
    )
    assert code == 200, r
    assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) == (n, room)
    assert r["choices"][0]["finish_reason"] == "length"
    ids = chat_ids(setup, msgs[0]["content"])
    code, r = _post(
        setup, "completions", {"model": "tiny", "prompt": ids, "temperature": 0, "ignore_eos": True}
    )
    assert code == 200, r
    assert r["usage"]["completion_tokens"] == 16 and r["choices"][0]["finish_reason"] == "length"
    # with less than 16 left, the default shrinks to what is left
    code, r = _post(
        setup, "completions", {"model": "tiny", "prompt": [5] * (CONTEXT - 3), "ignore_eos": True}
    )
    assert code == 200 and r["usage"]["completion_tokens"] == 3, r


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_omitted_temperature_samples_at_one(setup, path):
    """Omitted temperature = 1: the same tokens as an explicit 1 with the same seed, and not greedy's."""
    body = {"model": "tiny", "max_tokens": 24, "seed": 1234, "ignore_eos": True}
    body |= {"prompt": "Once upon a time"} if path == "completions" else {"messages": MSG}

    def text(**extra):
        code, r = _post(setup, path, body | extra)
        assert code == 200, r
        choice = r["choices"][0]
        return choice["text"] if path == "completions" else choice["message"]["content"]

    omitted = text()
    assert omitted == text(temperature=1)
    assert omitted != text(temperature=0)
    assert omitted != text(temperature=0.5)


def test_stop_string_in_the_last_step_of_a_request_at_its_length(setup):
    """The last step both reaches max_tokens and completes a stop string: the stop wins (as in OpenAI
    and vLLM): finish_reason "stop" and the text cut before the string."""
    tok = setup["target"].tokenizer
    ids = tok("The quick brown fox", add_special_tokens=True)["input_ids"]
    t = setup["target"]
    full = generate(
        t, ids, DFlashProposer(setup["draft"], t), GenerationConfig(max_new_tokens=40, stop_ids=[])
    )
    for m in range(40, 8, -1):  # a length whose text ends in two plain characters seen nowhere before
        text = tok.decode(full.tokens[:m], skip_special_tokens=True)
        stop = text[-2:]
        if stop.isprintable() and "\ufffd" not in stop and text.find(stop) == len(text) - 2:
            break
    else:
        pytest.fail("no usable stop string in the random output")
    body = {
        "model": "tiny",
        "prompt": ids,
        "max_tokens": m,
        "temperature": 0,
        "ignore_eos": True,
        "stop": [stop],
    }
    code, r = _post(setup, "completions", body)
    assert code == 200, r
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (text[:-2], "stop")
    del body["ignore_eos"]
    chunks = list(setup["client"].completions.create(stream=True, extra_body={"ignore_eos": True}, **body))
    assert "".join(c.choices[0].text for c in chunks) == text[:-2]
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_context_boundary_is_exact(setup, path):
    """prompt + max_tokens equal to the context is served; one more token is a 400 naming the most."""
    if path == "completions":
        n, body = CONTEXT - 8, {"prompt": [7] * (CONTEXT - 8)}
    else:
        msgs, n = _long_chat(setup, 8)
        body = {"messages": msgs}
    body |= {"model": "tiny", "temperature": 0, "ignore_eos": True}
    code, r = _post(setup, path, body | {"max_tokens": CONTEXT - n})
    assert code == 200 and r["usage"]["completion_tokens"] == CONTEXT - n, r
    code, r = _post(setup, path, body | {"max_tokens": CONTEXT - n + 1})
    assert code == 400 and f"lower max_tokens to at most {CONTEXT - n}" in r["error"]["message"], r
    if path == "completions":  # a prompt that fills the context leaves no room at all
        code, r = _post(setup, path, {"model": "tiny", "prompt": [7] * CONTEXT})
        assert code == 400 and "fills the model's context" in r["error"]["message"], r


def test_token_id_boundary_is_exact(setup):
    vocab = setup["target"].vocab_size
    code, r = _post(setup, "completions", {"model": "tiny", "prompt": [1, vocab - 1], "max_tokens": 1})
    assert code == 200, r
    code, r = _post(setup, "completions", {"model": "tiny", "prompt": [1, vocab], "max_tokens": 1})
    assert code == 400 and f"outside the vocabulary 0..{vocab - 1}" in r["error"]["message"], r
    code, r = _post(setup, "completions", {"model": "tiny", "prompt": [-1, 1], "max_tokens": 1})
    assert code == 400 and "outside the vocabulary" in r["error"]["message"], r


def test_seeded_request_ignores_the_batch_and_the_global_rng(setup):
    """A seeded sampled request gives the same text alone, after unseeded sampled requests moved the
    server's global torch RNG, and while unseeded sampled requests share its batch."""
    client = setup["client"]
    seeded = {"model": "tiny", "prompt": "Seeded story:", "max_tokens": 24, "temperature": 1, "seed": 99,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    alone = client.completions.create(**seeded).choices[0].text
    for _ in range(2):  # unseeded: they draw from the server's global generator
        client.completions.create(model="tiny", prompt="Noise:", max_tokens=8, temperature=1)
    assert client.completions.create(**seeded).choices[0].text == alone
    started, done, got = threading.Barrier(4), threading.Event(), {}

    def noise(i):
        s = client.completions.create(
            model="tiny", prompt=f"Noise {i}:", max_tokens=CONTEXT - 32, temperature=1, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for k, _ in enumerate(s):
            if k == 1:
                started.wait(timeout=60)
            if done.is_set():
                break
        s.close()  # the server frees the row at its next step

    threads = [threading.Thread(target=noise, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(timeout=60)  # the three are decoding: the seeded request joins their batch
    got["batched"] = client.completions.create(**seeded).choices[0].text
    in_flight = _metrics(setup)["requests_in_flight"]
    done.set()
    for t in threads:
        t.join(timeout=120)
    assert got["batched"] == alone
    assert in_flight >= 1  # the noise was still decoding when the seeded request ended


def test_busy_port_is_one_line_before_any_model_loads(tmp_path):
    """`serve` on a port another program holds: one line naming the port and the fix, exit status 2, no
    traceback and no "running on" banner; with a target that cannot load, still the port's error, so the
    check comes before loading."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        make_hf_model("llama", vocab=320, layers=1).save_pretrained(tmp_path / "target")
        make_tokenizer().save_pretrained(tmp_path / "target")
        (tmp_path / "broken").mkdir()
        (tmp_path / "broken" / "config.json").write_text("{ not json")  # a model that would fail to load
        for target in (tmp_path / "target", tmp_path / "broken"):
            cmd = [sys.executable, "-m", "flashdraft", "serve", "--target", str(target), "--port", str(port)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
            assert p.returncode == 2, p.stderr
            assert p.stderr.strip().splitlines() == [
                f"error: port {port} on 127.0.0.1 is already in use (another server?): pass another --port, "
                "or stop the program that holds it"
            ]
            assert "running" not in p.stdout and "http://" not in p.stdout, p.stdout


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
