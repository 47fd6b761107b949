"""`flashdraft train`'s settings: the config, its checks, and which fields define a run (for --resume)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from flashdraft.models import target
from flashdraft.models.draft import DraftConfig, DraftError
from flashdraft.models.load import local_dir

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


# The loss decay per block size: the paper's 7 and 5 for blocks of 16 and 10; for blocks of 8, 2, which beat
# the paper's 4 by +0.029 held-out tau at equal data and minutes (docs/recipe.md, sittings 11-13): a young
# draft gets its first one or two positions accepted, and a faster decay spends the loss there.
GAMMA_AUTO = {16: 7.0, 10: 5.0, 8: 2.0}
# The learning-rate schedule when --lr / --warmup / --decay are not given: (lr, warmup, decay; None: cosine).
# A new draft warms up and follows a cosine. A trained draft continued (--init-draft) takes a lower constant
# rate and a final linear decay, no warmup: at the new draft's 6e-4 (or 4e-4) the weights re-heat and lose
# tau for hundreds of steps; at 1.5e-4 the same sitting gained +0.062 more (docs/recipe.md, sittings 14-17).
NEW_SCHEDULE = (6e-4, 0.04, None)
CONTINUED_SCHEDULE = (1.5e-4, 0.0, 0.3)
# A new draft's block size. Blocks of 8 reached held-out tau 1.27 where blocks of 16 reached 1.17 in 30
# CPU-minutes from scratch, same data and steps (docs/recipe.md): the decayed loss then gives the first
# drafted positions, the only ones a young draft gets accepted, twice the weight. The paper trains 16 on
# GPUs; a draft trained at 16 also runs at 8, not the reverse.
NEW_DRAFT_BLOCK_SIZE = 8


class TrainError(ValueError):
    """Training cannot start or continue as asked (the message says why and what to do)."""


@dataclass
class TrainConfig:
    target: str
    data: list[str]
    out: str
    layers: int = 5
    num_features: int | None = None  # target layers read; default: as many as draft layers
    target_layer_ids: list[int] | None = None
    # None: --init-draft's block size (continuing never changes it unasked), else NEW_DRAFT_BLOCK_SIZE.
    block_size: int | None = None
    # Anchors and batch: many small optimizer steps buy the most held-out tau in 30 CPU-minutes (48 anchors,
    # 2,048 tokens per step: 1.17; the paper's 512 anchors and large batches: 1.04; docs/recipe.md). At the
    # paper's scale pass --anchors 512 and a large --batch-tokens.
    anchors: int = 48
    gamma: float | None = None  # None: auto (GAMMA_AUTO: 7 / 5 / 2 for B = 16 / 10 / 8)
    epochs: int = 6
    # lr, warmup (a fraction of the steps) and decay: None takes NEW_SCHEDULE or, with init_draft,
    # CONTINUED_SCHEDULE (resolve_schedule). decay: a fraction: constant, then a linear decay over that last
    # fraction of the steps; None after resolving: cosine after the warmup.
    lr: float | None = None
    warmup: float | None = None
    decay: float | None = None
    weight_decay: float = 0.01
    # Clip the outliers only: at 1.0 every step of the campaign was clipped (median norm 2.5); at 4, 14% were,
    # and held-out tau rose +0.016 at equal minutes (docs/recipe.md, sittings 11-13).
    grad_clip: float = 4.0
    max_len: int = 3072
    batch_tokens: int = 2048  # sequence tokens per optimizer step (the global batch)
    micro_batch: int = 1  # sequences per forward pass (per rank)
    eval_data: str | None = None
    eval_prompts: int = 8
    eval_every: int = 0  # 0: about 10 evaluations per run
    eval_max_new_tokens: int = 128
    # References (scripts/offline_tau.py --make-refs): evaluate by the offline walk on the target's greedy
    # answers instead of the decode loop, the same tau on greedy decoding in seconds instead of minutes.
    eval_refs: str | None = None
    save_every: int = 0  # 0: about 10 checkpoints per run
    keep_checkpoints: int = 2
    seed: int = 0
    # The frozen target's dtype. auto: bfloat16 on GPUs and CPUs with native bf16, float32 elsewhere (bf16 is
    # emulated, far slower, on AVX2-only CPUs). The draft's master weights are fp32 (fp64 with float64).
    dtype: str = "auto"
    # bf16 autocast of the draft (fp32 master weights). auto: on CUDA, and on CPUs with native bf16 when the
    # target runs in bf16 (1.6-1.9x the blocks/s of fp32 on a 2-core avx512_bf16 EPYC; docs/speed.md).
    autocast: str = "auto"
    device: str = "auto"
    mask_token_id: int | None = None
    max_steps: int | None = None
    max_minutes: float | None = None  # train this long (evaluations excluded); the LR schedule follows time
    save_dtype: str = "bfloat16"  # dtype of the final draft in OUT/draft
    # Sample efficiency (docs/training.md, "Choices that raise tau per CPU-hour"): what the draft learns from and starts from.
    distill: bool = False  # KL to the target's own next-token distribution instead of CE on the data token
    head_vocab: int = 0  # loss over the N most frequent response tokens only (0: the whole vocabulary)
    init_from_target: bool = False  # draft layers start as copies of the target's top layers
    cache_features: bool = False  # keep target features in memory after the first epoch
    # Where the draft's target features come from (training and evaluation). auto: the serving runner (the
    # target `serve` runs: its quantized weights on our kernels, in bf16) when the target runs on a CPU in
    # bf16, so the draft learns the very bits it reads when served; else transformers' forward of the
    # target (GPUs, float32 and float64 runs, architectures the runner lacks).
    features: str = "auto"
    cache_gb: float = 8.0  # memory cap of the feature cache; sequences past it are recomputed each epoch
    corpus_limit: int | None = None  # (prompt, answer) pairs taken from each named corpus in --data
    corpus_skip: int = 0  # ... after skipping this many (each sitting of a campaign can take a fresh slice)
    init_draft: str | None = None  # start from this draft's weights (a checkpoint: and its optimizer moments)
    # Each source is drawn at most this many times over the draft's whole lineage (train.lineage): a draft
    # that reads a small data set again and again memorises it (loss falls, held-out tau stands). 0: no cap.
    max_views: float = 3.0
    # With init_draft: grow it to this many layers (DFlashDraft.grown: new layers start as the identity).
    grow_to: int | None = None
    chat_template_kwargs: dict | None = None  # chat template options for corpora and evaluation prompts
    resume: bool = False
    progress: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


FEATURES = ("auto", "runner", "transformers")

# Fields that define a run: `--resume` refuses a checkpoint made with other values. The others
# (evaluation, checkpointing, micro-batch, device, progress bar) may change between sittings.
RUN_FIELDS = (
    "layers",
    "num_features",
    "target_layer_ids",
    "block_size",
    "anchors",
    "gamma",
    "epochs",
    "lr",
    "warmup",
    "decay",
    "weight_decay",
    "grad_clip",
    "max_len",
    "batch_tokens",
    "seed",
    "dtype",
    "autocast",
    "mask_token_id",
    "max_steps",
    "distill",
    "head_vocab",
    "init_from_target",
    "corpus_limit",
    "corpus_skip",
    "init_draft",
    "chat_template_kwargs",
    "max_views",
    "grow_to",
)


def use_autocast(setting: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the draft trains under bf16 autocast: `--autocast on/off`, or auto: on CUDA, and on CPUs
    that multiply bf16 natively when the target is bf16 too (an AVX2-only CPU emulates bf16, far slower
    than fp32; a float32 or float64 target asks for that precision)."""
    if setting != "auto":
        return setting == "on"
    return device.type == "cuda" or (dtype == torch.bfloat16 and target.cpu_has_fast_bf16())


def resolve_gamma(block_size: int, gamma: float | None) -> float:
    if gamma is not None:
        if not gamma > 0:
            raise TrainError(f"--gamma must be > 0, got {gamma}")
        return float(gamma)
    if block_size not in GAMMA_AUTO:
        raise TrainError(
            f"--gamma auto is defined for block sizes 8, 10 and 16 (gamma 2, 5, 7); "
            f"pass an explicit --gamma for block size {block_size} (about block_size / 2 is a fair start)"
        )
    return GAMMA_AUTO[block_size]


def resolve_block_size(cfg: TrainConfig) -> TrainConfig:
    """`--block-size` when given; else the starting draft's with --init-draft, else NEW_DRAFT_BLOCK_SIZE."""
    if cfg.block_size is not None:
        return cfg
    if cfg.init_draft is None:
        return replace(cfg, block_size=NEW_DRAFT_BLOCK_SIZE)
    try:
        size = DraftConfig.read(local_dir(cfg.init_draft)).block_size
    except (DraftError, target.TargetError, OSError) as e:
        raise TrainError(f"--init-draft {cfg.init_draft}: {e}") from None
    return replace(cfg, block_size=size)


def resolve_schedule(cfg: TrainConfig) -> TrainConfig:
    """The learning-rate schedule's unset parts: NEW_SCHEDULE for a new draft, CONTINUED_SCHEDULE for one
    continued from --init-draft. Given values are kept."""
    lr, warmup, decay = CONTINUED_SCHEDULE if cfg.init_draft is not None else NEW_SCHEDULE
    return replace(
        cfg,
        lr=lr if cfg.lr is None else cfg.lr,
        warmup=warmup if cfg.warmup is None else cfg.warmup,
        decay=decay if cfg.decay is None else cfg.decay,
    )


def resolve_defaults(cfg: TrainConfig) -> TrainConfig:
    """Every setting whose default depends on others (block size, schedule), filled in."""
    return resolve_schedule(resolve_block_size(cfg))


def check_config(cfg: TrainConfig) -> None:
    """Every problem with the config (its block size resolved), all named in one TrainError."""
    cfg = resolve_schedule(cfg)
    problems = []
    if cfg.block_size < 2:
        problems.append(
            f"--block-size must be >= 2 (index 0 is the anchor, nothing to predict), got {cfg.block_size}"
        )
    if 2 * cfg.block_size > cfg.max_len:
        problems.append(
            f"--block-size {cfg.block_size} cannot fit: a sequence needs 2 x block size response "
            f"tokens, more than --max-len {cfg.max_len}"
        )
    for name in ("layers", "anchors", "epochs", "batch_tokens", "micro_batch", "keep_checkpoints"):
        if getattr(cfg, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    for name in ("eval_prompts", "eval_every", "save_every", "head_vocab"):
        if getattr(cfg, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        problems.append(f"--max-steps must be >= 1, got {cfg.max_steps}")
    if cfg.decay is not None and not 0 < cfg.decay <= 1:
        problems.append(f"--decay is a fraction of the steps in (0, 1], got {cfg.decay}")
    if not 0 <= cfg.warmup < 1:
        problems.append(f"--warmup is a fraction of the steps in [0, 1), got {cfg.warmup}")
    if not cfg.lr > 0:
        problems.append(f"--lr must be > 0, got {cfg.lr}")
    for name in ("dtype", "save_dtype"):
        if getattr(cfg, name) not in DTYPES and not (name == "dtype" and cfg.dtype == "auto"):
            problems.append(
                f"--{name.replace('_', '-')} must be one of {list(DTYPES)}, got {getattr(cfg, name)!r}"
            )
    if cfg.autocast not in ("auto", "on", "off"):
        problems.append(f"--autocast must be auto, on or off, got {cfg.autocast!r}")
    if cfg.features not in FEATURES:
        problems.append(f"--features must be one of {', '.join(FEATURES)}, got {cfg.features!r}")
    if not cfg.data:
        problems.append("--data is empty: pass data files or corpus names (sharegpt, gsm-symbolic)")
    weighted = []
    for item in cfg.data:
        try:
            weighted.append(data_source(item)[1] is not None)
        except TrainError as e:
            problems.append(str(e))
    if any(weighted) and not all(weighted):
        problems.append("--data: give every item a mixing weight (sharegpt:0.7,x.npz:0.3) or none")
    if cfg.grow_to is not None and cfg.init_draft is None:
        problems.append("--grow-to grows the draft of --init-draft: pass one (a new draft takes --layers)")
    if cfg.max_views < 0:
        problems.append(f"--max-views must be >= 0 (0: no cap), got {cfg.max_views}")
    if cfg.corpus_skip < 0:
        problems.append(f"--corpus-skip must be >= 0, got {cfg.corpus_skip}")
    if cfg.corpus_limit is not None and cfg.corpus_limit < 1:
        problems.append(f"--corpus-limit must be >= 1, got {cfg.corpus_limit}")
    if cfg.init_draft is not None and cfg.init_from_target:
        problems.append("--init-draft and --init-from-target both set the draft's first weights: pass one")
    if problems:
        raise TrainError("; ".join(problems))
    resolve_gamma(cfg.block_size, cfg.gamma)


def data_source(item: str) -> tuple[str, float | None]:
    """`--data` item -> (file or corpus name, mixing weight or None): `x.npz`, `sharegpt`, `sharegpt:0.7`."""
    name, sep, weight = item.rpartition(":")
    if not sep or not name or Path(item).exists():
        return item, None
    try:
        w = float(weight)
    except ValueError:
        return item, None
    if not w > 0:
        raise TrainError(f"--data {item}: the mixing weight after ':' must be > 0")
    return name, w
