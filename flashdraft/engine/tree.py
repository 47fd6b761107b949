"""Draft trees: many continuations of one anchor verified in one target forward.

A DFlash draft gives a distribution at every block position in one pass, so alternatives to its argmax
cost no extra draft call. A tree spends the verify's slots on them: built best-first by path probability
from the block's per-position marginals (a node at depth d carries a token of position d's marginal; a
path's probability is the product of its tokens' marginals), as DDTree builds it. On a CPU a verify's
cost follows the tokens it carries, not their shape, so a tree of N nodes costs what a chain of N costs
and accepts more (docs/speed.md, "Trees from the block's marginals").

In the verify forward each node sees the committed context, its ancestors and itself
(`flashdraft.models.masks.tree_ancestors`), at the position anchor + its depth. Nodes are numbered so
that a parent comes before its children, so a path's slots are in position order and a node's attention
sums run over the same slots, in the same order, as a one-token step of its path: its logits equal that
step's bitwise where the forward is batch-invariant. The verify then walks the tree (`walk`): at each node the target's own next token
(its argmax, or a sample from exactly plain sampling's distribution), down to the child that carries
it, so every emitted token is the one plain decoding would emit; the token no child carries is the
bonus. The target's batch moves the accepted path's keys and values to the front of the block
(`flashdraft.models.batch`), after which the cache is as if a chain had been verified.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    """Drafted tokens after an anchor: `tokens[i]` follows `parents[i]` (-1: the anchor); a parent always
    comes before its children, and siblings carry different tokens."""

    tokens: list[int]
    parents: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int]) -> Tree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def depths(self) -> list[int]:
        """Per node, its depth: 1 for the anchor's children."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self) -> dict[int, dict[int, int]]:
        """node (-1: the anchor) -> {token: child node}."""
        out: dict[int, dict[int, int]] = {}
        for i, (t, p) in enumerate(zip(self.tokens, self.parents, strict=True)):
            out.setdefault(p, {})[t] = i
        return out


def build(probs: list[list[float]], tokens: list[list[int]], budget: int) -> Tree:
    """The tree of at most `budget` nodes with the highest path probabilities, best-first: probs[d] /
    tokens[d] are the top candidates of block position d + 1 (most likely first), so the tree is at most
    len(probs) deep. A node's first child and its next sibling enter the frontier when it is taken."""
    out = Tree([], [])
    if not probs or budget < 1:
        return out
    # (-path probability, the path's ranks (equal probabilities: the smaller ranks first), parent node,
    # the parent's path probability)
    frontier = [(-probs[0][0], (0,), -1, 1.0)]
    while frontier and len(out.tokens) < budget:
        neg, ranks, parent, parent_p = heapq.heappop(frontier)
        d, r, node = len(ranks) - 1, ranks[-1], len(out.tokens)
        out.tokens.append(tokens[d][r])
        out.parents.append(parent)
        if r + 1 < len(probs[d]):  # the next sibling
            heapq.heappush(frontier, (-parent_p * probs[d][r + 1], (*ranks[:-1], r + 1), parent, parent_p))
        if d + 1 < len(probs):  # the first child
            heapq.heappush(frontier, (neg * probs[d + 1][0], (*ranks, 0), node, -neg))
    return out


def from_probs(p: torch.Tensor, budget: int, ids: torch.Tensor | None = None) -> Tree:
    """`build` from a row's draft distributions (depth, V) at block positions 1..depth; `ids`: the token
    id of each of p's columns (default: the column)."""
    probs, tokens = p.topk(min(budget, p.shape[-1]), -1)
    return build(probs.tolist(), (tokens if ids is None else ids[tokens]).tolist(), budget)


def walk(tree: Tree, next_token: Callable[[int], int]) -> tuple[list[int], int]:
    """The verify's walk: from the anchor, `next_token(i)` is the target's token after block slot i (0:
    the anchor, 1 + node: a node); go down to the child that carries it. Returns the accepted nodes, in
    order, and the token after the last (which no child carries: the bonus)."""
    children, node, path = tree.children(), -1, []
    while True:
        token = next_token(node + 1)
        child = children.get(node, {}).get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child
