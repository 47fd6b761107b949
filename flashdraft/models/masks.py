"""Every attention mask flashdraft builds, in one place: who may see whom, from positions.

Slots of a batched cache are not positions: next to each cache the batch keeps the position every slot
holds for its row (`flashdraft.models.batch`), and a slot that holds nothing gets DEAD, a position past
every query. So a mask is one comparison of positions, whatever order the slots are in:

- the target's (`positional`, additive): a query sees the slots at its position or before, and on
  sliding-window layers only the last `window` positions (a window counts positions, not slots);
- a tree verify's (`tree_ancestors`, `restrict_to_tree`): a drafted node sees the context, its
  ancestors and itself, nothing of its siblings' branches;
- the draft's at inference (`draft_visibility`, boolean): a block attends everywhere its row holds
  something (a DFlash block is not causal), a sliding-window layer within its window;
- the draft's in training (`training_blocks`, `window_masks`, `rows_safe`): many blocks share one
  sequence, each sees the context before its anchor and itself, nothing of the other blocks.
"""

from __future__ import annotations

import torch

DEAD = 2**62  # the position of a slot that holds nothing for its row: no query ever sees it


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(B, 1, Q, S) bool: query i of row b (position q_pos[b, i]) may see slot j (position k_pos[b, j]):
    k <= q, and q - k < window when a window is given."""
    diff = q_pos[:, None, :, None] - k_pos[:, None, None, :]
    seen = diff >= 0
    return seen if window is None else seen & (diff < window)


def additive(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """0 where allowed, the dtype's lowest value elsewhere: what scaled dot-product attention adds."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def positional(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    kinds: bool = False,
):
    """A target's additive masks (B, 1, Q, S) for slots that are not in position order. `window`: the
    sliding-window layers' window; `kinds`: the model has both kinds of layers, so the answer is a
    {"full_attention": ..., "sliding_attention": ...} dict (else one mask: the window's when given)."""
    if window is None:
        return additive(visible(q_pos, k_pos), dtype)
    sliding = additive(visible(q_pos, k_pos, window), dtype)
    if not kinds:
        return sliding
    return {"full_attention": additive(visible(q_pos, k_pos), dtype), "sliding_attention": sliding}


# -- trees --------------------------------------------------------------------------------------------


def tree_ancestors(parents: list[list[int]], width: int, device=None) -> torch.Tensor:
    """(B, width, width) bool: which slots of a verify block [anchor, nodes] each block query may see:
    its ancestors and itself. parents[b][i]: the parent of row b's node i (-1: the anchor; a parent
    comes before its children). Slots past a row's tree (padding) hang from the anchor. Built as lists
    and made a tensor once: 0.28 ms at 16 rows of 9 slots, where a tensor op per slot took 1.34 ms."""
    out = []
    for row in parents:
        rows = [[j == 0 or j == i for j in range(width)] for i in range(width)]
        for i, p in enumerate(row):  # a parent's row is complete before its children's
            rows[i + 1] = [a or c for a, c in zip(rows[i + 1], rows[p + 1], strict=True)]
        out.append(rows)
    return torch.tensor(out, dtype=torch.bool, device=device)


def restrict_to_tree(mask, anc: torch.Tensor):
    """Additive masks (B, 1, Q, S), or a {layer kind: mask} dict, whose last Q slots are the block's:
    there the slots that are not a query's ancestors (`tree_ancestors`, (B, Q, Q)) are cut off, in
    place; the context's columns stay as positions made them."""
    for m in mask.values() if isinstance(mask, dict) else (mask,):
        m[..., -anc.shape[-1] :].masked_fill_(~anc[:, None], torch.finfo(m.dtype).min)
    return mask


# -- the draft ----------------------------------------------------------------------------------------


def draft_visibility(kpos: torch.Tensor, blk_pos: torch.Tensor, window: int | None = None):
    """The draft's boolean mask at inference: its block (positions blk_pos, (B, Q)) attends to every slot
    (kpos, (B, S)) its row holds something in, (B, 1, 1, S); with sliding-window layers a dict whose
    sliding entry (B, 1, Q, S) also keeps the window, counted in positions."""
    mask = (kpos != DEAD)[:, None, None, :]
    if window is None:
        return mask
    return {"full_attention": mask, "sliding_attention": visible(blk_pos, kpos, window)}


def _within(qp: torch.Tensor, kp: torch.Tensor, window: int) -> torch.Tensor:
    diff = qp[..., :, None] - kp[..., None, :]
    return (diff >= 0) & (diff < window)


def window_masks(mask, block_positions, ctx_positions, window: int, blocks: int) -> dict:
    """Training's draft mask (a tensor) per layer type: a sliding-window layer's query at position p sees,
    of what `mask` allows, keys at positions p - window < k <= p, as at inference (causal inside the
    window), its own block included. With `blocks` (the block layout): (context mask, own-block mask)."""
    ctx_pos = block_positions[:, :0] if ctx_positions is None else ctx_positions
    if blocks:  # (context mask, own-block mask), as `block_attention` takes them
        own = block_positions.view(block_positions.shape[0], -1, blocks)
        sliding = (
            mask & _within(block_positions, ctx_pos, window)[:, None],
            _within(own, own, window)[:, None],
        )
    else:
        all_pos = torch.cat([ctx_pos, block_positions], 1)
        sliding = mask & _within(block_positions, all_pos, window)[:, None]
    return {"full_attention": mask, "sliding_attention": sliding}


def training_blocks(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
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


def rows_safe(mask: torch.Tensor, ctx_len: int) -> torch.Tensor:
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
