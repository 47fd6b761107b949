"""Blocks, the training mask and the loss: one draft forward over every block of a sequence, against the
data token (CE) or the target's own next-token distribution (distillation), decayed along the block."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from flashdraft.models import masks
from flashdraft.models.target import Target


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
    # The dense (b, Q, S + Q) visibility of `masks.training_blocks`. None: the block layout computes the same
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
def target_features(target: Target, batch: Batch, layers: list[int]) -> torch.Tensor:
    """Features (b, S, n*H) of these target layers at every position, from one causal forward of the
    frozen target."""
    _, feats = target.forward(
        batch.ids, batch.positions, target.new_cache(), logits_to_keep=1, features=list(layers)
    )
    return feats.clone() if feats.is_inference() else feats  # the runner's: autograd may save them


def draft_hidden(
    draft, target: Target, batch: Batch, dtype: torch.dtype, features: torch.Tensor | None = None
) -> torch.Tensor:
    """The training forward: every block of the batch in one draft pass under the training mask."""
    if features is None:
        features = target_features(target, batch, draft.config.target_layer_ids)
    config = draft.config
    with torch.no_grad():
        embeds = target.embed(batch.block_ids).to(dtype)
        scale = float(config.extra.get("input_embedding_scale", 1.0))
        if scale != 1.0:
            embeds = embeds * scale
    s = batch.ids.shape[1]
    if batch.mask is not None:
        mask = masks.rows_safe(batch.mask, s)[:, None]
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
        features = target_features(target, batch, draft.config.target_layer_ids)
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
