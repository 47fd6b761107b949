"""Proposers: whatever drafts tokens for the verifier in `decode.generate`.

The interface is three calls, so the same lossless verifier serves the DFlash draft, n-gram lookup
and test oracles alike:

- `start(features)`: after the prefill, with the target features of the prompt (of `feature_layers`);
- `propose(tokens, k, sampling, generator)`: up to k tokens to follow `tokens` (whose last entry is
  the anchor), plus their proposal probabilities q (or None: a one-hot, i.e. greedy, proposal);
- `accept(features)`: after verification, with the target features of the newly committed tokens.
"""

from __future__ import annotations

import torch

from .draft import DFlashDraft
from .sampling import SamplingConfig, probs, sample
from .target import Target


class Proposer:
    feature_layers: list[int] | None = None  # target layers whose features `start`/`accept` receive
    block_size = 16

    def start(self, features: torch.Tensor | None) -> None:
        pass

    def propose(
        self, tokens: torch.Tensor, k: int, sampling: SamplingConfig, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def accept(self, features: torch.Tensor | None) -> None:
        pass


class DFlashProposer(Proposer):
    """Drafts a block in one pass of a DFlash draft that reads the target's features.

    With sampling, `proposal="draft"` samples each block position from the draft's own (warped)
    distribution and hands q to the verifier; `proposal="greedy"` drafts the argmax (one-hot q).
    Both are exact; they differ in how much they accept (see README, "Sampling").
    """

    def __init__(self, draft: DFlashDraft, target: Target, proposal: str = "draft"):
        if proposal not in ("draft", "greedy"):
            raise ValueError(f"proposal must be 'draft' or 'greedy', got {proposal!r}")
        draft.check_target(target)
        self.feature_layers = list(draft.config.target_layer_ids)
        self.draft, self.target, self.proposal = draft, target, proposal
        self.block_size = draft.config.block_size
        self.mask_id = draft.config.mask_token_id
        self.embed_scale = float(draft.config.extra.get("input_embedding_scale", 1.0))
        self.cache = None
        self.pending: torch.Tensor | None = None

    def start(self, features):
        self.cache = self.draft.new_cache()
        self.pending = features

    def accept(self, features):
        self.pending = features if self.pending is None else torch.cat([self.pending, features], dim=1)

    def propose(self, tokens, k, sampling, generator=None):
        anchor = tokens.shape[1] - 1
        ctx = self.pending
        c_len = 0 if ctx is None else ctx.shape[1]
        if self.cache.length + c_len != anchor:
            raise RuntimeError(
                f"draft context covers {self.cache.length + c_len} positions, anchor is at {anchor}"
            )
        block = torch.full((tokens.shape[0], k + 1), self.mask_id, dtype=tokens.dtype, device=tokens.device)
        block[:, 0] = tokens[:, -1]
        embeds = self.target.embed(block).to(self.draft.fc.weight.dtype)
        if self.embed_scale != 1.0:
            embeds = embeds * self.embed_scale
        pos = torch.arange(self.cache.length, anchor + k + 1, device=tokens.device)[None]
        hidden = self.draft(embeds, pos[:, c_len:], ctx, pos[:, :c_len], cache=self.cache)
        self.pending = None
        logits = self.draft.propose_logits(hidden[:, 1:].to(self.target.dtype), self.target.lm_head)
        if sampling.greedy or self.proposal == "greedy":
            return logits.argmax(-1), None
        q = probs(logits, sampling)
        return sample(q, generator), q


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the trailing n-gram and copy what followed."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, block_size: int = 8):
        self.max_ngram, self.min_ngram, self.block_size = max_ngram, min_ngram, block_size

    def propose(self, tokens, k, sampling, generator=None):
        seq = tokens[0]
        n_tok = seq.numel()
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            windows = seq.unfold(0, n, 1)[:-1]  # every n-gram that has a successor
            hits = (windows == seq[-n:]).all(-1).nonzero()
            if hits.numel():
                begin = int(hits[-1]) + n
                return seq[begin : begin + k][None], None
        return seq[:0][None], None
