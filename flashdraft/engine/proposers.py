"""Proposers: whatever drafts tokens for the engine's lossless verifier (DFlash, n-gram lookup, test
oracles), behind one batched protocol that serves batch 1 and batch N alike.

The engine owns the batch and tells its proposer what happens to it, in batch order:

- `reset()`: a new engine takes the proposer over (a proposer serves one engine at a time);
- `join(rows, features)`: rows appended to the batch after their prefill; features[i] (len, n*H) are
  the target features of rows[i]'s prompt, of the layers `feature_layers` lists (None: it reads none);
- `propose(rows, ks)`: per row b, up to ks[b] tokens to follow its anchor (a 1D tensor) and their
  proposal probabilities q (1, len, V), or None for a one-hot (greedy) proposal; or a tree of tokens,
  as (tokens, None, `flashdraft.engine.tree.Tree`), at most ks[b] deep;
- `accept(features, n)`: after the verify, row b committed n[b] tokens; features (B, T, n*H) are those
  of the verify block, the first n[b] of each row belong to its committed tokens;
- `keep(index)`: only these rows (indices into the batch, in order) remain;
- `observe(rows, ks, n, draft_s, verify_s, verify_tokens)`: how the step went (for adaptive proposers);
- `timed(tokens, seconds)`: a prefill forward over `tokens` tokens took `seconds` (likewise).

For proposers that price their own calls: `draft_tokens(ks)`, the tokens the next `propose` would run
through the draft (what its cost follows), and `relative_cost`, a drafted token's cost relative to a
target token's (None: unknown), which prices a draft call before one is timed.

Stateless proposers only write `propose_row(row, k)`; the base class asks them row by row.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from flashdraft.engine import tree
from flashdraft.engine.sampling import argmax, probs, sample
from flashdraft.engine.sequence import Row
from flashdraft.models import masks
from flashdraft.models.batch import Slots, gather_slots
from flashdraft.models.draft import DFlashDraft
from flashdraft.models.target import Target

NOTHING = torch.zeros(0, dtype=torch.long)


class Proposer:
    feature_layers: list[int] | None = None  # target layers whose features join/accept receive
    block_size = 16
    relative_cost: float | None = None  # a drafted token's cost over a target token's; None: unknown
    last_logits: torch.Tensor | None = None  # a drafting proposer's last block logits (B, k, V)

    def marginals(self) -> torch.Tensor | None:
        """The last call's per-position distributions (B, k, V) as their softmax gives them (what a greedy
        row's tree and adaptive speculation's confidence read), or None without logits."""
        return None if self.last_logits is None else self.last_logits.float().softmax(-1)

    def reset(self) -> None:
        pass

    def join(self, rows: list[Row], features: list[torch.Tensor] | None) -> None:
        pass

    def propose(self, rows: list[Row], ks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [self.propose_row(row, k) if k else (NOTHING, None) for row, k in zip(rows, ks, strict=True)]

    def propose_row(self, row: Row, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def draft_tokens(self, ks: list[int]) -> int:
        """Tokens a `propose(rows, ks)` now would run through its model: the blocks."""
        return sum(k + 1 for k in ks)

    def accept(self, features: torch.Tensor | None, n: list[int]) -> None:
        pass

    def keep(self, index: list[int]) -> None:
        pass

    def observe(
        self,
        rows: list[Row],
        ks: list[int],
        n: list[int],
        draft_s: float,
        verify_s: float,
        verify_tokens: int,
    ) -> None:
        """How the step went: row b verified ks[b] drafted tokens and committed n[b]; the draft phase took
        draft_s, the verify forward (verify_tokens tokens in all) verify_s. For proposers that adapt."""

    def timed(self, tokens: int, seconds: float) -> None:
        """A prefill forward over `tokens` tokens (padding included) took `seconds`: what a forward over
        many tokens costs, known before the first verify. For proposers that adapt."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the trailing n-gram and copy what followed.

    Each row keeps an index, every n-gram (n <= max_ngram) that has a successor -> where its latest
    occurrence's successor is, extended by the tokens committed since the last lookup, instead of a
    scan of the whole sequence per row and step (16 rows of 300-500 tokens: 0.6 ms a step instead of
    1.5-1.7 ms, on the 2-core CPU of docs/speed.md). Rows only grow (`Row.commit` appends), so the index
    reads only their new tokens; a row shorter than its index is indexed again."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, block_size: int = 8):
        self.max_ngram, self.min_ngram, self.block_size = max_ngram, min_ngram, block_size
        self._index: weakref.WeakKeyDictionary[Row, tuple[list[int], dict]] = weakref.WeakKeyDictionary()

    def propose_row(self, row, k):
        return self.lookup(row, k)[0], None

    def lookup(self, row: Row, k: int) -> tuple[torch.Tensor, int]:
        """(up to k tokens, the length of the n-gram that matched; 0 and no tokens: no match)."""
        seq, after = self._indexed(row)
        n_tok = len(seq)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            begin = after.get(tuple(seq[n_tok - n :]))
            if begin is not None:
                return torch.tensor(seq[begin : begin + k], dtype=torch.long), n
        return NOTHING, 0

    def _indexed(self, row: Row) -> tuple[list[int], dict]:
        """The row's tokens (prompt and committed) and its n-gram index, brought up to date."""
        seq, after = self._index.get(row) or ([], {})
        p, n_tok = len(row.prompt), len(row.prompt) + len(row.tokens)
        if len(seq) > n_tok or not seq:
            seq, after = [], {}
            self._index[row] = (seq, after)  # grown in place from here on
        old = len(seq)
        seq += (row.prompt + row.tokens)[old:] if old < p else row.tokens[old - p :]
        for j in range(max(old, 1), n_tok):  # token j follows the n-grams that end just before it
            for n in range(1, min(self.max_ngram, j) + 1):
                after[tuple(seq[j - n : j])] = j
        return seq, after


@dataclass
class Context:
    """A row's context that the draft has not read yet: the position of its first token and the target
    features of its tokens, in the chunks they came in. Kept as chunks because a batch where drafting does
    not pay steps plain for up to 64 steps between draft calls: appending each step's features to one
    tensor copied the whole context every step (16 rows of 200 tokens: about 20 MB a step)."""

    start: int
    chunks: list[torch.Tensor] = field(default_factory=list)
    # its tokens, the chunks' and those still in `DFlashProposer.unread` (a draft call is priced by it
    # every step)
    length: int = 0

    def __post_init__(self):
        self.length = sum(c.shape[0] for c in self.chunks)

    def __len__(self) -> int:
        return self.length

    def features(self) -> torch.Tensor:
        return self.chunks[0] if len(self.chunks) == 1 else torch.cat(self.chunks)


class DFlashProposer(Proposer):
    """Drafts every row's block in one pass of a DFlash draft that reads the target's features.

    Each row's new context (its prompt's features after the prefill, then the committed tokens of each
    verify) waits in `pending` until the next draft call writes it into the draft's context cache.
    While the rows are aligned (same positions in every slot: always so at batch 1) the call needs no
    mask and no slot positions are kept. Otherwise context is padded to the longest row with dead slots
    (`flashdraft.models.batch.Slots`, the bookkeeping of the target's batch) and blocks are as long as
    the longest row's, a row's extra block slots dead for it, so every row's drafts are the ones it
    would get alone. Sliding-window draft layers see a window counted in positions.

    With sampling, `proposal="draft"` samples each block position from the draft's own (warped)
    distribution and hands q to the verifier; `proposal="greedy"` drafts the argmax (one-hot q).
    Both are exact; they differ in how much they accept (see README, "Sampling").

    `tree` > 0: every row's proposal is a tree of up to `tree` tokens built best-first from the block's
    marginals (`flashdraft.engine.tree`; under the row's sampling settings when it samples), at most
    `tree` deep, so the draft's block is cut to that.
    """

    def __init__(
        self,
        draft: DFlashDraft,
        target: Target,
        proposal: str = "draft",
        context_vocab: bool = False,
        tree: int = 0,
    ):
        if proposal not in ("draft", "greedy"):
            raise ValueError(f"proposal must be 'draft' or 'greedy', got {proposal!r}")
        if tree < 0:
            raise ValueError(f"tree must be >= 0 (0: a chain), got {tree}")
        self.tree = tree
        draft.check_target(target)
        kind = getattr(getattr(target, "quantization", None), "layers", None)
        if kind in ("q8_0", "q4_1") and next(draft.parameters()).dtype == target.dtype:
            draft = draft.quantized("q8_0")  # the target's kernels run it too (DFlashDraft.quantized)
        self.feature_layers = list(draft.config.target_layer_ids)
        self.draft, self.target, self.proposal = draft, target, proposal
        if draft.vocab is not None:  # made now, not in the first request's first draft call
            draft.vocab_head(target.lm_head)
        # With a draft vocabulary: each request's own tokens join its rows of the head (propose_logits).
        self.context_vocab = context_vocab and draft.vocab is not None
        self._vocab_set = set(draft.vocab.tolist()) if self.context_vocab else set()
        self._context: dict[str, tuple[int, set[int]]] = {}
        self.block_size = draft.config.block_size
        self.mask_id = draft.config.mask_token_id
        self.embed_scale = float(draft.config.extra.get("input_embedding_scale", 1.0))
        # The target's embedding table, where the draft's native call looks its block up itself
        table = getattr(target, "embedding_table", None)
        native = draft.native is not None and self.embed_scale == 1.0
        self.embedding = table if native and table is not None and table.dtype == torch.bfloat16 else None
        self.window = draft.config.sliding_window if "sliding_attention" in draft.config.layer_types else None
        self.compactions = 0
        self._logits: torch.Tensor | None = None  # `last_logits`, once made
        self._marginals: torch.Tensor | None = None  # `marginals`, once per call
        # The draft's layers against the target's: a cost ratio per token, until a draft call is timed.
        self.relative_cost = draft.config.num_hidden_layers / target.num_layers
        self.reset()

    def reset(self):
        self._context = {}
        self.cache = self.draft.new_cache()
        self.slots = Slots(device=self.target.device)  # the positions the context cache's slots hold
        self.pending: list[Context] = []  # per row: the context the draft has not read yet
        # steps' features not split into `pending` yet (`accept`), with each row's accepted count
        self.unread: list[tuple[torch.Tensor, list[int]]] = []
        self.aligned = True  # also the pending context: every row's starts at the same position, same length

    def _contexts(self, rows) -> list[torch.Tensor]:
        """Per row, its request's tokens (prompt and committed) outside the draft vocabulary, updated with
        the tokens committed since the last call."""
        kept = {}
        for r in rows:
            seen, extra = self._context.get(r.request_id, (-1, set()))
            if seen < 0:
                extra = {t for t in r.prompt if t not in self._vocab_set}
            extra |= {t for t in r.tokens[max(seen, 0) :] if t not in self._vocab_set}
            kept[r.request_id] = (len(r.tokens), extra)
        self._context = kept
        return [torch.tensor(sorted(kept[r.request_id][1]), dtype=torch.long) for r in rows]

    def join(self, rows, features):
        self._split()
        if not self.pending:  # an empty batch starts over, aligned
            self.reset()
            self.aligned = len({f.shape[0] for f in features}) == 1
            self.pending = [Context(0, [f]) for f in features]
            self.slots.rows = len(features)
            return
        n = len(rows)
        self.cache.map(lambda t: torch.cat([t, t.new_zeros(n, *t.shape[1:])]))
        self.slots.join(Slots(n, device=self.target.device))
        self.pending += [Context(0, [f]) for f in features]
        self.aligned = False

    def draft_tokens(self, ks):
        """The rows' unread context, padded to the longest, and their blocks: after many plain steps in a
        batch, most of a draft call's cost is catching up with the context."""
        return len(ks) * (max((len(c) for c in self.pending), default=0) + max(ks) + 1)

    def keep(self, index):
        if not index:
            self.reset()
            return
        idx = torch.tensor(index, dtype=torch.long, device=self.target.device)
        self.cache.map(lambda t: t[idx])
        self.slots.keep(idx)
        self._split()
        self.pending = [self.pending[i] for i in index]

    def accept(self, features, n):
        """The step's features wait whole until a draft call (or a change of rows) needs them by row: a
        batch where drafting does not pay steps plain for many steps between calls, and a view per row
        and step cost torch ops every step (in the loop each runs with cold caches)."""
        if len(set(n)) > 1:
            self.aligned = False
        self.unread.append((features, n))
        for ctx, k in zip(self.pending, n, strict=True):
            ctx.length += k

    def _split(self) -> None:
        """The unread steps' features into their rows' chunks (their lengths already counted)."""
        for features, n in self.unread:
            width = features.shape[1]  # a row that kept its whole block keeps its view as it is
            for ctx, row, k in zip(self.pending, features.unbind(0), n, strict=True):
                ctx.chunks.append(row if k == width else row[:k])
        self.unread = []

    @property
    def last_logits(self) -> torch.Tensor | None:
        """The last call's block logits (B, k_max, V) over the whole vocabulary (tests compare them across
        batch sizes), made from the draft vocabulary's columns on first use."""
        if self._logits is None and self.draft.last_vocab_logits is not None:
            sub, rows = self.draft.last_vocab_logits
            self._logits = self.draft.full_logits(sub, rows, self.target.lm_head.weight.shape[0])
        return self._logits

    def marginals(self) -> torch.Tensor:
        """As `Proposer.marginals`, over the draft vocabulary's columns where it has one (every finite
        logit is one of them: 4x cheaper), made once per call for all rows."""
        if self._marginals is None:
            sub, _ = self.draft.last_vocab_logits or (self.last_logits, None)
            self._marginals = sub.float().softmax(-1)
        return self._marginals

    def tree_of(self, b: int, depth: int, budget: int) -> tree.Tree:
        """Row b's tree of up to `budget` tokens from the last call's marginals at block positions
        1..depth (a greedy row's)."""
        ids = self.draft.last_vocab_logits[1] if self.draft.last_vocab_logits else None
        return tree.from_probs(self.marginals()[b, :depth], budget, ids)

    def propose(self, rows, ks):
        if self.tree:  # a tree is never deeper than its budget
            ks = [min(k, self.tree) for k in ks]
        device, n_rows, k_max = self.target.device, len(rows), max(ks)
        order = self.slots.compaction()
        if order is not None:
            self.cache.map(lambda t: gather_slots(t, order))
            self.cache.length = self.slots.length
            self.compactions += 1
        # New context, padded to the longest row; its positions continue where each row's cache ends.
        self._split()
        feats = [c.features() for c in self.pending]
        lens = [f.shape[0] for f in feats]
        c_len = max(lens)
        if n_rows == 1:
            ctx = feats[0][None]
        else:
            ctx = feats[0].new_zeros(n_rows, c_len, feats[0].shape[1])
            for b, f in enumerate(feats):
                ctx[b, : f.shape[0]] = f
        # Block [anchor, MASK...] of the longest row's length; slots past a row's own k are dead for it.
        block = torch.tensor([[r.tokens[-1]] + [self.mask_id] * k_max for r in rows], device=device)
        if self.embedding is not None:  # looked up in the draft's native call
            embeds = block
        else:
            embeds = self.target.embed(block).to(self.draft.fc.weight.dtype)
            if self.embed_scale != 1.0:
                embeds = embeds * self.embed_scale
        aligned = self.aligned and len(set(ks)) == 1  # one set of positions for all rows, no mask
        if aligned:
            start = self.cache.length
            if start + c_len != rows[0].anchor:
                raise RuntimeError(
                    f"draft context covers {start + c_len} positions, anchor is at {rows[0].anchor}"
                )
            pos = torch.arange(start, start + c_len + k_max + 1, device=device).expand(n_rows, -1)
            ctx_pos, blk_pos = pos[:, :c_len], pos[:, c_len:]
        else:
            ctx_pos = torch.tensor([c.start for c in self.pending], device=device)[:, None] + torch.arange(
                c_len, device=device
            )
            blk_pos = torch.tensor([r.anchor for r in rows], device=device)[:, None] + torch.arange(
                k_max + 1, device=device
            )
        # The context joins the cache's slots (aligned context stays aligned, whatever the block's mask is).
        self.slots.advance(lens, ctx_pos)
        mask = None
        if not aligned:  # the call's keys: the cache's slots and the block, slots past a row's k dead
            keys = Slots(n_rows, self.slots.length, self.slots.kpos, device)
            keys.advance([k + 1 for k in ks], blk_pos)
            mask = masks.draft_visibility(keys.positions(), blk_pos, self.window)
        # The draft vocabulary's head rows, applied in the draft's own call where its layers run in C++.
        head = self.draft.vocab_head(self.target.lm_head) if self.draft.vocab is not None else None
        out = self.draft(
            embeds, blk_pos, ctx, ctx_pos, cache=self.cache, mask=mask, head=head, embed=self.embedding
        )
        hidden, raw, picks = out if head is not None else (out, None, None)
        self.pending = [Context(r.anchor) for r in rows]  # next: the committed tokens
        context = self._contexts(rows) if self.context_vocab else None
        # The whole vocabulary's logits only where a row samples from them (greedy rows read the draft
        # vocabulary's columns alone; `last_logits` makes them on demand).
        full = any(k and not row.sampling.greedy for row, k in zip(rows, ks, strict=True)) and (
            self.tree or self.proposal == "draft"
        )
        # the block's hidden states, where the head is still to be applied (or a request's own tokens')
        hidden = hidden[:, 1:].to(self.target.dtype) if raw is None or context is not None else None
        self._logits = self.draft.propose_logits(hidden, self.target.lm_head, context, full, raw)
        logits = self._logits
        self._marginals = None
        sub, ids = self.draft.last_vocab_logits or (logits, None)  # the draft vocabulary's columns alone
        greedy = picks  # made in the draft's C++ call, else here (a tree reads the marginals instead)
        if greedy is None and not self.tree:
            greedy = argmax(sub) if ids is None else ids[argmax(sub)]
        out = []
        for b, (row, k) in enumerate(zip(rows, ks, strict=True)):
            if k == 0:
                out.append((NOTHING, None))
            elif self.tree:
                if row.sampling.greedy:
                    drafted = self.tree_of(b, k, self.tree)
                else:
                    drafted = tree.from_probs(probs(logits[b, :k], row.sampling), self.tree)
                out.append((torch.tensor(drafted.tokens, dtype=torch.long), None, drafted))
            elif row.sampling.greedy or self.proposal == "greedy":
                out.append((greedy[b, :k], None))
            else:
                q = probs(logits[b : b + 1, :k], row.sampling)
                out.append((sample(q, row.generator)[0], q))
        return out
