"""Per-row slot bookkeeping for caches shared by rows of different lengths (batched decoding).

HF's DynamicCache appends at one slot index for all rows. Next to a cache we keep the absolute position
of every slot of every row (`kpos`, (B, S)). A slot that holds nothing for a row (prompt padding, a
rejected draft token, a row that joined later) gets the position DEAD, larger than any query, so an
attention mask is one comparison of positions and slot order never matters. Compaction gathers each
row's live slots to the front when dead slots pile up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from flashdraft.models.draft import KVCache

DEAD = 2**62  # the position of a slot that holds nothing for its row: no query ever sees it


def live_order(kpos: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Slot indices (B, L) that bring each row's live slots to the front, in slot order, and L, the
    most live slots of any row (shorter rows are filled up with dead slots)."""
    dead = kpos == DEAD
    n_live = int((~dead).sum(1).max()) if kpos.numel() else 0
    order = torch.sort(dead.to(torch.uint8), dim=1, stable=True).indices[:, :n_live]
    return order, n_live


def gather_slots(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """t (B, heads, S, D) -> (B, heads, L, D): the slots `order` (B, L) of each row."""
    return t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))


def pad_slots(t: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, length - t.shape[2]))


def pad_kpos(kpos: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(kpos, (0, length - kpos.shape[1]), value=DEAD)


def worth_compacting(kpos: torch.Tensor) -> bool:
    """Compact when dead slots make up a quarter of the longest row (and more than a few)."""
    if not kpos.numel():
        return False
    longest = int((kpos != DEAD).sum(1).max())
    return kpos.shape[1] - longest > max(32, longest // 4)


def map_target_cache(cache, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    for layer in cache.layers:
        if layer.keys is not None and layer.keys.dim() == 4:
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)


def map_draft_cache(cache: KVCache, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply fn to the committed part of every layer (the buffer then holds just that)."""
    for i, k in enumerate(cache.k):
        if k is not None:
            cache.k[i] = fn(k[:, :, : cache.length])
            cache.v[i] = fn(cache.v[i][:, :, : cache.length])


def path_order(paths: list[list[int]], device=None) -> torch.Tensor | None:
    """(B, L) the slots of a verify block [anchor, nodes] that each row keeps, in order: its anchor and
    accepted nodes (`paths`), padded with the last; L = the longest. None when every path is already
    the front of its block (a chain's always is)."""
    if all(path == list(range(len(path))) for path in paths):
        return None
    width = 1 + max(len(path) for path in paths)
    order = [[0] + [i + 1 for i in path] for path in paths]
    return torch.tensor([o + o[-1:] * (width - len(o)) for o in order], dtype=torch.long, device=device)


def reorder_slots(cache, start: int, order: torch.Tensor) -> None:
    """In place, every row's slots start.. of a target cache take the slots start + order (B, L)."""
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None and t.dim() == 4:
                t[:, :, start : start + order.shape[1]] = gather_slots(t[:, :, start:], order)
