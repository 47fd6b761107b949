"""Train a DFlash draft for a target on its own regenerated answers or on text corpora (the paper, section 4).

One optimizer step, in order:

1. a global batch of whole sequences (prompt + regenerated response), packed in a shuffled order
   up to `batch_tokens` tokens; under torchrun, rank r takes every world-th sequence of it;
2. per sequence, up to `anchors` random anchor positions among response tokens with room for a
   full block (p <= S - B, loss_mask[p] = 1), drawn without replacement and sorted, fresh each
   epoch; each anchor makes a block [x[a], MASK x (B-1)] at positions a..a+B-1;
3. the frozen target computes the selected-layer features of all S positions (no grad);
4. one draft pass over all blocks of the sequence at once: keys are [context features of all S
   positions ; all blocks], a block-b query sees context positions strictly before its anchor
   a_b and the B tokens of its own block, nothing of other blocks; padding sees nothing;
5. loss = sum(w * CE) / sum(w) over the global batch, at block index k = 1..B-1 against
   x[a + k] (same position, no shift), w_k = exp(-(k - 1) / gamma) x response mask x in-range;
6. AdamW, cosine schedule with warmup, gradient clipping; fp32 master weights.

Everything random is derived from (seed, epoch, sequence index), so the data order and anchors
of any step are known without replaying the run: a checkpoint stores the step, and `--resume`
continues the same run. Checkpoints are draft directories in the published format plus
optimizer / RNG / trainer state, each written to a temporary directory and renamed into place.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from flashdraft import chat
from flashdraft.engine.decode import GenerationConfig, generate
from flashdraft.engine.proposers import DFlashProposer
from flashdraft.files import atomic_write, write_json, write_text
from flashdraft.models.draft import DFlashDraft, DraftError, init_draft_config
from flashdraft.models.load import load_target, local_dir
from flashdraft.models.runner import RunnerTarget
from flashdraft.models.target import Target, TargetError, resolve_dtype
from flashdraft.train.acceptance import offline_tau, position_acceptance, read_references
from flashdraft.train.config import (
    CONTINUED_SCHEDULE,
    DTYPES,
    FEATURES,
    NEW_DRAFT_BLOCK_SIZE,
    NEW_SCHEDULE,
    RUN_FIELDS,
    TrainConfig,
    TrainError,
    check_config,
    resolve_defaults,
    resolve_gamma,
    use_autocast,
)
from flashdraft.train.data import (
    _generator,
    drawn,
    file_fingerprint,
    head_rows,
    plan_epochs,
    prepare_data,
    sample_anchors,
)
from flashdraft.train.lineage import (
    LINEAGE_NAME,
    allowed_draws,
    describe,
    lineage_after,
    read_lineage,
    write_lineage,
)
from flashdraft.train.loss import Batch, FrozenHead, batch_loss, block_targets, build_batch, target_features
from flashdraft.train.state import (
    Dist,
    all_sum,
    barrier,
    carry_moments,
    check_resume,
    checkpoint_dirs,
    checkpoint_name,
    load_checkpoint,
    read_state,
    save_checkpoint,
    setup,
    shard,
    target_fingerprint,
    unsharded,
)


@torch.no_grad()
def init_from_target(draft: DFlashDraft, target: Target) -> str:
    """Start the draft as the target's top layers: draft layer i <- target layer L - n + i (attention,
    MLP and norms), the final norm <- the target's, and fc reads the deepest selected feature through an
    identity, with hidden_norm <- the first copied layer's input norm. The context keys and values then
    start out exactly as that target layer computes them from its input. Returns a one-line summary."""
    n, big = len(draft.layers), target.num_layers
    ids = list(draft.config.target_layer_ids)
    src_layers = [target._layers[big - n + i] for i in range(n)]
    if "gemma" in type(target.model).__name__.lower():
        raise TrainError("--init-from-target supports Llama/Qwen-style targets (Gemma norms are offset by 1)")
    for layer, src in zip(draft.layers, src_layers, strict=True):
        theirs = dict(src.named_parameters())
        for name, p in layer.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")) and name not in theirs:
                continue  # Llama has no q/k norm: the draft's stay at 1
            if name not in theirs or theirs[name].shape != p.shape:
                raise TrainError(
                    f"--init-from-target: target layer has no {name} of shape {tuple(p.shape)}; train "
                    "without --init-from-target"
                )
            p.copy_(theirs[name])
    draft.norm.weight.copy_(target._final_norm.weight)
    h = target.hidden_size
    j = ids.index(max(ids))
    draft.fc.weight.zero_()
    draft.fc.weight[:, j * h : (j + 1) * h] = torch.eye(h, dtype=draft.fc.weight.dtype)
    draft.hidden_norm.weight.copy_(src_layers[0].input_layernorm.weight)
    return f"draft layers <- target layers {big - n}..{big - 1}, fc <- identity on target layer {ids[j]}"


def lr_at(step: int, total: int, lr: float, warmup: float, decay: float | None = None) -> float:
    """Linear warmup over `warmup` x total steps, then cosine decay to 0 at `total`; or, with `decay` (a
    fraction), constant after the warmup and a linear decay to 0 over the last `decay` x total steps (the
    warmup-stable-decay schedule: a campaign continues from a checkpoint before the decay, its optimizer
    moments with it, instead of restarting warmup and cosine every sitting)."""
    n_warm = max(1, round(warmup * total)) if warmup > 0 else 0
    if step < n_warm:
        return lr * (step + 1) / n_warm
    if decay is not None:
        n_decay = max(1, round(decay * total))
        return lr * min(1.0, max(0.0, (total - step) / n_decay))
    progress = (step - n_warm) / max(1, total - n_warm)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def evaluate_tau(
    draft: DFlashDraft,
    target: Target,
    prompts: dict[str, list[list[int]]] | list[list[int]],
    block_size: int,
    max_new_tokens: int,
) -> dict:
    """tau of the real decode loop (greedy) on held-out prompts: committed tokens per target forward,
    pooled over all prompts ("tau") and per evaluation set ("tau/<set>"), and the pooled
    "position_acceptance" (`flashdraft.train.acceptance.position_acceptance`)."""
    sets = prompts if isinstance(prompts, dict) else {"held-out": prompts}
    proposer = DFlashProposer(draft, target, proposal="greedy")
    out, every, t0 = {}, [], time.perf_counter()
    for name, group in sets.items():
        committed = steps = 0
        for prompt in group:
            room = target.max_length - len(prompt)
            if room < 1:
                continue
            cfg = GenerationConfig(
                max_new_tokens=min(max_new_tokens, room), block_size=block_size, stop_ids=target.stop_ids
            )
            res = generate(target, prompt, proposer, cfg)
            committed += sum(res.acceptance_lengths)
            steps += len(res.acceptance_lengths)
            every += res.acceptance_lengths
        out[f"tau/{name}"] = committed / steps if steps else float("nan")
    return {
        "tau": sum(every) / len(every) if every else float("nan"),
        **(out if len(sets) > 1 else {}),
        "eval_tokens": sum(every),
        "position_acceptance": [round(x, 4) for x in position_acceptance(every, block_size)],
        "eval_s": round(time.perf_counter() - t0, 3),
    }


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def plot_metrics(metrics: list[dict], path: Path) -> None:
    """PNG of the training loss and the held-out tau against optimizer steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = [(m["step"], m["loss"]) for m in metrics if m.get("loss") is not None]
    tau = [(m["step"], m["tau"]) for m in metrics if m.get("tau") is not None]
    names = sorted({k for m in metrics for k in m if k.startswith("tau/")})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if loss:
        ax1.plot(*zip(*loss, strict=True), lw=1)
    ax1.set(xlabel="step", ylabel="loss (weighted CE, or KL with --distill)", title="training loss")
    if loss and min(v for _, v in loss) > 0:
        ax1.set_yscale("log")
    if tau:
        ax2.plot(*zip(*tau, strict=True), marker="o", label="all sets" if names else None, color="k")
    for name in names:
        series = [(m["step"], m[name]) for m in metrics if m.get(name) is not None]
        ax2.plot(*zip(*series, strict=True), marker=".", label=name.removeprefix("tau/"))
    if names:
        ax2.legend(fontsize=8)
    ax2.set(xlabel="step", ylabel="tau (tokens per target forward)", title="held-out tau (greedy)")
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training; returns a summary. Raises TrainError on bad input or a NaN loss."""
    cfg = resolve_defaults(cfg)
    check_config(cfg)
    d, device = setup(cfg)
    try:
        return _train(cfg, d, device)
    finally:
        if d.enabled:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _log(d: Dist, msg: str) -> None:
    if d.main:
        print(msg, file=sys.stderr, flush=True)


@dataclass
class Run:
    """One training run: what the steps, evaluations and checkpoints share."""

    cfg: TrainConfig
    d: Dist
    device: torch.device
    out: Path
    t_start: float
    gamma: float
    identity: dict
    master: torch.dtype
    autocast: bool
    target: Target
    features: Target  # whose forward gives the draft's features (`_feature_target`)
    seqs: list
    eval_prompts: dict
    stats: dict
    refs: list | None
    draft: DFlashDraft | None = None
    mask_id: int = 0
    feature_ids: list[int] = field(default_factory=list)  # the draft's target layers, then the teacher's
    n_draft_feats: int = 0
    optimizer: torch.optim.Optimizer | None = None
    head: FrozenHead | None = None
    total: int = 0
    per_epoch: list[int] = field(default_factory=list)
    plans: list[list[list[int]]] = field(default_factory=list)  # every epoch's batches (data.plan_epochs)
    prior: dict = field(default_factory=dict)  # --init-draft's lineage (train.lineage)
    feature_cache: dict[int, torch.Tensor] = field(default_factory=dict)
    cache_room: int = 0  # bytes left for cached features
    last: dict = field(default_factory=dict)  # the last metrics row
    last_ckpt: Path | None = None

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"

    @property
    def evaluating(self) -> bool:
        return bool(self.eval_prompts)

    def log(self, msg: str) -> None:
        _log(self.d, msg)

    def log_metrics(self, row: dict) -> None:
        if self.d.main:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")


def _train(cfg: TrainConfig, d: Dist, device: torch.device) -> dict:
    run, ckpt, ckpt_state = _open_run(cfg, d, device)
    _make_draft(run, ckpt, ckpt_state)
    start = _start_at(run, ckpt, ckpt_state)
    blocks_done, busy_s = _loop(run, start)
    return _finish(run, blocks_done, busy_s)


def _open_run(cfg: TrainConfig, d: Dist, device: torch.device) -> tuple[Run, Path | None, dict | None]:
    """Checks that need no model first (a wrong --resume fails before the target loads), then the target
    and the data."""
    t_start = time.perf_counter()
    out = Path(cfg.out)
    gamma = resolve_gamma(cfg.block_size, cfg.gamma)
    found = checkpoint_dirs(out)
    if cfg.resume and not found:
        raise TrainError(f"--resume: no checkpoint in {out / 'checkpoints'} to resume from")
    if not cfg.resume and found:
        raise TrainError(
            f"{out} already holds checkpoints of a run: pass --resume to continue it, or choose a new --out"
        )
    dtype = resolve_dtype(cfg.dtype, device)
    identity = {
        "config": {k: getattr(cfg, k) for k in RUN_FIELDS} | {"dtype": str(dtype).removeprefix("torch.")},
        "data": file_fingerprint(cfg.data),
        "held_out": 0 if cfg.eval_data or cfg.eval_refs else cfg.eval_prompts,
    }
    ckpt, ckpt_state = None, None
    if cfg.resume:
        ckpt = found[-1]
        ckpt_state = read_state(ckpt)
        check_resume(ckpt_state, identity, ckpt)
    target = load_target(cfg.target, dtype, str(device), runner="transformers")
    features, identity["config"]["features"] = _feature_target(cfg, target, device)
    seqs, eval_prompts, stats = prepare_data(cfg, target.vocab_size, target.tokenizer)
    run = Run(
        cfg=cfg,
        d=d,
        device=device,
        out=out,
        t_start=t_start,
        gamma=gamma,
        identity=identity,
        master=torch.float64 if dtype == torch.float64 else torch.float32,
        autocast=use_autocast(cfg.autocast, device, dtype),
        target=target,
        features=features,
        seqs=seqs,
        eval_prompts=eval_prompts,
        stats=stats,
        refs=read_references(cfg.eval_refs) if cfg.eval_refs else None,
        cache_room=int(cfg.cache_gb * 2**30),
    )
    _plan(run)
    return run, ckpt, ckpt_state


def _plan(run: Run) -> None:
    """Every epoch's batches, under the view budget left by --init-draft's lineage (train.lineage)."""
    cfg, seqs, sources = run.cfg, run.seqs, run.stats["sources"]
    run.prior = read_lineage(local_dir(cfg.init_draft)) if cfg.init_draft else {}
    allowed = allowed_draws(sources, run.prior, cfg.max_views)
    if allowed is not None and not any(allowed):
        raise TrainError(
            f"every --data source has been read --max-views {cfg.max_views} times by this draft's lineage "
            f"({LINEAGE_NAME} of --init-draft): train on fresh data (flashdraft datagen, another corpus "
            "slice) or raise --max-views"
        )
    spent = [s["name"] for s, n in zip(sources, allowed or [], strict=False) if n == 0]
    if spent:
        run.log(
            f"view budget: skipping what the lineage read --max-views {cfg.max_views} times: {', '.join(spent)}"
        )
    run.plans = plan_epochs(
        [q.source for q in seqs],
        [q.ids.numel() for q in seqs],
        run.stats["weights"],
        cfg.seed,
        cfg.epochs,
        cfg.batch_tokens,
        allowed,
    )
    run.per_epoch = [len(p) for p in run.plans]
    total = sum(run.per_epoch)
    run.total = total if cfg.max_steps is None else min(total, cfg.max_steps)


def _draft_config(run: Run):
    """The draft's config: new from the options, or the shape of --init-draft's weights (also returned)."""
    cfg, target = run.cfg, run.target
    start_from = None
    if cfg.init_draft:
        try:
            start_from = DFlashDraft.from_pretrained(local_dir(cfg.init_draft), dtype=run.master)
        except (DraftError, TargetError, OSError) as e:
            raise TrainError(f"--init-draft {cfg.init_draft}: {e}") from None
    mask_id, note = (
        (cfg.mask_token_id, None) if cfg.mask_token_id is not None else target.default_mask_token_id()
    )
    if start_from is not None:
        mask_id, note = start_from.config.mask_token_id, None
    if note:
        run.log(note)
    if not 0 <= mask_id < target.vocab_size:
        raise TrainError(
            f"--mask-token-id {mask_id} is not a row of the target's embedding (0..{target.vocab_size - 1})"
        )
    dcfg = init_draft_config(
        target.model.config, cfg.layers, mask_id, cfg.block_size, cfg.target_layer_ids, cfg.num_features
    )
    if start_from is not None and cfg.grow_to:
        try:
            start_from = start_from.grown(cfg.grow_to)
        except DraftError as e:
            raise TrainError(f"--grow-to {cfg.grow_to}: {e}") from None
    if start_from is not None:  # its shape wins: layers, target layers and mask id come with the weights
        dcfg = start_from.config.replace(block_size=cfg.block_size)
    return dcfg, start_from


def _make_draft(run: Run, ckpt: Path | None, ckpt_state: dict | None) -> None:
    """The draft (first weights from the options), its optimizer and the frozen head of the loss."""
    cfg, d, target = run.cfg, run.d, run.target
    dcfg, start_from = _draft_config(run)
    run.mask_id = dcfg.mask_token_id
    run.identity["target"] = target_fingerprint(target)
    run.identity["draft_config"] = dcfg.to_json()
    if ckpt is not None:
        check_resume(ckpt_state, run.identity, ckpt)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    draft = DFlashDraft(dcfg).to(device=run.device, dtype=run.master)
    draft.check_target(target)
    if cfg.init_from_target and ckpt is None:
        run.log(init_from_target(draft, target))
    if start_from is not None and ckpt is None:
        draft.load_state_dict(start_from.state_dict())
        run.log(f"draft starts from {cfg.init_draft} ({len(dcfg.target_layer_ids)} target layers)")
    # With --distill the target's last layer (its final-normed output) is read too: the teacher.
    run.feature_ids = list(dcfg.target_layer_ids) + ([target.num_layers - 1] if cfg.distill else [])
    run.n_draft_feats = len(dcfg.target_layer_ids) * target.hidden_size
    if d.enabled:
        shard(draft, run.device, d)
    draft.train()
    run.optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if start_from is not None and ckpt is None:
        run.log(carry_moments(local_dir(cfg.init_draft), draft, run.optimizer))
    rows = None
    if cfg.head_vocab:
        keep = None if start_from is None else start_from.vocab
        rows, coverage = head_rows(run.seqs, cfg.head_vocab, target.vocab_size, keep)
        run.log(
            f"loss over the {cfg.head_vocab} most frequent response tokens"
            + ("" if keep is None else f" and the {keep.numel()} of --init-draft's vocabulary")
            + f": {rows.numel()} rows, {100 * coverage:.2f}% of the response tokens"
        )
        draft.set_vocab(rows, target.lm_head.weight)  # saved with the draft: it proposes only from these
        rows = rows.to(run.device)
    run.head = FrozenHead(target.lm_head, None if run.autocast else run.master, rows)
    run.draft = draft


def _start_at(run: Run, ckpt: Path | None, ckpt_state: dict | None) -> int:
    """Load the checkpoint (if resuming) and prepare the output directory; returns the first step."""
    cfg, d, out, stats = run.cfg, run.d, run.out, run.stats
    start = 0
    if ckpt is not None:
        load_checkpoint(ckpt, run.draft, run.optimizer, d)
        start = int(ckpt_state["step"])
        run.last_ckpt = ckpt
        run.log(f"resuming from {ckpt} at step {start}/{run.total}")
        if d.main:  # forget metrics of steps the interrupted sitting ran past its last checkpoint
            kept = [m for m in read_metrics(run.metrics_path) if m["step"] <= start]
            write_text(run.metrics_path, "".join(json.dumps(m) + "\n" for m in kept))
    elif d.main:
        out.mkdir(parents=True, exist_ok=True)
        run.metrics_path.unlink(missing_ok=True)
    if d.main:
        for stale in (out / "checkpoints").glob(".step-*.tmp"):  # left by a run killed while saving
            shutil.rmtree(stale, ignore_errors=True)
    dcfg, per_epoch = run.draft.config, run.per_epoch
    run.log(
        f"data: {stats['sequences']} sequences ({stats['tokens']} tokens, {stats['response_tokens']} response), "
        f"{stats['dropped_short']} dropped with fewer than {2 * cfg.block_size} response tokens, "
        f"{stats['eval_prompts']} evaluation prompts{' held out' if stats['held_out'] else ''}"
    )
    run.log(
        f"draft: {dcfg.num_hidden_layers} layers, block {cfg.block_size}, gamma {run.gamma}, target layers "
        f"{dcfg.target_layer_ids}, mask {run.mask_id}, "
        f"{sum(p.numel() for p in run.draft.parameters()) / 1e6:.1f}M parameters; {run.total} steps "
        f"({', '.join(map(str, per_epoch[:4]))}{', ...' if len(per_epoch) > 4 else ''} per epoch), "
        f"world {d.world}, device {run.device}, autocast {'bf16' if run.autocast else 'off'}"
    )
    run.log(f"target features from: {run.features.describe()}")
    if start == 0 and run.evaluating:
        res = _evaluate(run, 0)
        if res:
            run.last = {"step": 0, "epoch": 0, **res}
            run.log_metrics(run.last)
            run.log(f"step 0: tau {res['tau']:.3f} on {stats['eval_prompts']} held-out prompts")
    return start


def _lineage(run: Run, steps: int) -> dict:
    """The draft's lineage after `steps` optimizer steps: --init-draft's plus this run's draws."""
    sources = run.stats["sources"]
    draws = drawn(run.plans, [q.source for q in run.seqs], steps, len(sources))
    return lineage_after(sources, draws, run.prior, run.cfg.max_views)


def _feature_target(cfg: TrainConfig, target: Target, device: torch.device):
    """The target whose forward gives the draft's features, and its name for the run's identity: the
    serving runner (`load_target` as `serve` calls it) or the transformers `target` (`TrainConfig.features`)."""
    if cfg.features == "transformers" or (
        cfg.features == "auto" and (device.type != "cpu" or target.dtype != torch.bfloat16)
    ):
        return target, "transformers"
    if device.type != "cpu":
        raise TrainError(f"--features runner: the serving runner runs on CPUs, not {device.type}")
    served = load_target(cfg.target, "auto", "cpu", runner="auto" if cfg.features == "auto" else "native")
    if not isinstance(served, RunnerTarget):  # auto, and an architecture the runner lacks
        return target, "transformers"
    return served, "runner"


def _batch_features(run: Run, part: list[int], batch: Batch) -> torch.Tensor:
    """Target features of a micro-batch: computed, or (--cache-features) assembled from memory."""
    cache, seqs, target = run.feature_cache, run.seqs, run.target
    if not run.cfg.cache_features or any(i not in cache for i in part):
        feats = target_features(run.features, batch, run.feature_ids)
        if run.cfg.cache_features:
            for row, i in enumerate(part):
                kept = feats[row, : seqs[i].ids.numel()]
                if i not in cache and kept.nbytes <= run.cache_room:
                    cache[i] = kept.clone()
                    run.cache_room -= kept.nbytes
        return feats
    feats = torch.zeros(*batch.ids.shape, len(run.feature_ids) * target.hidden_size, dtype=run.features.dtype)
    for row, i in enumerate(part):
        feats[row, : seqs[i].ids.numel()] = cache[i]
    return feats.to(run.device)


def _evaluate(run: Run, step: int) -> dict | None:
    """Held-out tau: the offline walk with --eval-refs, else the real decode loop (main rank only)."""
    result = None
    if run.evaluating:
        whole = unsharded(run.draft, run.d)
        if run.d.main and run.refs is not None:
            t0 = time.perf_counter()
            result = offline_tau(whole, run.features, run.refs) | {
                "eval_s": round(time.perf_counter() - t0, 3)
            }
        elif run.d.main:
            cfg = run.cfg
            result = evaluate_tau(
                whole, run.features, run.eval_prompts, cfg.block_size, cfg.eval_max_new_tokens
            )
        barrier(run.d)
    return result


def _save(run: Run, step: int, epoch: int, epoch_step: int) -> None:
    state = {
        "identity": run.identity,
        "epoch": epoch,
        "epoch_step": epoch_step,
        "total_steps": run.total,
        "loss": run.last.get("loss"),
        "tau": run.last.get("tau"),
        "data_stats": run.stats,
        "train_config": asdict(run.cfg),
        "wall_s": round(time.perf_counter() - run.t_start, 1),
    }
    lineage = {LINEAGE_NAME: json.dumps(_lineage(run, step), indent=1) + "\n"}
    saved = save_checkpoint(
        run.out, step, run.draft, run.optimizer, run.d, state, run.cfg.keep_checkpoints, lineage
    )
    run.last_ckpt = saved or run.last_ckpt


def _step(run: Run, step: int, epoch: int, batch_idx: list[int]) -> tuple[float, float, int]:
    """One optimizer step over the global batch `batch_idx`: (loss, gradient norm, blocks)."""
    cfg, d, seqs, device = run.cfg, run.d, run.seqs, run.device
    anchors = {
        i: sample_anchors(
            seqs[i].loss_mask, cfg.block_size, cfg.anchors, _generator(cfg.seed, "anchors", epoch, i)
        )
        for i in batch_idx
    }
    weights = (
        block_targets(seqs[i].ids, seqs[i].loss_mask, anchors[i], cfg.block_size, run.gamma)[1]
        for i in batch_idx
    )
    total_w = sum(float(w.sum()) for w in weights) or 1.0  # 0 only if no anchor has a response token after it
    mine = batch_idx[d.rank :: d.world]
    micro = [mine[k : k + cfg.micro_batch] for k in range(0, len(mine), cfg.micro_batch)]
    # Every rank runs the same number of passes (FSDP collectives); spare ones carry zero weight.
    n_micro = max(1, math.ceil(math.ceil(len(batch_idx) / d.world) / cfg.micro_batch))
    wce_sum = torch.zeros((), dtype=torch.float64, device=device)
    for m in range(n_micro):
        part, scale = (micro[m], 1.0) if m < len(micro) else ([batch_idx[0]], 0.0)
        if d.enabled:
            run.draft.set_requires_gradient_sync(m == n_micro - 1)
        batch = build_batch(
            [(seqs[i].ids, seqs[i].loss_mask) for i in part],
            [anchors[i] for i in part],
            cfg.block_size,
            run.mask_id,
            run.gamma,
        ).to(device)
        feats = _batch_features(run, part, batch)
        teacher = feats[..., run.n_draft_feats :] if cfg.distill else None
        wce, _ = batch_loss(
            run.draft,
            run.target,
            run.head,
            batch,
            run.master,
            run.autocast,
            feats[..., : run.n_draft_feats],
            teacher,
        )
        # FSDP averages gradients over ranks: scale by world so the result is sum(w*CE) / sum(w).
        (wce * (scale * d.world / total_w)).backward()
        wce_sum += wce.detach().double() * scale
    loss = float(all_sum(wce_sum, d)) / total_w
    if not math.isfinite(loss):
        where = (
            f"the last good checkpoint is {run.last_ckpt}"
            if run.last_ckpt
            else "no checkpoint had been written yet"
        )
        raise TrainError(
            f"loss is {loss} at step {step + 1} (epoch {epoch + 1}): training stopped; {where} "
            "(lower --lr, or check the data and the target's dtype)"
        )
    grad_norm = torch.nn.utils.clip_grad_norm_(run.draft.parameters(), cfg.grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not math.isfinite(grad_norm):
        raise TrainError(
            f"gradient norm is {grad_norm} at step {step + 1}: training stopped; the last good "
            f"checkpoint is {run.last_ckpt or 'none (none written yet)'}"
        )
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, sum(a.numel() for a in anchors.values())


def _loop(run: Run, start: int) -> tuple[int, float]:
    """The optimizer steps from `start`, with evaluations, metrics and checkpoints; (blocks, busy seconds)."""
    cfg, total = run.cfg, run.total
    eval_every = cfg.eval_every or max(1, total // 10)
    save_every = cfg.save_every or max(1, total // 10)
    bar = tqdm(
        total=total,
        initial=start,
        desc="train",
        unit="step",
        disable=not (run.d.main and cfg.progress),
        dynamic_ncols=True,
    )
    epoch, plan, first_in_epoch, j = -1, [], 0, 0
    blocks_done, busy_s = 0, 0.0
    budget = None if cfg.max_minutes is None else 60 * cfg.max_minutes  # seconds of optimizer steps
    try:
        for step in range(start, total):
            if budget is not None and busy_s > budget:
                run.log(f"--max-minutes {cfg.max_minutes} reached at step {step}/{total}: stopping")
                if run.evaluating and "tau" not in run.last:
                    res = _evaluate(run, step)
                    if res:
                        run.last.update(res)
                        run.log_metrics({"step": step, "epoch": epoch, **res})
                if step > start and (run.last_ckpt is None or run.last_ckpt.name != checkpoint_name(step)):
                    _save(run, step, epoch, j + 1)  # unless the last step was just saved
                break
            while epoch < 0 or step >= first_in_epoch + len(plan):
                if epoch >= 0:
                    first_in_epoch += len(plan)
                epoch += 1
                plan = run.plans[epoch]
            j = step - first_in_epoch
            t0 = time.perf_counter()
            # With --max-minutes the schedule runs on time: it ends where the budget does.
            at = step if budget is None else max(step, int(total * busy_s / budget))
            lr = lr_at(at, total, cfg.lr, cfg.warmup, cfg.decay)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            loss, grad_norm, n_blocks = _step(run, step, epoch, plan[j])
            dt = time.perf_counter() - t0
            blocks_done, busy_s, done = blocks_done + n_blocks, busy_s + dt, step + 1
            run.last = {
                "step": done,
                "epoch": epoch,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "blocks": n_blocks,
                "sequences": len(plan[j]),
                "blocks_per_s": round(n_blocks / dt, 2),
                "time_s": round(time.perf_counter() - run.t_start, 2),
            }
            if run.evaluating and (done % eval_every == 0 or done == total):
                res = _evaluate(run, done)
                if res:
                    run.last.update(res)
            run.log_metrics(run.last)
            if run.d.main and "tau" in run.last:
                plot_metrics(read_metrics(run.metrics_path), run.out / "plot.png")
            tau = f"{run.last['tau']:.2f}" if "tau" in run.last else "-"
            bar.set_postfix(loss=f"{loss:.3f}", tau=tau, bps=f"{n_blocks / dt:.0f}")
            bar.update(1)
            if done % save_every == 0 or done == total:
                _save(run, done, epoch, j + 1)
    finally:
        bar.close()
    return blocks_done, busy_s


def _finish(run: Run, blocks_done: int, busy_s: float) -> dict:
    """Save the final draft, the plot and summary.json; returns the summary."""
    whole = unsharded(run.draft, run.d)
    summary = {}
    if run.d.main:
        out = run.out
        whole.save_pretrained(out / "draft", dtype=DTYPES[run.cfg.save_dtype])
        lineage = _lineage(run, run.last.get("step", 0))
        write_lineage(out / "draft", lineage)
        run.log("sources read by this draft's lineage:\n  " + "\n  ".join(describe(lineage)))
        rows = read_metrics(run.metrics_path)
        plot_metrics(rows, out / "plot.png")
        losses = [m["loss"] for m in rows if m.get("loss") is not None]
        taus = [(m["step"], m["tau"]) for m in rows if m.get("tau") is not None]
        summary = {
            "steps": run.last.get("step", run.total),
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "tau": taus,
            "data": run.stats,
            "blocks_per_s": round(blocks_done / busy_s, 2) if busy_s else None,
            "wall_s": round(time.perf_counter() - run.t_start, 1),
            "draft": str(out / "draft"),
            "checkpoint": str(run.last_ckpt) if run.last_ckpt else None,
            "lineage": lineage["sources"],
        }
        write_json(out / "summary.json", summary, indent=1)
        tau_txt = " -> ".join(f"{t:.3f}" for _, t in taus) if taus else "not evaluated"
        loss_txt = " -> ".join(f"{x:.4f}" for x in (losses[0], losses[-1])) if losses else "-"
        run.log(
            f"done: {summary['steps']} steps, loss {loss_txt}, tau {tau_txt}, "
            f"{summary['blocks_per_s']} blocks/s, {summary['wall_s']} s; draft in {out / 'draft'}"
        )
    barrier(run.d)
    return summary


# -- command line -------------------------------------------------------------------------------


def _gamma(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gamma takes a number or 'auto', got {text!r}") from None


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`flashdraft train` options (README, "Train a draft for your own model"): data, then the draft and
    its optimization, then evaluation, checkpoints and the run."""
    _add_data_arguments(p)
    _add_recipe_arguments(p)
    _add_run_arguments(p)


def _add_data_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target", required=True, help="built-in name, a .gguf file or a local HF model directory"
    )
    p.add_argument(
        "--data",
        required=True,
        type=lambda s: [x for x in s.split(",") if x],
        help="comma-separated datagen JSONL / packed .npz files and text corpora (sharegpt, sharegpt-turns, "
        "gsm-symbolic: their recorded answers, no regeneration; use with --distill), each optionally with a "
        "mixing weight: sharegpt:0.7,data/x.npz:0.3",
    )
    p.add_argument(
        "--corpus-limit",
        type=int,
        default=None,
        help="(prompt, answer) pairs taken from each corpus (default all)",
    )
    p.add_argument(
        "--corpus-skip", type=int, default=0, help="skip this many pairs of each corpus first (a fresh slice)"
    )
    chat.add_argument(p, "corpus conversations and evaluation prompts")
    p.add_argument(
        "--init-draft",
        default=None,
        help="start from this draft directory's weights; a training checkpoint (OUT/checkpoints/step-N) "
        "also carries its optimizer moments. The schedule then defaults to a continuation's: --lr 1.5e-4, "
        "--warmup 0, --decay 0.3 (a trained draft continued at 4e-4 lost tau, at 1.5e-4 gained; "
        "docs/recipe.md)",
    )
    p.add_argument(
        "--grow-to",
        type=int,
        default=None,
        help="with --init-draft: grow that draft to this many layers, the new ones starting as the identity "
        "(zero output projections), so training starts from its exact proposals",
    )
    p.add_argument(
        "--max-views",
        type=float,
        default=TrainConfig.max_views,
        help="draw each data source at most this many times over the draft's whole lineage (its "
        "lineage.json, which --init-draft's carries over); the run ends early when every source is spent. "
        "0: no cap",
    )
    p.add_argument(
        "--cache-gb", type=float, default=TrainConfig.cache_gb, help="memory cap of --cache-features (GiB)"
    )
    p.add_argument(
        "--out", required=True, help="run directory: checkpoints/, draft/, metrics.jsonl, plot.png"
    )


def _add_recipe_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig
    p.add_argument("--layers", type=int, default=d.layers, help="draft layers")
    p.add_argument("--num-features", type=int, default=None, help="target layers read (default: --layers)")
    p.add_argument("--target-layer-ids", type=_int_list, default=None, help="explicit 0-based target layers")
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"tokens per drafted block (default: --init-draft's, else {NEW_DRAFT_BLOCK_SIZE})",
    )
    p.add_argument("--anchors", type=int, default=d.anchors, help="max anchors (blocks) per sequence")
    p.add_argument("--gamma", type=_gamma, default=None, help="loss decay; auto = 7/5/2 for block 16/10/8")
    p.add_argument("--epochs", type=int, default=d.epochs)
    new, cont = NEW_SCHEDULE, CONTINUED_SCHEDULE
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"peak learning rate (default {new[0]:g}; {cont[0]:g} with --init-draft)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help=f"warmup fraction of the steps (default {new[1]:g}; {cont[1]:g} with --init-draft)",
    )
    p.add_argument(
        "--decay",
        type=float,
        default=None,
        help="constant learning rate after the warmup, then a linear decay to 0 over this last fraction of "
        f"the steps (or of --max-minutes); default: a cosine for a new draft, {cont[2]:g} with --init-draft",
    )
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument(
        "--grad-clip", type=float, default=d.grad_clip, help="clip the gradient norm here (outliers only)"
    )
    p.add_argument("--max-len", type=int, default=d.max_len, help="truncate sequences to this many tokens")
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=d.batch_tokens,
        help="sequence tokens per optimizer step (global batch, gradient accumulation)",
    )
    p.add_argument(
        "--micro-batch", type=int, default=d.micro_batch, help="sequences per forward pass per rank"
    )


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig
    p.add_argument(
        "--eval-data",
        default=None,
        help="comma-separated evaluation sets: datagen files or data set names such as "
        "gsm-symbolic-eval,humaneval (tau per set); default: hold out the last --eval-prompts records of --data",
    )
    p.add_argument(
        "--eval-prompts", type=int, default=d.eval_prompts, help="held-out prompts for tau; 0 = none"
    )
    p.add_argument(
        "--eval-every", type=int, default=d.eval_every, help="steps between evaluations (0: ~10 per run)"
    )
    p.add_argument("--eval-max-new-tokens", type=int, default=d.eval_max_new_tokens)
    p.add_argument(
        "--eval-refs",
        default=None,
        help="references JSONL (scripts/offline_tau.py --make-refs): tau by the offline walk, in seconds",
    )
    p.add_argument(
        "--save-every", type=int, default=d.save_every, help="steps between checkpoints (0: ~10 per run)"
    )
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default=d.dtype,
        help="the frozen target's dtype (auto: bfloat16 on GPUs and CPUs with native bf16, else float32)",
    )
    p.add_argument(
        "--autocast",
        choices=["auto", "on", "off"],
        default=d.autocast,
        help="bf16 autocast of the draft (auto: on CUDA, and on CPUs with native bf16 when the target is bf16)",
    )
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument(
        "--max-steps", type=int, default=None, help="stop (and end the schedule) after this many steps"
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="train for this many minutes (evaluations excluded), then save; warmup and cosine decay follow "
        "the elapsed share of this budget instead of the step count",
    )
    p.add_argument("--save-dtype", choices=list(DTYPES), default=d.save_dtype, help="dtype of OUT/draft")
    p.add_argument(
        "--distill",
        action="store_true",
        help="learn the target's whole next-token distribution (KL) instead of the data token (CE)",
    )
    p.add_argument(
        "--head-vocab",
        type=int,
        default=d.head_vocab,
        help="softmax over the N most frequent response tokens only (0: full vocabulary); the LM head "
        "dominates a CPU step. With --init-draft, that draft's vocabulary is kept and these join it",
    )
    p.add_argument(
        "--init-from-target", action="store_true", help="start the draft layers as the target's top layers"
    )
    p.add_argument(
        "--cache-features",
        action="store_true",
        help="keep the target's features of every sequence in memory after their first use",
    )
    p.add_argument(
        "--features",
        choices=FEATURES,
        default=d.features,
        help="where the draft's target features come from (auto: the serving runner, the bits `serve` reads, "
        "on a CPU with a bf16 target; transformers elsewhere)",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
