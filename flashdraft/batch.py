"""Batched speculative decoding: continuous batching at step granularity.

Rows (requests) join between steps with a prefill and leave when they stop, reach their length or
are cancelled. Each step drafts a block for every running row, verifies all rows in one target
forward, and commits a different number of tokens per row. Each row's output is what
`decode.generate` gives for that row alone: the same tokens under greedy decoding, the same
distribution under sampling (every row has its own generator and sampling settings).

How rows of different lengths share one cache: HF's DynamicCache appends at one slot index for all
rows. Next to it we keep the absolute position of every slot of every row (`kpos`, (B, S)). A slot
that holds nothing for a row (prompt padding, a rejected draft token, a row that joined later) gets
the position DEAD, larger than any query. The attention mask is then one comparison: a query sees
a slot iff the slot's position is <= its own (and within the window on sliding-window layers, counted
in positions). Slot order never matters. Each step appends every row's verify block, trims the slots
no row kept, and compacts (gathers each row's live slots to the front) when dead slots pile up. The
draft's context cache gets the same treatment.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .decode import GenerationConfig, GenerationResult, _check_prompt, prompt_tensor
from .draft import DFlashDraft, KVCache
from .proposers import Proposer
from .sampling import SamplingConfig, next_token, probs, sample, verify_sampling
from .target import Target

DEAD = 2**62  # the position of a slot that holds nothing for its row: no query ever sees it


@dataclass
class StepOutput:
    request_id: str
    tokens: list[int]  # tokens committed for this request in this step (may be empty)
    finished: str | None  # None, "stop", "length" or "cancelled"
    accepted: int | None  # tokens committed by this row's verify (its acceptance length); None for a prefill


@dataclass(eq=False)
class Row:
    """One request in the batch; what proposers see of it."""

    request_id: str
    prompt: list[int]
    config: GenerationConfig
    block_size: int  # this row drafts up to block_size - 1 tokens per step
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)  # generated so far; the last one is the anchor
    lengths: list[int] = field(default_factory=list)  # acceptance length of every verify step
    finished: str | None = None
    prefill_s: float = 0.0
    started: float = 0.0  # when the prefill ended
    ended: float = 0.0
    draft_s: list[float] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)

    @property
    def anchor(self) -> int:
        """Position of the last committed token, the only one not yet in the target cache."""
        return len(self.prompt) + len(self.tokens) - 1

    @property
    def room(self) -> int:
        return self.config.max_new_tokens - len(self.tokens)

    @property
    def sampling(self) -> SamplingConfig:
        return self.config.sampling

    def commit(self, new: list[int]) -> list[int]:
        """Append new tokens, cut at the length limit and at the first stop token; set `finished`."""
        new = new[: self.room]
        stops = set(self.config.stop_ids)
        for i, t in enumerate(new):
            if t in stops:
                new, self.finished = new[: i + 1], "stop"
                break
        self.tokens += new
        if self.finished is None and self.room == 0:
            self.finished = "length"
        return new

    def result(self) -> GenerationResult:
        return GenerationResult(
            tokens=list(self.tokens),
            acceptance_lengths=list(self.lengths),
            prefill_s=self.prefill_s,
            decode_s=self.ended - self.started,
            draft_s=list(self.draft_s),
            verify_s=list(self.verify_s),
            step_s=list(self.step_s),
            stop_reason=self.finished or "length",
        )


# -- per-row slot bookkeeping ---------------------------------------------------------------------


def _live_order(kpos: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Slot indices (B, L) that bring each row's live slots to the front, in slot order, and L, the
    most live slots of any row (shorter rows are filled up with dead slots)."""
    dead = kpos == DEAD
    n_live = int((~dead).sum(1).max()) if kpos.numel() else 0
    order = torch.sort(dead.to(torch.uint8), dim=1, stable=True).indices[:, :n_live]
    return order, n_live


def _gather_slots(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """t (B, heads, S, D) -> (B, heads, L, D): the slots `order` (B, L) of each row."""
    return t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))


def _pad_slots(t: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, length - t.shape[2]))


def _pad_kpos(kpos: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(kpos, (0, length - kpos.shape[1]), value=DEAD)


def _worth_compacting(kpos: torch.Tensor) -> bool:
    """Compact when dead slots make up a quarter of the longest row (and more than a few)."""
    if not kpos.numel():
        return False
    longest = int((kpos != DEAD).sum(1).max())
    return kpos.shape[1] - longest > max(32, longest // 4)


def _map_target_cache(cache, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.dim() == 4:
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)


def _map_draft_cache(cache: KVCache, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply fn to the committed part of every layer (the buffer then holds just that)."""
    for i, k in enumerate(cache.k):
        if k is not None:
            cache.k[i] = fn(k[:, :, : cache.length])
            cache.v[i] = fn(cache.v[i][:, :, : cache.length])


# -- proposers ----------------------------------------------------------------------------------


class BatchProposer:
    """Drafts for every running row in one call. Rows are in batch order; the decoder says when rows
    join (with their prompt features) and which rows stay when others leave.

    - `join(rows, features)`: rows appended to the batch after their prefill; features[i] (len, n*H)
      are the target features of rows[i]'s prompt (None when `feature_layers` is None);
    - `propose(rows, ks)`: per row b, up to ks[b] drafted tokens (a 1D tensor) and their proposal
      probabilities (1, len, V), or None for a one-hot (greedy) proposal;
    - `accept(features, n)`: after the verify, row b committed n[b] tokens; features (B, T, n*H) are
      those of the verify block, the first n[b] belong to the committed tokens;
    - `keep(index)`: only these rows (indices into the batch, in order) remain.
    """

    feature_layers: list[int] | None = None
    block_size = 16

    def join(self, rows: list[Row], features: list[torch.Tensor] | None) -> None:
        pass

    def propose(self, rows: list[Row], ks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        raise NotImplementedError

    def accept(self, features: torch.Tensor | None, n: list[int]) -> None:
        pass

    def keep(self, index: list[int]) -> None:
        pass


class PerRowProposer(BatchProposer):
    """Batch form of a stateless single-row proposer (`NgramProposer`, test oracles): asks it row by row."""

    def __init__(self, proposer: Proposer):
        self.proposer, self.block_size = proposer, proposer.block_size

    def propose(self, rows, ks):
        out = []
        for row, k in zip(rows, ks, strict=True):
            tokens = torch.tensor([row.prompt + row.tokens])
            d, q = (
                self.proposer.propose(tokens, k, row.sampling, row.generator) if k else (tokens[:, :0], None)
            )
            out.append((d[0], q))
        return out


class BatchDFlashProposer(BatchProposer):
    """DFlash for a batch: one draft forward drafts every row's block.

    Each row's new context (prompt features after its prefill, then the committed tokens of each
    verify) waits in `pending` until the next draft call writes it into the draft's context cache,
    padded to the longest row with dead slots. Blocks are as long as the longest row's; a row's
    extra block slots are dead for it, so its drafts are the ones `DFlashProposer` would make.
    """

    def __init__(self, draft: DFlashDraft, target: Target, proposal: str = "draft"):
        if proposal not in ("draft", "greedy"):
            raise ValueError(f"proposal must be 'draft' or 'greedy', got {proposal!r}")
        draft.check_target(target)
        if "sliding_attention" in draft.config.layer_types:
            raise ValueError(
                "batched decoding does not support drafts with sliding-window layers yet: "
                "use decode.generate (batch 1) with this draft"
            )
        self.feature_layers = list(draft.config.target_layer_ids)
        self.draft, self.target, self.proposal = draft, target, proposal
        self.block_size = draft.config.block_size
        self.mask_id = draft.config.mask_token_id
        self.embed_scale = float(draft.config.extra.get("input_embedding_scale", 1.0))
        self.cache = draft.new_cache()
        self.kpos = torch.empty(0, 0, dtype=torch.long, device=target.device)
        self.pending: list[tuple[int, torch.Tensor]] = []  # per row: (first position, features)
        self.compactions = 0

    def join(self, rows, features):
        n, length = len(rows), self.cache.length
        _map_draft_cache(self.cache, lambda t: torch.cat([t, t.new_zeros(n, *t.shape[1:])]))
        self.kpos = torch.cat([self.kpos, self.kpos.new_full((n, length), DEAD)])
        self.pending += [(0, f) for f in features]

    def keep(self, index):
        idx = torch.tensor(index, dtype=torch.long, device=self.kpos.device)
        _map_draft_cache(self.cache, lambda t: t[idx])
        self.kpos = self.kpos[idx]
        self.pending = [self.pending[i] for i in index]

    def accept(self, features, n):
        self.pending = [
            (start, torch.cat([f, features[b, : n[b]]])) for b, (start, f) in enumerate(self.pending)
        ]

    def propose(self, rows, ks):
        device, n_rows, k_max = self.kpos.device, len(rows), max(ks)
        if _worth_compacting(self.kpos):
            order, n_live = _live_order(self.kpos)
            _map_draft_cache(self.cache, lambda t: _gather_slots(t, order))
            self.kpos, self.cache.length = self.kpos.gather(1, order), n_live
            self.compactions += 1
        # New context, padded to the longest row; its positions continue where each row's cache ends.
        c_len = max(f.shape[0] for _, f in self.pending)
        ctx = self.pending[0][1].new_zeros(n_rows, c_len, self.pending[0][1].shape[1])
        lens = torch.tensor([f.shape[0] for _, f in self.pending], device=device)
        for b, (_, f) in enumerate(self.pending):
            ctx[b, : f.shape[0]] = f
        steps = torch.arange(c_len, device=device)
        ctx_pos = torch.tensor([s for s, _ in self.pending], device=device)[:, None] + steps
        ctx_kpos = torch.where(steps < lens[:, None], ctx_pos, DEAD)
        # Block [anchor, MASK...] of the longest row's length; slots past a row's own k are dead for it.
        anchors = torch.tensor([r.anchor for r in rows], device=device)
        steps = torch.arange(k_max + 1, device=device)
        blk_pos = anchors[:, None] + steps
        blk_kpos = torch.where(steps <= torch.tensor(ks, device=device)[:, None], blk_pos, DEAD)
        block = torch.full((n_rows, k_max + 1), self.mask_id, dtype=torch.long, device=device)
        block[:, 0] = torch.tensor([r.tokens[-1] for r in rows], device=device)
        embeds = self.target.embed(block).to(self.draft.fc.weight.dtype)
        if self.embed_scale != 1.0:
            embeds = embeds * self.embed_scale
        kpos = torch.cat([self.kpos, ctx_kpos, blk_kpos], 1)
        mask = (kpos != DEAD)[:, None, None, :]  # inference attends everywhere it may
        hidden = self.draft(embeds, blk_pos, ctx, ctx_pos, cache=self.cache, mask=mask)
        self.kpos = kpos[:, : self.cache.length]
        self.pending = [(r.anchor, ctx.new_zeros(0, ctx.shape[2])) for r in rows]  # next: committed tokens
        logits = self.draft.propose_logits(hidden[:, 1:].to(self.target.dtype), self.target.lm_head)
        greedy = logits.argmax(-1)
        out = []
        for b, (row, k) in enumerate(zip(rows, ks, strict=True)):
            if row.sampling.greedy or self.proposal == "greedy" or k == 0:
                out.append((greedy[b, :k], None))
            else:
                q = probs(logits[b : b + 1, :k], row.sampling)
                out.append((sample(q, row.generator)[0], q))
        return out


# -- the decoder --------------------------------------------------------------------------------


class BatchDecoder:
    """Continuous batching at step granularity: rows join (prefill) and leave (finish/cancel) between steps.

    `step()` first drops cancelled rows, then runs one draft + verify step for the rows already
    running (rows that finish leave the batch and its caches at once), then admits waiting rows up to
    `max_batch_size` with one batched prefill, which emits their first token. A `draft` makes it
    DFlash; without one (or with block_size 1) it is plain batched decoding through the same code.
    `proposer` replaces the draft with any `BatchProposer` (n-gram lookup, test oracles).
    Not thread-safe except for `add` and `cancel`, which may be called while `step` runs.
    """

    def __init__(
        self,
        target: Target,
        draft: DFlashDraft | None = None,
        block_size: int | None = None,
        max_batch_size: int = 8,
        proposal: str = "draft",
        proposer: BatchProposer | None = None,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if proposal not in ("draft", "greedy"):
            raise ValueError(f"proposal must be 'draft' or 'greedy', got {proposal!r}")
        if draft is not None and proposer is not None:
            raise ValueError("pass a draft or a proposer, not both")
        if draft is not None:
            proposer = BatchDFlashProposer(draft, target, proposal)
        self.block_size = block_size if block_size is not None else (proposer.block_size if proposer else 1)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 (1 = plain decoding), got {self.block_size}")
        self.target, self.proposer, self.max_batch_size = target, proposer, max_batch_size
        self.features = proposer is not None and proposer.feature_layers is not None
        self.rows: list[Row] = []  # running, in batch order
        self.waiting: list[Row] = []
        self.cancelled: set[str] = set()
        self.active: dict[str, Row] = {}  # running or waiting, by request id
        self.lock = threading.Lock()
        self.cache = None
        self.kpos = torch.empty(0, 0, dtype=torch.long, device=target.device)  # (B, S) slot positions
        self.stats = {
            "verify_steps": 0,  # per-row verify forwards
            "committed": 0,  # tokens committed by verify steps
            "tau": float("nan"),  # committed / verify_steps
            "forwards": 0,  # batched verify forwards
            "prefills": 0,  # batched prefill forwards
            "compactions": 0,
        }

    def add(self, request_id: str, prompt_ids: Sequence[int], config: GenerationConfig) -> None:
        """Validate now (ValueError naming the problem); the row joins at the next `step()`."""
        if not isinstance(config, GenerationConfig):
            raise ValueError(f"config must be a GenerationConfig, got {type(config).__name__}")
        if not isinstance(config.sampling, SamplingConfig):
            raise ValueError(
                f"config.sampling must be a SamplingConfig, got {type(config.sampling).__name__}"
            )
        block = config.block_size if config.block_size is not None else self.block_size
        prompt = prompt_tensor(prompt_ids)
        _check_prompt(prompt, self.target, config, block)
        gen = None
        if config.seed is not None:
            gen = torch.Generator(device=self.target.device).manual_seed(config.seed)
        row = Row(request_id, prompt[0].tolist(), config, block, gen)
        with self.lock:
            if request_id in self.active:
                raise ValueError(f"request id {request_id!r} is already in the batch: use a unique id")
            self.active[request_id] = row
            self.waiting.append(row)

    def cancel(self, request_id: str) -> None:
        """Free the request's slot at the next step, which reports it as finished="cancelled".
        Unknown or already finished ids are ignored (a client may disconnect after its last token)."""
        with self.lock:
            if request_id in self.active:
                self.cancelled.add(request_id)

    def pending(self) -> int:
        """Rows running plus rows waiting to join."""
        with self.lock:
            return len(self.active)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        with self.lock:
            cancelled, self.cancelled = self.cancelled, set()
            self.waiting = [r for r in self.waiting if r.request_id not in cancelled]
        out = [StepOutput(i, [], "cancelled", None) for i in sorted(cancelled)]
        if self.features:
            self.target.select_layers(self.proposer.feature_layers)
        if cancelled & {r.request_id for r in self.rows}:
            self._keep([b for b, r in enumerate(self.rows) if r.request_id not in cancelled])
        if self.rows:
            out += self._verify_step()
        with self.lock:
            n_new = max(0, self.max_batch_size - len(self.rows))
            joining, self.waiting = self.waiting[:n_new], self.waiting[n_new:]
        if joining:
            out += self._prefill(joining)
        with self.lock:
            for o in out:
                if o.finished:
                    self.active.pop(o.request_id).finished = o.finished
                    self.cancelled.discard(o.request_id)  # a cancel that came in while it finished
        return out

    # -- one draft + verify step for every running row --------------------------------------------

    def _verify_step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        rows, device = self.rows, self.target.device
        ks = [min(r.block_size - 1, r.room) if self.proposer else 0 for r in rows]
        proposals = self.proposer.propose(rows, ks) if max(ks) else [(None, None)] * len(rows)
        ks = [0 if d is None else len(d) for d, _ in proposals]
        k_max = max(ks)
        drafts = torch.zeros(len(rows), k_max, dtype=torch.long, device=device)
        for b, (d, _) in enumerate(proposals):
            if ks[b]:
                drafts[b, : ks[b]] = d.to(device)
        t1 = time.perf_counter()
        anchors = torch.tensor([r.anchor for r in rows], device=device)
        block = torch.cat([torch.tensor([r.tokens[-1] for r in rows], device=device)[:, None], drafts], 1)
        steps = torch.arange(k_max + 1, device=device)
        q_pos = anchors[:, None] + steps
        new_kpos = torch.where(steps <= torch.tensor(ks, device=device)[:, None], q_pos, DEAD)
        kpos = torch.cat([self.kpos, new_kpos], 1)
        logits, feats = self.target.forward(
            block,
            q_pos,
            self.cache,
            features=self.features,
            attention_mask=self.target.attention_mask(q_pos, kpos),
        )
        t2 = time.perf_counter()
        # Greedy rows all at once: one argmax and one host transfer per step, not a few per row.
        choice = logits.argmax(-1)  # (B, k_max + 1)
        real = steps[:k_max] < torch.tensor(ks, device=device)[:, None]
        accepted = ((drafts == choice[:, :k_max]) & real).cumprod(-1).sum(-1)
        choice_l, accepted_l, drafts_l = choice.tolist(), accepted.tolist(), drafts.tolist()
        out, n = [], []
        for b, (row, k) in enumerate(zip(rows, ks, strict=True)):
            if row.sampling.greedy:
                a, bonus = accepted_l[b], choice_l[b][accepted_l[b]]
            else:
                p = probs(logits[b : b + 1, : k + 1], row.sampling)
                a, bonus = verify_sampling(drafts[b : b + 1, :k], p, proposals[b][1], row.generator)
            new = row.commit(drafts_l[b][:a] + [int(bonus)])
            row.lengths.append(len(new))
            n.append(len(new))
            out.append(StepOutput(row.request_id, new, row.finished, len(new)))
        # The cache keeps each row's anchor and accepted drafts (its first n slots of the block);
        # slots that no row kept are cut off right away.
        kept = torch.where(steps < torch.tensor(n, device=device)[:, None], new_kpos, DEAD)
        self.kpos = torch.cat([self.kpos, kept[:, : max(n)]], 1)
        self.target.crop(self.cache, self.kpos.shape[1])
        if self.proposer is not None:
            self.proposer.accept(feats, n)
        self.stats["forwards"] += 1
        self.stats["verify_steps"] += len(rows)
        self.stats["committed"] += sum(n)
        self.stats["tau"] = self.stats["committed"] / self.stats["verify_steps"]
        now = time.perf_counter()
        for row in rows:
            row.draft_s.append(t1 - t0)
            row.verify_s.append(t2 - t1)
            row.step_s.append(now - t0)
            row.ended = now
        self._keep([b for b, r in enumerate(rows) if r.finished is None])
        return out

    # -- rows join and leave ------------------------------------------------------------------------

    def _keep(self, index: list[int]) -> None:
        """Only these rows stay in the batch and its caches; compact when dead slots pile up."""
        if len(index) < len(self.rows):
            idx = torch.tensor(index, dtype=torch.long, device=self.kpos.device)
            self.rows = [self.rows[i] for i in index]
            self.kpos = self.kpos[idx]
            _map_target_cache(self.cache, lambda t: t[idx])
            if self.proposer is not None:
                self.proposer.keep(index)
        if _worth_compacting(self.kpos):
            order, n_live = _live_order(self.kpos)
            _map_target_cache(self.cache, lambda t: _gather_slots(t, order))
            self.kpos = self.kpos.gather(1, order)
            self.stats["compactions"] += 1
        if not self.rows:
            self.cache, self.kpos = None, self.kpos[:0, :0]

    def _prefill(self, rows: list[Row]) -> list[StepOutput]:
        """One forward over the newcomers' prompts (left-padded, so the last logits are every row's
        last token) on a cache of their own, then merged into the batch's cache."""
        t0 = time.perf_counter()
        device = self.target.device
        lens = torch.tensor([len(r.prompt) for r in rows], device=device)
        p_len = int(lens.max())
        ids = torch.zeros(len(rows), p_len, dtype=torch.long, device=device)
        for b, r in enumerate(rows):
            ids[b, p_len - len(r.prompt) :] = torch.tensor(r.prompt, device=device)
        pos = torch.arange(p_len, device=device) - (p_len - lens)[:, None]  # padding: negative positions
        kpos = torch.where(pos >= 0, pos, DEAD)
        cache = self.target.new_cache(sliding=False)
        logits, feats = self.target.forward(
            ids,
            pos.clamp_min(0),
            cache,
            logits_to_keep=1,
            features=self.features,
            attention_mask=self.target.attention_mask(pos.clamp_min(0), kpos),
        )
        out = []
        for b, r in enumerate(rows):
            first = int(next_token(logits[b, -1], r.sampling, r.generator))
            out.append(StepOutput(r.request_id, r.commit([first]), r.finished, None))
        now = time.perf_counter()
        for r in rows:
            r.prefill_s, r.started, r.ended = now - t0, now, now
        self.stats["prefills"] += 1
        stay = [b for b, r in enumerate(rows) if r.finished is None]
        if not stay:
            return out
        idx = torch.tensor(stay, dtype=torch.long, device=device)
        kpos = kpos[idx]
        _map_target_cache(cache, lambda t: t[idx])
        if self.cache is None:
            self.cache, self.kpos = cache, kpos
        else:
            length = max(self.kpos.shape[1], p_len)
            for mine, new in zip(self.cache.layers, cache.layers, strict=True):
                mine.keys = torch.cat([_pad_slots(mine.keys, length), _pad_slots(new.keys, length)])
                mine.values = torch.cat([_pad_slots(mine.values, length), _pad_slots(new.values, length)])
            self.kpos = torch.cat([_pad_kpos(self.kpos, length), _pad_kpos(kpos, length)])
        joined = [rows[b] for b in stay]
        self.rows += joined
        if self.proposer is not None:
            self.proposer.join(
                joined, [feats[b, p_len - len(rows[b].prompt) :] for b in stay] if self.features else None
            )
        return out


def generate_batch(
    target: Target,
    prompts: list[Sequence[int]],
    draft: DFlashDraft | None = None,
    config: GenerationConfig | Sequence[GenerationConfig] | None = None,
    block_size: int | None = None,
    max_batch_size: int | None = None,
    proposer: BatchProposer | None = None,
    proposal: str = "draft",
) -> list[GenerationResult]:
    """All prompts through one BatchDecoder (by default all at once); results in prompt order.
    `config` is one config for every prompt or one per prompt."""
    configs = (
        [config or GenerationConfig()] * len(prompts) if not isinstance(config, Sequence) else list(config)
    )
    if len(configs) != len(prompts):
        raise ValueError(
            f"got {len(configs)} configs for {len(prompts)} prompts: pass one, or one per prompt"
        )
    dec = BatchDecoder(target, draft, block_size, max_batch_size or max(1, len(prompts)), proposal, proposer)
    rows = {}
    for i, (prompt, cfg) in enumerate(zip(prompts, configs, strict=True)):
        dec.add(str(i), prompt, cfg)
        rows[str(i)] = dec.waiting[-1]
    while dec.pending():
        dec.step()
    return [rows[str(i)].result() for i in range(len(prompts))]
