"""`flashdraft make-draft`: from a target model to a trained draft in one command.

The stages, each resumable (a rerun after Ctrl-C or a crash goes on where the last one stopped, and with
count budgets ends with the same draft as a run never stopped):

1. references: the target's greedy answers to a few held-out prompts of each evaluation set, written
   once; the offline walk (`flashdraft.train.acceptance`) scores the draft on them during training.
2. answers: the target regenerates answers to the training prompts on the serving runner (`datagen`,
   the weights `serve` runs), one file per prompt set, each set its share of the data time.
3. training: `flashdraft train` with the recipe that bought the most tau per CPU-hour from scratch
   (docs/recipe.md: 2 layers, blocks of 8, distillation, a draft vocabulary, cached features).
4. the real loop: the trained draft decodes the held-out prompts with the serving target; tau per set.
5. the draft folder: weights, config, lineage, the training curve, a model card with the numbers and
   the `serve` line to use it.

Budgets: `hours` splits into data time (`DATA_SHARE`), the real loop's (`LOOP_SHARE`) and training, which
gets the rest (what the references took and what a prompt set left unused); `max_prompts` (prompts per set)
and `max_steps` cap the work instead, and make the run reproducible: a time budget ends where the clock
says, a count budget where the counts say.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flashdraft.files import write_json, write_text

# The prompt sets answered by default and each one's share of the data time: chat most, and maths and
# code so the draft stays fast on every domain the campaign measured (docs/recipe.md: a run without maths
# lost 0.2 tau on gsm-symbolic-eval).
PROMPTS = {"sharegpt-train": 0.6, "gsm-symbolic": 0.2, "code-stdlib-methods": 0.2}
EVAL_SETS = ("sharegpt-eval", "mt-bench", "humaneval", "gsm-symbolic-eval")
DATA_SHARE = 0.4  # of --hours: regenerating answers (a set that runs out of prompts leaves its time)
LOOP_SHARE = 0.05  # of --hours: kept for the real loop at the end; training gets all the rest
# Training's minutes count its steps, not its ~10 in-run evaluations (the offline walk: ~20 s each for 32
# references of SmolLM2 on 2 cores), so it gets this share of its time for steps.
TRAIN_TIME = 0.9
STATE = "make-draft.json"


class MakeError(ValueError):
    """The command cannot start or go on as asked (the message says why and what to do)."""


@dataclass
class MakeConfig:
    target: str
    out: str
    hours: float = 1.0
    prompts: Sequence[str] = tuple(PROMPTS)  # data set names or prompt .jsonl files
    eval_sets: Sequence[str] = EVAL_SETS
    eval_prompts: int = 8  # per evaluation set
    max_prompts: int | None = None  # prompts answered per set (a count budget)
    max_steps: int | None = None  # optimizer steps (a count budget: replaces the training time)
    max_new_tokens: int = 256  # per regenerated answer
    eval_max_new_tokens: int = 128
    layers: int = 2
    block_size: int = 8
    seed: int = 0
    runner: str = "auto"  # the serving target: answers and the real loop
    quantize: str = "auto"
    batch_size: int = 64
    progress: bool = True
    train_options: dict = field(default_factory=dict)  # more TrainConfig fields (tests: a tiny recipe)


# What a rerun must share with the run it continues (the time budget may change).
IDENTITY = (
    "target",
    "prompts",
    "eval_sets",
    "eval_prompts",
    "max_prompts",
    "max_steps",
    "max_new_tokens",
    "eval_max_new_tokens",
    "layers",
    "block_size",
    "seed",
    "runner",
    "quantize",
    "train_options",
)


def check(cfg: MakeConfig) -> Path:
    """Bad input, one line each, before any model loads: returns the output folder, made."""
    if not cfg.hours > 0:
        raise MakeError(f"--hours must be more than 0 (got {cfg.hours}): the time the whole run may take")
    if not cfg.prompts:
        raise MakeError("no prompts: give --prompts data set names or prompt .jsonl files")
    from flashdraft.models.load import local_dir, target_kind
    from flashdraft.models.target import check_model_dir

    if target_kind(cfg.target) == "dir":  # names what it is without loading (a draft folder, say)
        check_model_dir(local_dir(cfg.target))
    from flashdraft.data import DataError, check_dataset_name

    for name in [*cfg.prompts, *cfg.eval_sets]:
        try:
            check_dataset_name(name)
        except DataError as e:
            raise MakeError(str(e)) from None
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise MakeError(f"--out {out} is a file: give a folder (it is made when missing)")
    if out.is_dir() and any(out.iterdir()) and not (out / STATE).is_file():
        raise MakeError(f"--out {out} holds files of something else: give an empty or new folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise MakeError(
            f"cannot write to --out {out} ({e.strerror}): choose a folder you can write"
        ) from None
    return out


def open_state(cfg: MakeConfig, out: Path) -> dict:
    """The run's state file: what a rerun continues (refused when its settings differ)."""
    identity = json.loads(json.dumps({k: getattr(cfg, k) for k in IDENTITY}))  # tuples as lists
    path = out / STATE
    if path.is_file():
        state = json.loads(path.read_text())
        changed = [k for k in IDENTITY if state["identity"].get(k) != identity[k]]
        if changed:
            was = ", ".join(f"{k} {state['identity'].get(k)!r} (now {identity[k]!r})" for k in changed)
            raise MakeError(f"{out} holds a make-draft run with other settings: {was}; use another --out")
        return state
    state = {"identity": identity, "seconds": {}, "done": []}
    write_json(path, state, indent=1)
    return state


def _stage(state: dict, out: Path, name: str, fn) -> None:
    """Run stage `name` unless done; its seconds add up over reruns (a Ctrl-C's share included)."""
    if name in state["done"]:
        return
    t0 = time.perf_counter()
    try:
        fn()
        state["done"].append(name)
    finally:
        state["seconds"][name] = round(state["seconds"].get(name, 0.0) + time.perf_counter() - t0, 1)
        write_json(out / STATE, state, indent=1)


def _log(msg: str) -> None:
    print(f"make-draft: {msg}", file=sys.stderr, flush=True)


def make_draft(cfg: MakeConfig) -> dict:
    """Run (or continue) every stage; returns the numbers the model card shows."""
    out = check(cfg)
    state = open_state(cfg, out)
    data, run = out / "data", out / "run"
    data.mkdir(exist_ok=True)
    refs = data / "eval-refs.jsonl"
    _stage(state, out, "references", lambda: _references(cfg, refs))
    for name in cfg.prompts:
        _stage(state, out, f"answers:{name}", lambda n=name: _answers(cfg, state, n, _answers_file(data, n)))
    files = [str(_answers_file(data, n)) for n in cfg.prompts if _answers_file(data, n).is_file()]
    _stage(state, out, "training", lambda: _train(cfg, state, files, refs, run))
    _stage(state, out, "real loop", lambda: _real_loop(cfg, refs, run / "draft", out / "eval.json"))
    return _publish(cfg, state, out, run, files)


def _answers_file(data: Path, name: str) -> Path:
    return data / f"answers-{Path(name).stem}.jsonl"


def _references(cfg: MakeConfig, path: Path) -> None:
    """The serving target's greedy answers to the held-out prompts: what the offline walk compares the
    draft's blocks with (on the serving runner's features too, it scores the real loop's own path)."""
    from flashdraft.models.load import load_target
    from flashdraft.train.acceptance import greedy_references, write_references
    from flashdraft.train.data import dataset_prompts

    _log(f"references: greedy answers to {cfg.eval_prompts} prompts of each of {', '.join(cfg.eval_sets)}")
    target = load_target(cfg.target, "auto", "cpu", runner=cfg.runner, quantize=cfg.quantize)
    prompts = {s: dataset_prompts(s, cfg.eval_prompts, target.tokenizer) for s in cfg.eval_sets}
    write_references(greedy_references(target, prompts, cfg.eval_max_new_tokens), path)


def _answers(cfg: MakeConfig, state: dict, name: str, path: Path) -> None:
    from flashdraft.train.datagen import DatagenConfig, run_datagen

    share = PROMPTS.get(name, 1.0) if set(cfg.prompts) == set(PROMPTS) else 1.0 / len(cfg.prompts)
    spent = state["seconds"].get(f"answers:{name}", 0.0) / 60
    minutes = max(cfg.hours * 60 * DATA_SHARE * share - spent, 0.01)
    _log(
        f"answers: {name}, up to {minutes:.1f} minutes"
        + (f" or {cfg.max_prompts} prompts" if cfg.max_prompts else "")
    )
    s = run_datagen(
        DatagenConfig(
            target=cfg.target,
            datasets=[name],
            out=path,
            max_new_tokens=cfg.max_new_tokens,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            limit=cfg.max_prompts,
            max_prompt_tokens=256,  # long prompts cost prefill for the same answer tokens
            max_minutes=minutes,
            runner=cfg.runner,
            quantize=cfg.quantize,
            progress=cfg.progress,
        )
    )
    _log(
        f"answers: {name}: {s.written} new answers, {s.response_tokens} tokens ({s.tokens_per_s:.0f} tokens/s)"
    )


def _train(cfg: MakeConfig, state: dict, files: list[str], refs: Path, run: Path) -> None:
    from flashdraft.train.config import TrainConfig
    from flashdraft.train.loop import train
    from flashdraft.train.state import checkpoint_dirs

    if not files:
        raise MakeError("no answers were written (the data time ran out first): raise --hours")
    spent = sum(state["seconds"].values()) / 60  # the references, the answers, training so far
    options = dict(
        target=cfg.target,
        data=files,
        out=str(run),
        layers=cfg.layers,
        block_size=cfg.block_size,
        distill=True,
        head_vocab=8192,
        cache_features=True,
        max_len=1024,
        epochs=30,  # the time or step budget ends the run; the view budget keeps it from memorising
        eval_refs=str(refs),
        seed=cfg.seed,
        max_steps=cfg.max_steps,
        max_minutes=None
        if cfg.max_steps
        else max(TRAIN_TIME * (cfg.hours * 60 * (1 - LOOP_SHARE) - spent), 0.01),
        resume=bool(checkpoint_dirs(run)),
        progress=cfg.progress,
    )
    train(TrainConfig(**(options | cfg.train_options)))


def _real_loop(cfg: MakeConfig, refs: Path, draft_dir: Path, path: Path) -> None:
    """tau of the real greedy loop on the held-out prompts, with the target `serve` runs."""
    from flashdraft.models.draft import DFlashDraft
    from flashdraft.models.load import load_target
    from flashdraft.train.acceptance import read_references
    from flashdraft.train.loop import evaluate_tau

    target = load_target(cfg.target, "auto", "cpu", runner=cfg.runner, quantize=cfg.quantize)
    draft = DFlashDraft.from_pretrained(str(draft_dir), dtype=target.dtype)
    sets: dict[str, list[list[int]]] = {}
    for r in read_references(refs):
        sets.setdefault(r["set"], []).append(r["prompt_ids"])
    _log(f"real loop: {sum(map(len, sets.values()))} held-out prompts on {target.describe()}")
    result = evaluate_tau(draft, target, sets, draft.config.block_size, cfg.eval_max_new_tokens)
    write_json(path, result | {"target": target.describe()}, indent=1)


def _publish(cfg: MakeConfig, state: dict, out: Path, run: Path, files: list[str]) -> dict:
    """OUT/draft: the run's draft, its curve and a model card, replaced whole (a temp folder renamed)."""
    summary = json.loads((run / "summary.json").read_text())
    real = json.loads((out / "eval.json").read_text())
    offline = summary["tau"][-1][1] if summary["tau"] else None
    tmp = out / ".draft.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(run / "draft", tmp)
    if (run / "plot.png").is_file():
        shutil.copy2(run / "plot.png", tmp / "training.png")
    numbers = {
        "target": cfg.target,
        "steps": summary["steps"],
        "offline_tau": offline,
        "offline_curve": summary["tau"],
        "real_tau": real["tau"],
        "real_sets": {k.removeprefix("tau/"): v for k, v in real.items() if k.startswith("tau/")},
        "position_acceptance": real.get("position_acceptance"),
        "answers": {Path(f).name: _count(f) for f in files},
        "minutes": {k: round(v / 60, 1) for k, v in state["seconds"].items()},
        "serve": f"flashdraft serve --target {cfg.target} --draft {out / 'draft'}",
    }
    write_text(tmp / "MODEL_CARD.md", model_card(cfg, numbers))
    final = out / "draft"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    write_json(out / "result.json", numbers, indent=1)
    return numbers


def _count(path: str) -> dict:
    n = tokens = 0
    for line in Path(path).read_text().splitlines():
        if line.strip():
            n += 1
            tokens += len(json.loads(line)["response_ids"])
    return {"answers": n, "response_tokens": tokens}


def model_card(cfg: MakeConfig, n: dict) -> str:
    sets = " | ".join(f"{k} {v:.3f}" for k, v in n["real_sets"].items())
    data = ", ".join(
        f"{k}: {v['answers']} answers, {v['response_tokens']} tokens" for k, v in n["answers"].items()
    )
    minutes = ", ".join(f"{k} {v}" for k, v in n["minutes"].items())
    offline = f"{n['offline_tau']:.3f}" if n["offline_tau"] is not None else "not evaluated"
    accept = " / ".join(f"{x:.3f}" for x in (n["position_acceptance"] or [])[:5])
    return f"""# DFlash draft for {cfg.target}

Made by `flashdraft make-draft` ({cfg.layers} layers, blocks of {cfg.block_size}, seed {cfg.seed}).

Use it:

```bash
{n["serve"]}
```

| | |
|---|---|
| held-out tau, real greedy loop (serving target) | **{n["real_tau"]:.3f}** ({sets}) |
| held-out tau, offline walk (the features training read) | {offline} |
| drafted token accepted at block positions 1-5 | {accept} |
| optimizer steps | {n["steps"]} |
| regenerated answers | {data} |
| minutes per stage | {minutes} |

tau is the mean number of tokens committed per target forward on {cfg.eval_prompts} held-out prompts of
each of {", ".join(cfg.eval_sets)} (up to {cfg.eval_max_new_tokens} new tokens); 1.0 is plain decoding.
`training.png` is the training curve, `lineage.json` the data this draft read and how often.
"""


def config_from_args(args) -> MakeConfig:
    return MakeConfig(
        target=args.target,
        out=args.out,
        hours=args.hours,
        prompts=tuple(p for p in args.prompts.split(",") if p),
        eval_sets=tuple(p for p in args.eval_sets.split(",") if p),
        eval_prompts=args.eval_prompts,
        max_prompts=args.max_prompts,
        max_steps=args.max_steps,
        max_new_tokens=args.max_new_tokens,
        eval_max_new_tokens=args.eval_max_new_tokens,
        layers=args.layers,
        seed=args.seed,
        runner=args.runner,
        quantize=args.quantize,
        progress=not args.no_progress,
    )


def add_arguments(p) -> None:
    p.add_argument(
        "--target", required=True, help="built-in name, a .gguf file, a local HF model or a Hub id"
    )
    p.add_argument("--out", required=True, help="the folder of the run; the draft lands in OUT/draft")
    p.add_argument("--hours", type=float, default=1.0, help="the time the whole run may take")
    p.add_argument(
        "--prompts",
        default=",".join(PROMPTS),
        help="comma-separated data set names or prompt .jsonl files ({id, dataset, turns} lines) to answer",
    )
    p.add_argument("--eval-sets", default=",".join(EVAL_SETS), help="held-out sets the draft is scored on")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per evaluation set")
    p.add_argument("--max-prompts", type=int, default=None, help="answer at most N prompts of each set")
    p.add_argument("--max-steps", type=int, default=None, help="train N steps (instead of the training time)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per regenerated answer")
    p.add_argument("--eval-max-new-tokens", type=int, default=128, help="per held-out prompt")
    p.add_argument("--layers", type=int, default=2, help="draft layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
