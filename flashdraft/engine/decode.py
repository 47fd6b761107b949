"""`generate` and `generate_batch`: the engine (`flashdraft.engine.engine`) run to completion, for one prompt or many.

Both are thin wrappers: every step, batch 1 or batch N, plain or speculative, greedy or sampled, goes
through `Engine.step`, so a feature added there serves the Python API, the CLI, `serve` and `bench` at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from flashdraft.engine.engine import Engine
from flashdraft.engine.proposers import DFlashProposer, Proposer
from flashdraft.engine.sequence import GenerationConfig, GenerationResult, prompt_tensor
from flashdraft.models.draft import DFlashDraft
from flashdraft.models.target import Target

__all__ = ["GenerationConfig", "GenerationResult", "generate", "generate_batch", "prompt_tensor"]


@torch.inference_mode()
def generate(
    target: Target,
    prompt_ids: Sequence[int] | torch.Tensor,
    proposer: Proposer | None = None,
    config: GenerationConfig | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """One prompt (a list of ids, a tensor or a tokenizer's BatchEncoding) through the engine at batch 1.
    `on_tokens` receives the tokens of every step as they are committed (for streaming)."""
    cfg = config or GenerationConfig()
    block = cfg.block_size if cfg.block_size is not None else (proposer.block_size if proposer else 1)
    engine = Engine(target, proposer if block > 1 else None, block, max_batch_size=1)
    row = engine.add("0", prompt_ids, cfg)
    while engine.pending():
        for out in engine.step():
            if on_tokens and out.tokens:
                on_tokens(out.tokens)
    return row.result()


def generate_batch(
    target: Target,
    prompts: list[Sequence[int]],
    draft: DFlashDraft | None = None,
    config: GenerationConfig | Sequence[GenerationConfig] | None = None,
    block_size: int | None = None,
    max_batch_size: int | None = None,
    proposer: Proposer | None = None,
    proposal: str = "draft",
) -> list[GenerationResult]:
    """All prompts through one engine (by default all at once); results in prompt order.
    `config` is one config for every prompt or one per prompt."""
    configs = (
        [config or GenerationConfig()] * len(prompts) if not isinstance(config, Sequence) else list(config)
    )
    if len(configs) != len(prompts):
        raise ValueError(
            f"got {len(configs)} configs for {len(prompts)} prompts: pass one, or one per prompt"
        )
    if draft is not None and proposer is not None:
        raise ValueError("pass a draft or a proposer, not both")
    if draft is not None:
        proposer = DFlashProposer(draft, target, proposal)
    engine = Engine(target, proposer, block_size, max_batch_size or max(1, len(prompts)))
    rows = [
        engine.add(str(i), prompt, cfg) for i, (prompt, cfg) in enumerate(zip(prompts, configs, strict=True))
    ]
    while engine.pending():
        engine.step()
    return [row.result() for row in rows]
