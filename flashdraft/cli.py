"""Command line: `flashdraft generate | init-draft | models | datagen | train | serve | bench`."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import torch

from flashdraft import chat
from flashdraft.data import check_dataset_name
from flashdraft.engine.adaptive import DEFAULT_SPECULATION, SPECULATION, TREE_NODES, make_proposer
from flashdraft.engine.decode import GenerationConfig, generate
from flashdraft.engine.sampling import SamplingConfig
from flashdraft.models.draft import DFlashDraft, DraftConfig, DraftError, init_draft_config
from flashdraft.models.load import RUNNERS, load_target, local_dir, target_kind
from flashdraft.models.runner import QUANTIZE, supports
from flashdraft.models.target import (
    DTYPES,
    Target,
    TargetError,
    check_model_dir,
    resolve_device,
)


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def _prompt_ids(args, target: Target) -> list[int]:
    if args.prompt_ids is not None:
        return _ids(args.prompt_ids)
    tok = target.tokenizer
    if tok is None:
        raise ValueError("this target has no tokenizer; pass --prompt-ids instead of --prompt")
    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError("--chat needs a tokenizer with a chat template; drop --chat")
        return chat.chat_ids(tok, [{"role": "user", "content": args.prompt}], args.chat_template_kwargs)
    return tok(args.prompt, add_special_tokens=True)["input_ids"]


class _TextStream:
    """Prints committed tokens as text, decoding the whole output so multi-byte pieces come out whole."""

    def __init__(self, tokenizer, out):
        self.tok, self.out, self.ids, self.shown = tokenizer, out, [], ""

    def __call__(self, new: list[int]) -> None:
        self.ids += new
        text = (
            self.tok.decode(self.ids, skip_special_tokens=True) if self.tok else " ".join(map(str, self.ids))
        )
        if text.startswith(self.shown):
            self.out.write(text[len(self.shown) :])
            self.out.flush()
            self.shown = text


INEXACT_NOTE = (
    "note: {what}: a verify pass over a block and a one-token step round differently, so greedy output "
    "can differ from plain decoding after a near-tie (docs/lossless.md); the default (--runner auto "
    "--quantize auto: quantized weights, bf16) or --dtype float32 makes them equal"
)


def inexact_note(target) -> str | None:
    """The one-line warning for settings whose verify does not round as a one-token step does: bf16 or
    fp16 activations without the native runner's batch-invariant quantized kernels."""
    if target.exact or target.dtype not in (torch.bfloat16, torch.float16):
        return None
    return INEXACT_NOTE.format(what=target.describe())


def add_runner_arguments(p) -> None:
    """--runner and --quantize, for the verbs that decode (generate, serve, bench, datagen)."""
    p.add_argument(
        "--runner",
        choices=list(RUNNERS),
        default="auto",
        help="the target's model code: native (ours: static cache, quantized weights; Llama, Qwen2, Qwen3, "
        "Gemma 3), transformers, or auto (native where it covers the architecture)",
    )
    p.add_argument(
        "--quantize",
        choices=["auto", *QUANTIZE],
        default="auto",
        help="the native runner's weights: q8_0 / q4_1 (GGUF's blocks of 32, our kernels, int8 activations), "
        "gguf (a GGUF target's blocks as stored: Q4_K, Q6_K, Q5_0, Q8_0, Q4_1), int8 per channel or int4 in "
        "groups of 32 (torch's kernels), or none (dense). auto: quantized with bf16 activations, which makes "
        "DFlash bitwise equal to plain decoding (a GGUF's own blocks, q8_0 for other checkpoints, int8 where "
        "our kernels cannot be built); dense otherwise (flashdraft.models.compute)",
    )


def cmd_generate(args) -> int:
    device = resolve_device(args.device)
    target = load_target(args.target, args.dtype, str(device), args.runner, args.quantize)
    dtype = target.dtype  # what `auto` chose (flashdraft.models.compute): the draft runs in it too
    proposer = None
    # Adaptive cuts follow measured timings, so with them a seed fixes only the distribution: seeded sampling
    # runs fixed blocks unless asked otherwise.
    if args.speculation is None:
        args.speculation = "fixed" if args.seed is not None and args.temperature > 0 else DEFAULT_SPECULATION
    if args.draft:
        draft = DFlashDraft.from_pretrained(local_dir(args.draft), dtype=dtype, device=device)
        proposer = make_proposer(draft, target, args.proposal, args.speculation, args.tree_nodes)
        note = inexact_note(target)
        if note and (args.block_size or 2) > 1:
            print(note, file=sys.stderr)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    stop_ids = [] if args.ignore_eos else target.stop_ids
    cfg = GenerationConfig(args.max_new_tokens, args.block_size, sampling, stop_ids, args.seed)
    prompt = _prompt_ids(args, target)
    stream = None if args.json else _TextStream(target.tokenizer, sys.stdout)
    torch.manual_seed(args.seed if args.seed is not None else 0)
    res = generate(target, prompt, proposer, cfg, on_tokens=stream)
    if stream is not None:
        print()  # the text ends its line; the summary below goes to stderr
    text = target.tokenizer.decode(res.tokens, skip_special_tokens=True) if target.tokenizer else None
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_ids": prompt,
                    "token_ids": res.tokens,
                    "text": text,
                    "acceptance_lengths": res.acceptance_lengths,
                    "tau": res.tau,
                    "tokens_per_s": res.tokens_per_s,
                    "prefill_s": res.prefill_s,
                    "decode_s": res.decode_s,
                    "draft_s": sum(res.draft_s),
                    "verify_s": sum(res.verify_s),
                    "bookkeeping_s": res.bookkeeping_s,
                    "stop_reason": res.stop_reason,
                    "device": str(device),
                    "dtype": str(dtype).removeprefix("torch."),
                    "runner": target.describe(),
                    "speculation": args.speculation if proposer is not None else None,
                    "adaptive": getattr(
                        proposer, "stats", None
                    ),  # draft / skipped steps, n-gram / DFlash rows
                }
            )
        )
    else:
        print(
            f"\n\n[{len(res.tokens)} tokens, tau {res.tau:.2f}, {res.tokens_per_s:.1f} tokens/s, "
            f"prefill {res.prefill_s * 1e3:.0f} ms, stop: {res.stop_reason}; {device}, "
            f"{target.describe()}]",
            file=sys.stderr,
        )
    return 0


def cmd_init_draft(args) -> int:
    target = load_target(args.target, torch.float32, runner="transformers")
    mask, note = (
        (args.mask_token_id, None) if args.mask_token_id is not None else target.default_mask_token_id()
    )
    if note:
        print(note, file=sys.stderr)
    layer_ids = _ids(args.target_layer_ids) if args.target_layer_ids else None
    cfg = init_draft_config(target.model.config, args.layers, mask, args.block_size, layer_ids)
    if not 0 <= mask < target.vocab_size:  # the config only knows the declared vocab_size
        raise DraftError(f"mask_token_id {mask} is outside the target vocabulary of {target.vocab_size}")
    torch.manual_seed(args.seed)
    draft = DFlashDraft(cfg)
    draft.check_target(target)
    draft.save_pretrained(args.out, dtype=DTYPES[args.dtype])
    print(
        f"wrote {args.out}: {args.layers} layers, block {cfg.block_size}, target layers {cfg.target_layer_ids}, "
        f"mask {mask}, {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M parameters"
    )
    return 0


def cmd_export(args) -> int:
    import tempfile

    from flashdraft.models.export import export_gguf, export_transformers, target_gguf

    draft = DFlashDraft.from_pretrained(local_dir(args.draft))  # exported in the dtype it was saved in
    if args.to == "gguf":
        with tempfile.TemporaryDirectory(prefix="flashdraft-export-") as scratch:
            source = target_gguf(args.target, Path(scratch))  # before loading: an HF target is refused now
            target = load_target(args.target, torch.float32, runner="transformers")
            out = export_gguf(draft, target, source, args.out)
        print(
            f"wrote {out}: llama.cpp's DFlash draft ({len(draft.layers)} layers, block {draft.config.block_size}"
            f"{'' if draft.vocab is None else f', draft vocabulary of {len(draft.vocab)} tokens'}); run it as "
            f"llama-server -m TARGET.gguf -md {out} --spec-type draft-dflash --spec-draft-n-max "
            f"{draft.config.block_size - 1}"
        )
        return 0
    target = load_target(args.target, next(draft.parameters()).dtype, runner="transformers")
    out = export_transformers(draft, target, args.out)
    print(
        f"wrote {out}: transformers' DFlash assistant model; use it as "
        f"MuseGlimmerAssistantModel.from_pretrained({str(out)!r}) with "
        "generate(..., assistant_model=assistant, speculation_type='dflash')"
    )
    return 0


def cmd_models(args) -> int:
    from flashdraft.models import load as models

    rows = models.describe()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        state = (
            f"{'installed' if r['installed'] else 'not installed'}, "
            f"{'converted (cached)' if r['cached'] else 'not converted yet (converts on first use)'}"
        )
        print(f"{r['name']:<{width}}  {state}\n{'':<{width}}  {r['description']} [{r['license']}]")
        if not r["installed"]:
            print(f"{'':<{width}}  install: {r['install']}")
    print(f"\ncache: {models.cache_root()} (set FLASHDRAFT_CACHE to move it)")
    return 0


def cmd_datagen(args) -> int:
    from flashdraft.train.datagen import DatagenConfig, run_datagen

    cfg = DatagenConfig(
        target=args.target,
        datasets=args.dataset.split(","),
        out=args.out,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        limit=args.limit,
        max_prompt_tokens=args.max_prompt_tokens,
        max_minutes=args.max_minutes,
        endpoint=args.endpoint,
        model=args.model,
        dtype=args.dtype,
        runner=args.runner,
        quantize=args.quantize,
        device=args.device,
        progress=not args.no_progress,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    print(run_datagen(cfg).line())
    return 0


def cmd_make_draft(args) -> int:
    from flashdraft.train.make import config_from_args, make_draft

    n = make_draft(config_from_args(args))
    print(
        f"draft: {args.out}/draft ({n['steps']} steps; held-out tau {n['real_tau']:.3f} in the real loop); "
        f"use it: {n['serve']}"
    )
    return 0


def cmd_pack_data(args) -> int:
    from flashdraft.train.datagen import pack

    info = pack(args.sources, args.out)  # a DataGenError is a ValueError: main prints it, exit code 2
    print(
        f"packed {info['records']} records ({info['tokens']} tokens, {info['response_tokens']} response) "
        f"into {args.out}: {info['bytes']} bytes"
    )
    return 0


def cmd_train(args) -> int:
    from flashdraft.train.config import TrainConfig
    from flashdraft.train.loop import train
    from flashdraft.train.state import checkpoint_dirs

    try:
        train(TrainConfig.from_args(args))
    except KeyboardInterrupt:  # the checkpoints on disk are whole (written atomically): say how to go on
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank gets the Ctrl-C; one line will do
            found = checkpoint_dirs(Path(args.out))
            again = ["flashdraft", *args.argv] + ([] if args.resume else ["--resume"])
            print(
                f"interrupted: the last checkpoint is {found[-1]}; continue with: {shlex.join(again)}"
                if found
                else f"interrupted before the first checkpoint: nothing to resume; start again with: "
                f"{shlex.join(['flashdraft', *args.argv])}",
                file=sys.stderr,
            )
        return 130
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # FSDP2 keeps Python references to the process group past destroy_process_group (torch 2.13: 11
        # of them), so gloo's threads would be torn down by the interpreter's exit, which now and then
        # aborts a finished run ("terminate called without an active exception", exit -6, seen in CI).
        # Every file is written and closed by now: leave without running those destructors.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def cmd_serve(args) -> int:
    try:
        from flashdraft.serve import cmd_serve
    except ImportError as e:  # a slim install (the GPU box's) may lack the web stack; no other verb needs it
        raise ValueError(
            f"flashdraft serve needs the server's packages ({e.name or e} is missing): "
            "pip install fastapi uvicorn pydantic prometheus_client (the versions pinned in pyproject.toml)"
        ) from None
    return cmd_serve(args)


def cmd_bench(args) -> int:
    from flashdraft.bench.bench import main_from_args

    return main_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    from flashdraft import __version__

    p = argparse.ArgumentParser(prog="flashdraft", description=__doc__)
    p.add_argument("--version", action="version", version=f"flashdraft {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in (_add_generate, _add_draft_verbs, _add_datagen, _add_heavy_verbs):
        add(sub)
    p.verbs = sub.choices
    for verb in sub.choices.values():  # every verb's --help shows the defaults that mean something
        _show_defaults(verb)
    return p


def _show_defaults(verb: argparse.ArgumentParser) -> None:
    for a in verb._actions:
        if (
            a.option_strings
            and not any(a.default is x for x in (None, False, argparse.SUPPRESS))
            and "%(default)" not in (a.help or "")
        ):
            a.help = f"{a.help} (default: %(default)s)" if a.help else "default: %(default)s"


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text, speculatively when a draft is given")
    g.add_argument(
        "--target",
        required=True,
        help="built-in name (see `flashdraft models`), a .gguf file or a local HF model directory",
    )
    g.add_argument("--draft", help="DFlash draft directory (omit for plain decoding)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the target's chat template")
    chat.add_argument(g, "--chat")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--block-size", type=int, default=None, help="default: the draft's; 1 = plain decoding")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--proposal",
        choices=["draft", "greedy"],
        default="draft",
        help="with sampling: sample drafts from the draft's distribution, or draft its argmax",
    )
    g.add_argument(
        "--speculation",
        choices=SPECULATION,
        default=None,
        help=f"fixed: verify every drafted token; adaptive: DFlash and n-gram lookup, cut and skipped by "
        f"measured costs (README, Adaptive speculation); tree: trees of --tree-nodes drafted tokens from the "
        f"block's marginals (README, Tree verification). Default: {DEFAULT_SPECULATION}, except fixed when "
        "sampling with --seed (adaptive decisions follow timings, so the same seed would give other tokens)",
    )
    g.add_argument(
        "--tree-nodes", type=int, default=TREE_NODES, help="drafted tokens per tree (--speculation tree)"
    )
    g.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="auto: bf16 on our CPU kernels (any x86 CPU they build on) and where the hardware has it, else float32 (what runs is printed: flashdraft.models.compute)",
    )
    add_runner_arguments(g)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)


def _add_draft_verbs(sub) -> None:
    """init-draft, export, models and pack-data."""
    i = sub.add_parser("init-draft", help="write a randomly initialised draft shaped for a target")
    i.add_argument(
        "--target", required=True, help="built-in name, a .gguf file or a local HF model directory"
    )
    i.add_argument("--layers", type=int, default=5)
    i.add_argument("--block-size", type=int, default=16)
    i.add_argument(
        "--target-layer-ids", help="comma-separated 0-based target layers (default: spread formula)"
    )
    i.add_argument("--mask-token-id", type=int, default=None)
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    i.add_argument("--out", required=True, help="the draft directory to write (refused when it holds files)")
    i.add_argument("--force", action="store_true", help="replace the files of an existing --out")
    i.set_defaults(func=cmd_init_draft)

    x = sub.add_parser(
        "export", help="write a draft in another engine's format (transformers' DFlash, llama.cpp's GGUF)"
    )
    x.add_argument("--to", choices=["transformers", "gguf"], required=True, help="the format to write")
    x.add_argument("draft", help="the draft directory")
    x.add_argument("out", help="the directory (transformers) or .gguf file (gguf) to write")
    x.add_argument(
        "--target", required=True, help="the draft's target: built-in name, a .gguf file or a local HF model"
    )
    x.set_defaults(func=cmd_export)

    m = sub.add_parser(
        "models", help="list the built-in target names and whether they are installed / cached"
    )
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)

    pk = sub.add_parser("pack-data", help="pack datagen JSONL files into one compressed .npz of token ids")
    pk.add_argument("sources", nargs="+", help="datagen JSONL files")
    pk.add_argument("--out", required=True, help="the .npz to write (train --data reads it)")
    pk.set_defaults(func=cmd_pack_data)


def _add_datagen(sub) -> None:

    d = sub.add_parser(
        "datagen", help="regenerate training responses with the target itself (JSONL, resumable)"
    )
    d.add_argument(
        "--target",
        required=True,
        help="built-in name, a .gguf file or a local HF model directory (with --endpoint: the tokenizer)",
    )
    d.add_argument(
        "--dataset",
        required=True,
        help="comma-separated data set names (flashdraft.data), e.g. sharegpt-train,gsm-symbolic",
    )
    d.add_argument("--out", required=True, help="JSONL file; rerunning continues it (skips finished ids)")
    d.add_argument("--max-new-tokens", type=int, default=512)
    d.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="prompts per generate call (with --endpoint: concurrent requests)",
    )
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--top-k", type=int, default=0, help="0 = off")
    d.add_argument("--seed", type=int, default=0, help="sampling seed; also picks the gsm-symbolic problems")
    d.add_argument("--limit", type=int, default=None, help="at most N prompts per data set")
    d.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="skip prompts longer than N tokens (chat template included): long prompts cost prefill "
        "time and memory for the same answer tokens",
    )
    d.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop answering after this many minutes (rows still decoding are dropped); rerun to continue",
    )
    d.add_argument(
        "--endpoint", help="URL of an OpenAI-compatible server (vLLM, SGLang, ...) to generate with"
    )
    d.add_argument("--model", help="model name to request from --endpoint (default: --target)")
    d.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="auto: bf16 on our CPU kernels (any x86 CPU they build on) and where the hardware has it, else float32 (what runs is printed: flashdraft.models.compute)",
    )
    d.add_argument(
        "--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N] (local target)"
    )
    add_runner_arguments(d)
    chat.add_argument(d, "the prompts (also sent to --endpoint)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=cmd_datagen)


def _add_heavy_verbs(sub) -> None:
    """train and bench, whose options live beside their code, and serve, whose options live here."""
    from flashdraft.train.loop import add_arguments as add_train_arguments
    from flashdraft.train.make import add_arguments as add_make_arguments

    md = sub.add_parser(
        "make-draft",
        help="from a target to a trained draft in one command: answers, training, evaluation (resumable)",
    )
    add_make_arguments(md)
    add_runner_arguments(md)
    md.set_defaults(func=cmd_make_draft)

    t = sub.add_parser(
        "train", help="train a DFlash draft on regenerated data (resumable; torchrun for many ranks)"
    )
    add_train_arguments(t)
    t.set_defaults(func=cmd_train)

    from flashdraft.bench.bench import add_arguments as add_bench_arguments

    b = sub.add_parser(
        "bench", help="benchmark plain, n-gram, DFlash, the reference loop and transformers on data sets"
    )
    add_bench_arguments(b)
    add_runner_arguments(b)
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server with batched speculative decoding (loopback by default)"
    )
    _add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)


def _add_serve_arguments(p) -> None:
    """Here rather than in serve.py, so that building the parser for any verb needs no web stack."""
    p.add_argument(
        "--target", required=True, help="built-in name, a .gguf file or a local HF model directory"
    )
    p.add_argument("--draft", help="DFlash draft directory (omit for plain batched decoding)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key", help="require `Authorization: Bearer KEY` (default: $FLASHDRAFT_API_KEY, else no key)"
    )
    p.add_argument("--max-batch-size", type=int, default=8, help="rows decoded together per step")
    p.add_argument("--block-size", type=int, default=None, help="default: the draft's; 1 = plain decoding")
    p.add_argument("--proposal", choices=["draft", "greedy"], default="draft", help="drafts when sampling")
    p.add_argument(
        "--speculation",
        choices=SPECULATION,
        default=DEFAULT_SPECULATION,
        help="fixed: verify every drafted token; adaptive: DFlash and n-gram lookup, cut and skipped by "
        "measured costs (README, Adaptive speculation); tree: trees of --tree-nodes drafted tokens from the "
        "block's marginals (README, Tree verification)",
    )
    p.add_argument(
        "--tree-nodes", type=int, default=TREE_NODES, help="drafted tokens per tree (--speculation tree)"
    )
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="auto: bf16 on our CPU kernels and where the hardware has it",
    )
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    add_runner_arguments(p)
    p.add_argument("--model-name", help="the model id clients send (default: --target as given)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get a 413")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


# -- checks of the command line that need no model: they run before anything loads -----------------

# Option (by dest) -> (is the value fine, what it must be). Each applies to every verb that has the option;
# None (not given) always passes.
RULES = {
    "max_new_tokens": (lambda v: v >= 1, ">= 1"),
    "temperature": (lambda v: v >= 0, ">= 0 (0 = greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1] (1 = off)"),
    "top_k": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "block_size": (lambda v: v >= 1, ">= 1"),
    "layers": (lambda v: v >= 1, ">= 1"),
    "mask_token_id": (lambda v: v >= 0, ">= 0"),
    "batch_size": (lambda v: v >= 1, ">= 1"),
    "max_batch_size": (lambda v: v >= 1, ">= 1"),
    "max_prompt_tokens": (lambda v: v >= 1, ">= 1"),
    "limit": (lambda v: v >= 0, ">= 0"),
    "samples": (lambda v: v >= 1, ">= 1"),
    "ngram_tokens": (lambda v: v >= 1, ">= 1"),
    "numerics_samples": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "numerics_max_new_tokens": (lambda v: v >= 1, ">= 1"),
    "max_body_bytes": (lambda v: v >= 1, ">= 1"),
    "port": (lambda v: 1 <= v <= 65535, "a TCP port, 1-65535"),
}


class UsageError(ValueError):
    """An option's value is wrong; found before any model loads (main prints it: exit code 2)."""


def _utf8(text: str, option: str) -> None:
    """Python hands bytes that are not UTF-8 over as lone surrogates, which tokenizers cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"character U+{code:04X}"
        raise UsageError(
            f"{option} is not valid UTF-8 ({byte} at character {e.start}): pass UTF-8 text "
            "(check the terminal's or the file's encoding)"
        ) from None


def _draft_dir(spec: str, option: str) -> None:
    """A draft directory (or cached Hub id) with a readable draft config.json: read, not loaded."""
    try:
        DraftConfig.read(local_dir(spec))
    except (DraftError, TargetError) as e:
        raise UsageError(f"{option} {spec}: {e}") from None


def check_args(args) -> None:
    """Refuse wrong option values, missing files and unusable inputs before any model loads (a model
    takes seconds to a minute to load; a typo should cost nothing)."""
    for dest, (fine, what) in RULES.items():
        value = getattr(args, dest, None)
        if value is not None and not fine(value):
            raise UsageError(f"--{dest.replace('_', '-')} must be {what}, got {value}")
    if getattr(args, "target", None) is not None:
        # target_kind's message names the target and what it could be; a draft swapped in is named too
        if target_kind(args.target) == "dir":
            check_model_dir(Path(args.target).expanduser())
            if getattr(args, "runner", None) == "native":  # the config alone tells (no weights read)
                from transformers import AutoConfig

                why = supports(AutoConfig.from_pretrained(Path(args.target).expanduser()))
                if why:
                    raise UsageError(f"--runner native: {why}: use --runner auto or transformers")
    if getattr(args, "device", None) is not None:
        resolve_device(args.device)
    if getattr(args, "runner", None) == "transformers" and args.quantize not in ("auto", "none"):
        raise UsageError(f"--quantize {args.quantize} needs the native runner: drop --runner transformers")
    if getattr(args, "prompt", None) is not None:
        _utf8(args.prompt, "--prompt")
    if getattr(args, "prompt_ids", None) is not None:
        try:
            ids = _ids(args.prompt_ids)
        except ValueError as e:
            raise UsageError(f"--prompt-ids: {e}") from None
        if not ids:
            raise UsageError("--prompt-ids is empty: pass at least one token id")
    for names in (getattr(args, "dataset", None), getattr(args, "datasets", None)):  # datagen, bench
        for name in (n.strip() for n in (names or "").split(",") if n.strip()):
            check_dataset_name(name)
    if getattr(args, "draft", None):
        _draft_dir(args.draft, "DRAFT" if args.cmd == "export" else "--draft")
    if args.cmd == "export" and args.to == "gguf":
        from flashdraft.models.export import not_a_gguf_target

        reason = not_a_gguf_target(args.target)
        if reason:
            raise UsageError(reason)
        if Path(args.out).is_dir():
            raise UsageError(
                f"OUT {args.out} is a directory: --to gguf writes one file, e.g. {args.out}/draft.gguf"
            )
    if args.cmd == "init-draft":
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file: give a directory for the draft")
        if out.is_dir() and any(out.iterdir()) and not args.force:
            raise UsageError(
                f"--out {out} already exists and is not empty (a draft would be replaced by random weights): "
                "choose another --out, or pass --force to replace it"
            )
        if args.target_layer_ids:
            try:
                _ids(args.target_layer_ids)
            except ValueError as e:
                raise UsageError(f"--target-layer-ids: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done; 2 the command line or its inputs are wrong (usage, files, models, values), with
    one line saying what and how to fix it; 3 `bench` wrote results whose timings are implausible (see
    `flashdraft bench --help`); 130 interrupted (Ctrl-C); anything else is a bug and shows
    its traceback."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # the verb's own usage, not the top-level one
        parser.verbs[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = argv  # the command as typed, for "continue with" hints
    try:
        check_args(args)
        return args.func(args)
    except (DraftError, TargetError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # one line, no traceback; train names its checkpoint (cmd_train)
        hint = ""
        if args.cmd == "datagen":
            hint = f": {args.out} keeps every finished record; continue with: {shlex.join(['flashdraft', *argv])}"
        if args.cmd == "make-draft":
            hint = f": {args.out} keeps what is done; continue with: {shlex.join(['flashdraft', *argv])}"
        print(f"interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
