"""The decode engine: lossless speculative decoding for one request or many, with continuous batching.

One `step()` drives everything. It drafts up to B-1 tokens after every running row's anchor (its last
committed token), verifies all rows' [anchor, drafts] blocks in one causal target forward, commits
each row's accepted prefix plus the target's own next token, and crops the caches back to what was
committed. Rows (requests, `flashdraft.engine.sequence.Row`) join between steps with a prefill and leave when
they stop, reach their length or are cancelled. With no proposer, or B = 1, every step verifies the
anchor alone: plain decoding, through the same code. `decode.generate` is this engine at batch 1.

The target's cache, its slots and masks belong to the target's batch state (`flashdraft.models.batch`,
`BatchState`): the engine prefills, verifies, commits and keeps rows through it and never touches a
cache. So the whole step reads:

    proposals = proposer.propose(rows, ks)               # chains or trees after each row's anchor
    logits, feats = batch.verify(block, anchors, ks, trees)
    paths, bonus = verify_trees / verify_block(logits)   # the target's own tokens, exactly
    rows commit their accepted drafts and the bonus
    feats = batch.commit(n, paths, feats)                # the accepted path's slots kept, the rest cut
    proposer.accept(feats, n)
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
from flashdraft.models.batch import BatchState, TargetBatch
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
        self.batch: BatchState = TargetBatch(target, self.feature_layers)  # their cache, slots and masks
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
        drafts_l = drafts.tolist() if k_max else [[] for _ in rows]
        if any(t is not None for t in trees):  # every row a tree (a chain is one)
            trees = [t or tree.Tree.chain(drafts_l[b][: ks[b]]) for b, t in enumerate(trees)]
        else:
            trees = None
        block = torch.tensor([[r.tokens[-1]] for r in rows], device=device)  # the anchors
        if k_max:
            block = torch.cat([block, drafts], 1)
        logits, feats = self.batch.verify(block, [r.anchor for r in rows], ks, trees)
        t2 = time.perf_counter()
        if trees is not None:
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
        # Each row keeps its anchor and accepted drafts (a tree's path moved to the block's front).
        feats = self.batch.commit(n, paths if trees is not None else None, feats)
        if self.proposer is not None:
            self.proposer.accept(feats, n)
            if proposed:
                tokens = (
                    sum(ks) + len(rows) if self.batch.ragged else block.numel()
                )  # what the verify computed
                self.proposer.observe(rows, ks, n, t1 - t0, t2 - t1, tokens)
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
        """Only these rows stay in the batch and its caches, in the order `fill_holes` gives them."""
        if len(index) < len(self.rows):
            index = fill_holes(index)
            self.rows = [self.rows[i] for i in index]
            if self.proposer is not None:
                self.proposer.keep(index)
        self.stats["compactions"] += self.batch.keep(index)

    def _prefill(self, rows: list[Row]) -> list[StepOutput]:
        """One forward over the newcomers' prompts on a batch of their own, then joined to the running
        batch (the rows that did not finish at their first token)."""
        t0 = time.perf_counter()
        logits, feats, joining = self.batch.prefill([r.prompt for r in rows])
        if self.proposer is not None:
            self.proposer.timed(len(rows) * max(len(r.prompt) for r in rows), time.perf_counter() - t0)
        out = []
        for b, r in enumerate(rows):
            first = int(next_token(logits[b], r.sampling, r.generator))
            out.append(StepOutput(r.request_id, r.commit([first]), r.finished, None))
        now = time.perf_counter()
        for r in rows:
            r.prefill_s, r.started, r.ended = now - t0, now, now
        self.stats["prefills"] += 1
        stay = [b for b, r in enumerate(rows) if r.finished is None]
        self.batch.join(joining, stay)
        joined = [rows[b] for b in stay]
        self.rows += joined
        if self.proposer is not None and joined:
            self.proposer.join(joined, [feats[b] for b in stay] if self.feature_layers else None)
        return out


def fill_holes(index: list[int]) -> list[int]:
    """The rows `index` (ascending) that stay, in the order that moves the fewest: each stays in its
    place, except those past the new end, which take the places of rows that left. A cache moves a row's
    slots only where its place changes: in order, one row leaving at the top of a 64-row batch moved the
    63 below it (datagen: 6% of its time). No row's numbers depend on its place in the batch."""
    movers = iter(b for b in index if b >= len(index))
    staying = set(index)
    return [b if b in staying else next(movers) for b in range(len(index))]
