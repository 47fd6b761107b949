"""The decode loop: plain decoding and lossless speculative decoding in one function.

Each step drafts up to B-1 tokens after the anchor (the last committed token), verifies
[anchor, drafts] in one causal target pass, commits the accepted prefix plus the target's own next
token, and crops the target cache back to what was committed. With no proposer, or B = 1, every
step verifies the anchor alone: that is plain autoregressive decoding, through the same code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .proposers import Proposer
from .sampling import SamplingConfig, next_token, probs, verify_greedy, verify_sampling
from .target import Target


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


def _check_prompt(prompt: torch.Tensor, target: Target, cfg: GenerationConfig, block_size: int) -> None:
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


@torch.inference_mode()
def generate(
    target: Target,
    prompt_ids: Sequence[int] | torch.Tensor,
    proposer: Proposer | None = None,
    config: GenerationConfig | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    cfg = config or GenerationConfig()
    sampling = cfg.sampling
    prompt = prompt_tensor(prompt_ids, target.device)
    block_size = cfg.block_size if cfg.block_size is not None else (proposer.block_size if proposer else 1)
    _check_prompt(prompt, target, cfg, block_size)
    speculative = proposer is not None and block_size > 1
    features = speculative and proposer.feature_layers is not None
    if features:
        target.select_layers(proposer.feature_layers)
    gen = None
    if cfg.seed is not None:
        gen = torch.Generator(device=target.device).manual_seed(cfg.seed)
    stop = torch.tensor(sorted(set(cfg.stop_ids)), dtype=torch.long, device=target.device)

    n_prompt = prompt.shape[1]
    end = n_prompt + cfg.max_new_tokens  # total length we may reach
    tokens = torch.empty(1, end, dtype=torch.long, device=target.device)
    tokens[:, :n_prompt] = prompt
    positions = torch.arange(end, device=target.device)[None]
    no_draft = tokens[:, :0]

    t_start = time.perf_counter()
    cache = target.new_cache()
    logits, feats = target.forward(
        prompt, positions[:, :n_prompt], cache, logits_to_keep=1, features=features
    )
    tokens[0, n_prompt] = next_token(logits[:, -1], sampling, gen)[0]
    if speculative:
        proposer.start(feats)
    prefill_s = time.perf_counter() - t_start
    first = int(tokens[0, n_prompt])
    if on_tokens:
        on_tokens([first])
    stopped = first in cfg.stop_ids

    anchor = n_prompt  # index of the last committed token, the only one not yet in the target cache
    lengths, draft_s, verify_s, step_s = [], [], [], []
    while not stopped and anchor + 1 < end:
        t0 = time.perf_counter()
        room = end - anchor - 1  # new tokens still allowed
        draft, q = no_draft, None
        if speculative:
            draft, q = proposer.propose(tokens[:, : anchor + 1], min(block_size - 1, room), sampling, gen)
        k = draft.shape[1]
        t1 = time.perf_counter()
        block = (
            tokens[:, anchor : anchor + 1]
            if k == 0
            else torch.cat([tokens[:, anchor : anchor + 1], draft], 1)
        )
        logits, feats = target.forward(block, positions[:, anchor : anchor + k + 1], cache, features=features)
        t2 = time.perf_counter()
        if sampling.greedy:
            a, bonus = verify_greedy(draft, logits)
        else:
            a, bonus = verify_sampling(draft, probs(logits, sampling), q, gen)
        new = torch.cat([draft[0, :a], bonus.view(1)])[:room]
        if stop.numel():
            hits = torch.isin(new, stop).nonzero()
            if hits.numel():
                new = new[: int(hits[0]) + 1]
                stopped = True
        n = new.numel()
        tokens[0, anchor + 1 : anchor + 1 + n] = new
        target.crop(cache, anchor + n)  # anchor + accepted drafts; the new last token comes next step
        if speculative:
            proposer.accept(None if feats is None else feats[:, :n])
        anchor += n
        lengths.append(n)
        draft_s.append(t1 - t0)
        verify_s.append(t2 - t1)
        step_s.append(time.perf_counter() - t0)
        if on_tokens:
            on_tokens(new.tolist())

    out = tokens[0, n_prompt : anchor + 1].tolist()
    return GenerationResult(
        tokens=out,
        acceptance_lengths=lengths,
        prefill_s=prefill_s,
        decode_s=time.perf_counter() - t_start - prefill_s,
        draft_s=draft_s,
        verify_s=verify_s,
        step_s=step_s,
        stop_reason="stop" if stopped else "length",
    )
