"""Bounded load test of `flashdraft serve`: N streaming greedy chat requests at once, against the same
requests served one at a time.

Checks: zero errors, and every concurrent answer equal to the same request served alone (batching
must not change a greedy output). Reports throughput (completion tokens per second of wall time) and
tau (tokens committed per row per verify step, from the server's /metrics) for both phases, prints a
summary and writes it as JSON. Exit status 1 when any check fails.

    # start a server for the test (loopback, random key) and stop it afterwards
    python scripts/load_test.py --target smollm2-135m-instruct --draft checkpoints/smollm2-135m-instruct-dflash \
        --out load.json
    # or test a server that is already running
    python scripts/load_test.py --base-url http://127.0.0.1:8000/v1 --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request

import openai


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, key: str | None) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    """A `flashdraft serve` subprocess on a free loopback port; waits until /health answers."""
    port, key = _free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "flashdraft", "serve", "--target", args.target, "--port", str(port),
           "--max-batch-size", str(args.max_batch_size), "--dtype", args.dtype, "--device", args.device,
           "--log-level", "warning"]  # fmt: skip
    if args.draft:
        cmd += ["--draft", args.draft]
    log = open(args.server_log, "w")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, FLASHDRAFT_API_KEY=key)
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.startup_timeout
    while True:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}; see {args.server_log}")
        try:
            if _get(base + "/health", None).get("status") == "ok":
                return proc, base + "/v1", key
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            sys.exit(
                f"the server did not answer /health within {args.startup_timeout} s; see {args.server_log}"
            )
        time.sleep(0.5)


async def one(client, model: str, messages: list[dict], args) -> dict:
    """One streaming greedy chat request: text, usage and timings, or the error."""
    t0 = time.perf_counter()
    text, first, finish, usage = [], None, None, None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} if args.ignore_eos else None,
        )
        async for chunk in stream:
            if chunk.choices:
                piece = chunk.choices[0].delta.content
                if piece:
                    first = first or time.perf_counter() - t0
                    text.append(piece)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
    except Exception as e:  # counted, never raised: the test reports every failure
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        "text": "".join(text),
        "completion_tokens": usage.completion_tokens if usage else None,
        "finish_reason": finish,
        "ttft_s": first,
        "latency_s": time.perf_counter() - t0,
    }


def _tau(before: dict, after: dict) -> float | None:
    steps = (after.get("verify_steps") or 0) - (before.get("verify_steps") or 0)
    return ((after.get("committed") or 0) - (before.get("committed") or 0)) / steps if steps else None


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


async def phase(client, model, prompts, args, base, key, concurrent: bool) -> tuple[list[dict], dict]:
    before = _get(base.removesuffix("/v1") + "/metrics.json", key)
    t0 = time.perf_counter()
    if concurrent:
        results = await asyncio.gather(*(one(client, model, p, args) for p in prompts))
    else:
        results = [await one(client, model, p, args) for p in prompts]
    wall = time.perf_counter() - t0
    after = _get(base.removesuffix("/v1") + "/metrics.json", key)
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    summary = {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "wall_s": round(wall, 3),
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else None,
        "tau": _tau(before, after),
        "mean_batch_rows": (after["rows"] - before["rows"]) / max(1, after["steps"] - before["steps"]),
        "ttft_p50_s": _pct([r["ttft_s"] for r in ok], 0.5),
        "ttft_p95_s": _pct([r["ttft_s"] for r in ok], 0.95),
        "latency_p50_s": _pct([r["latency_s"] for r in ok], 0.5),
        "latency_p95_s": _pct([r["latency_s"] for r in ok], 0.95),
    }  # fmt: skip
    return results, summary


async def run(args, base: str, key: str | None, model: str) -> dict:
    from flashdraft.data import load_dataset

    examples = load_dataset(args.dataset, limit=args.requests, seed=args.seed)
    if not examples:
        sys.exit(f"data set {args.dataset} gave no prompts")
    prompts = [examples[i % len(examples)].messages() for i in range(args.requests)]
    client = openai.AsyncOpenAI(base_url=base, api_key=key or "none", max_retries=0, timeout=args.timeout)
    alone, alone_sum = await phase(client, model, prompts, args, base, key, concurrent=False)
    together, together_sum = await phase(client, model, prompts, args, base, key, concurrent=True)
    mismatches = []
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        if "error" in a or "error" in b:
            continue
        if a["text"] != b["text"]:
            at = len(os.path.commonprefix([a["text"], b["text"]]))
            mismatches.append({"request": i, "first_difference_at_char": at, "alone": a["text"][at : at + 40],
                               "concurrent": b["text"][at : at + 40]})  # fmt: skip
    errors = [{"phase": p, "request": i, "error": r["error"]}
              for p, rs in (("alone", alone), ("concurrent", together)) for i, r in enumerate(rs) if "error" in r]  # fmt: skip
    return {
        "base_url": base,
        "model": model,
        "dataset": args.dataset,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "alone": alone_sum,
        "concurrent": together_sum,
        "speedup": (together_sum["tokens_per_s"] / alone_sum["tokens_per_s"])
        if alone_sum["tokens_per_s"]
        else None,
        "errors": errors,
        "mismatches": mismatches,
        "passed": not errors and not mismatches,
        "server_metrics": _get(base.removesuffix("/v1") + "/metrics.json", key),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="a running server's /v1 URL (else --target starts one)")
    ap.add_argument("--model", help="model id to request (default: the server's only model)")
    ap.add_argument("--api-key", default=os.environ.get("FLASHDRAFT_API_KEY"))
    ap.add_argument("--target", help="start `flashdraft serve --target T` on loopback for the test")
    ap.add_argument("--draft")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--server-log", default="load_test_server.log")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument(
        "--requests", type=int, default=32, help="requests per phase (all at once when concurrent)"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ignore-eos", action="store_true", help="every request runs to --max-tokens")
    ap.add_argument("--dataset", default="mt-bench", help="prompts: first turns of a flashdraft.data set")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600, help="per request, seconds")
    ap.add_argument("--out", default="load_test.json")
    args = ap.parse_args()
    if not (args.base_url or args.target):
        ap.error("pass --base-url of a running server or --target to start one")

    proc = None
    if args.target:
        proc, base, key = start_server(args)
    else:
        base, key = args.base_url.rstrip("/"), args.api_key
    try:
        model = args.model or _get(base + "/models", key)["data"][0]["id"]
        report = asyncio.run(run(args, base, key, model))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    for name in ("alone", "concurrent"):
        s = report[name]
        tau = f"{s['tau']:.3f}" if s["tau"] is not None else "n/a"
        print(
            f"{name:>10}: {s['requests']} requests, {s['errors']} errors, {s['completion_tokens']} tokens in "
            f"{s['wall_s']:.2f} s = {s['tokens_per_s']:.1f} tokens/s, tau {tau}, "
            f"mean batch {s['mean_batch_rows']:.1f}, latency p50 {s['latency_p50_s']:.2f} s"
        )
    speedup = f"{report['speedup']:.2f}x" if report["speedup"] else "n/a"
    print(f"throughput speedup {speedup}; {len(report['mismatches'])} greedy outputs differ from alone")
    print(f"{'PASSED' if report['passed'] else 'FAILED'}; report in {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
