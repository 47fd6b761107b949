"""`flashdraft serve`: an OpenAI-compatible HTTP server with speculative, batched decoding.

Why this shape: the model is not thread-safe, and batching only pays when one loop owns every row. So
one background thread (`EngineThread`) owns the `Engine` and calls `step()` while any request is in
flight; a new request joins the batch at the next step, and a finished or abandoned one leaves it at
the next step. The HTTP side (FastAPI on uvicorn) validates, tokenizes, hands (prompt ids, config) to
that thread through a thread-safe inbox, and turns the `StepOutput`s it gets back (through a
per-request asyncio queue) into OpenAI JSON or server-sent events.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming or not),
GET /health, GET /metrics (Prometheus text), GET /metrics.json. Every error is a 4xx/5xx with an OpenAI-style body
{"error": {"message", "type", "param", "code"}}, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import hmac
import json
import logging
import math
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request  # FastAPI resolves route annotations in this module's globals

from flashdraft.chat import chat_ids, check_kwargs
from flashdraft.engine.adaptive import DEFAULT_SPECULATION, TREE_NODES, make_proposer
from flashdraft.engine.decode import GenerationConfig
from flashdraft.engine.engine import Engine
from flashdraft.engine.sampling import SamplingConfig

log = logging.getLogger("flashdraft.serve")

# OpenAI parameters that would change the output and that this server does not implement: refused
# with a 400 rather than silently ignored. Unknown fields get a 400 too, as OpenAI answers them.
UNSUPPORTED = (
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "suffix",
    "logit_bias",
    "tools",
    "tool_choice",
    "functions",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",  # vLLM / SGLang sampling extensions from here on
    "min_p",
    "min_tokens",
    "typical_p",
    "best_of",
    "use_beam_search",
    "length_penalty",
    "bad_words",
    "allowed_token_ids",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "reasoning_effort",
)
NEUTRAL = {"repetition_penalty": 1}  # a value that changes nothing is accepted (besides 0, false, empty)
# OpenAI fields that change no output (bookkeeping, caching, billing): accepted and ignored.
IGNORED = ("user", "safety_identifier", "prompt_cache_key", "metadata", "store", "service_tier")
ROLES = ("system", "developer", "user", "assistant")  # "developer" is OpenAI's new name for "system"


class ApiError(Exception):
    """An error answer: HTTP status plus an OpenAI-style error object whose message names the fix."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# -- requests ------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = None


class _Request(BaseModel):
    """Fields shared by both endpoints, strictly typed as OpenAI types them (`"8"` is not an integer);
    ranges are checked by hand so the message can name the fix. Other fields land in `model_extra`,
    where `App._check_common` refuses the unsupported and the unknown ones."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI's default is 1.0
    top_p: float | None = None
    top_k: int | None = None  # vLLM / SGLang extension; -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    ignore_eos: bool | None = False  # vLLM extension
    response_format: dict | None = None


class ChatRequest(_Request):
    messages: list[dict]
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict | None = None  # vLLM extension


class CompletionRequest(_Request):
    prompt: str | list[Any]


@dataclass
class _Job:
    """One request in flight."""

    rid: str
    chat: bool
    prompt_ids: list[int]
    config: GenerationConfig
    stops: list[str]
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
    text: TextStream | None = None  # set once generation starts

    def usage(self) -> dict:
        n, m = len(self.prompt_ids), self.completion_tokens
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


# -- text ----------------------------------------------------------------------------------------


class TextStream:
    """Committed token ids -> text deltas, for one request.

    Decoding token by token would split multi-byte characters (byte-level BPE emits UTF-8 one piece
    at a time) and lose the leading-space rules of SentencePiece vocabularies. So each push decodes a
    short window `ids[prefix:]` with the already-sent tokens `ids[prefix:read]` as context, and sends
    only what the new tokens added, holding back text that ends in an incomplete character (U+FFFD).
    OpenAI `stop` strings are matched on the text; text that might still be the start of one is
    held back until it cannot be. The last push decodes the whole output, so `result` is exact even
    for a tokenizer that rewrites earlier text (space clean-up); a stream can only be best effort there.
    """

    def __init__(self, tokenizer, stops: list[str] = ()):
        self.tok, self.stops = tokenizer, [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text, self.sent = "", 0

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    @property
    def result(self) -> str:
        """The output text so far (after the last push: all of it, cut at a stop string)."""
        return self.text[: self.sent]

    def push(self, ids: list[int], final: bool = False) -> tuple[str, bool]:
        """New text that is safe to send, and whether a stop string ended the output."""
        self.ids += ids
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and after.startswith(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        if final:
            sent, self.text = self.text[: self.sent], self._decode(self.ids)
            if not self.text.startswith(sent):  # the tokenizer rewrote text already streamed
                self.sent = len(os.path.commonprefix([sent, self.text]))
        hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            end, stopped = min(hits), True
        else:
            end, stopped = (len(self.text) if final else max(self.sent, len(self.text) - self.hold)), False
        out, self.sent = self.text[self.sent : end], end
        return out, stopped


# -- the scheduler -------------------------------------------------------------------------------


@dataclass
class ServerStats:
    started: float = field(default_factory=time.time)
    requests: int = 0  # handed to the decoder
    rejected: int = 0  # answered with a 4xx
    failed: int = 0  # answered with a 5xx
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0, "disconnected": 0})
    prompt_tokens: int = 0
    completion_tokens: int = 0
    steps: int = 0
    rows: int = 0  # request rows summed over steps
    busy_s: float = 0.0  # time spent inside Engine.step
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))


class EngineThread:
    """Owns the Engine on one background thread and steps it while any request is in flight.

    Requests arrive through `inbox` (thread-safe). The thread answers each add with "added" or the
    ValueError the decoder raised, then every StepOutput of that request, on the request's asyncio
    queue via `loop.call_soon_threadsafe`, so the event loop never waits on the model.
    """

    def __init__(self, make_decoder: Callable[[], Any]):
        self.make_decoder = make_decoder
        self.decoder = make_decoder()
        self.inbox: queue.Queue = queue.Queue()
        self.sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # thread-only
        self.stats = ServerStats()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="flashdraft-scheduler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout=10)

    def submit(self, rid: str, prompt_ids: list[int], config: GenerationConfig) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.inbox.put(("add", rid, prompt_ids, config, (asyncio.get_running_loop(), q)))
        return q

    def cancel(self, rid: str) -> None:
        """Free the request's batch slot at the next step (harmless if it has already finished)."""
        self.inbox.put(("cancel", rid))

    @staticmethod
    def _send(sink, item) -> None:
        loop, q = sink
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    def _drain(self, block: bool) -> None:
        while True:
            try:
                msg = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if msg[0] == "add":
                _, rid, ids, cfg, sink = msg
                try:
                    self.decoder.add(rid, ids, cfg)
                except ValueError as e:
                    self._send(sink, e)
                    continue
                self.sinks[rid] = sink
                self.stats.requests += 1
                self.stats.prompt_tokens += len(ids)
                self._send(sink, "added")
            elif msg[0] == "cancel" and msg[1] in self.sinks:
                self.decoder.cancel(msg[1])

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=self.decoder.pending() == 0)
            if self.decoder.pending() == 0:
                continue
            t0 = time.perf_counter()
            try:
                outs = self.decoder.step()
            except Exception as e:  # a bug or OOM: fail the requests in flight, keep serving
                log.exception("Engine.step failed; failing %d requests", len(self.sinks))
                for sink in self.sinks.values():
                    self._send(sink, RuntimeError(f"the decoder failed: {type(e).__name__}: {e}"))
                self.sinks = {}
                self.decoder = self.make_decoder()
                continue
            dt = time.perf_counter() - t0
            n = sum(len(o.tokens) for o in outs)
            st = self.stats
            st.steps, st.rows, st.busy_s, st.completion_tokens = (
                st.steps + 1,
                st.rows + len(outs),
                st.busy_s + dt,
                st.completion_tokens + n,
            )
            st.recent.append((time.time(), n))
            for out in outs:
                sink = self.sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.finished is not None:
                    del self.sinks[out.request_id]
                self._send(sink, out)

    def metrics(self) -> dict:
        st, now = self.stats, time.time()
        dec = dict(getattr(self.decoder, "stats", {}))
        tau = dec.get("tau")
        tau = tau if tau is None or math.isfinite(tau) else None  # NaN before the first verify step
        window = [n for t, n in list(st.recent) if t > now - 10]
        return {
            "uptime_s": round(now - st.started, 3),
            "requests_total": st.requests,
            "requests_in_flight": self.decoder.pending(),
            "requests_finished": dict(st.finished),
            "requests_rejected": st.rejected,
            "requests_failed": st.failed,
            "prompt_tokens_total": st.prompt_tokens,
            "completion_tokens_total": st.completion_tokens,
            "tokens_per_s": st.completion_tokens / st.busy_s if st.busy_s else 0.0,  # while busy
            "tokens_per_s_10s": sum(window) / 10.0,
            "busy_s": round(st.busy_s, 3),
            "steps": st.steps,
            "rows": st.rows,
            "mean_batch_rows": st.rows / st.steps if st.steps else 0.0,
            "tau": tau,
            "verify_steps": dec.get("verify_steps"),
            "committed": dec.get("committed"),
            "drafts": dec.get("drafts", 0),
            "draft_tokens": dec.get("draft_tokens", 0),
            "accepted_tokens": dec.get("accepted_tokens", 0),
            "accepted_per_position": list(dec.get("accepted_per_position", [])),
        }

    def prometheus(self) -> bytes:
        """The metrics in Prometheus' text format: vLLM's names (its `vllm:` prefix as `flashdraft:`) for
        requests, tokens, batch occupancy and speculative decoding (drafts, draft tokens, accepted tokens,
        accepted tokens per block position)."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.metrics()

        def counter(name: str, doc: str, value) -> CounterMetricFamily:
            return CounterMetricFamily(f"flashdraft:{name}", doc, value=value)

        per_reason = CounterMetricFamily(
            "flashdraft:request_success", "Finished requests by reason", labels=["finished_reason"]
        )
        for reason, n in m["requests_finished"].items():
            per_reason.add_metric([reason], n)
        per_pos = CounterMetricFamily(
            "flashdraft:spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafted tokens at each block position (1 = the first drafted token)",
            labels=["position"],
        )
        for i, n in enumerate(m["accepted_per_position"], 1):
            per_pos.add_metric([str(i)], n)
        running = GaugeMetricFamily("flashdraft:num_requests_running", "Requests in the batch or waiting")
        running.add_metric([], m["requests_in_flight"])
        occupancy = GaugeMetricFamily("flashdraft:batch_rows_mean", "Mean rows per decoder step")
        occupancy.add_metric([], m["mean_batch_rows"])
        families = [
            counter("requests", "Requests handed to the decoder", m["requests_total"]),
            counter("requests_rejected", "Requests answered with a 4xx", m["requests_rejected"]),
            counter("requests_failed", "Requests answered with a 5xx", m["requests_failed"]),
            per_reason,
            running,
            counter("prompt_tokens", "Prompt tokens of the requests", m["prompt_tokens_total"]),
            counter("generation_tokens", "Generated tokens", m["completion_tokens_total"]),
            counter("engine_steps", "Decoder steps", m["steps"]),
            counter("engine_step_rows", "Rows summed over decoder steps", m["rows"]),
            occupancy,
            counter("spec_decode_num_drafts", "Row-steps that verified drafted tokens", m["drafts"]),
            counter("spec_decode_num_draft_tokens", "Drafted tokens verified", m["draft_tokens"]),
            counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted", m["accepted_tokens"]),
            per_pos,
        ]

        class Snapshot:
            def collect(self):
                return families

        registry = CollectorRegistry(auto_describe=False)
        registry.register(Snapshot())
        return generate_latest(registry)


# -- the app -------------------------------------------------------------------------------------


class _Disconnected(Exception):
    pass


async def _get(q: asyncio.Queue, request, poll: bool):
    """The next item for a request. With poll, also checks whether the client has gone, after each
    item and at least twice a second (non-streaming responses have no other way to notice)."""
    if not poll:
        return await q.get()
    task = asyncio.ensure_future(q.get())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if await request.is_disconnected():  # after every item too: items may never pause
                raise _Disconnected
            if done:
                return task.result()
    finally:
        task.cancel()


async def _read_json(request, limit: int) -> dict:
    """The request body as a JSON object; oversize bodies are refused without reading them whole."""
    declared = request.headers.get("content-length")
    too_big = ApiError(
        413, f"request body is larger than {limit} bytes: send a shorter prompt", code="too_large"
    )
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    try:
        data = json.loads(body)
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON ({e}): send a JSON object") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return data


def _validated(model: type[BaseModel], data: dict):
    """The request as `model`, or a 400 naming the field, what was sent and what it should be."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        loc = errs[0]["loc"]
        param = str(loc[0]) if loc else "body"
        if errs[0]["type"] == "missing":
            raise ApiError(400, f"`{param}` is required: add it to the request", param) from None
        if errs[0]["type"] == "extra_forbidden":
            where = ".".join(str(x) for x in loc)
            raise ApiError(400, f"unknown field `{where}`: leave it out", param) from None
        # a union (`stop`: a string or a list of strings) gives one error per alternative
        wants = dict.fromkeys(
            x["msg"].removeprefix("Input should be ").replace("valid dictionary", "JSON object")
            for x in errs
            if x["loc"][:1] == loc[:1]
        )
        where = ".".join(str(x) for x in loc[: 2 if len(loc) > 1 and isinstance(loc[1], int) else 1])
        got = json.dumps(errs[0]["input"])
        got = got if len(got) <= 40 else got[:37] + "..."
        raise ApiError(400, f"invalid `{where}`: got {got}, send {' or '.join(wants)}", param) from None


class App:
    """The HTTP routes, around an EngineThread and the target's tokenizer."""

    def __init__(
        self,
        scheduler: EngineThread,
        tokenizer,
        model_name: str,
        max_length: int,
        vocab_size: int,
        stop_ids: list[int],
        api_key: str | None = None,
        max_body_bytes: int = 4 << 20,
    ):
        self.sched, self.tok, self.model_name = scheduler, tokenizer, model_name
        self.max_length, self.vocab_size, self.stop_ids = max_length, vocab_size, list(stop_ids)
        self.api_key, self.max_body_bytes = api_key, max_body_bytes

    # validation ------------------------------------------------------------------------------

    def _check_common(self, req: _Request) -> None:
        if req.model != self.model_name:
            raise ApiError(
                404,
                f"model {req.model!r} does not exist: this server serves {self.model_name!r} (see /v1/models)",
                "model",
                "model_not_found",
            )
        if req.n not in (None, 1):
            raise ApiError(400, f"n must be 1 (one choice per request), got {req.n}", "n")
        for key, value in (req.model_extra or {}).items():
            if key in IGNORED:
                continue
            if key not in UNSUPPORTED:
                raise ApiError(
                    400,
                    f"unknown field `{key}`: leave it out (this server takes OpenAI's parameters and the "
                    "vLLM extensions top_k, ignore_eos and chat_template_kwargs)",
                    key,
                )
            if value not in (None, False, 0, [], {}, NEUTRAL.get(key)):
                raise ApiError(400, f"`{key}` is not supported by this server: leave it out", key)
        if (req.response_format or {}).get("type", "text") != "text":
            raise ApiError(400, "only response_format type 'text' is supported", "response_format")

    def _sampling(self, req: _Request) -> SamplingConfig:
        t = 1.0 if req.temperature is None else req.temperature
        if not 0 <= t <= 2:
            raise ApiError(400, f"temperature must be between 0 and 2 (0 = greedy), got {t}", "temperature")
        p = 1.0 if req.top_p is None else req.top_p
        if not 0 < p <= 1:
            raise ApiError(400, f"top_p must be in (0, 1] (1 = off), got {p}", "top_p")
        k = 0 if req.top_k is None else req.top_k
        if k < -1:
            raise ApiError(400, f"top_k must be -1 or 0 (off) or a positive count, got {k}", "top_k")
        return SamplingConfig(t, max(k, 0), p)

    def _chat_ids(self, req: ChatRequest) -> list[int]:
        if not req.messages:
            raise ApiError(400, "`messages` is empty: send at least one message", "messages")
        msgs = []
        for i, m in enumerate(req.messages):
            role, content = m.get("role"), m.get("content")
            if role not in ROLES:
                raise ApiError(
                    400, f"messages[{i}].role is {role!r}: send one of {', '.join(ROLES)}", "messages"
                )
            if isinstance(content, list):  # content parts: text only
                if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                    raise ApiError(400, f"messages[{i}]: only text content parts are supported", "messages")
                if any(not isinstance(p.get("text"), str) for p in content):
                    raise ApiError(
                        400, f"messages[{i}]: a text content part needs a string `text`", "messages"
                    )
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                got = "null or missing" if content is None else f"a {type(content).__name__}"
                raise ApiError(400, f"messages[{i}].content is {got}: send a string", "messages")
            # what OpenAI's own replies carry (refusal, tool_calls, ...) may come back empty
            extra = [k for k, v in m.items() if k not in ("role", "content") and v not in (None, [], {}, "")]
            if extra:
                raise ApiError(400, f"messages[{i}].{extra[0]} is not supported: leave it out", "messages")
            msgs.append({"role": "system" if role == "developer" else role, "content": content})
        if not getattr(self.tok, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions")
        try:
            kwargs = check_kwargs(req.chat_template_kwargs or {})
        except ValueError as e:
            raise ApiError(400, f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
        try:
            return chat_ids(self.tok, msgs, kwargs)
        except Exception as e:  # template errors (e.g. roles that must alternate) are the caller's
            raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None

    def _completion_ids(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
            p = p[0]
        if isinstance(p, str):
            return list(self.tok(p, add_special_tokens=True)["input_ids"])
        if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ApiError(
                    400, f"token ids {bad[:5]} are outside the vocabulary 0..{self.vocab_size - 1}", "prompt"
                )
            return list(p)
        raise ApiError(
            400, "`prompt` must be a string or a list of token ids (one prompt per request)", "prompt"
        )

    def _job(self, req: _Request, ids: list[int], chat: bool) -> _Job:
        if not ids:
            raise ApiError(400, "the prompt is empty: send some text", "prompt")
        room = self.max_length - len(ids)
        if room < 1:
            raise ApiError(
                400, f"the prompt ({len(ids)} tokens) fills the model's context of {self.max_length} tokens"
            )
        limit, param = req.max_tokens, "max_tokens"
        if getattr(req, "max_completion_tokens", None) is not None:
            limit, param = req.max_completion_tokens, "max_completion_tokens"
        if limit is None:
            limit = room if chat else min(16, room)  # OpenAI's defaults: to the context / 16
        if limit < 1:
            raise ApiError(400, f"{param} must be at least 1, got {limit}", param)
        if limit > room:
            raise ApiError(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({limit}) exceeds the model's context of "
                f"{self.max_length} tokens: lower max_tokens to at most {room} or shorten the prompt",
                param,
            )
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > 4:
            raise ApiError(400, f"at most 4 stop strings, got {len(stops)}", "stop")
        sampling = self._sampling(req)
        cfg = GenerationConfig(
            max_new_tokens=limit,
            sampling=sampling,
            stop_ids=[] if req.ignore_eos else self.stop_ids,
            seed=req.seed,
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        prefix = "chatcmpl-" if chat else "cmpl-"
        return _Job(prefix + uuid.uuid4().hex, chat, ids, cfg, stops, include_usage)

    # generation ------------------------------------------------------------------------------

    async def _pieces(
        self, request, job: _Job, q: asyncio.Queue, poll: bool
    ) -> AsyncIterator[tuple[str, str | None]]:
        """(text delta, finish reason or None) until the request ends. However it ends early (a stop
        string, a client that went away, a cancelled task), its batch slot is freed at the next step."""
        text = job.text = TextStream(self.tok, job.stops)
        done = False
        try:
            while True:
                item = await _get(q, request, poll)
                if isinstance(item, Exception):
                    done = True
                    raise ApiError(500, str(item))
                job.completion_tokens += len(item.tokens)
                final = item.finished is not None
                delta, stopped = text.push(item.tokens, final)
                if stopped or final:
                    done = final
                    reason = "length" if item.finished == "length" and not stopped else "stop"
                    self.sched.stats.finished[reason] += 1
                    yield delta, reason
                    return
                if delta:
                    yield delta, None
        except (_Disconnected, asyncio.CancelledError, GeneratorExit):
            self.sched.stats.finished["disconnected"] += 1
            raise
        finally:
            if not done:
                self.sched.cancel(job.rid)

    def _head(self, job: _Job, obj: str) -> dict:
        return {"id": job.rid, "object": obj, "created": job.created, "model": self.model_name}

    async def _sse(self, request, job: _Job, q: asyncio.Queue) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if job.chat else "text_completion"

        def event(delta: str | None, reason: str | None, role: bool = False) -> str:
            if job.chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
            body = {**self._head(job, obj), "choices": [choice]}
            if job.include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        try:
            if job.chat:
                yield event(None, None, role=True)
            async for delta, reason in self._pieces(request, job, q, poll=False):
                if delta:
                    yield event(delta, None)
                if reason:
                    yield event(None, reason)
            if job.include_usage:
                yield f"data: {json.dumps({**self._head(job, obj), 'choices': [], 'usage': job.usage()})}\n\n"
        except ApiError as e:  # the headers are gone: report in-band, as OpenAI does
            self.sched.stats.failed += 1
            yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"

    async def respond(self, request, req: _Request, ids: list[int], chat: bool):
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        gone = Response(status_code=499)  # the client closed the connection: nobody reads this
        job = self._job(req, ids, chat)
        q = self.sched.submit(job.rid, ids, job.config)
        try:
            ack = await _get(q, request, poll=True)
        except BaseException as e:
            self.sched.cancel(job.rid)
            if isinstance(e, _Disconnected):
                self.sched.stats.finished["disconnected"] += 1
                return gone
            raise
        if isinstance(ack, ValueError):  # the decoder's own validation
            raise ApiError(400, str(ack))
        if isinstance(ack, Exception):
            raise ApiError(500, str(ack))
        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                self._sse(request, job, q), media_type="text/event-stream", headers=headers
            )
        reason = None
        try:
            async for _, fin in self._pieces(request, job, q, poll=True):
                reason = fin or reason
        except _Disconnected:
            return gone
        text = job.text.result
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None}
            obj = "chat.completion"
        else:
            choice, obj = {"index": 0, "text": text, "logprobs": None}, "text_completion"
        choice["finish_reason"] = reason
        return JSONResponse({**self._head(job, obj), "choices": [choice], "usage": job.usage()})

    # routes ----------------------------------------------------------------------------------

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise ApiError(
                401,
                "missing or wrong API key: send the header `Authorization: Bearer <key>` with the key "
                "the server was started with (--api-key)",
                code="invalid_api_key",
            )

    def build(self):
        """The FastAPI application."""
        from contextlib import asynccontextmanager

        from fastapi import Depends, FastAPI
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse, Response
        from starlette.exceptions import HTTPException

        @asynccontextmanager
        async def lifespan(_app):
            if not self.sched.thread.is_alive():
                self.sched.start()
            yield
            self.sched.stop()

        app = FastAPI(title="flashdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        stats = self.sched.stats

        def error(e: ApiError) -> JSONResponse:
            if e.status >= 500:
                stats.failed += 1
            else:
                stats.rejected += 1
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(ApiError)
        async def _api_error(_request, e: ApiError):
            return error(e)

        @app.exception_handler(HTTPException)
        async def _http_error(_request, e: HTTPException):
            return error(ApiError(e.status_code, str(e.detail)))

        @app.exception_handler(RequestValidationError)
        async def _validation_error(_request, e: RequestValidationError):
            return error(ApiError(400, str(e)))

        @app.exception_handler(Exception)
        async def _internal_error(_request, e: Exception):
            log.exception("internal error")
            return error(ApiError(500, f"internal error: {type(e).__name__}: {e}"))

        auth = [Depends(self.check_key)]

        @app.get("/health")
        async def health():
            if not self.sched.thread.is_alive():
                return JSONResponse({"status": "scheduler thread is not running"}, status_code=503)
            return {"status": "ok"}

        @app.get("/metrics", dependencies=auth)
        async def metrics():
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(self.sched.prometheus(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/metrics.json", dependencies=auth)
        async def metrics_json():
            return self.sched.metrics()

        @app.get("/v1/models", dependencies=auth)
        async def models():
            card = {
                "id": self.model_name,
                "object": "model",
                "created": int(stats.started),
                "owned_by": "flashdraft",
                "max_model_len": self.max_length,
            }
            return {"object": "list", "data": [card]}

        @app.post("/v1/chat/completions", dependencies=auth)
        async def chat(request: Request):
            req = _validated(ChatRequest, await _read_json(request, self.max_body_bytes))
            self._check_common(req)
            return await self.respond(request, req, self._chat_ids(req), chat=True)

        @app.post("/v1/completions", dependencies=auth)
        async def completions(request: Request):
            req = _validated(CompletionRequest, await _read_json(request, self.max_body_bytes))
            self._check_common(req)
            return await self.respond(request, req, self._completion_ids(req), chat=False)

        return app


# -- the command ---------------------------------------------------------------------------------


@dataclass
class ServeConfig:
    target: str
    draft: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch_size: int = 8
    block_size: int | None = None  # None: the draft's
    proposal: str = "draft"
    # fixed blocks, trees or the adaptive rule (flashdraft.engine.adaptive)
    speculation: str = DEFAULT_SPECULATION
    tree_nodes: int = TREE_NODES  # drafted tokens per tree (speculation "tree")
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    runner: str = "auto"  # the target's model code: native where it covers the architecture
    quantize: str = "auto"  # the native runner's weights (flashdraft.models.load.default_quantization)
    model_name: str | None = None  # None: --target as given
    max_body_bytes: int = 4 << 20
    log_level: str = "info"


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening): a busy port is one line at once, before the models
    load, and the "running on" banner is printed only for a port that is ours. As uvicorn binds."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may find the port in TIME_WAIT
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        if getattr(e, "errno", None) == errno.EADDRINUSE:
            raise ValueError(
                f"port {port} on {host} is already in use (another server?): pass another --port, "
                "or stop the program that holds it"
            ) from None
        raise ValueError(f"cannot listen on {host}:{port} ({e}): pass another --host or --port") from None
    return sock


def serve(cfg: ServeConfig) -> None:
    """Bind the port, load the models, start the scheduler thread and serve until interrupted."""
    import uvicorn

    from flashdraft.models.draft import DFlashDraft
    from flashdraft.models.load import load_target, local_dir
    from flashdraft.models.target import resolve_device

    if cfg.max_batch_size < 1:
        raise ValueError(f"--max-batch-size must be >= 1, got {cfg.max_batch_size}")
    sock = bind(cfg.host, cfg.port)
    device = str(resolve_device(cfg.device))  # the one "auto" rule of every verb; refuses a missing GPU
    target = load_target(cfg.target, cfg.dtype, device, cfg.runner, cfg.quantize)
    dtype = target.dtype  # what `auto` chose (flashdraft.models.compute): the draft runs in it too
    if target.tokenizer is None:
        raise ValueError(
            f"target {cfg.target!r} has no tokenizer: the server needs one to read and write text"
        )
    draft = (
        DFlashDraft.from_pretrained(local_dir(cfg.draft), dtype=dtype, device=device) if cfg.draft else None
    )

    def make_decoder():
        proposer = make_proposer(draft, target, cfg.proposal, cfg.speculation, cfg.tree_nodes)
        return Engine(target, block_size=cfg.block_size, max_batch_size=cfg.max_batch_size, proposer=proposer)

    api_key = cfg.api_key or os.environ.get("FLASHDRAFT_API_KEY") or None
    app = App(
        EngineThread(make_decoder),
        target.tokenizer,
        cfg.model_name or cfg.target,
        target.max_length,
        target.vocab_size,
        target.stop_ids,
        api_key,
        cfg.max_body_bytes,
    ).build()
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use it", cfg.host)
    print(
        f"flashdraft serve: {cfg.model_name or cfg.target} ({'draft ' + cfg.draft if cfg.draft else 'no draft'}, "
        f"{target.describe()} on {device}, batch <= {cfg.max_batch_size}) on http://{cfg.host}:{sock.getsockname()[1]}/v1",
        flush=True,
    )
    config = uvicorn.Config(app, log_level=cfg.log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


def cmd_serve(args) -> int:
    fields = ServeConfig.__dataclass_fields__
    serve(ServeConfig(**{k: v for k, v in vars(args).items() if k in fields}))
    return 0
