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
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from .decode import GenerationConfig, generate
from .draft import DFlashDraft, DraftError, _atomic_write, init_draft_config
from .proposers import DFlashProposer
from .target import Target, load_target, resolve_dtype

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
GAMMA_AUTO = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's loss decay per block size
STATE_NAME = "trainer_state.json"
OPTIM_NAME = "optimizer.safetensors"
RNG_NAME = "rng.safetensors"
STATE_FORMAT = "flashdraft-train/1"


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
    block_size: int = 16
    anchors: int = 512
    gamma: float | None = None  # None: auto (7 / 5 / 4 for B = 16 / 10 / 8)
    epochs: int = 6
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of the steps
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    max_len: int = 3072
    batch_tokens: int = 16384  # sequence tokens per optimizer step (the global batch)
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
    autocast: str = "auto"  # bf16 autocast of the draft: auto = on CUDA only
    device: str = "auto"
    mask_token_id: int | None = None
    max_steps: int | None = None
    max_minutes: float | None = None  # train this long (evaluations excluded); the LR schedule follows time
    save_dtype: str = "bfloat16"  # dtype of the final draft in OUT/draft
    # Sample efficiency (README, "Choices that raise tau per CPU-hour"): what the draft learns from and starts from.
    distill: bool = False  # KL to the target's own next-token distribution instead of CE on the data token
    head_vocab: int = 0  # loss over the N most frequent response tokens only (0: the whole vocabulary)
    init_from_target: bool = False  # draft layers start as copies of the target's top layers
    cache_features: bool = False  # keep target features in memory after the first epoch
    cache_gb: float = 8.0  # memory cap of the feature cache; sequences past it are recomputed each epoch
    corpus_limit: int | None = None  # (prompt, answer) pairs taken from each named corpus in --data
    corpus_skip: int = 0  # ... after skipping this many (each sitting of a campaign can take a fresh slice)
    init_draft: str | None = None  # start from this draft's weights (fresh optimizer and schedule)
    resume: bool = False
    progress: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


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
)


def resolve_gamma(block_size: int, gamma: float | None) -> float:
    if gamma is not None:
        if not gamma > 0:
            raise TrainError(f"--gamma must be > 0, got {gamma}")
        return float(gamma)
    if block_size not in GAMMA_AUTO:
        raise TrainError(
            f"--gamma auto is defined for block sizes 8, 10 and 16 (gamma 4, 5, 7, from the paper); "
            f"pass an explicit --gamma for block size {block_size} (about block_size / 2 is a fair start)"
        )
    return GAMMA_AUTO[block_size]


def check_config(cfg: TrainConfig) -> None:
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
    if cfg.corpus_skip < 0:
        problems.append(f"--corpus-skip must be >= 0, got {cfg.corpus_skip}")
    if cfg.corpus_limit is not None and cfg.corpus_limit < 1:
        problems.append(f"--corpus-limit must be >= 1, got {cfg.corpus_limit}")
    if cfg.init_draft is not None and cfg.init_from_target:
        problems.append("--init-draft and --init-from-target both set the draft's first weights: pass one")
    if problems:
        raise TrainError("; ".join(problems))
    resolve_gamma(cfg.block_size, cfg.gamma)


# -- data ---------------------------------------------------------------------------------------


@dataclass
class Sequence:
    id: str
    ids: torch.Tensor  # (S,) int64: prompt + response, truncated to max_len
    loss_mask: torch.Tensor  # (S,) bool: True on response tokens
    n_prompt: int
    source: int = 0  # index of its --data item


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


def is_corpus(name: str) -> bool:
    from .data import CORPORA, EVAL_SETS

    return not Path(name).exists() and (name in CORPORA or name in EVAL_SETS)


def corpus_records(name: str, tokenizer, limit: int | None, seed: int = 0, skip: int = 0) -> list[dict]:
    """Records of a text corpus (`data.CORPORA`): each prompt through the chat template, and its recorded
    answer as the response, as the template renders an assistant turn. No regeneration: with --distill
    the labels are the target's own distributions over this text (teacher forcing)."""
    from .data import DataError, load_corpus
    from .datagen import _chat_ids

    if tokenizer is None:
        raise TrainError(f"--data {name}: a corpus needs the target's tokenizer, and this target has none")
    try:
        pairs = load_corpus(name, limit, seed, skip)
    except DataError as e:
        raise TrainError(f"--data {name}: {e}") from None
    eos = tokenizer.eos_token_id
    records = []
    for ex, answer in tqdm(
        pairs, desc=f"tokenizing {name}", unit="pair", leave=False, disable=len(pairs) < 500
    ):
        msgs = ex.messages()
        prompt = _chat_ids(tokenizer, msgs)
        full = tokenizer.apply_chat_template(
            msgs + [{"role": "assistant", "content": answer}], tokenize=True, return_dict=False
        )
        full = [int(t) for t in (full["input_ids"] if hasattr(full, "keys") else full)]
        if full[: len(prompt)] == prompt:
            response = full[len(prompt) :]
            if eos in response:  # what follows the end of turn is never generated
                response = response[: response.index(eos) + 1]
        else:
            response = tokenizer.encode(answer, add_special_tokens=False) + ([eos] if eos is not None else [])
        records.append(
            {
                "id": ex.id,
                "prompt_ids": prompt,
                "response_ids": response,
                "loss_mask": [0] * len(prompt) + [1] * len(response),
            }
        )
    return records


def read_records(path: str | os.PathLike, vocab_size: int) -> list[dict]:
    """Records of a datagen JSONL file, checked: ids inside the vocabulary, a consistent loss mask."""
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"data file {path} not found")
    if path.suffix == ".npz":  # `flashdraft pack-data` output
        from .datagen import DataGenError, read_packed

        try:
            return list(read_packed(path, vocab_size))
        except DataGenError as e:
            raise TrainError(str(e)) from None
    records = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.endswith("\n"):  # what an interrupted datagen leaves; rerunning it repairs the file
                print(
                    f"warning: {path} ends with a partial line (an interrupted datagen?); skipped",
                    file=sys.stderr,
                )
                break
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                rec = json.loads(line)
                prompt, response, mask = rec["prompt_ids"], rec["response_ids"], rec["loss_mask"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise TrainError(
                    f"{where}: not a datagen record ({e!r}); expected JSON with prompt_ids, "
                    "response_ids and loss_mask"
                ) from None
            if len(mask) != len(prompt) + len(response):
                raise TrainError(
                    f"{where}: loss_mask has {len(mask)} entries for {len(prompt)} prompt + "
                    f"{len(response)} response tokens"
                )
            ids = prompt + response
            if ids:
                lo, hi = min(ids), max(ids)
                if lo < 0 or hi >= vocab_size:
                    raise TrainError(
                        f"{where}: token id {hi if hi >= vocab_size else lo} is outside the target vocabulary "
                        f"(0..{vocab_size - 1}): this file was made with another tokenizer; regenerate it with "
                        "`flashdraft datagen --target` set to this target"
                    )
            records.append(
                {
                    "id": str(rec.get("id", f"{path.name}:{lineno}")),
                    "prompt_ids": prompt,
                    "response_ids": response,
                    "loss_mask": mask,
                }
            )
    return records


def prepare_data(
    cfg: TrainConfig, vocab_size: int, tokenizer=None
) -> tuple[list[Sequence], dict[str, list[list[int]]], dict]:
    """Training sequences, evaluation prompts by set, and counts. The last `eval_prompts` records
    are held out (never trained on) unless `eval_data` names the evaluation sets: datagen files or
    built-in data set names (`gsm-symbolic-eval,humaneval`), `eval_prompts` from each."""
    records, groups = [], []
    for item in cfg.data:
        name, weight = data_source(item)
        part = (
            corpus_records(name, tokenizer, cfg.corpus_limit, cfg.seed, cfg.corpus_skip)
            if is_corpus(name)
            else read_records(name, vocab_size)
        )
        records += [r | {"source": len(groups)} for r in part]
        groups.append(weight)
    if not records:
        raise TrainError(f"no records in {', '.join(cfg.data)}")
    if not any(any(r["loss_mask"]) for r in records):
        raise TrainError(
            f"no record in {', '.join(cfg.data)} has response tokens (loss_mask is 0 everywhere): "
            "the draft only learns responses; regenerate the data with `flashdraft datagen`"
        )
    held_out: list[dict] = []
    eval_sets: dict[str, list[list[int]]] = {}
    if cfg.eval_refs:
        from .acceptance import read_references

        for r in read_references(cfg.eval_refs):
            eval_sets.setdefault(r.get("set", "refs"), []).append(r["prompt_ids"])
    elif cfg.eval_data:
        for item in (x for x in cfg.eval_data.split(",") if x):
            if Path(item).is_file() and not _is_prompt_file(item):
                eval_sets[Path(item).stem] = [
                    r["prompt_ids"]
                    for r in read_records(item, vocab_size)[: cfg.eval_prompts]
                    if r["prompt_ids"]
                ]
            else:
                eval_sets[item] = dataset_prompts(item, cfg.eval_prompts, tokenizer)
    elif cfg.eval_prompts:
        if cfg.eval_prompts >= len(records):
            raise TrainError(
                f"--eval-prompts {cfg.eval_prompts} would hold out all {len(records)} records: "
                "lower it or pass --eval-data"
            )
        records, held_out = records[: -cfg.eval_prompts], records[-cfg.eval_prompts :]
    if held_out:
        eval_sets["held-out"] = [r["prompt_ids"] for r in held_out if r["prompt_ids"]]
    seen = {tuple(p) for prompts in eval_sets.values() for p in prompts}
    leaked = [r["id"] for r in records if tuple(r["prompt_ids"]) in seen]
    if leaked:
        raise TrainError(
            f"{len(leaked)} training record(s) ask an evaluation prompt (first: {leaked[0]}): evaluation "
            "prompts can never be trained on; drop them from the data or evaluate on other prompts"
        )
    need = 2 * cfg.block_size
    seqs, dropped, longest = [], 0, 0
    for r in records:
        ids = torch.tensor(r["prompt_ids"] + r["response_ids"], dtype=torch.long)[: cfg.max_len]
        mask = torch.tensor(r["loss_mask"], dtype=torch.bool)[: cfg.max_len]
        n_resp = int(mask.sum())
        longest = max(longest, n_resp)
        if n_resp < need:
            dropped += 1
            continue
        seqs.append(Sequence(r["id"], ids, mask, len(r["prompt_ids"]), r["source"]))
    if not seqs:
        raise TrainError(
            f"block size {cfg.block_size} cannot fit: no sequence has 2 x {cfg.block_size} = {need} response "
            f"tokens within --max-len {cfg.max_len} (the longest has {longest}); lower --block-size or use "
            "longer responses"
        )
    stats = {
        "records": len(records),
        "sequences": len(seqs),
        "dropped_short": dropped,
        "held_out": 0 if cfg.eval_data or cfg.eval_refs else len(held_out),
        "eval_prompts": sum(map(len, eval_sets.values())),
        "tokens": sum(s.ids.numel() for s in seqs),
        "response_tokens": sum(int(s.loss_mask.sum()) for s in seqs),
        "weights": groups if any(w is not None for w in groups) else None,
    }
    return seqs, eval_sets, stats


def _is_prompt_file(path: str) -> bool:
    """A `data.write_prompts` file (prompts only), not datagen records."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return path.endswith(".jsonl") and '"turns"' in f.readline()


def dataset_prompts(name: str, n: int, tokenizer) -> list[list[int]]:
    """The first `n` prompts of a built-in data set, through the target's chat template."""
    from .data import DataError, load_dataset
    from .datagen import _chat_ids

    if tokenizer is None:
        raise TrainError(
            f"--eval-data {name}: not a file, and this target has no tokenizer to ask a data set with"
        )
    try:
        return [_chat_ids(tokenizer, ex.messages()) for ex in load_dataset(name, limit=n)[:n]]
    except DataError as e:
        raise TrainError(f"--eval-data {name} is neither a file nor a usable data set: {e}") from None


def file_fingerprint(paths: list[str]) -> list[str]:
    """What `--resume` compares: each data file's sha256; a corpus by its name (its package is pinned)."""
    out = []
    for item in paths:
        p, weight = data_source(item)
        if is_corpus(p):
            out.append(f"corpus:{item}")
            continue
        h = hashlib.sha256()
        try:
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except OSError as e:
            raise TrainError(f"cannot read data file {p}: {e}") from None
        out.append(h.hexdigest())
    return out


def _generator(*key) -> torch.Generator:
    """A generator seeded from a key (seed, purpose, epoch, ...): the same on every rank and sitting."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def epoch_mix(sources: list[int], weights: list[float], seed: int, epoch: int) -> list[int]:
    """The sequences of one epoch under mixing weights: as many sequences as there are in all, a
    `w / sum(w)` share of them from each source (drawn without replacement, cycling through a small
    source in fresh permutations), so the mix holds whatever the sources' sizes."""
    out = []
    for g, w in enumerate(weights):
        members = [i for i, s in enumerate(sources) if s == g]
        want, picked = round(len(sources) * w / sum(weights)), []
        while members and len(picked) < want:
            perm = torch.randperm(len(members), generator=_generator(seed, "mix", epoch, g, len(picked)))
            picked += [members[i] for i in perm.tolist()]
        out += picked[:want]
    return out


def epoch_batches(
    lengths: list[int], batch_tokens: int, seed: int, epoch: int, members: list[int] | None = None
) -> list[list[int]]:
    """The global batches of one epoch: sequence indices (all, or `members`, see `epoch_mix`) in a
    shuffled order, packed greedily up to `batch_tokens` tokens per batch (a longer sequence gets a
    batch of its own)."""
    perm = torch.randperm(
        len(lengths) if members is None else len(members), generator=_generator(seed, "order", epoch)
    )
    order = perm.tolist() if members is None else [members[i] for i in perm.tolist()]
    batches, cur, tokens = [], [], 0
    for i in order:
        if cur and tokens + lengths[i] > batch_tokens:
            batches.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += lengths[i]
    if cur:
        batches.append(cur)
    return batches


# -- anchors, blocks, mask, loss ------------------------------------------------------------------


def sample_anchors(
    loss_mask: torch.Tensor, block_size: int, max_anchors: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Sorted anchor positions: up to `max_anchors` response positions p with p <= S - B, drawn
    without replacement."""
    n = loss_mask.numel()
    candidates = loss_mask[: max(0, n - block_size + 1)].nonzero().flatten()
    if candidates.numel() > max_anchors:
        candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:max_anchors]]
    return candidates.sort().values


def block_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight per block index: 0 for the anchor, exp(-(k - 1) / gamma) for k = 1..B-1."""
    k = torch.arange(block_size, dtype=torch.float64)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def block_targets(
    ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and weights (n_blocks, B): index k of the block at anchor a predicts x[a + k] (same
    position, no shift), weighted by exp(-(k-1)/gamma) x response mask x in range; 0 at k = 0."""
    pos = anchors[:, None] + torch.arange(block_size)  # (n, B)
    in_range = pos < ids.numel()
    safe = pos.clamp(max=ids.numel() - 1)
    labels = ids[safe]
    weights = block_weights(block_size, gamma) * (in_range & loss_mask[safe])
    return labels, weights


def build_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Visibility (b, Q, ctx_len + Q), Q = n_blocks * B, over keys [context ; blocks]; True = may attend.

    anchors: (b, n_blocks), -1 marks a padding block. A query of block j sees context positions
    strictly before that block's anchor and the B tokens of block j itself, nothing of any other
    block (blocks are identified by their slot, their relation to others by nothing at all);
    padding queries see nothing."""
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # (b, Q)
    real = q_anchor >= 0
    ctx = torch.arange(ctx_len, device=anchors.device)[None, None, :] < q_anchor[:, :, None]
    slot = torch.arange(q_anchor.shape[1], device=anchors.device) // block_size
    own = (slot[:, None] == slot[None, :])[None] & real[:, :, None] & real[:, None, :]
    return torch.cat([ctx, own], dim=-1)


def make_rows_safe(mask: torch.Tensor, ctx_len: int) -> torch.Tensor:
    """Let rows that see nothing (padding) attend to their own key, so attention never divides by
    zero (a fully masked row gives NaN that would leak into gradients). No real query sees padding
    keys and padding carries no loss, so nothing else changes."""
    empty = ~mask.any(-1)  # (..., Q)
    if not bool(empty.any()):
        return mask
    q = mask.shape[-2]
    eye = torch.eye(q, dtype=torch.bool, device=mask.device)
    out = mask.clone()
    out[..., ctx_len:] |= eye & empty[..., :, None]
    return out


@dataclass
class Batch:
    ids: torch.Tensor  # (b, S) target input, right-padded
    positions: torch.Tensor  # (b, S)
    block_ids: torch.Tensor  # (b, Q) [x[a], MASK, ...] per block
    block_positions: torch.Tensor  # (b, Q)
    labels: torch.Tensor  # (b, Q)
    weights: torch.Tensor  # (b, Q) float64, 0 on index 0 and padding
    anchors: torch.Tensor  # (b, n_blocks) anchor positions, -1 for padding blocks
    n_blocks: int  # real blocks
    # The dense (b, Q, S + Q) visibility of `build_mask`. None: the block layout computes the same
    # attention without it (`draft.block_attention`); tests set it to check the rules one by one.
    mask: torch.Tensor | None = None

    def to(self, device) -> Batch:
        return Batch(
            **{
                f.name: (
                    getattr(self, f.name).to(device)
                    if isinstance(getattr(self, f.name), torch.Tensor)
                    else getattr(self, f.name)
                )
                for f in fields(self)
            }
        )


def build_batch(
    seqs: list[tuple[torch.Tensor, torch.Tensor]],
    anchors: list[torch.Tensor],
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> Batch:
    """Blocks, labels, weights and the training mask for sequences (ids, loss_mask), padded."""
    b = len(seqs)
    s_max = max(ids.numel() for ids, _ in seqs)
    n_max = max(1, max(a.numel() for a in anchors))
    q = n_max * block_size
    ids_pad = torch.zeros(b, s_max, dtype=torch.long)
    anchor_pad = torch.full((b, n_max), -1, dtype=torch.long)
    block_ids = torch.full((b, q), mask_token_id, dtype=torch.long)
    block_pos = torch.arange(block_size).repeat(n_max)[None].repeat(b, 1)
    labels = torch.zeros(b, q, dtype=torch.long)
    weights = torch.zeros(b, q, dtype=torch.float64)
    for i, ((ids, loss_mask), a) in enumerate(zip(seqs, anchors, strict=True)):
        ids_pad[i, : ids.numel()] = ids
        n = a.numel()
        if not n:
            continue
        anchor_pad[i, :n] = a
        lab, w = block_targets(ids, loss_mask, a, block_size, gamma)
        labels[i, : n * block_size] = lab.flatten()
        weights[i, : n * block_size] = w.flatten()
        block_ids[i, 0 : n * block_size : block_size] = ids[a]
        block_pos[i, : n * block_size] = (a[:, None] + torch.arange(block_size)).flatten()
    return Batch(
        ids_pad,
        torch.arange(s_max)[None].repeat(b, 1),
        block_ids,
        block_pos,
        labels,
        weights,
        anchor_pad,
        sum(a.numel() for a in anchors),
    )


def teacher_targets(teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, sum(p log p)) of the teacher's distributions: all that KL(teacher || draft) needs besides
    the draft's logits, since KL = CE(p, draft) + sum(p log p)."""
    logp = F.log_softmax(teacher_logits, -1)
    p = logp.exp()
    return p, (p * logp).sum(-1)


def block_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    teacher_logits: torch.Tensor | None = None,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum(w * loss), sum(w)); the loss is their ratio, taken over the whole global batch. The loss
    is CE against `labels`, or with `teacher_logits` (or their `teacher_targets`) KL(teacher || draft):
    the target's whole next-token distribution at that position, not just its top token. The KL goes
    through cross-entropy's fused soft-target kernel instead of materialising several (N, V) tensors."""
    logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    if teacher_logits is not None:
        teacher = teacher_targets(teacher_logits.to(logits.dtype))
    if teacher is None:
        per = F.cross_entropy(logits, labels, reduction="none")
    else:
        p, neg_entropy = teacher
        per = F.cross_entropy(logits, p.to(logits.dtype), reduction="none") + neg_entropy.to(logits.dtype)
    w = weights.to(per.dtype)
    return (w * per).sum(), w.sum()


class FrozenHead:
    """The target's LM head as a plain function, optionally on an upcast copy of its weight (on CPUs
    without bf16 units an fp32 matmul is faster than a bf16 one, and more exact).

    With `rows`, only those vocabulary rows: the loss is then a softmax over that sub-vocabulary
    (`--head-vocab`), and `index` maps token ids to their row (-1 outside)."""

    def __init__(
        self, lm_head: torch.nn.Module, dtype: torch.dtype | None = None, rows: torch.Tensor | None = None
    ):
        w, b = lm_head.weight.detach(), getattr(lm_head, "bias", None)
        if rows is not None:
            w, b = w[rows], (None if b is None else b[rows])
        self.weight = w if dtype is None else w.to(dtype)
        self.bias = None if b is None else (b.detach() if dtype is None else b.detach().to(dtype))
        self.index = None
        if rows is not None:
            self.index = torch.full((lm_head.weight.shape[0],), -1, dtype=torch.long, device=w.device)
            self.index[rows] = torch.arange(rows.numel(), device=w.device)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if not torch.is_autocast_enabled(hidden.device.type):
            hidden = hidden.to(self.weight.dtype)
        return F.linear(hidden, self.weight, self.bias)


@torch.no_grad()
def target_features(target: Target, batch: Batch) -> torch.Tensor:
    """Selected-layer features (b, S, n*H) of every position, from one causal forward of the frozen target."""
    _, feats = target.forward(batch.ids, batch.positions, target.new_cache(), logits_to_keep=1, features=True)
    return feats


def head_rows(seqs: list[Sequence], n: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `n` most frequent response tokens of the data (ties by id) and the share of response tokens
    they cover: a softmax over them costs n/V of the full LM head, which dominates a CPU step."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.ids[s.loss_mask], minlength=vocab_size)
    rows = torch.sort(torch.argsort(counts, descending=True, stable=True)[: min(n, vocab_size)]).values
    return rows, float(counts[rows].sum()) / max(1, int(counts.sum()))


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


def draft_hidden(
    draft, target: Target, batch: Batch, dtype: torch.dtype, features: torch.Tensor | None = None
) -> torch.Tensor:
    """The training forward: every block of the batch in one draft pass under the training mask."""
    if features is None:
        features = target_features(target, batch)
    config = draft.config
    with torch.no_grad():
        embeds = target.embed(batch.block_ids).to(dtype)
        scale = float(config.extra.get("input_embedding_scale", 1.0))
        if scale != 1.0:
            embeds = embeds * scale
    s = batch.ids.shape[1]
    if batch.mask is not None:
        mask = make_rows_safe(batch.mask, s)[:, None]
        return draft(embeds, batch.block_positions, features.to(dtype), batch.positions, mask=mask)
    q_anchor = batch.anchors.repeat_interleave(config.block_size, dim=1)  # (b, Q), -1 on padding
    ctx_visible = torch.arange(s, device=q_anchor.device)[None, None, :] < q_anchor[:, :, None]
    return draft(
        embeds,
        batch.block_positions,
        features.to(dtype),
        batch.positions,
        mask=ctx_visible[:, None],
        blocks=config.block_size,
    )


def batch_loss(
    draft,
    target: Target,
    head,
    batch: Batch,
    dtype: torch.dtype,
    autocast: bool = False,
    features: torch.Tensor | None = None,
    teacher: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum(w * loss), sum(w)) of a batch; logits are only computed where the weight is non-zero.

    `teacher` (b, S, H): the target's final hidden states; block slot k of the block at anchor a
    then learns the target's distribution at position a + k - 1 (which predicts x[a + k])."""
    if features is None:
        features = target_features(target, batch)
    keep = batch.weights > 0
    labels, weights = batch.labels[keep], batch.weights[keep]
    if head.index is not None:  # a sub-vocabulary: tokens outside it carry no loss
        labels = head.index[labels]
        weights = weights * (labels >= 0)
        labels = labels.clamp(min=0)
    with torch.autocast(batch.ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = draft_hidden(draft, target, batch, dtype, features)
        logits = draft.logits(hidden[keep], head)
        targets = None
        if teacher is not None:
            with torch.no_grad():
                # Blocks of nearby anchors overlap: each position's distribution is computed once.
                s = batch.ids.shape[1]
                pos = (batch.block_positions - 1).clamp(min=0)[keep]
                rows = torch.arange(batch.ids.shape[0], device=pos.device)[:, None].expand_as(keep)[keep]
                where, inverse = torch.unique(rows * s + pos, return_inverse=True)
                t_logits = draft.logits(teacher[where // s, where % s].to(dtype), head)
                p, neg_entropy = teacher_targets(
                    t_logits.float() if t_logits.dtype == torch.bfloat16 else t_logits
                )
                targets = (p[inverse], neg_entropy[inverse])
    return block_loss(logits, labels, weights, teacher=targets)


# -- schedule -----------------------------------------------------------------------------------


def lr_at(step: int, total: int, lr: float, warmup: float) -> float:
    """Linear warmup over `warmup` x total steps, then cosine decay to 0 at `total`."""
    n_warm = max(1, round(warmup * total)) if warmup > 0 else 0
    if step < n_warm:
        return lr * (step + 1) / n_warm
    progress = (step - n_warm) / max(1, total - n_warm)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# -- distributed --------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    enabled: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup(cfg: TrainConfig) -> tuple[Dist, torch.device]:
    """Process group (under torchrun) and device: gloo on CPU, NCCL on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    want = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if world <= 1:
        return Dist(), torch.device(want)
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if want.startswith("cuda"):
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(hours=3))
    return Dist(dist.get_rank(), dist.get_world_size(), local, True), device


def shard(draft: DFlashDraft, device: torch.device, d: Dist):
    """FSDP2: shard each draft layer, then the rest (fc, norms), across the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (d.world,))
    for layer in draft.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(draft, mesh=mesh)
    return draft


def all_sum(value: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.enabled:
        import torch.distributed as dist

        dist.all_reduce(value)
    return value


def barrier(d: Dist) -> None:
    if d.enabled:
        import torch.distributed as dist

        dist.barrier()


def _state_options(d: Dist, **kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=d.enabled, **kw)


def unsharded(draft, d: Dist) -> DFlashDraft | None:
    """The whole draft on rank 0 (the module itself without torchrun; a gathered copy with FSDP,
    a collective call on every rank). Other ranks get None."""
    if not d.enabled:
        return draft
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(draft, options=_state_options(d))
    if not d.main:
        return None
    with torch.random.fork_rng(devices=[]):  # building a module draws its random init: keep the RNG as is
        copy = DFlashDraft(draft.config)
    copy.to(next(iter(state.values())).dtype).load_state_dict(
        state
    )  # cast first: loading copies into the dtype
    copy.set_vocab(draft.vocab)
    return copy


# -- evaluation, metrics, plot ------------------------------------------------------------------


def evaluate_tau(
    draft: DFlashDraft,
    target: Target,
    prompts: dict[str, list[list[int]]] | list[list[int]],
    block_size: int,
    max_new_tokens: int,
) -> dict:
    """tau of the real decode loop (greedy) on held-out prompts: committed tokens per target forward,
    pooled over all prompts ("tau") and per evaluation set ("tau/<set>")."""
    sets = prompts if isinstance(prompts, dict) else {"held-out": prompts}
    proposer = DFlashProposer(draft, target, proposal="greedy")
    out, all_c, all_s, t0 = {}, 0, 0, time.perf_counter()
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
        out[f"tau/{name}"] = committed / steps if steps else float("nan")
        all_c, all_s = all_c + committed, all_s + steps
    return {
        "tau": all_c / all_s if all_s else float("nan"),
        **(out if len(sets) > 1 else {}),
        "eval_tokens": all_c,
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
    _atomic_write(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)


# -- checkpoints --------------------------------------------------------------------------------


def checkpoint_dirs(out: Path) -> list[Path]:
    """Complete checkpoints (renamed into place, so complete by construction), oldest first."""
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / STATE_NAME).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


def read_state(ckpt: Path) -> dict:
    try:
        state = json.loads((ckpt / STATE_NAME).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TrainError(
            f"{ckpt / STATE_NAME} is unreadable ({e}): delete {ckpt} to resume from an older one"
        ) from None
    if state.get("format") != STATE_FORMAT:
        raise TrainError(f"{ckpt} was written by another trainer (format {state.get('format')!r})")
    return state


def target_fingerprint(target: Target) -> dict:
    w = target.embedding.weight
    rows = w[:: max(1, w.shape[0] // 256)].double()
    return {
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "head_layout": list(target.head_layout),
        "embedding_checksum": float(rows.abs().sum()),
    }


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_checkpoint(out: Path, step: int, draft, optimizer, d: Dist, state: dict, keep: int) -> Path | None:
    """Write OUT/checkpoints/step-N atomically (temp dir, then rename) and prune older ones.
    A collective call under torchrun; only rank 0 writes."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    whole = unsharded(draft, d)
    optim = get_optimizer_state_dict(draft, optimizer, options=_state_options(d))
    final = None
    if d.main:
        root = out / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{step:08d}"
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".step-{step:08d}.", suffix=".tmp"))
        try:
            whole.save_pretrained(tmp)
            tensors = {}
            for fqn, entries in optim["state"].items():
                for name, value in entries.items():
                    tensors[f"{fqn}::{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
            save_file(tensors, str(tmp / OPTIM_NAME))
            rng = {"torch": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
            save_file(rng, str(tmp / RNG_NAME))
            py_state = random.getstate()
            state = dict(
                state,
                format=STATE_FORMAT,
                step=step,
                python_random=[py_state[0], list(py_state[1]), py_state[2]],
            )
            (tmp / STATE_NAME).write_text(json.dumps(state, indent=1) + "\n")
            for f in tmp.iterdir():
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
            os.chmod(tmp, 0o755)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in checkpoint_dirs(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier(d)
    return final


def load_checkpoint(ckpt: Path, draft, optimizer, d: Dist) -> None:
    """Weights, optimizer moments and RNG states of a checkpoint into this (possibly sharded) run."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    try:
        model = load_file(str(ckpt / "model.safetensors"))
        flat = load_file(str(ckpt / OPTIM_NAME))
        rng = load_file(str(ckpt / RNG_NAME))
    except (SafetensorError, OSError) as e:
        raise TrainError(
            f"checkpoint {ckpt} is damaged ({e}): delete it to resume from an older one"
        ) from None
    set_model_state_dict(draft, model, options=opts)
    optim = get_optimizer_state_dict(draft, optimizer, options=opts)
    state: dict[str, dict] = {}
    for key, value in flat.items():
        fqn, name = key.rsplit("::", 1)
        state.setdefault(fqn, {})[name] = value
    set_optimizer_state_dict(
        draft, optimizer, {"state": state, "param_groups": optim["param_groups"]}, options=opts
    )
    torch.set_rng_state(rng["torch"])
    cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    py = read_state(ckpt)["python_random"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def check_resume(state: dict, identity: dict, ckpt: Path) -> None:
    """Refuse a checkpoint made for another run (options, data, target or draft shape)."""
    old = state.get("identity", {})
    diffs = []
    # An option added after the checkpoint was made resumes as if it had had its default.
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    for k in RUN_FIELDS:
        a, b = old.get("config", {}).get(k, defaults[k]), identity["config"][k]
        if a != b:
            diffs.append(f"--{k.replace('_', '-')}: checkpoint {a!r}, now {b!r}")
    if old.get("data") != identity["data"]:
        diffs.append("the data files (content or order) differ from the checkpoint's")
    if old.get("held_out") != identity["held_out"]:
        diffs.append(f"held-out records: checkpoint {old.get('held_out')}, now {identity['held_out']}")
    for key in ("target", "draft_config"):
        if key in identity and old.get(key) != identity[key]:
            a, b = old.get(key) or {}, identity[key]
            if (
                key == "target"
                and a
                and {k: v for k, v in a.items() if k != "embedding_checksum"}
                == {k: v for k, v in b.items() if k != "embedding_checksum"}
                and math.isclose(a["embedding_checksum"], b["embedding_checksum"], rel_tol=1e-6)
            ):
                continue
            changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            diffs.append(f"{'target model' if key == 'target' else 'draft config'} differs in {changed}")
    if diffs:
        raise TrainError(
            f"cannot resume from {ckpt}: it belongs to a different run ({'; '.join(diffs)}). "
            "Resume with the same target, data and options, or train into a new --out"
        )


# -- the training loop --------------------------------------------------------------------------


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training; returns a summary. Raises TrainError on bad input or a NaN loss."""
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


def _train(cfg: TrainConfig, d: Dist, device: torch.device) -> dict:
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
    if cfg.resume:  # options and data first: a wrong --resume fails before the target is loaded
        ckpt = found[-1]
        ckpt_state = read_state(ckpt)
        check_resume(ckpt_state, identity, ckpt)

    master = torch.float64 if dtype == torch.float64 else torch.float32
    use_autocast = cfg.autocast == "on" or (cfg.autocast == "auto" and device.type == "cuda")
    target = load_target(cfg.target, dtype, str(device))
    seqs, eval_prompts, stats = prepare_data(cfg, target.vocab_size, target.tokenizer)
    start_from = None
    if cfg.init_draft:
        try:
            start_from = DFlashDraft.from_pretrained(cfg.init_draft, dtype=master)
        except (DraftError, OSError) as e:
            raise TrainError(f"--init-draft {cfg.init_draft}: {e}") from None
    mask_id, note = (
        (cfg.mask_token_id, None) if cfg.mask_token_id is not None else target.default_mask_token_id()
    )
    if start_from is not None:
        mask_id, note = start_from.config.mask_token_id, None
    if note:
        _log(d, note)
    if not 0 <= mask_id < target.vocab_size:
        raise TrainError(
            f"--mask-token-id {mask_id} is not a row of the target's embedding (0..{target.vocab_size - 1})"
        )
    dcfg = init_draft_config(
        target.model.config, cfg.layers, mask_id, cfg.block_size, cfg.target_layer_ids, cfg.num_features
    )
    if start_from is not None:  # its shape wins: layers, target layers and mask id come with the weights
        dcfg = start_from.config.replace(block_size=cfg.block_size)
    identity["target"] = target_fingerprint(target)
    identity["draft_config"] = dcfg.to_json()
    if ckpt is not None:
        check_resume(ckpt_state, identity, ckpt)

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    draft = DFlashDraft(dcfg).to(device=device, dtype=master)
    draft.check_target(target)
    if cfg.init_from_target and ckpt is None:
        _log(d, init_from_target(draft, target))
    if start_from is not None and ckpt is None:
        draft.load_state_dict(start_from.state_dict())
        _log(
            d,
            f"draft starts from {cfg.init_draft} ({len(dcfg.target_layer_ids)} target layers, fresh optimizer)",
        )
    # With --distill the target's last layer (its final-normed output) is read too: the teacher.
    feature_ids = list(dcfg.target_layer_ids) + ([target.num_layers - 1] if cfg.distill else [])
    n_draft_feats = len(dcfg.target_layer_ids) * target.hidden_size
    target.select_layers(feature_ids)
    if d.enabled:
        shard(draft, device, d)
    draft.train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rows = None
    if cfg.head_vocab:
        rows, coverage = head_rows(seqs, cfg.head_vocab, target.vocab_size)
        _log(d, f"loss over the {rows.numel()} most frequent response tokens: {100 * coverage:.2f}% of them")
        draft.set_vocab(rows)  # saved with the draft: it proposes only from what it was trained on
        rows = rows.to(device)
    head = FrozenHead(target.lm_head, None if use_autocast else master, rows)
    feature_cache: dict[int, torch.Tensor] = {}
    cache_room = [int(cfg.cache_gb * 2**30)]  # bytes left for cached features

    def batch_features(part: list[int], batch: Batch) -> torch.Tensor:
        """Target features of a micro-batch: computed, or (--cache-features) assembled from memory."""
        target.select_layers(feature_ids)  # evaluation points the hooks at the draft's layers only
        if not cfg.cache_features or any(i not in feature_cache for i in part):
            feats = target_features(target, batch)
            if cfg.cache_features:
                for row, i in enumerate(part):
                    kept = feats[row, : seqs[i].ids.numel()]
                    if i not in feature_cache and kept.nbytes <= cache_room[0]:
                        feature_cache[i] = kept.clone()
                        cache_room[0] -= kept.nbytes
            return feats
        feats = torch.zeros(*batch.ids.shape, len(feature_ids) * target.hidden_size, dtype=target.dtype)
        for row, i in enumerate(part):
            feats[row, : seqs[i].ids.numel()] = feature_cache[i]
        return feats.to(device)

    lengths = [s.ids.numel() for s in seqs]

    def epoch_plan(epoch: int) -> list[list[int]]:
        members = (
            None
            if stats["weights"] is None
            else epoch_mix([s.source for s in seqs], stats["weights"], cfg.seed, epoch)
        )
        return epoch_batches(lengths, cfg.batch_tokens, cfg.seed, epoch, members)

    per_epoch = [len(epoch_plan(e)) for e in range(cfg.epochs)]
    total = sum(per_epoch) if cfg.max_steps is None else min(sum(per_epoch), cfg.max_steps)
    eval_every = cfg.eval_every or max(1, total // 10)
    save_every = cfg.save_every or max(1, total // 10)
    evaluating = bool(eval_prompts)
    refs = None
    if cfg.eval_refs:
        from .acceptance import offline_tau, read_references

        refs = read_references(cfg.eval_refs)

    start = 0
    metrics_path, plot_path = out / "metrics.jsonl", out / "plot.png"
    if ckpt is not None:
        load_checkpoint(ckpt, draft, optimizer, d)
        start = int(ckpt_state["step"])
        _log(d, f"resuming from {ckpt} at step {start}/{total}")
        if d.main:  # forget metrics of steps the interrupted sitting ran past its last checkpoint
            kept = [m for m in read_metrics(metrics_path) if m["step"] <= start]
            _atomic_write(
                metrics_path, lambda p: Path(p).write_text("".join(json.dumps(m) + "\n" for m in kept))
            )
    elif d.main:
        out.mkdir(parents=True, exist_ok=True)
        metrics_path.unlink(missing_ok=True)
    if d.main:
        for stale in (out / "checkpoints").glob(".step-*.tmp"):  # left by a run killed while saving
            shutil.rmtree(stale, ignore_errors=True)
    _log(
        d,
        f"data: {stats['sequences']} sequences ({stats['tokens']} tokens, {stats['response_tokens']} response), "
        f"{stats['dropped_short']} dropped with fewer than {2 * cfg.block_size} response tokens, "
        f"{stats['eval_prompts']} evaluation prompts{' held out' if stats['held_out'] else ''}",
    )
    _log(
        d,
        f"draft: {dcfg.num_hidden_layers} layers, block {cfg.block_size}, gamma {gamma}, target layers "
        f"{dcfg.target_layer_ids}, mask {mask_id}, {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M "
        f"parameters; {total} steps ({', '.join(map(str, per_epoch[:4]))}{', ...' if len(per_epoch) > 4 else ''} "
        f"per epoch), world {d.world}, "
        f"device {device}, autocast {'bf16' if use_autocast else 'off'}",
    )

    def log_metrics(row: dict) -> None:
        if d.main:
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def run_eval(step: int) -> float | None:
        result = None
        if evaluating:
            whole = unsharded(draft, d)
            if d.main and refs is not None:
                t0 = time.perf_counter()
                result = offline_tau(whole, target, refs) | {"eval_s": round(time.perf_counter() - t0, 3)}
            elif d.main:
                result = evaluate_tau(whole, target, eval_prompts, cfg.block_size, cfg.eval_max_new_tokens)
            barrier(d)
        return result

    def ckpt_state_now(step: int, epoch: int, epoch_step: int, last: dict) -> dict:
        return {
            "identity": identity,
            "epoch": epoch,
            "epoch_step": epoch_step,
            "total_steps": total,
            "loss": last.get("loss"),
            "tau": last.get("tau"),
            "data_stats": stats,
            "train_config": asdict(cfg),
            "wall_s": round(time.perf_counter() - t_start, 1),
        }

    last: dict = {}
    last_ckpt = ckpt
    if start == 0 and evaluating:
        res = run_eval(0)
        if res:
            last = {"step": 0, "epoch": 0, **res}
            log_metrics(last)
            _log(d, f"step 0: tau {res['tau']:.3f} on {stats['eval_prompts']} held-out prompts")
    bar = tqdm(
        total=total,
        initial=start,
        desc="train",
        unit="step",
        disable=not (d.main and cfg.progress),
        dynamic_ncols=True,
    )
    epoch, plan, first_in_epoch = -1, [], 0
    blocks_done, busy_s = 0, 0.0
    j = 0
    budget = None if cfg.max_minutes is None else 60 * cfg.max_minutes  # seconds of optimizer steps
    for step in range(start, total):
        if budget is not None and busy_s > budget:
            _log(d, f"--max-minutes {cfg.max_minutes} reached at step {step}/{total}: stopping")
            if evaluating and "tau" not in last:
                res = run_eval(step)
                if res:
                    last.update(res)
                    log_metrics({"step": step, "epoch": epoch, **res})
            if step > start and (last_ckpt is None or not str(last_ckpt).endswith(f"step-{step}")):
                last_ckpt = (
                    save_checkpoint(
                        out,
                        step,
                        draft,
                        optimizer,
                        d,
                        ckpt_state_now(step, epoch, j + 1, last),
                        cfg.keep_checkpoints,
                    )
                    or last_ckpt
                )
            break
        while epoch < 0 or step >= first_in_epoch + len(plan):
            if epoch >= 0:
                first_in_epoch += len(plan)
            epoch += 1
            plan = epoch_plan(epoch)
        j = step - first_in_epoch
        t0 = time.perf_counter()
        # With --max-minutes the schedule runs on time: it ends where the budget does.
        at = step if budget is None else max(step, int(total * busy_s / budget))
        lr = lr_at(at, total, cfg.lr, cfg.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr

        batch_idx = plan[j]
        anchors = {
            i: sample_anchors(
                seqs[i].loss_mask, cfg.block_size, cfg.anchors, _generator(cfg.seed, "anchors", epoch, i)
            )
            for i in batch_idx
        }
        total_w = (
            sum(
                float(
                    block_targets(seqs[i].ids, seqs[i].loss_mask, anchors[i], cfg.block_size, gamma)[1].sum()
                )
                for i in batch_idx
            )
            or 1.0
        )  # 0 only if no anchor has a response token after it
        n_blocks = sum(a.numel() for a in anchors.values())
        mine = batch_idx[d.rank :: d.world]
        micro = [mine[k : k + cfg.micro_batch] for k in range(0, len(mine), cfg.micro_batch)]
        # Every rank runs the same number of passes (FSDP collectives); spare ones carry zero weight.
        n_micro = max(1, math.ceil(math.ceil(len(batch_idx) / d.world) / cfg.micro_batch))
        wce_sum = torch.zeros((), dtype=torch.float64, device=device)
        for m in range(n_micro):
            part, scale = (micro[m], 1.0) if m < len(micro) else ([batch_idx[0]], 0.0)
            if d.enabled:
                draft.set_requires_gradient_sync(m == n_micro - 1)
            batch = build_batch(
                [(seqs[i].ids, seqs[i].loss_mask) for i in part],
                [anchors[i] for i in part],
                cfg.block_size,
                mask_id,
                gamma,
            ).to(device)
            feats = batch_features(part, batch)
            teacher = feats[..., n_draft_feats:] if cfg.distill else None
            wce, _ = batch_loss(
                draft, target, head, batch, master, use_autocast, feats[..., :n_draft_feats], teacher
            )
            # FSDP averages gradients over ranks: scale by world so the result is sum(w*CE) / sum(w).
            (wce * (scale * d.world / total_w)).backward()
            wce_sum += wce.detach().double() * scale
        loss = float(all_sum(wce_sum, d)) / total_w
        if not math.isfinite(loss):
            bar.close()
            raise TrainError(
                f"loss is {loss} at step {step + 1} (epoch {epoch + 1}): training stopped; "
                + (
                    f"the last good checkpoint is {last_ckpt}"
                    if last_ckpt
                    else "no checkpoint had been written yet"
                )
                + " (lower --lr, or check the data and the target's dtype)"
            )
        grad_norm = torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if not math.isfinite(grad_norm):
            bar.close()
            raise TrainError(
                f"gradient norm is {grad_norm} at step {step + 1}: training stopped; the last good "
                f"checkpoint is {last_ckpt or 'none (none written yet)'}"
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        blocks_done += n_blocks
        busy_s += dt
        done = step + 1
        last = {
            "step": done,
            "epoch": epoch,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "blocks": n_blocks,
            "sequences": len(batch_idx),
            "blocks_per_s": round(n_blocks / dt, 2),
            "time_s": round(time.perf_counter() - t_start, 2),
        }
        if evaluating and (done % eval_every == 0 or done == total):
            res = run_eval(done)
            if res:
                last.update(res)
        log_metrics(last)
        if d.main and "tau" in last:
            plot_metrics(read_metrics(metrics_path), plot_path)
        bar.set_postfix(
            loss=f"{loss:.3f}", tau=f"{last['tau']:.2f}" if "tau" in last else "-", bps=f"{n_blocks / dt:.0f}"
        )
        bar.update(1)
        if done % save_every == 0 or done == total:
            last_ckpt = (
                save_checkpoint(
                    out,
                    done,
                    draft,
                    optimizer,
                    d,
                    ckpt_state_now(done, epoch, j + 1, last),
                    cfg.keep_checkpoints,
                )
                or last_ckpt
            )
    bar.close()

    whole = unsharded(draft, d)
    summary = {}
    if d.main:
        whole.save_pretrained(out / "draft", dtype=DTYPES[cfg.save_dtype])
        rows = read_metrics(metrics_path)
        plot_metrics(rows, plot_path)
        losses = [m["loss"] for m in rows if m.get("loss") is not None]
        taus = [(m["step"], m["tau"]) for m in rows if m.get("tau") is not None]
        summary = {
            "steps": last.get("step", total),
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "tau": taus,
            "data": stats,
            "blocks_per_s": round(blocks_done / busy_s, 2) if busy_s else None,
            "wall_s": round(time.perf_counter() - t_start, 1),
            "draft": str(out / "draft"),
            "checkpoint": str(last_ckpt) if last_ckpt else None,
        }
        _atomic_write(
            out / "summary.json", lambda p: Path(p).write_text(json.dumps(summary, indent=1) + "\n")
        )
        tau_txt = " -> ".join(f"{t:.3f}" for _, t in taus) if taus else "not evaluated"
        _log(
            d,
            f"done: {summary['steps']} steps, loss {summary['first_loss']} -> {summary['last_loss']}, tau {tau_txt}, "
            f"{summary['blocks_per_s']} blocks/s, {summary['wall_s']} s; draft in {out / 'draft'}",
        )
    barrier(d)
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
    """`flashdraft train` options (README, "Train a draft for your own model")."""
    d = TrainConfig
    p.add_argument(
        "--target", required=True, help="built-in name, a .gguf file or a local HF model directory"
    )
    p.add_argument(
        "--data",
        required=True,
        type=lambda s: [x for x in s.split(",") if x],
        help="comma-separated datagen JSONL / packed .npz files and text corpora (sharegpt, gsm-symbolic: "
        "their recorded answers, no regeneration; use with --distill), each optionally with a mixing weight: "
        "sharegpt:0.7,data/x.npz:0.3",
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
    p.add_argument(
        "--init-draft",
        default=None,
        help="start from this draft directory's weights (fresh optimizer and schedule)",
    )
    p.add_argument(
        "--cache-gb", type=float, default=TrainConfig.cache_gb, help="memory cap of --cache-features (GiB)"
    )
    p.add_argument(
        "--out", required=True, help="run directory: checkpoints/, draft/, metrics.jsonl, plot.png"
    )
    p.add_argument("--layers", type=int, default=d.layers, help="draft layers")
    p.add_argument("--num-features", type=int, default=None, help="target layers read (default: --layers)")
    p.add_argument("--target-layer-ids", type=_int_list, default=None, help="explicit 0-based target layers")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--anchors", type=int, default=d.anchors, help="max anchors (blocks) per sequence")
    p.add_argument("--gamma", type=_gamma, default=None, help="loss decay; auto = 7/5/4 for block 16/10/8")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=float, default=d.warmup, help="warmup fraction of the steps")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
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
        help="bf16 autocast of the draft (auto: on CUDA only)",
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
        "dominates a CPU step",
    )
    p.add_argument(
        "--init-from-target", action="store_true", help="start the draft layers as the target's top layers"
    )
    p.add_argument(
        "--cache-features",
        action="store_true",
        help="keep the target's features of every sequence in memory after their first use",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
