"""The decode engine: lossless speculative decoding for one request or many, with continuous batching.

One `step()` drives everything. It drafts up to B-1 tokens after every running row's anchor (its last
committed token), verifies all rows' [anchor, drafts] blocks in one causal target forward, commits
each row's accepted prefix plus the target's own next token, and crops the caches back to what was
committed. Rows (requests, `flashdraft.engine.sequence.Row`) join between steps with a prefill and leave when
they stop, reach their length or are cancelled. With no proposer, or B = 1, every step verifies the
anchor alone: plain decoding, through the same code. `decode.generate` is this engine at batch 1.

Rows of different lengths share one cache through per-slot positions (`flashdraft.engine.slots`): then every
forward needs an explicit attention mask. While the rows are aligned (every row's slot i holds its
position i, always so at batch 1) the engine keeps no slot positions, passes no mask and pays nothing
for batching; the positions are materialised the first time the rows stop being aligned.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashdraft.engine import tree
from flashdraft.engine.proposers import Proposer
from flashdraft.engine.sampling import SamplingConfig, next_token, verify_block, verify_trees
from flashdraft.engine.scheduler import Scheduler, prefill_groups
from flashdraft.engine.sequence import GenerationConfig, Row, check_prompt, prompt_tensor
from flashdraft.engine.slots import (
    DEAD,
    gather_slots,
    live_order,
    map_target_cache,
    pad_kpos,
    pad_slots,
    path_order,
    reorder_slots,
    worth_compacting,
)
from flashdraft.models.target import Target


@dataclass
class StepOutput:
    request_id: str
    tokens: list[int]  # tokens committed for this request in this step (may be empty)
    finished: str | None  # None, "stop", "length" or "cancelled"
    accepted: int | None  # tokens committed by this row's verify (its acceptance length); None for a prefill


class Engine:
    """Continuous batching at step granularity: rows join (prefill) and leave (finish/cancel) between steps.

    `step()` first drops cancelled rows, then runs one draft + verify step for the rows already
    running (rows that finish leave the batch and its caches at once), then admits waiting rows up to
    `max_batch_size` with one batched prefill, which emits their first token. The engine knows drafts
    only through the `Proposer` interface (`DFlashProposer(draft, target)`, n-gram lookup, adaptive
    speculation, test oracles); without one (or with block_size 1) it is plain decoding through the
    same code. The engine resets the proposer, so a proposer serves one engine at a time.
    Not thread-safe except for `add` and `cancel`, which may be called while `step` runs.
    """

    def __init__(
        self,
        target: Target,
        proposer: Proposer | None = None,
        block_size: int | None = None,
        max_batch_size: int = 8,
    ):
        self.scheduler = Scheduler(max_batch_size)
        if proposer is not None:
            proposer.reset()
        self.block_size = block_size if block_size is not None else (proposer.block_size if proposer else 1)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 (1 = plain decoding), got {self.block_size}")
        self.target, self.proposer = target, proposer
        self.feature_layers = proposer.feature_layers if proposer is not None else None
        self.rows: list[Row] = []  # running, in batch order
        self.cache = None
        self.length = 0  # slots in the cache
        self.kpos: torch.Tensor | None = None  # (B, length) slot positions; None while the rows are aligned
        self.stats = {
            "verify_steps": 0,  # per-row verify forwards
            "committed": 0,  # tokens committed by verify steps
            "tau": float("nan"),  # committed / verify_steps
            "forwards": 0,  # batched verify forwards
            "prefills": 0,  # batched prefill forwards
            "compactions": 0,
            # speculative decoding, as vLLM counts it: row-steps that verified drafted tokens, those tokens,
            # the ones accepted, and per block position how often it was accepted
            "drafts": 0,
            "draft_tokens": 0,
            "accepted_tokens": 0,
            "accepted_per_position": [],
        }

    def add(self, request_id: str, prompt_ids: Sequence[int], config: GenerationConfig) -> Row:
        """Validate now (ValueError naming the problem); the row joins at the next `step()`."""
        if not isinstance(config, GenerationConfig):
            raise ValueError(f"config must be a GenerationConfig, got {type(config).__name__}")
        if not isinstance(config.sampling, SamplingConfig):
            raise ValueError(
                f"config.sampling must be a SamplingConfig, got {type(config.sampling).__name__}"
            )
        block = config.block_size if config.block_size is not None else self.block_size
        prompt = prompt_tensor(prompt_ids)
        check_prompt(prompt, self.target, config, block)
        gen = None
        if config.seed is not None:
            gen = torch.Generator(device=self.target.device).manual_seed(config.seed)
        row = Row(request_id, prompt[0].tolist(), config, block, gen)
        self.scheduler.add(row)
        return row

    def cancel(self, request_id: str) -> None:
        """Free the request's slot at the next step, which reports it as finished="cancelled".
        Unknown or already finished ids are ignored (a client may disconnect after its last token)."""
        self.scheduler.cancel(request_id)

    @property
    def max_batch_size(self) -> int:
        return self.scheduler.max_batch_size

    def slot_positions(self) -> torch.Tensor:
        """(B, S): the position every slot of the cache holds for its row (DEAD: nothing)."""
        if self.kpos is not None:
            return self.kpos
        return torch.arange(self.length, device=self.target.device).expand(len(self.rows), -1)

    def pending(self) -> int:
        """Rows running plus rows waiting to join."""
        return self.scheduler.pending()

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        cancelled = self.scheduler.take_cancelled()
        out = [StepOutput(i, [], "cancelled", None) for i in sorted(cancelled)]
        if cancelled & {r.request_id for r in self.rows}:
            self._keep([b for b, r in enumerate(self.rows) if r.request_id not in cancelled])
        if self.rows:
            out += self._verify_step()
        joining = self.scheduler.admit(len(self.rows))
        for group in prefill_groups(joining):
            out += self._prefill(group)
        self.scheduler.finish({o.request_id: o.finished for o in out if o.finished})
        return out

    # -- one draft + verify step for every running row --------------------------------------------

    def _verify_step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        rows, device = self.rows, self.target.device
        ks = [min(r.block_size - 1, r.room) if self.proposer else 0 for r in rows]
        proposed = max(ks) > 0
        proposals = self.proposer.propose(rows, ks) if proposed else [(None, None)] * len(rows)
        ks = [0 if p[0] is None else len(p[0]) for p in proposals]
        trees = [p[2] if len(p) > 2 else None for p in proposals]
        k_max = max(ks)
        drafts = torch.zeros(len(rows), k_max, dtype=torch.long, device=device)
        for b, p in enumerate(proposals):
            if ks[b]:
                drafts[b, : ks[b]] = p[0].to(device)
        t1 = time.perf_counter()
        drafts_l = drafts.tolist()
        steps = torch.arange(k_max + 1, device=device)
        anchors = torch.tensor([r.anchor for r in rows], device=device)[:, None]
        tree_step = any(t is not None for t in trees)
        if tree_step:  # every row a tree (a chain is one), so its nodes sit at anchor + depth
            trees = [t or tree.Tree.chain(drafts_l[b][: ks[b]]) for b, t in enumerate(trees)]
            depth = [[0, *t.depths(), *[0] * (k_max - len(t))] for t in trees]
            q_pos = anchors + torch.tensor(depth, device=device)
        if self.kpos is None and len(set(ks)) == 1 and not tree_step:
            # aligned: every row's block sits at the same positions, right after the cache
            q_pos = (steps + self.length).expand(len(rows), -1)
            new_kpos, mask = q_pos, None
        else:
            q_pos = q_pos if tree_step else anchors + steps
            new_kpos = torch.where(steps <= torch.tensor(ks, device=device)[:, None], q_pos, DEAD)
            mask = self.target.attention_mask(q_pos, torch.cat([self.slot_positions(), new_kpos], 1))
            if tree_step:
                mask = tree.restrict(mask, tree.ancestors(trees, k_max + 1, device))
        block = torch.cat([torch.tensor([r.tokens[-1] for r in rows], device=device)[:, None], drafts], 1)
        logits, feats = self.target.forward(
            block, q_pos, self.cache, features=self.feature_layers, attention_mask=mask
        )
        t2 = time.perf_counter()
        if tree_step:
            paths, bonus = verify_trees(
                logits, trees, [r.sampling for r in rows], [r.generator for r in rows]
            )
        else:
            accepted, bonus = verify_block(
                logits,
                drafts,
                ks,
                [r.sampling for r in rows],
                [p[1] for p in proposals],
                [r.generator for r in rows],
            )
            paths = [list(range(a)) for a in accepted]
        out, n = [], []
        for b, (row, k, path) in enumerate(zip(rows, ks, paths, strict=True)):
            self._count_drafts(k, len(path))
            new = row.commit([drafts_l[b][i] for i in path] + [bonus[b]])
            row.lengths.append(len(new))
            n.append(len(new))
            out.append(StepOutput(row.request_id, new, row.finished, len(new)))
        # Each row's accepted path to the front of its block: from there on, as if a chain was verified.
        order = path_order(paths, device) if tree_step else None
        if order is not None:
            reorder_slots(self.cache, self.length, order)
            if feats is not None:
                feats = feats.gather(1, order[:, :, None].expand(-1, -1, feats.shape[2]))
        if tree_step:
            new_kpos = anchors + steps  # slots past a row's n are cut below
        # The cache keeps each row's anchor and accepted drafts (its first n slots of the block);
        # slots that no row kept are cut off right away.
        if self.kpos is None and len(set(n)) == 1:  # every row kept its first n slots: still aligned
            self.length += n[0]
        else:
            kept = torch.where(steps < torch.tensor(n, device=device)[:, None], new_kpos, DEAD)
            self.kpos = torch.cat([self.slot_positions(), kept[:, : max(n)]], 1)
            self.length = self.kpos.shape[1]
        self.target.crop(self.cache, self.length)
        if self.proposer is not None:
            self.proposer.accept(feats, n)
            if proposed:
                self.proposer.observe(rows, ks, n, t1 - t0, t2 - t1, block.numel())
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

    def _count_drafts(self, k: int, accepted: int) -> None:
        if not k:
            return
        st = self.stats
        st["drafts"] += 1
        st["draft_tokens"] += k
        st["accepted_tokens"] += accepted
        per = st["accepted_per_position"]
        per.extend([0] * (accepted - len(per)))
        for i in range(accepted):
            per[i] += 1

    # -- rows join and leave ------------------------------------------------------------------------

    def _keep(self, index: list[int]) -> None:
        """Only these rows stay in the batch and its caches; compact when dead slots pile up."""
        if not index:  # the batch is empty: the next row starts on a fresh cache, aligned
            self.rows, self.cache, self.kpos, self.length = [], None, None, 0
            if self.proposer is not None:
                self.proposer.keep([])
            return
        if len(index) < len(self.rows):
            idx = torch.tensor(index, dtype=torch.long, device=self.target.device)
            self.rows = [self.rows[i] for i in index]
            if self.kpos is not None:
                self.kpos = self.kpos[idx]
            map_target_cache(self.cache, lambda t: t[idx])
            if self.proposer is not None:
                self.proposer.keep(index)
        if self.kpos is not None and worth_compacting(self.kpos):
            order, n_live = live_order(self.kpos)
            map_target_cache(self.cache, lambda t: gather_slots(t, order))
            self.kpos = self.kpos.gather(1, order)
            self.length = n_live
            self.stats["compactions"] += 1

    def _prefill(self, rows: list[Row]) -> list[StepOutput]:
        """One forward over the newcomers' prompts (left-padded, so the last logits are every row's
        last token) on a cache of their own, then merged into the batch's cache."""
        t0 = time.perf_counter()
        device = self.target.device
        lens = torch.tensor([len(r.prompt) for r in rows], device=device)
        p_len = int(lens.max())
        same = len({len(r.prompt) for r in rows}) == 1
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
            features=self.feature_layers,
            attention_mask=None if same else self.target.attention_mask(pos.clamp_min(0), kpos),
        )
        if self.proposer is not None:
            self.proposer.timed(ids.numel(), time.perf_counter() - t0)
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
        if len(stay) < len(rows):
            idx = torch.tensor(stay, dtype=torch.long, device=device)
            kpos = kpos[idx]
            map_target_cache(cache, lambda t: t[idx])
        if self.cache is None:
            self.cache, self.kpos, self.length = cache, None if same else kpos, p_len
        else:
            length = max(self.length, p_len)
            for mine, new in zip(self.cache.layers, cache.layers, strict=True):
                mine.keys = torch.cat([pad_slots(mine.keys, length), pad_slots(new.keys, length)])
                mine.values = torch.cat([pad_slots(mine.values, length), pad_slots(new.values, length)])
            self.kpos = torch.cat([pad_kpos(self.slot_positions(), length), pad_kpos(kpos, length)])
            self.length = length
        joined = [rows[b] for b in stay]
        self.rows += joined
        if self.proposer is not None:
            self.proposer.join(
                joined,
                [feats[b, p_len - len(rows[b].prompt) :] for b in stay] if self.feature_layers else None,
            )
        return out
