"""One request's settings, state and result: what the engine schedules and what it hands back.

`Row` is the request while it runs (nano-vllm calls it a sequence): its prompt, the tokens committed so
far (the last one is the anchor, the only one not yet in the target cache), its own sampling generator,
and the stop and length rules that decide when it ends. Batch 1 and batch N share all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from flashdraft.engine.sampling import SamplingConfig
from flashdraft.models.target import Target


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    block_size: int | None = None  # None: the proposer's own block size; 1: plain decoding
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_ids: Sequence[int] = ()
    seed: int | None = None


@dataclass
class GenerationResult:
    tokens: list[int]  # the new tokens, stop token included
    acceptance_lengths: list[int]  # tokens committed per verify step (1..B)
    prefill_s: float
    decode_s: float  # everything after the prefill
    draft_s: list[float]
    verify_s: list[float]
    step_s: list[float]
    stop_reason: str  # "stop" or "length"

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens committed per verify forward (bonus token included)."""
        n = len(self.acceptance_lengths)
        return sum(self.acceptance_lengths) / n if n else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def bookkeeping_s(self) -> float:
        return sum(self.step_s) - sum(self.draft_s) - sum(self.verify_s)


def prompt_tensor(prompt_ids, device: torch.device | str = "cpu") -> torch.Tensor:
    """One prompt as a (1, n) tensor, from whatever tokenizers and chat templates return: a list of ids,
    a tensor of shape (n,) or (1, n), or a BatchEncoding / dict holding `input_ids`."""
    if hasattr(prompt_ids, "keys") and "input_ids" in prompt_ids:
        prompt_ids = prompt_ids["input_ids"]
    try:
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"the prompt must be token ids (a list of ints, a tensor, or a tokenizer's BatchEncoding), got "
            f"{type(prompt_ids).__name__} ({e})"
        ) from None
    if prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if prompt.dim() != 1:
        raise ValueError(
            f"generate takes one prompt, got token ids of shape {tuple(prompt.shape)}: pass several prompts "
            "to generate_batch"
        )
    return prompt[None]


def check_prompt(prompt: torch.Tensor, target: Target, cfg: GenerationConfig, block_size: int) -> None:
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty: pass at least one token (or a non-empty text)")
    if cfg.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (1 = plain decoding), got {block_size}")
    total = prompt.shape[1] + cfg.max_new_tokens
    if total > target.max_length:
        raise ValueError(
            f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({cfg.max_new_tokens}) = {total} exceeds the "
            f"target's context of {target.max_length} tokens: shorten the prompt or lower max_new_tokens"
        )
    lo, hi = int(prompt.min()), int(prompt.max())
    if lo < 0 or hi >= target.vocab_size:
        raise ValueError(f"prompt token ids must lie in 0..{target.vocab_size - 1}, got {lo}..{hi}")


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
