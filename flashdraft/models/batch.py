"""A target's batch state: the KV cache of every running row, the position each of its slots holds, and
the few operations decoding needs on both (`BatchState`). The engine holds one and knows nothing of
caches, slots or masks; the DFlash proposer keeps its draft's context cache with the same `Slots`.

Rows of different lengths share one cache: a forward writes every row's new tokens at the same slot
indices. Next to the cache, `Slots` keeps the absolute position every slot holds for its row; a slot
that holds nothing for it (prompt padding, a rejected draft token, a row that joined later) gets the
position DEAD, so a mask is one comparison of positions (`flashdraft.models.masks`) and slot order never
matters. While the rows are aligned (every row's slot i holds its position i, always so at batch 1) no
positions are kept, no mask is built and batching costs nothing; positions are materialised the first
time the rows stop being aligned, and compaction gathers each row's live slots to the front when dead
slots pile up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from flashdraft.models import masks
from flashdraft.models.masks import DEAD


class BatchState(Protocol):
    """What the engine asks of a target's batch (`TargetBatch` implements it for every target)."""

    rows: int  # rows running, in batch order
    ragged: bool  # a verify computes each row's own 1 + ks[b] tokens only: its cost follows their sum

    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor] | None, BatchState]:
        """New rows' prompts in one forward: their last logits (n, V), each row's prompt features (or
        None) and the newcomers' own batch, to `join` once the caller knows which of them stay."""

    def join(self, other: BatchState, index: list[int]) -> None:
        """`other`'s rows `index` join below this batch's (the others finished at their first token)."""

    def verify(
        self, block: torch.Tensor, anchors: list[int], ks: list[int], trees: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over every row's [anchor, drafts] block (B, W): row b's first 1 + ks[b] slots, at
        positions anchor.. (a chain) or anchor + depth (`trees`: `flashdraft.engine.tree.Tree`s, the
        drafts in node order). Logits (B, W, V) and features; past a row's 1 + ks[b] slots, not defined."""

    def commit(self, n: list[int], paths: list[list[int]] | None, feats: torch.Tensor | None):
        """After `verify`: row b keeps its anchor and its accepted drafts, n[b] slots; with trees, the
        accepted nodes `paths[b]` move to the block's front first (features with them, returned)."""

    def keep(self, index: list[int]) -> bool:
        """Only these rows stay (others leave); compacts when dead slots pile up (then True)."""


class Slots:
    """The position every slot of a cache of `length` slots holds for each of its `rows` rows. `kpos`
    (rows, length) is None while the rows are aligned (slot i holds position i for every row)."""

    def __init__(self, rows: int = 0, length: int = 0, kpos: torch.Tensor | None = None, device=None):
        self.rows, self.length, self.kpos, self.device = rows, length, kpos, device

    @property
    def aligned(self) -> bool:
        return self.kpos is None

    def positions(self) -> torch.Tensor:
        """(rows, length): the position every slot holds for its row (DEAD: nothing)."""
        if self.kpos is not None:
            return self.kpos
        return torch.arange(self.length, device=self.device).expand(self.rows, -1)

    def advance(self, n: Sequence[int], pos: torch.Tensor) -> None:
        """Every row b keeps the first n[b] of the new slots written at positions `pos` (rows, W)."""
        if self.kpos is None and len(set(n)) == 1:  # every row kept as many: still aligned
            self.length += n[0]
            return
        steps = torch.arange(pos.shape[1], device=pos.device)
        kept = torch.where(steps < torch.tensor(n, device=pos.device)[:, None], pos, DEAD)
        self.kpos = torch.cat([self.positions(), kept[:, : max(n)]], 1)
        self.length = self.kpos.shape[1]

    def keep(self, index: torch.Tensor) -> None:
        self.rows = len(index)
        if self.kpos is not None:
            self.kpos = self.kpos[index]

    def join(self, other: Slots) -> None:
        """`other`'s rows below these, both padded with dead slots to the longer."""
        length = max(self.length, other.length)
        self.kpos = torch.cat([_pad_kpos(self.positions(), length), _pad_kpos(other.positions(), length)])
        self.rows, self.length = self.rows + other.rows, length

    def compaction(self) -> torch.Tensor | None:
        """When dead slots make up a quarter of the longest row (and more than a few): the slot order
        (rows, L) that brings each row's live slots to the front, and the positions already so
        gathered (the caller gathers its caches by it); else None."""
        if self.kpos is None or not self.kpos.numel():
            return None
        dead = self.kpos == DEAD
        longest = int((~dead).sum(1).max())
        if self.kpos.shape[1] - longest <= max(32, longest // 4):
            return None
        order = torch.sort(dead.to(torch.uint8), dim=1, stable=True).indices[:, :longest]
        self.kpos, self.length = self.kpos.gather(1, order), longest
        return order


def _pad_kpos(kpos: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(kpos, (0, length - kpos.shape[1]), value=DEAD)


def gather_slots(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """t (B, heads, S, D) -> (B, heads, L, D): the slots `order` (B, L) of each row."""
    return t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))


def _map_cache(cache, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply fn to every layer's keys and values of a target cache (a transformers DynamicCache or the
    runner's KVCache, which takes the assignment into its buffers)."""
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.dim() == 4:
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)


def path_order(paths: list[list[int]], device=None) -> torch.Tensor | None:
    """(B, L) the slots of a verify block [anchor, nodes] that each row keeps, in order: its anchor and
    accepted nodes (`paths`), padded with the last; L = the longest. None when every path is already
    the front of its block (a chain's always is)."""
    if all(path == list(range(len(path))) for path in paths):
        return None
    width = 1 + max(len(path) for path in paths)
    order = [[0] + [i + 1 for i in path] for path in paths]
    return torch.tensor([o + o[-1:] * (width - len(o)) for o in order], dtype=torch.long, device=device)


def _reorder_block(cache, start: int, order: torch.Tensor) -> None:
    """In place, every row's slots start.. of a target cache take the slots start + order (B, L): in one
    call where the cache moves them itself (the runner's, `KVCache.reorder`), else a gather per layer."""
    reorder = getattr(cache, "reorder", None)
    if reorder is None or not reorder(start, order):
        _gather_block(cache, start, order)


def _gather_block(cache, start: int, order: torch.Tensor) -> None:
    """`_reorder_block` on any cache: a gather and a copy per layer and tensor."""
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None and t.dim() == 4:
                t[:, :, start : start + order.shape[1]] = gather_slots(t[:, :, start:], order)


class TargetBatch:
    """`BatchState` on a target (`flashdraft.models.target.Target` or the native runner's look-alike):
    its cache, the slots beside it, and forwards that read features of the `features` layers."""

    def __init__(self, target, features: Sequence[int] | None = None):
        self.target, self.features = target, features
        self.cache = None
        self.slots = Slots(device=target.device)
        self._block_pos: torch.Tensor | None = None  # (B, W) where the last verify's slots land
        self.ragged = getattr(target, "ragged", False)

    @property
    def rows(self) -> int:
        return self.slots.rows

    def prefill(self, prompts: list[list[int]]):
        """Left-padded, so the last logits are every row's last token; padding slots are dead. On a ragged
        target, prompts of different lengths are right-padded instead and only their own tokens computed
        (each query reading only the slots it sees, not a masked square over the padding)."""
        device = self.target.device
        lens = torch.tensor([len(p) for p in prompts], device=device)
        p_len = int(lens.max())
        same = len({len(p) for p in prompts}) == 1
        right = self.ragged and not same
        ids = torch.zeros(len(prompts), p_len, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            at = slice(0, len(p)) if right else slice(p_len - len(p), p_len)
            ids[b, at] = torch.tensor(p, device=device)
        if right:  # padding after each prompt
            pos = torch.arange(p_len, device=device).expand(len(prompts), -1)
            live = pos < lens[:, None]
        else:  # padding before it: negative positions
            pos = torch.arange(p_len, device=device) - (p_len - lens)[:, None]
            live = pos >= 0
        new = TargetBatch(self.target, self.features)
        kpos = None if same else torch.where(live, pos, DEAD)
        new.slots = Slots(len(prompts), p_len, kpos, device)
        new.cache = self.target.new_cache(sliding=False)
        ragged = {"lengths": lens.tolist()} if right else {}
        logits, feats = self.target.forward(
            ids,
            pos.clamp_min(0),
            new.cache,
            logits_to_keep=1,
            features=self.features,
            attention_mask=None if same or right else self.target.attention_mask(pos.clamp_min(0), kpos),
            **ragged,
        )
        if feats is not None:
            feats = [
                feats[b, : len(p)] if right else feats[b, p_len - len(p) :] for b, p in enumerate(prompts)
            ]
        return logits[:, -1], feats, new

    def join(self, other: TargetBatch, index: list[int]) -> None:
        if not index:
            return
        if len(index) < other.rows:
            idx = torch.tensor(index, dtype=torch.long, device=self.target.device)
            other.slots.keep(idx)
            _map_cache(other.cache, lambda t: t[idx])
        if self.cache is None:
            self.cache, self.slots = other.cache, other.slots
            return
        length = max(self.slots.length, other.slots.length)

        def pad(t: torch.Tensor) -> torch.Tensor:
            return F.pad(t, (0, 0, 0, length - t.shape[2]))

        if not (hasattr(self.cache, "append_rows") and self.cache.append_rows(other.cache)):
            for mine, new in zip(self.cache.layers, other.cache.layers, strict=True):
                mine.keys = torch.cat([pad(mine.keys), pad(new.keys)])
                mine.values = torch.cat([pad(mine.values), pad(new.values)])
        self.slots.join(other.slots)

    def verify(self, block, anchors, ks, trees=None):
        device, (n_rows, width) = self.target.device, block.shape
        if self.slots.aligned and len(set(ks)) == 1 and trees is None:
            # aligned: every row's block sits at the same positions, right after the cache
            length = self.slots.length
            q_pos = torch.arange(length, length + width, device=device).expand(n_rows, -1)
            self._block_pos, mask = q_pos, None
        else:
            steps = torch.arange(width, device=device)
            at = torch.tensor(anchors, device=device)[:, None]
            if trees is None:
                q_pos = at + steps
            else:  # every node at anchor + its depth
                depth = [[0, *t.depths(), *[0] * (width - 1 - len(t))] for t in trees]
                q_pos = at + torch.tensor(depth, device=device)
            new_kpos = torch.where(steps <= torch.tensor(ks, device=device)[:, None], q_pos, DEAD)
            mask = self.target.attention_mask(q_pos, torch.cat([self.slots.positions(), new_kpos], 1))
            if trees is not None:
                anc = masks.tree_ancestors([t.parents for t in trees], width, device)
                mask = masks.restrict_to_tree(mask, anc)
            # after the commit a row's kept slots hold anchor.. in order (a tree's path moved to the front)
            self._block_pos = new_kpos if trees is None else at + steps
        # a row's padding past its 1 + k tokens: not computed where the target is ragged (only such a
        # target is asked to take `lengths`)
        ragged = {"lengths": [k + 1 for k in ks]} if self.ragged and min(ks) + 1 < width else {}
        return self.target.forward(
            block, q_pos, self.cache, features=self.features, attention_mask=mask, **ragged
        )

    def commit(self, n, paths=None, feats=None):
        order = None if paths is None else path_order(paths, self.target.device)
        if order is not None:
            _reorder_block(self.cache, self.slots.length, order)
            if feats is not None:
                feats = feats.gather(1, order[:, :, None].expand(-1, -1, feats.shape[2]))
        self.slots.advance(n, self._block_pos)  # slots no row kept are cut off right away
        self.target.crop(self.cache, self.slots.length)
        return feats

    def keep(self, index):
        if not index:  # the batch is empty: the next row starts on a fresh cache, aligned
            self.cache, self.slots = None, Slots(device=self.target.device)
            return False
        if len(index) < self.rows:
            idx = torch.tensor(index, dtype=torch.long, device=self.target.device)
            self.slots.keep(idx)
            if hasattr(self.cache, "keep_rows"):  # the runner's cache: in place
                self.cache.keep_rows(index)
            else:
                _map_cache(self.cache, lambda t: t[idx])
        order = self.slots.compaction()
        if order is not None:
            _map_cache(self.cache, lambda t: gather_slots(t, order))
        return order is not None
