"""`flashdraft datagen`: records, batched == unbatched greedy, kill -9 and resume, repair, the endpoint path.

A tiny random Llama with the real SmolLM2 tokenizer and chat template (from the converted cache),
so prompts go through a real chat template without any download."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import make_chat_target

from flashdraft.cli import main
from flashdraft.data import DataError, load_dataset
from flashdraft.train.datagen import (
    DatagenConfig,
    DataGenError,
    cut_response,
    meta_path,
    read_meta,
    read_records,
    run_datagen,
)

VOCAB = 49152


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models on a shared 2-core machine: one thread is ~20x faster than two fighting for cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _prompt_ids(tok, ex):
    return list(
        tok.apply_chat_template(ex.messages(), add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def _greedy_alone(model, prompt, n, stop_ids):
    """The reference: one prompt, no padding, plain greedy, cut at the first stop token."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=stop_ids,
            pad_token_id=stop_ids[0],
        )
    return cut_response(out[0, len(prompt) :].tolist(), stop_ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama + SmolLM2 tokenizer on disk. Besides the tokenizer's eos (2), a token that
    greedy decoding emits a few steps into one humaneval answer is made a stop token, so some
    responses end on a stop and others run to the length limit."""
    d = tmp_path_factory.mktemp("dg") / "tiny"
    model, tok = make_chat_target(d)
    ex = load_dataset("humaneval", limit=1)[0]
    first, _ = _greedy_alone(model, _prompt_ids(tok, ex), 8, [2])
    extra = next((t for t in first[3:] if t not in first[:3]), first[-1])
    model.generation_config.eos_token_id = [2, extra]
    model.save_pretrained(d)
    return d, model, tok, [2, extra]


def _cfg(tiny_dir, out, **kw):
    base = dict(
        target=str(tiny_dir),
        datasets=["humaneval"],
        out=out,
        max_new_tokens=16,
        batch_size=3,
        dtype="float32",
        runner="transformers",  # these tests compare with transformers' generate
        limit=8,
        progress=False,
    )
    return DatagenConfig(**(base | kw))


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_are_well_formed_and_batched_greedy_equals_unbatched(tiny, tmp_path):
    d, model, tok, stops = tiny
    out = tmp_path / "a.jsonl"
    s = run_datagen(_cfg(d, out, max_new_tokens=20))
    recs = list(read_records(out, vocab_size=VOCAB))
    examples = load_dataset("humaneval", limit=8)
    assert (
        s.written == 8 and s.skipped == 0 and sorted(r["id"] for r in recs) == sorted(e.id for e in examples)
    )
    assert s.response_tokens == sum(len(r["response_ids"]) for r in recs) and s.tokens_per_s > 0
    by_id = {r["id"]: r for r in recs}
    finishes = set()
    for ex in examples:
        r = by_id[ex.id]
        prompt = _prompt_ids(tok, ex)
        assert r["dataset"] == "humaneval" and r["prompt_ids"] == prompt
        assert r["loss_mask"] == [0] * len(prompt) + [1] * len(r["response_ids"])
        response, finish = _greedy_alone(model.float(), prompt, 20, stops)
        assert r["response_ids"] == response, ex.id  # left padding must not change greedy output
        assert r["finish"] == finish
        assert (finish == "stop") == (r["response_ids"][-1] in stops) and 2 not in r["response_ids"][:-1]
        finishes.add(finish)
    assert finishes == {"stop", "length"}  # both ends are exercised
    meta = read_meta(out)
    assert meta["target"] == str(d.resolve()) and meta["vocab_size"] == VOCAB and meta["stop_ids"] == stops
    assert meta["max_new_tokens"] == 20 and meta["datasets"] == ["humaneval"] and meta["backend"] == "local"


def test_the_serving_runner_answers_each_prompt_as_it_does_alone(tiny, tmp_path):
    """The default (`--runner auto`: the native runner, bf16 on our kernels, what `serve` runs) with 3
    rows under continuous batching: rows finish at different steps (on a stop token or at the length
    limit), the next prompt takes the freed row in place and rows that joined later hold dead slots. Each
    answer must have the bits of the same prompt decoded alone (batch 1), greedy and sampled (per-prompt
    seeds)."""
    d = tiny[0]
    common = dict(runner="auto", dtype="auto", max_new_tokens=24, seed=3)
    for temperature in (0.0, 1.0):
        alone, batched = tmp_path / f"alone{temperature}.jsonl", tmp_path / f"batched{temperature}.jsonl"
        run_datagen(_cfg(d, alone, batch_size=1, temperature=temperature, **common))
        run_datagen(_cfg(d, batched, batch_size=3, temperature=temperature, **common))
        assert "native runner" in read_meta(batched)["weights"]
        one = {r["id"]: r for r in _lines(alone)}
        many = {r["id"]: r for r in _lines(batched)}
        assert len(many) == 8 and one.keys() == many.keys()
        if temperature == 0:  # rows leave at different steps
            assert {r["finish"] for r in many.values()} == {"stop", "length"}
        for k, r in many.items():
            assert r["response_ids"] == one[k]["response_ids"], (temperature, k)


def test_max_prompt_tokens_skips_long_prompts_and_counts_them(tiny, tmp_path):
    d, _, tok, _ = tiny
    lengths = sorted(len(_prompt_ids(tok, ex)) for ex in load_dataset("humaneval", limit=8))
    cap = lengths[3]  # the four shortest prompts (and any as long as the fourth) pass
    out = tmp_path / "short.jsonl"
    s = run_datagen(_cfg(d, out, max_new_tokens=4, max_prompt_tokens=cap))
    kept = [len(r["prompt_ids"]) for r in read_records(out, vocab_size=VOCAB)]
    assert kept and max(kept) <= cap and s.written == sum(n <= cap for n in lengths)
    assert s.over_cap == 8 - s.written > 0 and "over --max-prompt-tokens" in s.line()
    with pytest.raises(DataGenError, match="--max-prompt-tokens must be >= 1"):
        run_datagen(_cfg(d, tmp_path / "z.jsonl", max_prompt_tokens=0))


def test_progress_bar_counts_tokens_before_any_conversation_is_done(tiny, tmp_path, monkeypatch, capsys):
    """A batch of long answers finishes no row for minutes: the bar must show the tokens generated so far
    (and their rate) while it still reads 0/N, not sit still until a whole conversation is done."""
    from flashdraft.train import datagen

    monkeypatch.setattr(datagen, "PROGRESS_EVERY_S", 0.0)  # redraw at every step
    run_datagen(_cfg(tiny[0], tmp_path / "p.jsonl", progress=True, limit=2, batch_size=2, max_new_tokens=8))
    err = capsys.readouterr().err
    assert re.search(r" 0/2 \[.*, [1-9]\d* tokens, \d+\.\d tok/s\]", err), err


def test_cut_response():
    assert cut_response([5, 6, 2, 7, 2], [2, 9]) == ([5, 6, 2], "stop")
    assert cut_response([5, 6, 7], [2]) == ([5, 6, 7], "length")
    assert cut_response([9], [2, 9]) == ([9], "stop")


def _cli(tiny_dir, out, *extra):
    return [
        sys.executable,
        "-m",
        "flashdraft",
        "datagen",
        "--target",
        str(tiny_dir),
        "--dataset",
        "humaneval",
        "--limit",
        "24",
        "--batch-size",
        "4",
        "--max-new-tokens",
        "40",
        "--dtype",
        "float64",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def test_kill_9_then_resume_loses_and_duplicates_nothing(tiny, tmp_path):
    d = tiny[0]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    out = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(_cli(d, out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while not (out.exists() and out.read_bytes().count(b"\n") >= 1):
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "no record written in 120 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    written_before = out.read_bytes().count(b"\n")
    assert 1 <= written_before < 24, "the run was not interrupted mid-way"

    done = subprocess.run(_cli(d, out), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{written_before} already done" in done.stdout

    # The same run uninterrupted, in process.
    ref = tmp_path / "ref.jsonl"
    run_datagen(_cfg(d, ref, limit=24, batch_size=4, max_new_tokens=40, dtype="float64"))
    resumed = _lines(out)  # every line parses
    ids = [r["id"] for r in resumed]
    assert len(ids) == len(set(ids)) == 24  # nothing lost, nothing twice
    assert {r["id"]: r for r in resumed} == {r["id"]: r for r in _lines(ref)}
    assert len(list(read_records(out, vocab_size=VOCAB))) == 24


def test_partial_last_line_is_repaired_and_other_settings_are_refused(tiny, tmp_path):
    d = tiny[0]
    out = tmp_path / "p.jsonl"
    run_datagen(_cfg(d, out, limit=4, batch_size=4))
    first = out.read_bytes()
    cut = first.splitlines(keepends=True)[-1]
    with out.open("ab") as f:
        f.write(cut[: len(cut) // 2])  # what a crash mid-write leaves
    assert len(list(read_records(out))) == 4  # the reader skips the partial line
    s = run_datagen(_cfg(d, out, limit=6, batch_size=4))
    assert s.repaired_bytes == len(cut) // 2 and s.skipped == 4 and s.written == 2
    assert out.read_bytes().startswith(first)
    recs = _lines(out)
    assert len(recs) == len({r["id"] for r in recs}) == 6

    with pytest.raises(DataGenError, match=r"max_new_tokens 16 \(now 17, --max-new-tokens\)"):
        run_datagen(_cfg(d, out, limit=6, max_new_tokens=17))
    with pytest.raises(DataGenError, match=r"temperature"):
        run_datagen(_cfg(d, out, limit=6, temperature=0.7))
    with pytest.raises(
        DataGenError, match=r"weights 'transformers, dense weights, float32' \(now 'native runner"
    ):
        run_datagen(_cfg(d, out, limit=6, runner="native"))  # another model's answers: another file
    # A different batch size or more prompts is fine: same records.
    assert run_datagen(_cfg(d, out, limit=7, batch_size=2)).written == 1

    # Corrupt middle line: refused, nothing changed.
    lines = out.read_bytes().splitlines(keepends=True)
    lines[2] = b'{"id": "humaneval/2", "prompt_\n'
    out.write_bytes(b"".join(lines))
    with pytest.raises(DataGenError, match=r"line 3 is not JSON"):
        run_datagen(_cfg(d, out, limit=7))
    with pytest.raises(DataGenError, match=r"line 3 is not JSON"):
        list(read_records(out))
    assert out.read_bytes() == b"".join(lines)


def test_bad_input(tiny, tmp_path, capsys):
    d = tiny[0]
    out = tmp_path / "b.jsonl"
    run_datagen(_cfg(d, out, limit=2))
    with pytest.raises(DataGenError, match=r"record 'humaneval/\d+'.*another tokenizer"):
        list(read_records(out, vocab_size=1000))
    meta_path(out).unlink()
    with pytest.raises(DataGenError, match=r"meta.json is missing"):
        run_datagen(_cfg(d, out, limit=2))
    with pytest.raises(DataGenError, match=r"no examples"):
        run_datagen(_cfg(d, tmp_path / "e.jsonl", limit=0))
    with pytest.raises(DataError, match=r"unknown data set 'nope'"):
        run_datagen(_cfg(d, tmp_path / "e.jsonl", datasets=["nope"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(
            {
                "id": "x",
                "dataset": "d",
                "prompt_ids": [1],
                "response_ids": [2, 3],
                "loss_mask": [0, 1],
                "finish": "stop",
            }
        )
        + "\n"
    )
    with pytest.raises(DataGenError, match=r"record 'x'.*loss_mask has 2 entries, prompt \+ response have 3"):
        list(read_records(bad))
    # The command line turns these into one clear line and exit status 2.
    assert main(["datagen", "--target", str(d), "--dataset", "nope", "--out", str(tmp_path / "c.jsonl")]) == 2
    assert "unknown data set 'nope'" in capsys.readouterr().err
    assert (
        main(
            [
                "datagen",
                "--target",
                str(tmp_path / "missing"),
                "--dataset",
                "humaneval",
                "--limit",
                "1",
                "--out",
                str(tmp_path / "c.jsonl"),
            ]
        )
        == 2
    )
    assert "not a built-in name" in capsys.readouterr().err


class _FakeOpenAI(BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        prompt = body["messages"][-1]["content"]
        n = len(prompt) % 7
        # A deterministic "answer" of the prompt; every third one is cut by max_tokens.
        text = f"def answer():\n    return {n}  # {prompt[:12]!r}"
        reply = {
            "id": "x",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length" if n % 3 == 0 else "stop",
                }
            ],
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    _FakeOpenAI.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _FakeOpenAI.requests
    server.shutdown()
    server.server_close()


def test_endpoint_produces_the_same_record_format(tiny, tmp_path, fake_server):
    d, _, tok, _ = tiny
    url, requests = fake_server
    out = tmp_path / "ep.jsonl"
    cfg = _cfg(
        d,
        out,
        endpoint=url,
        model="served-name",
        limit=10,
        batch_size=4,
        max_new_tokens=33,
        temperature=0.5,
        top_p=0.9,
    )
    s = run_datagen(cfg)
    assert s.written == 10 and len(requests) == 10
    paths = {p for p, _ in requests}
    assert paths == {"/v1/chat/completions"}
    for _, body in requests:
        assert body["model"] == "served-name" and body["max_tokens"] == 33
        assert body["temperature"] == 0.5 and body["top_p"] == 0.9 and body["messages"][-1]["role"] == "user"
        assert "chat_template_kwargs" not in body  # only when asked: not every server takes it
    examples = {e.id: e for e in load_dataset("humaneval", limit=10)}
    recs = list(read_records(out, vocab_size=VOCAB))
    assert sorted(r["id"] for r in recs) == sorted(examples)
    for r in recs:
        ex = examples[r["id"]]
        prompt = ex.turns[0]
        n = len(prompt) % 7
        text = f"def answer():\n    return {n}  # {prompt[:12]!r}"
        want = tok(text, add_special_tokens=False)["input_ids"]
        assert r["prompt_ids"] == _prompt_ids(tok, ex)
        if n % 3 == 0:
            assert r["finish"] == "length" and r["response_ids"] == want
        else:
            assert r["finish"] == "stop" and r["response_ids"] == want + [tok.eos_token_id]
        assert r["loss_mask"] == [0] * len(r["prompt_ids"]) + [1] * len(r["response_ids"])
    meta = read_meta(out)
    assert meta["backend"] == "endpoint" and meta["model"] == "served-name" and meta["dtype"] is None

    # Resume over the endpoint asks only for what is missing; a local run may not append to it.
    requests.clear()
    assert (
        run_datagen(
            _cfg(
                d,
                out,
                endpoint=url + "/v1/",
                model="served-name",
                limit=12,
                batch_size=4,
                max_new_tokens=33,
                temperature=0.5,
                top_p=0.9,
            )
        ).written
        == 2
    )
    assert len(requests) == 2
    with pytest.raises(DataGenError, match=r"backend 'endpoint' \(now 'local', --endpoint\)"):
        run_datagen(_cfg(d, out, limit=12, max_new_tokens=33, temperature=0.5, top_p=0.9))

    # Chat template options (thinking mode) go to the server too, which renders the prompt there.
    requests.clear()
    run_datagen(
        _cfg(
            d, tmp_path / "ep2.jsonl", endpoint=url, limit=1, chat_template_kwargs={"enable_thinking": False}
        )
    )
    assert [body["chat_template_kwargs"] for _, body in requests] == [{"enable_thinking": False}]


def test_endpoint_down_is_a_clear_error(tiny, tmp_path):
    import socket

    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = _cfg(tiny[0], tmp_path / "x.jsonl", endpoint=f"http://127.0.0.1:{port}", limit=1)
    with pytest.raises(DataGenError, match=r"cannot reach .*is the server running"):
        run_datagen(cfg)


def _write_records(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_pack_round_trips_and_train_reads_it(tmp_path):
    from flashdraft.train.config import TrainError
    from flashdraft.train.data import read_records as train_records
    from flashdraft.train.datagen import make_record, pack, read_packed

    g = torch.Generator().manual_seed(0)
    recs = [
        make_record(
            f"r{i}",
            "toy",
            torch.randint(0, VOCAB, (5 + i,), generator=g).tolist(),
            torch.randint(0, VOCAB, (30 - i,), generator=g).tolist(),
            "stop" if i % 2 else "length",
        )
        for i in range(6)
    ]
    a = _write_records(tmp_path / "a.jsonl", recs[:4])
    b = _write_records(tmp_path / "b.jsonl", recs[4:])
    info = pack([a, b], tmp_path / "d.npz")
    assert info["records"] == 6 and info["tokens"] == sum(35 for _ in recs)
    assert list(read_packed(tmp_path / "d.npz")) == recs
    assert [r["response_ids"] for r in train_records(tmp_path / "d.npz", VOCAB)] == [
        r["response_ids"] for r in recs
    ]
    with pytest.raises(TrainError, match="outside the vocabulary"):
        train_records(tmp_path / "d.npz", 100)
    with pytest.raises(DataGenError, match="same record id"):
        pack([a, a], tmp_path / "e.npz")
    raw = (tmp_path / "d.npz").read_bytes()
    (tmp_path / "bad.npz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataGenError, match="not a packed token file"):
        list(read_packed(tmp_path / "bad.npz"))


def test_a_later_turn_is_asked_after_its_recorded_history(tiny, tmp_path):
    """A prompt file's later turn of a recorded conversation (scripts/export_prompts.py's ShareGPT turns)
    is answered after the earlier turns and their recorded answers, not as a first turn alone."""
    from flashdraft.data import Example, write_prompts

    d, _, tok, _ = tiny
    turns = ("Name a prime number.", "Now name a larger one.")
    ex = Example("sharegpt/x@2", "sharegpt", turns, meta={"answers": ("Seven.",)})
    prompts = tmp_path / "turns.jsonl"
    write_prompts([ex], prompts)
    out = tmp_path / "turns-out.jsonl"
    run_datagen(_cfg(d, out, datasets=[str(prompts)], max_new_tokens=2))
    (rec,) = read_records(out, vocab_size=VOCAB)
    history = [
        {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": turns[1]},
    ]
    want = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert rec["prompt_ids"] == list(want)


def test_max_minutes_stops_answering_and_a_rerun_continues(tiny, tmp_path, monkeypatch):
    """--max-minutes ends the run with the prompts left counted; a rerun answers the rest."""
    import flashdraft.train.datagen as dg

    d, _, _, _ = tiny
    clock = iter(range(0, 10**6, 10))  # every reading of the budget's clock is 10 s after the last
    monkeypatch.setattr(dg, "_clock", lambda: float(next(clock)))
    out = tmp_path / "timed.jsonl"
    first = run_datagen(_cfg(d, out, max_new_tokens=8, batch_size=2, max_minutes=1.0))
    assert 0 < first.unanswered < 8 and first.written + first.unanswered == 8
    assert "left at --max-minutes" in first.line()
    second = run_datagen(_cfg(d, out, max_new_tokens=8, batch_size=2))
    assert second.skipped == first.written and second.unanswered == 0
    assert len(list(read_records(out, vocab_size=VOCAB))) == 8
    with pytest.raises(DataGenError, match="--max-minutes must be > 0"):
        run_datagen(_cfg(d, tmp_path / "z.jsonl", max_minutes=0))
