"""Training data for a draft: prompts answered again by the target itself (`flashdraft datagen`).

A draft must learn the distribution of the target it will serve, not that of whoever wrote the
original answers, so every response is regenerated: the prompt (first user turn) goes through the
target's chat template and the target answers it, either here (the project's batched decoder on the
target `serve` runs: the native runner on our kernels where it covers the model; rows join and leave
the batch at every step and each answer has the bits of the prompt answered alone) or through any
OpenAI-compatible server (`--endpoint`, how one regenerates with vLLM / SGLang).

The output is JSON lines, one conversation per line, appended as soon as it is done:

    {"id", "dataset", "prompt_ids", "response_ids", "loss_mask", "finish": "stop" | "length"}

`loss_mask` covers prompt + response (0 on the prompt, 1 on the response); a response that ended
on a stop token keeps it, so the draft learns to stop. Each line is written with a single write,
flushed and fsynced, so a crash leaves at most a partial last line; a rerun drops that line, skips
the ids already done and continues. A `FILE.meta.json` next to the file records the target,
tokenizer and settings, and a rerun with other ones is refused instead of mixing two distributions.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.chat import chat_ids
from flashdraft.files import atomic_write, write_json

log = logging.getLogger("flashdraft")

FORMAT = 1  # bump when the record layout changes
RECORD_KEYS = ("id", "dataset", "prompt_ids", "response_ids", "loss_mask", "finish")
TOKEN_KEYS = ("prompt_ids", "response_ids", "loss_mask")  # all a training record needs
FINISH = ("stop", "length")
PROGRESS_EVERY_S = 0.5  # how often the bar's token count is redrawn
# Settings that change what the records contain: a file may only be continued with the same ones.
# (flag for the error message, meta key)
MATCHED = (
    ("--target", "target"),
    ("--target", "tokenizer_sha256"),
    ("--target", "chat_template_sha256"),
    ("--chat-template-kwargs", "chat_template_kwargs"),
    ("--endpoint", "backend"),
    ("--model", "model"),
    ("--max-new-tokens", "max_new_tokens"),
    ("--temperature", "temperature"),
    ("--top-p", "top_p"),
    ("--top-k", "top_k"),
    ("--dtype", "dtype"),
)


class DataGenError(ValueError):
    """Data generation cannot go on as asked (the message says how to fix it)."""


@dataclass
class DatagenConfig:
    target: str
    datasets: Sequence[str]
    out: str | os.PathLike
    max_new_tokens: int = 512
    batch_size: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    limit: int | None = None
    max_prompt_tokens: int | None = None  # skip longer prompts: short ones make tokens per second
    max_minutes: float | None = None  # stop answering after this long (a rerun continues the file)
    endpoint: str | None = None
    model: str | None = None  # the model name sent to the endpoint (default: the target name)
    dtype: str = "auto"
    # The local target's model code and weights: auto answers with what `serve` runs (the native runner
    # on our kernels where it covers the model), so the draft learns the target it will be verified
    # against, at 2.6-3x the tokens/s of transformers' path (docs/training.md, scripts/datagen_speed.py).
    runner: str = "auto"
    quantize: str = "auto"
    device: str = "auto"  # where the local target runs: auto (CUDA when present), cpu or cuda[:N]
    progress: bool = True
    timeout_s: float = 600.0  # per endpoint request
    chat_template_kwargs: dict | None = (
        None  # chat template options (thinking mode), also sent to an endpoint
    )
    weights: str | None = None  # set when the target loads: which model code and weights answered


@dataclass
class DatagenSummary:
    out: Path
    written: int = 0
    skipped: int = 0  # already in the file
    stop: int = 0
    length: int = 0
    too_long: int = 0  # prompts that leave no room for max_new_tokens in the model's context
    over_cap: int = 0  # prompts longer than --max-prompt-tokens
    duplicates: int = 0  # the same id in two of the requested data sets
    repaired_bytes: int = 0  # partial last line dropped
    unanswered: int = 0  # prompts left when --max-minutes ended the run (a rerun answers them)
    response_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.response_tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        extra = [f"{self.skipped} already done"]
        if self.too_long:
            extra.append(f"{self.too_long} prompts too long, skipped")
        if self.over_cap:
            extra.append(f"{self.over_cap} prompts over --max-prompt-tokens, skipped")
        if self.duplicates:
            extra.append(f"{self.duplicates} duplicate ids across data sets")
        if self.repaired_bytes:
            extra.append(f"dropped a partial last line of {self.repaired_bytes} bytes")
        if self.unanswered:
            extra.append(f"{self.unanswered} prompts left at --max-minutes (rerun to answer them)")
        return (
            f"datagen: wrote {self.written} records to {self.out} ({self.stop} stop, {self.length} length; "
            f"{'; '.join(extra)}): {self.response_tokens} response tokens in {self.seconds:.1f} s = "
            f"{self.tokens_per_s:.1f} tokens/s"
        )


@dataclass
class _Prompt:
    id: str
    dataset: str
    messages: list[dict[str, str]]
    prompt_ids: list[int] = field(default_factory=list)


# -- records -------------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def record_problem(rec: Any, vocab_size: int | None = None, complete: bool = True) -> str | None:
    """What is wrong with one record, or None when it is well-formed. `complete=False` (training data
    made by hand) asks only for the token lists and the mask; id, dataset and finish are then optional."""
    if not isinstance(rec, dict):
        return "not a JSON object"
    missing = [k for k in RECORD_KEYS if k not in rec and (complete or k in TOKEN_KEYS)]
    if missing:
        return f"missing key(s) {', '.join(missing)}"
    if "id" in rec and (not isinstance(rec["id"], str) or not rec["id"]):
        return "id is not a non-empty string"
    if "dataset" in rec and not isinstance(rec["dataset"], str):
        return "dataset is not a string"
    for key in ("prompt_ids", "response_ids", "loss_mask"):
        if not isinstance(rec[key], list) or not all(_is_int(t) for t in rec[key]):
            return f"{key} is not a list of integers"
    n = len(rec["prompt_ids"]) + len(rec["response_ids"])
    if len(rec["loss_mask"]) != n:
        return f"loss_mask has {len(rec['loss_mask'])} entries, prompt + response have {n}"
    if any(m not in (0, 1) for m in rec["loss_mask"]):
        return "loss_mask holds values other than 0 and 1"
    if "finish" in rec and rec["finish"] not in FINISH:
        return f"finish is {rec['finish']!r}, not one of {', '.join(FINISH)}"
    ids = rec["prompt_ids"] + rec["response_ids"]
    if ids and min(ids) < 0:
        return f"negative token id {min(ids)}"
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        return (
            f"token id {max(ids)} is outside the vocabulary of {vocab_size}: this file was made with another "
            "tokenizer; regenerate it with `flashdraft datagen --target <the target you train for>`"
        )
    return None


def make_record(
    id: str, dataset: str, prompt_ids: Sequence[int], response_ids: Sequence[int], finish: str
) -> dict:
    p, r = [int(t) for t in prompt_ids], [int(t) for t in response_ids]
    return {
        "id": id,
        "dataset": dataset,
        "prompt_ids": p,
        "response_ids": r,
        "loss_mask": [0] * len(p) + [1] * len(r),
        "finish": finish,
    }


def read_records(
    path: str | os.PathLike, vocab_size: int | None = None, complete: bool = True
) -> Iterator[dict]:
    """The validated records of a datagen file (JSONL, or a `pack`ed .npz), in file order: the one reader
    of training records.

    Every line must be a well-formed record (keys, integer ids, mask length, ids < `vocab_size` when
    given) with an id not seen before in the file; otherwise DataGenError names the line, the record
    and the fix. With `complete=False` (hand-made training files) only the token lists and the mask are
    required; a missing id becomes FILE:LINE. An unterminated last line is what an interrupted datagen
    leaves: it is skipped with a warning (rerunning datagen on the file repairs it)."""
    path = Path(path)
    if not path.is_file():
        raise DataGenError(f"data file {path} not found: make one with `flashdraft datagen --out {path}`")
    if path.suffix == ".npz":
        yield from read_packed(path, vocab_size)
        return
    seen: set[str] = set()
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                log.warning("flashdraft: %s ends with a partial line (an interrupted datagen); skipped", path)
                return
            if not complete and not raw.strip():
                continue
            rec = _parse_line(path, n, raw)
            problem = record_problem(rec, vocab_size, complete)
            if problem is None and not complete:
                rec.setdefault("id", f"{path.name}:{n}")
            if problem is None and rec["id"] in seen:
                problem = "a second record with this id"
            if problem is not None:
                rid = rec.get("id") if isinstance(rec, dict) else None
                raise DataGenError(f"{path} line {n} (record {rid!r}): {problem}")
            seen.add(rec["id"])
            yield rec


def _parse_line(path: Path, n: int, raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as e:
        raise DataGenError(
            f"{path} line {n} is not JSON ({e}); only a partial LAST line can come from an interrupted run, "
            "so the file was damaged or edited: delete that line (or the file and its .meta.json) and rerun"
        ) from None


def read_meta(path: str | os.PathLike) -> dict | None:
    """The settings a datagen file was made with (`FILE.meta.json`), or None when there is none."""
    meta = meta_path(path)
    if not meta.is_file():
        return None
    try:
        out = json.loads(meta.read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataGenError(
            f"{meta} is not JSON ({e}): delete it and rerun with the settings of {path}"
        ) from None
    if not isinstance(out, dict):
        raise DataGenError(f"{meta} is not a JSON object: delete it and rerun with the settings of {path}")
    return out


def meta_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".meta.json")


# -- the output file -----------------------------------------------------------------------------


def scan_output(path: Path) -> tuple[set[str], int, int]:
    """(ids already done, byte length of the complete lines, bytes of a partial last line).

    Read-only: the caller truncates the partial line once it knows it may continue the file."""
    done: set[str] = set()
    good = 0
    if not path.exists():
        return done, 0, 0
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                return done, good, len(raw)
            rec = _parse_line(path, n, raw)
            problem = record_problem(rec)
            if problem is None and rec["id"] in done:
                problem = "a second record with this id"
            if problem is not None:
                raise DataGenError(
                    f"{path} line {n}: {problem}; datagen never writes such a line, so the file was damaged "
                    "or edited: delete that line (or the file and its .meta.json) and rerun"
                )
            done.add(rec["id"])
            good += len(raw)
    return done, good, 0


class _Writer:
    """Appends records; each line goes out in one write (looping only on a short write), is flushed
    and fsynced before the next, so a crash can only leave a partial last line."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)

    def write(self, rec: dict) -> None:
        data = (json.dumps(rec, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def _lock(path: Path):
    """An exclusive lock on `path.lock` for the duration of the run (released by the OS on a crash)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return None
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise DataGenError(
            f"another datagen is writing {path} right now: wait for it to finish, or choose another --out"
        ) from None
    return fd


def _check_meta(out: Path, old: dict, new: dict) -> None:
    bad = [(flag, key) for flag, key in MATCHED if old.get(key) != new.get(key)]
    if old.get("format") != new["format"]:
        bad.insert(0, ("(flashdraft version)", "format"))
    if new["temperature"] > 0 and old.get("seed") != new["seed"]:
        bad.append(("--seed", "seed"))
    # Older files did not record which weights answered.
    if old.get("weights") is not None and old["weights"] != new.get("weights"):
        bad.append(("--runner / --quantize", "weights"))
    if bad:
        diffs = "; ".join(f"{key} {old.get(key)!r} (now {new.get(key)!r}, {flag})" for flag, key in bad)
        raise DataGenError(
            f"{out} was made with other settings: {diffs}. Rerun with the settings of {meta_path(out)} to "
            "continue it, or write to another --out (delete both files to start over)"
        )


# -- prompts -------------------------------------------------------------------------------------


def load_prompts(datasets: Sequence[str], limit: int | None, seed: int) -> tuple[list[_Prompt], int]:
    """The asked turn of every example of the data sets (`Example.asked`: the first user turn, or the last
    one of a recorded conversation's later turn), in order, and how many duplicate ids
    (the same prompt in two of the sets, say sharegpt and sharegpt-train) were dropped."""
    from flashdraft.data import load_dataset

    prompts: list[_Prompt] = []
    seen: set[str] = set()
    dups = 0
    for name in datasets:
        examples = load_dataset(name, limit=limit, seed=seed)
        if not examples:
            raise DataGenError(
                f"data set {name!r} gave no examples (limit {limit}): drop it or raise --limit"
            )
        for ex in examples:
            if ex.id in seen:
                dups += 1
                continue
            seen.add(ex.id)
            prompts.append(_Prompt(ex.id, name, ex.asked()))
    return prompts, dups


def _sha256_text(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the token -> id map and special tokens: the same for the same tokenizer anywhere."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    return _sha256_text(json.dumps([vocab, special], ensure_ascii=False))


def _target_name(spec: str) -> str:
    from flashdraft.models import load as models

    if spec in models.MODELS:
        return spec
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def _stop_ids_from_dir(path: Path, tokenizer) -> list[int]:
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(path, local_files_only=True)
        src = gen.eos_token_id
        ids += [src] if isinstance(src, int) else list(src or [])
    except Exception:  # no generation_config.json: the tokenizer's eos only
        pass
    eos = getattr(tokenizer, "eos_token_id", None)
    ids += [eos] if isinstance(eos, int) else []
    return sorted(set(ids))


def _load_tokenizer_only(spec: str):
    """(tokenizer, stop ids) for the endpoint path, without loading the weights when avoidable."""
    from transformers import AutoTokenizer

    from flashdraft.models import load as models
    from flashdraft.models.load import load_target
    from flashdraft.models.target import TargetError

    path = None
    if spec in models.MODELS:
        path = models.ensure_converted(spec)
    elif Path(spec).expanduser().is_dir():
        path = Path(spec).expanduser()
    if path is None:  # a .gguf (or an error message from load_target)
        target = load_target(spec, runner="transformers")
        return target.tokenizer, target.stop_ids
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise TargetError(
            f"{path} has no usable tokenizer ({e}): datagen needs the target's tokenizer"
        ) from None
    return tok, _stop_ids_from_dir(path, tok)


# -- generation: local ---------------------------------------------------------------------------


def cut_response(tokens: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[int], str]:
    """The response up to and including its first stop token ("stop"), or all of it ("length")."""
    stops = set(stop_ids)
    out = []
    for t in tokens:
        out.append(int(t))
        if t in stops:
            return out, "stop"
    return out, "length"


def _seed_for(seed: int, first_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}\0{first_id}".encode()).digest()[:8], "big") % 2**63


def _generate_local(
    target,
    prompts: list[_Prompt],
    cfg: DatagenConfig,
    emit: Callable,
    on_tokens: Callable[[int], None],
    out_of_time: Callable[[], bool],
) -> None:
    """The target answers every prompt through the project's own batched decoder (block size 1:
    plain decoding): a row that finishes leaves the batch at once and the next prompt takes its
    slot, so no step is spent on padding or on rows already done (HF `generate` keeps decoding
    finished rows until the longest one ends). Only our sampling settings apply, so the draft
    learns the plain distribution it will be verified against; each prompt samples from its own
    seed, so its answer does not depend on its batch-mates. The longest prompts go first (a batch that
    does not fit in memory fails at once, not hours in), then the rest in the caller's order, so that a
    run cut short by `out_of_time` has answered the first prompts of the file, not only long ones; rows
    still decoding then are dropped (a rerun answers them)."""
    from flashdraft.engine.engine import Engine
    from flashdraft.engine.sampling import SamplingConfig
    from flashdraft.engine.sequence import GenerationConfig

    greedy = cfg.temperature <= 0
    sampling = (
        SamplingConfig() if greedy else SamplingConfig(cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    )
    decoder = Engine(target, block_size=1, max_batch_size=cfg.batch_size)
    longest = sorted(prompts, key=lambda p: -len(p.prompt_ids))[: cfg.batch_size]
    by_id = {p.id: p for p in longest + prompts}
    for p in by_id.values():
        run = GenerationConfig(
            max_new_tokens=cfg.max_new_tokens,
            block_size=1,
            sampling=sampling,
            stop_ids=target.stop_ids,
            seed=None if greedy else _seed_for(cfg.seed, p.id),
        )
        decoder.add(p.id, p.prompt_ids, run)
    answers: dict[str, list[int]] = {}
    while decoder.pending() and not out_of_time():
        outs = decoder.step()
        on_tokens(sum(len(out.tokens) for out in outs))  # progress within a batch, long before a row ends
        for out in outs:
            answers.setdefault(out.request_id, []).extend(out.tokens)
            if out.finished:
                p = by_id[out.request_id]
                emit(make_record(p.id, p.dataset, p.prompt_ids, answers.pop(p.id), out.finished))


# -- generation: an OpenAI-compatible server -----------------------------------------------------


def _chat_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def _post(url: str, body: dict, timeout: float, attempts: int = 3) -> dict:
    data = json.dumps(body).encode("utf-8")
    headers = {"Content-Type": "application/json"}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    for attempt in range(attempts):
        try:
            req = urllib.request.Request(url, data=data, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode("utf-8", "replace")
            if e.code in (429, 500, 502, 503, 504) and attempt + 1 < attempts:
                time.sleep(2**attempt)
                continue
            raise DataGenError(
                f"{url} answered HTTP {e.code}: {detail} (check --endpoint and that --model names a model "
                "the server serves)"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            if attempt + 1 < attempts:
                time.sleep(2**attempt)
                continue
            raise DataGenError(f"cannot reach {url} ({e}): is the server running? check --endpoint") from None
        except ValueError as e:
            raise DataGenError(
                f"{url} did not answer JSON ({e}): is it an OpenAI-compatible server?"
            ) from None
    raise AssertionError("unreachable")


def _generate_endpoint(
    tokenizer,
    stop_ids: list[int],
    prompts: list[_Prompt],
    cfg: DatagenConfig,
    emit: Callable,
    on_tokens: Callable[[int], None],
    out_of_time: Callable[[], bool],
) -> None:
    url = _chat_url(cfg.endpoint)
    stop_token = stop_ids[0] if stop_ids else None
    if tokenizer.eos_token_id in stop_ids:
        stop_token = tokenizer.eos_token_id  # what the chat template closes a turn with

    def ask(p: _Prompt) -> dict:
        body: dict[str, Any] = {
            "model": cfg.model or cfg.target,
            "messages": p.messages,
            "max_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
        }
        if cfg.top_k > 0:
            body["top_k"] = cfg.top_k  # vLLM / SGLang extension
        if cfg.chat_template_kwargs:
            body["chat_template_kwargs"] = cfg.chat_template_kwargs  # vLLM / SGLang / flashdraft serve
        if cfg.temperature > 0:
            body["seed"] = _seed_for(cfg.seed, p.id) % 2**31
        reply = _post(url, body, cfg.timeout_s)
        try:
            choice = reply["choices"][0]
            text = choice["message"].get("content") or ""
            reason = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise DataGenError(
                f"{url} answered {json.dumps(reply)[:300]}, not a chat completion: is --endpoint "
                "an OpenAI-compatible server?"
            ) from None
        response = tokenizer(text, add_special_tokens=False)["input_ids"]
        finish = "length" if reason == "length" else "stop"
        if finish == "stop" and stop_token is not None:
            response = list(response) + [stop_token]
        return make_record(p.id, p.dataset, p.prompt_ids, response, finish)

    workers = max(1, cfg.batch_size)
    pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="datagen")
    pending: set[cf.Future] = set()
    queue = iter(prompts)
    try:
        while True:
            while len(pending) < 2 * workers and not out_of_time():  # those in flight still finish
                p = next(queue, None)
                if p is None:
                    break
                pending.add(pool.submit(ask, p))
            if not pending:
                break
            finished, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                rec = fut.result()
                on_tokens(len(rec["response_ids"]))
                emit(rec)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# -- the command ---------------------------------------------------------------------------------


def _check_config(cfg: DatagenConfig) -> list[str]:
    """Refuse bad settings before anything is loaded; resolve "auto" device and dtype (the meta file
    records what actually ran). Returns the data set names."""
    if cfg.max_new_tokens < 1:
        raise DataGenError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.batch_size < 1:
        raise DataGenError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    if cfg.max_prompt_tokens is not None and cfg.max_prompt_tokens < 1:
        raise DataGenError(f"--max-prompt-tokens must be >= 1, got {cfg.max_prompt_tokens}")
    if cfg.max_minutes is not None and not cfg.max_minutes > 0:
        raise DataGenError(f"--max-minutes must be > 0, got {cfg.max_minutes}")
    if cfg.temperature < 0 or not 0 < cfg.top_p <= 1 or cfg.top_k < 0:
        raise DataGenError("need --temperature >= 0, 0 < --top-p <= 1 and --top-k >= 0")

    from flashdraft.models.target import TargetError, resolve_device, resolve_dtype

    try:  # "auto" is resolved here and the dtype where the target loads, so the meta file records what ran
        cfg.device = str(resolve_device(cfg.device))
        resolve_dtype(cfg.dtype, cfg.device)  # checked; load_target chooses what "auto" runs
    except TargetError as e:
        raise DataGenError(str(e)) from None
    except ValueError as e:
        raise DataGenError(f"--dtype: {e}") from None
    datasets = [d.strip() for d in cfg.datasets if d.strip()]
    if not datasets:
        raise DataGenError("no data set given: pass --dataset NAME[,NAME] (see flashdraft.data.DATASETS)")
    return datasets


def _load_backend(cfg: DatagenConfig):
    """(target or None for an endpoint, tokenizer, stop ids, chat template): datagen asks a chat model."""
    if cfg.endpoint:
        target = None
        tokenizer, stop_ids = _load_tokenizer_only(cfg.target)
    else:
        from flashdraft.models.load import load_target
        from flashdraft.models.target import cpu_has_fast_bf16

        torch_ops = cfg.runner == "transformers"  # the native runner's bf16 runs on our kernels instead
        if torch_ops and cfg.dtype == "bfloat16" and cfg.device == "cpu" and not cpu_has_fast_bf16():
            log.warning(
                "flashdraft: this CPU has no native bfloat16 (no avx512_bf16 / amx_bf16): bf16 matmuls are "
                "emulated, far slower than float32 here; pass --dtype float32 (or auto)"
            )
        target = load_target(cfg.target, cfg.dtype, cfg.device, cfg.runner, cfg.quantize)
        cfg.dtype = str(target.dtype).removeprefix("torch.")  # what `auto` chose
        cfg.weights = target.describe()
        tokenizer, stop_ids = target.tokenizer, target.stop_ids
    if tokenizer is None:
        raise DataGenError(f"target {cfg.target!r} has no tokenizer: datagen needs one for the chat template")
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataGenError(
            f"the tokenizer of {cfg.target!r} has no chat template: datagen asks the model as a chat "
            "model, so use an instruction-tuned target (or add a chat_template to its tokenizer_config)"
        )
    return target, tokenizer, stop_ids, template


def _meta(cfg: DatagenConfig, tokenizer, stop_ids, template, datasets: list[str]) -> dict:
    """What the records were made with: a later run into the same file must match it (_check_meta)."""
    return {
        "format": FORMAT,
        "target": _target_name(cfg.target),
        "vocab_size": len(tokenizer),
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
        "chat_template_sha256": _sha256_text(template if isinstance(template, str) else json.dumps(template)),
        "chat_template_kwargs": cfg.chat_template_kwargs or None,
        "stop_ids": stop_ids,
        "datasets": list(datasets),
        "backend": "endpoint" if cfg.endpoint else "local",
        "endpoint": cfg.endpoint,
        "model": (cfg.model or cfg.target) if cfg.endpoint else None,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": float(cfg.temperature),
        "top_p": float(cfg.top_p),
        "top_k": int(cfg.top_k),
        "seed": cfg.seed,
        "dtype": None if cfg.endpoint else cfg.dtype,
        "weights": None if cfg.endpoint else cfg.weights,
    }


def run_datagen(cfg: DatagenConfig) -> DatagenSummary:
    """Regenerate the responses of `cfg.datasets` with the target into `cfg.out` (see the module doc)."""
    datasets = _check_config(cfg)
    out = Path(cfg.out)
    if out.is_dir():
        raise DataGenError(f"--out {out} is a directory: give a file name such as {out / 'data.jsonl'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = DatagenSummary(out)
    lock = _lock(out)
    try:
        # Cheap checks of the existing file first, before loading any model.
        done, good_bytes, partial = scan_output(out)
        old_meta = read_meta(out) if done else None
        if done and old_meta is None:
            raise DataGenError(
                f"{out} holds records but {meta_path(out)} is missing, so its settings are unknown: restore "
                "that file, or write to another --out"
            )
        prompts, summary.duplicates = load_prompts(datasets, cfg.limit, cfg.seed)

        target, tokenizer, stop_ids, template = _load_backend(cfg)
        meta = _meta(cfg, tokenizer, stop_ids, template, datasets)
        if old_meta is not None:
            _check_meta(out, old_meta, meta)
            meta["datasets"] = list(dict.fromkeys(list(old_meta.get("datasets") or []) + list(datasets)))
        if partial:
            with out.open("r+b") as f:
                f.truncate(good_bytes)
                os.fsync(f.fileno())
            summary.repaired_bytes = partial
            log.warning("flashdraft: dropped a partial last line (%d bytes) of %s", partial, out)
        write_json(meta_path(out), meta)

        todo = [p for p in prompts if p.id not in done]
        summary.skipped = len(prompts) - len(todo)
        max_len = target.max_length if target is not None else None
        ready = []
        for p in todo:
            p.prompt_ids = chat_ids(tokenizer, p.messages, cfg.chat_template_kwargs)
            if cfg.max_prompt_tokens is not None and len(p.prompt_ids) > cfg.max_prompt_tokens:
                summary.over_cap += 1
                continue
            if max_len is not None and len(p.prompt_ids) + cfg.max_new_tokens > max_len:
                summary.too_long += 1
                continue
            ready.append(p)
        if summary.too_long:
            log.warning(
                "flashdraft: %d prompts + --max-new-tokens %d exceed the target's context of %s; skipped",
                summary.too_long,
                cfg.max_new_tokens,
                max_len,
            )
        _run(target, tokenizer, stop_ids, ready, cfg, out, summary)
    finally:
        if lock is not None:
            os.close(lock)
    return summary


def _clock() -> float:
    """The clock of --max-minutes (its own name, so a test can run it fast)."""
    return time.perf_counter()


def _run(target, tokenizer, stop_ids, prompts, cfg, out: Path, summary: DatagenSummary) -> None:
    from tqdm import tqdm

    writer = _Writer(out)
    bar = tqdm(
        total=len(prompts),
        unit="conv",
        desc="datagen",
        disable=not cfg.progress,
        dynamic_ncols=True,
        file=sys.stderr,
    )
    start = time.perf_counter()
    generated, shown = 0, start
    deadline = None if cfg.max_minutes is None else _clock() + 60 * cfg.max_minutes

    def out_of_time() -> bool:
        return deadline is not None and _clock() > deadline

    def emit(rec: dict) -> None:
        writer.write(rec)
        summary.written += 1
        summary.response_tokens += len(rec["response_ids"])
        if rec["finish"] == "stop":
            summary.stop += 1
        else:
            summary.length += 1
        summary.seconds = time.perf_counter() - start
        bar.update(1)

    def on_tokens(n: int) -> None:
        """Tokens generated so far (finished or not) on the bar: it moves while a batch is under way."""
        nonlocal generated, shown
        generated += n
        now = time.perf_counter()
        if now - shown >= PROGRESS_EVERY_S:
            shown = now
            bar.set_postfix_str(f"{generated} tokens, {generated / max(now - start, 1e-9):.1f} tok/s")

    try:
        if prompts:
            if cfg.endpoint:
                _generate_endpoint(tokenizer, stop_ids, prompts, cfg, emit, on_tokens, out_of_time)
            else:
                _generate_local(target, prompts, cfg, emit, on_tokens, out_of_time)
    finally:
        summary.seconds = time.perf_counter() - start
        summary.unanswered = len(prompts) - summary.written
        bar.close()
        writer.close()


# -- packed token files: what the repository commits ---------------------------------------------

PACKED_FORMAT = "flashdraft-tokens/1"


def pack(sources: Sequence[str | os.PathLike], out: str | os.PathLike) -> dict:
    """Write the records of datagen files as one compressed `.npz` of token ids (uint16 when the
    vocabulary allows): about 1.5 bytes a token instead of ~6 in JSON, small enough to commit, and
    read back by `flashdraft train --data` like the JSONL itself. Ids must be unique across sources."""
    import numpy as np

    records = [r for src in sources for r in read_records(src)]
    if not records:
        raise DataGenError(f"no records in {', '.join(map(str, sources))}: nothing to pack")
    ids = [r["id"] for r in records]
    if len(set(ids)) != len(ids):
        raise DataGenError("the same record id occurs in two source files: pack each id once")
    metas = {str(src): read_meta(src) for src in sources}
    tokens = [t for r in records for t in r["prompt_ids"] + r["response_ids"]]
    dtype = np.uint16 if max(tokens, default=0) < 2**16 else np.uint32
    header = {"format": PACKED_FORMAT, "ids": ids, "datasets": [r["dataset"] for r in records], "meta": metas}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    arrays = {
        "tokens": np.asarray(tokens, dtype=dtype),
        "lengths": np.asarray(
            [[len(r["prompt_ids"]), len(r["response_ids"])] for r in records], dtype=np.int32
        ),
        "finish": np.asarray([FINISH.index(r.get("finish", "stop")) for r in records], dtype=np.uint8),
        "header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
    }

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object: numpy would add .npz to a name
            np.savez_compressed(f, **arrays)

    atomic_write(out, write)
    n_resp = sum(len(r["response_ids"]) for r in records)
    return {
        "records": len(records),
        "tokens": len(tokens),
        "response_tokens": n_resp,
        "bytes": out.stat().st_size,
    }


def read_packed(path: str | os.PathLike, vocab_size: int | None = None) -> Iterator[dict]:
    """The records of a `pack`ed file, as `read_records` gives them from JSONL."""
    import numpy as np

    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            tokens, lengths, finish = z["tokens"].astype(np.int64), z["lengths"], z["finish"]
            header = json.loads(bytes(z["header"]).decode())
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise DataGenError(
            f"{path} is not a packed token file ({e}): repack it with `flashdraft pack-data`"
        ) from None
    if (
        header.get("format") != PACKED_FORMAT
        or len(header["ids"]) != len(lengths)
        or lengths.sum() != len(tokens)
    ):
        raise DataGenError(f"{path}: header and arrays disagree (a damaged file): repack it")
    if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
        raise DataGenError(
            f"{path}: token id {int(tokens.max())} is outside the vocabulary of {vocab_size}: packed for another "
            "tokenizer"
        )
    start = 0
    for rid, dataset, (n_p, n_r), fin in zip(header["ids"], header["datasets"], lengths, finish, strict=True):
        seq = tokens[start : start + n_p + n_r].tolist()
        start += n_p + n_r
        yield make_record(rid, dataset, seq[:n_p], seq[n_p:], FINISH[int(fin)])
