"""Throughput of batched DFlash against plain batched decoding, per batch size (issue 7).

Like the paper's concurrency table: the same chat prompts go through `flashdraft.Engine`
at each batch size, with continuous batching (a finished row's slot goes to the next prompt), once
with plain decoding, once with the DFlash draft at each block size, and once with adaptive
speculation (the server's default: it verifies only what it expects to pay at this batch size).
Throughput is generated tokens over wall time, prefills included. Verification stops being free as
batches grow, so a smaller block can win at larger batches: pass several --block-sizes to measure that.

    python scripts/bench_batch.py --target smollm2-135m-instruct \
        --draft checkpoints/smollm2-135m-instruct-dflash --batch-sizes 1,4,8,16 --block-sizes 16,8 \
        --prompts 32 --max-new-tokens 128 --rounds 3 --out batch.json

Run it on an otherwise idle machine; numbers from a busy one say little. A 2-core VM drifts by up
to 25% over minutes even so: `--rounds 3` runs every method three times, interleaved, and reports
the median round; a speedup is the median of the rounds' ratios to plain's run in the same round.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from flashdraft import DFlashDraft, DFlashProposer, Engine, GenerationConfig, SamplingConfig, load_target
from flashdraft.chat import chat_ids
from flashdraft.data import load_dataset
from flashdraft.engine.adaptive import make_proposer


def ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def measure(target, draft, blocks, trees, batch_size, prompts, config, rounds: int, lockstep=False) -> dict:
    """Plain, each block size, each tree size and adaptive at one batch size, `rounds` times in a rotating
    order, so that the machine's drift over minutes reaches every method alike (`lockstep`: all at
    once, step by step). Per method: the median round's run (by tokens/s), with every round's tokens/s
    beside it."""
    methods = ["plain", *map(str, blocks), *(f"tree-{n}" for n in trees), "adaptive"]
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for r in range(rounds):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        engines = {m: make_engine(target, draft, m, max(blocks), batch_size) for m in order}
        if lockstep:
            done = in_lockstep(engines, prompts, config)
        else:
            done = {m: drive(e, prompts, config) for m, e in engines.items()}
        for m in order:
            runs[m].append(done[m])
    out = {}
    for m, rs in runs.items():
        median = sorted(rs, key=lambda x: x["tokens_per_s"])[len(rs) // 2]
        out[m] = {**median, "rounds_tokens_per_s": [x["tokens_per_s"] for x in rs]}
    return out


def label(block) -> str:
    if str(block).startswith("tree-"):
        return f"tree of {block.removeprefix('tree-')}"
    return "adaptive" if block == "adaptive" else f"DFlash B={block}"


def chat_prompts(target, dataset: str, n: int) -> list[list[int]]:
    tok = target.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise SystemExit(f"{dataset}: the target has no tokenizer with a chat template; pass a chat model")
    examples = load_dataset(dataset, limit=n)
    if len(examples) < n:
        raise SystemExit(f"{dataset} has {len(examples)} prompts, fewer than --prompts {n}")
    return [chat_ids(tok, ex.messages()) for ex in examples]


def make_engine(target, draft, method: str, block_size: int, batch_size: int) -> Engine:
    """A decoder with at most batch_size rows for a method: "plain", a block size ("8"), a tree size
    ("tree-3") or "adaptive" (a fresh proposer: it measures this batch size)."""
    if method == "plain":
        return Engine(target, None, 1, max_batch_size=batch_size)
    if method == "adaptive":
        proposer = make_proposer(draft, target, speculation="adaptive")
        return Engine(target, proposer, block_size, max_batch_size=batch_size)
    if method.startswith("tree-"):
        proposer = DFlashProposer(draft, target, tree=int(method.removeprefix("tree-")))
        return Engine(target, proposer, draft.config.block_size, max_batch_size=batch_size)
    return Engine(target, DFlashProposer(draft, target), int(method), max_batch_size=batch_size)


def run(target, draft, block_size, batch_size, prompts, config) -> dict:
    """All prompts through one DFlash decoder at a fixed block size (the warm-up)."""
    return drive(make_engine(target, draft, str(block_size), block_size, batch_size), prompts, config)


def drive(dec: Engine, prompts, config) -> dict:
    """All prompts through one decoder; throughput (wall time, prefills included) and acceptance."""
    out: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        dec.add(str(i), ids, config)
    while dec.pending():
        for o in dec.step():
            out.setdefault(o.request_id, []).extend(o.tokens)
    return result(dec, out, time.perf_counter() - start)


def in_lockstep(engines: dict[str, Engine], prompts, config) -> dict[str, dict]:
    """All prompts through every decoder at once: one step of each in turn (the order reversed every
    step), each timing its own steps, so that the machine's drift (15-25% over minutes on a 2-core VM,
    and within seconds too) reaches every method alike and the ratios stay put (batch 4, adaptive
    against plain: 0.93 twice in lockstep, 0.84-0.94 in runs one after the other)."""
    outs: dict[str, dict[str, list[int]]] = {m: {} for m in engines}
    seconds = dict.fromkeys(engines, 0.0)
    for dec in engines.values():
        for i, ids in enumerate(prompts):
            dec.add(str(i), ids, config)
    order = list(engines)
    while any(dec.pending() for dec in engines.values()):
        for m in order:
            if engines[m].pending():
                t0 = time.perf_counter()
                for o in engines[m].step():
                    outs[m].setdefault(o.request_id, []).extend(o.tokens)
                seconds[m] += time.perf_counter() - t0
        order.reverse()
    return {m: result(engines[m], outs[m], seconds[m]) for m in engines}


def result(dec: Engine, out: dict[str, list[int]], wall: float) -> dict:
    tokens = sum(len(t) for t in out.values())
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "tau": dec.stats["tau"],
        "target_forwards": dec.stats["forwards"] + dec.stats["prefills"],
        "outputs": [out[str(i)] for i in range(len(out))],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct", help="built-in name or local HF directory")
    ap.add_argument("--draft", required=True, help="DFlash draft directory")
    ap.add_argument("--batch-sizes", type=ints, default=[1, 4, 8, 16])
    ap.add_argument("--block-sizes", type=ints, default=None, help="default: the draft's own block size")
    ap.add_argument(
        "--trees", type=ints, default=[], help="drafted tokens per tree, e.g. 3,4 (default: none)"
    )
    ap.add_argument("--dataset", default="mt-bench", help="built-in data set of chat prompts")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per run (>= the largest batch size)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--runner", default="auto", choices=["auto", "native", "transformers"])
    ap.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per method and batch size, interleaved")
    ap.add_argument(
        "--lockstep",
        action="store_true",
        help="every method at once, one step of each in turn, each timing its own steps (less drift)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    if args.prompts < max(args.batch_sizes):
        ap.error(
            f"--prompts ({args.prompts}) must be at least the largest batch size ({max(args.batch_sizes)})"
        )
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_target(args.target, dtype=args.dtype, runner=args.runner, quantize=args.quantize)
    draft = DFlashDraft.from_pretrained(args.draft, dtype=target.dtype, device=target.device)
    blocks = args.block_sizes or [draft.config.block_size]
    prompts = chat_prompts(target, args.dataset, args.prompts)
    sampling = SamplingConfig(args.temperature)
    config = GenerationConfig(args.max_new_tokens, sampling=sampling, stop_ids=target.stop_ids, seed=0)
    print(
        f"target {args.target} ({target.describe()}), draft {args.draft}, {len(prompts)} {args.dataset} prompts, "
        f"{args.max_new_tokens} new tokens, temperature {args.temperature}, {torch.get_num_threads()} threads",
        flush=True,
    )
    run(target, draft, blocks[0], 2, prompts[:2], GenerationConfig(8, stop_ids=target.stop_ids))  # warm-up

    rows = []
    methods = [*blocks, *(f"tree-{n}" for n in args.trees), "adaptive"]
    for bs in args.batch_sizes:
        runs = measure(target, draft, blocks, args.trees, bs, prompts, config, args.rounds, args.lockstep)
        plain = runs.pop("plain")
        row = {"batch_size": bs, "plain": {k: v for k, v in plain.items() if k != "outputs"}, "dflash": {}}
        for block in methods:
            spec = runs[str(block)]
            same = sum(a == b for a, b in zip(spec.pop("outputs"), plain["outputs"], strict=True))
            # each round's ratio to plain's run of the same round (adjacent in time), then their median:
            # the VM's drift over minutes moves both runs of a round alike
            ratios = [
                a / b for a, b in zip(spec["rounds_tokens_per_s"], plain["rounds_tokens_per_s"], strict=True)
            ]
            spec["rounds_speedup"] = ratios
            spec["speedup"] = sorted(ratios)[len(ratios) // 2]
            spec["rows_identical_to_plain"] = same
            row["dflash"][str(block)] = spec
            print(
                f"batch {bs:>3}  plain {plain['tokens_per_s']:8.1f} tok/s  {label(block):<12} "
                f"{spec['tokens_per_s']:8.1f} tok/s  x{spec['speedup']:.2f}  tau {spec['tau']:.2f}  "
                f"same output {same}/{len(prompts)}",
                flush=True,
            )
        rows.append(row)

    head = "| batch | plain tok/s | " + " | ".join(f"{label(b)} tok/s (tau) | speedup" for b in methods)
    print("\n" + head + " | best |")
    print("|" + "---|" * (3 + 2 * len(methods)))
    for row in rows:
        cells = [str(row["batch_size"]), f"{row['plain']['tokens_per_s']:.1f}"]
        for b in methods:
            d = row["dflash"][str(b)]
            cells += [f"{d['tokens_per_s']:.1f} ({d['tau']:.2f})", f"{d['speedup']:.2f}x"]
        best = max(methods, key=lambda b: row["dflash"][str(b)]["tokens_per_s"])
        row["best"] = label(best) if row["dflash"][str(best)]["speedup"] > 1 else "plain"
        print("| " + " | ".join(cells) + f" | {row['best']} |")

    if args.out:
        result = {
            "settings": {
                k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"
            },
            "block_sizes": blocks,
            "dtype": str(target.dtype).removeprefix("torch."),
            "runner": target.describe(),
            "threads": torch.get_num_threads(),
            "machine": {"platform": platform.platform(), "processor": platform.processor()},
            "torch": torch.__version__,
            "results": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
