"""Offline acceptance: how many tokens a draft would get accepted, without running the decode loop.

The real loop (`train.evaluate_tau`) is the measure that counts, but it costs a target forward per
step and one draft pass per block: minutes per evaluation on a CPU. With greedy decoding the target's
output does not depend on the draft, so it can be computed once (`greedy_references`) and kept. A
draft is then scored on it in one target forward per sequence (features) and one draft pass over
many blocks at once: at every anchor among the response positions, the draft's block is compared
with the target's own next tokens, and the acceptance length is one plus the leading matches, as the
verifier would count it. The mean over anchors estimates tau; it weights every response position
alike, where the real loop visits only the positions its own acceptances land on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from flashdraft.engine import tree
from flashdraft.engine.decode import GenerationConfig, generate_batch
from flashdraft.files import write_text
from flashdraft.models.draft import DFlashDraft
from flashdraft.models.target import Target
from flashdraft.train.loss import build_batch, draft_hidden, target_features


def greedy_references(
    target: Target, prompts: dict[str, list[list[int]]], max_new_tokens: int, batch_size: int = 16
) -> list[dict]:
    """The target's own greedy continuation of each prompt (plain decoding through the batched
    decoder, cut at a stop id), as records with `set`, `prompt_ids` and `response_ids`."""
    items = [(name, p) for name, group in prompts.items() for p in group if len(p) < target.max_length]
    configs = [
        GenerationConfig(
            max_new_tokens=min(max_new_tokens, target.max_length - len(p)), stop_ids=target.stop_ids
        )
        for _, p in items
    ]
    results = generate_batch(
        target, [p for _, p in items], config=configs, block_size=1, max_batch_size=batch_size
    )
    return [
        {"set": name, "prompt_ids": list(p), "response_ids": list(r.tokens)}
        for (name, p), r in zip(items, results, strict=True)
    ]


def write_references(records: list[dict], path: str | os.PathLike) -> None:
    write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def read_references(path: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _block_logits(draft, target, prompt_ids, response_ids, chunk: int, context_vocab: bool):
    """The draft's logits at every anchor among the response positions, `chunk` anchors at a time:
    yields (anchors, logits (anchors, B, V), ids of the whole sequence)."""
    b = draft.config.block_size
    ids = torch.tensor(list(prompt_ids) + list(response_ids), dtype=torch.long)
    n_prompt, n = len(prompt_ids), ids.numel()
    mask = torch.zeros(n, dtype=torch.bool)
    mask[n_prompt:] = True
    feats = None
    for part in torch.arange(n_prompt, n - 1).split(chunk):
        batch = build_batch([(ids, mask)], [part], b, draft.config.mask_token_id, 1.0).to(target.device)
        if feats is None:
            feats = target_features(target, batch, draft.config.target_layer_ids)
        hidden = draft_hidden(draft, target, batch, draft.fc.weight.dtype, feats)
        context = [ids[: p + 1] for p in part.tolist()] if context_vocab and draft.vocab is not None else None
        yield (
            part,
            draft.propose_logits(hidden.to(target.dtype).view(len(part), b, -1), target.lm_head, context),
            ids,
        )


@torch.no_grad()
def acceptance_lengths(
    draft: DFlashDraft,
    target: Target,
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    chunk: int = 64,
    context_vocab: bool = False,
) -> torch.Tensor:
    """The tokens the verifier would commit with the anchor at each response position p (all but the
    last): 1 + the drafted tokens of p+1..p+B-1 that match the reference before the first miss, capped
    by what is left of the reference (as the loop caps by its remaining room).

    The anchor at p sees target features of positions < p, exactly the training layout (whose equality
    with the inference forward is tested). Anchors go through the draft `chunk` at a time. `context_vocab`:
    the tokens up to each anchor join the draft vocabulary, as `DFlashProposer(context_vocab=True)` does."""
    b, out = draft.config.block_size, []
    for part, logits, ids in _block_logits(draft, target, prompt_ids, response_ids, chunk, context_vocab):
        n = ids.numel()
        guess = logits.argmax(-1)[:, 1:].cpu()
        pos = part[:, None] + torch.arange(1, b)  # the positions each block drafts
        hit = (guess == ids[pos.clamp(max=n - 1)]) & (pos < n)
        accepted = torch.cumprod(hit.long(), dim=1).sum(1)
        out.append(torch.minimum(accepted + 1, n - 1 - part))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def tree_accepted(probs: list[list[float]], tokens: list[list[int]], truth: list[int], budget: int) -> int:
    """Tokens a greedy verify commits with a tree of `budget` drafted tokens built best-first from the
    block's marginals (`flashdraft.engine.tree.build`): probs[d] / tokens[d], the top candidates of block
    position d + 1, most likely first. The verify accepts the deepest node whose path equals the target's
    own next tokens `truth`, plus its bonus token. A chain is the tree whose every node has one child
    (budget = block size - 1)."""
    depth = min(len(probs), len(truth))
    drafted = tree.build(probs[:depth], tokens[:depth], budget)
    depths = [0, *drafted.depths()]
    path, _ = tree.walk(drafted, lambda i: truth[depths[i]] if depths[i] < depth else -1)
    return len(path) + 1


@torch.no_grad()
def tree_lengths(
    draft: DFlashDraft, target: Target, prompt_ids, response_ids, budgets: Sequence[int], chunk: int = 64
) -> dict[int, torch.Tensor]:
    """`acceptance_lengths` for trees of each budget (`tree_accepted`), capped the same way."""
    b, top = draft.config.block_size, max(budgets)
    out: dict[int, list[int]] = {n: [] for n in budgets}
    for part, logits, ids in _block_logits(draft, target, prompt_ids, response_ids, chunk, False):
        probs, tokens = logits[:, 1:].float().softmax(-1).topk(min(top, logits.shape[-1]), -1)
        n = ids.numel()
        for i, p in enumerate(part.tolist()):
            truth = ids[p + 1 : min(n, p + b)].tolist()
            pr, tk = probs[i].tolist(), tokens[i].tolist()
            for budget in budgets:
                out[budget].append(min(tree_accepted(pr, tk, truth, budget), n - 1 - p))
    return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}


def walk(lengths: torch.Tensor) -> list[int]:
    """The commits of the greedy loop through a reference whose per-anchor commits are `lengths`
    (index 0 = the first response token): it starts at the first and jumps by each commit."""
    p, visited = 0, []
    while p < lengths.numel():
        visited.append(int(lengths[p]))
        p += visited[-1]
    return visited


def position_acceptance(lengths: Sequence[int], block_size: int) -> list[float]:
    """Entry k-1: the share of decode steps whose drafted token at block position k was accepted (the step
    committed more than k tokens), k = 1 .. block_size - 1. Unconditional, hence non-increasing in k; it
    shows where a draft's acceptance ends, which tau alone hides."""
    top = max([block_size, *lengths])
    return [sum(n > k for n in lengths) / len(lengths) if lengths else float("nan") for k in range(1, top)]


def offline_tau(
    draft: DFlashDraft, target: Target, references: list[dict], context_vocab: bool = False
) -> dict:
    """Per set and pooled: "tau", the real greedy loop's tau on these references (committed tokens per
    step, by walking the anchors it would visit), "tau_all", the mean over every anchor, and
    "position_acceptance" of the walked steps (`position_acceptance`)."""
    walked: dict[str, list[int]] = {}
    every: dict[str, list[torch.Tensor]] = {}
    for r in references:
        lengths = acceptance_lengths(
            draft, target, r["prompt_ids"], r["response_ids"], context_vocab=context_vocab
        )
        name = r.get("set", "all")
        walked.setdefault(name, []).extend(walk(lengths))
        every.setdefault(name, []).append(lengths.double())
    steps = [n for v in walked.values() for n in v]
    out = {"tau": sum(steps) / max(1, len(steps))}
    pooled = torch.cat([torch.cat(v) for v in every.values()]) if every else torch.zeros(1)
    out["tau_all"] = float(pooled.mean())
    for name, v in walked.items():
        out[f"tau/{name}"] = sum(v) / max(1, len(v))
        out[f"tau_all/{name}"] = float(torch.cat(every[name]).mean())
    out["anchors"] = int(pooled.numel())
    out["position_acceptance"] = [round(x, 4) for x in position_acceptance(steps, draft.config.block_size)]
    return out


def offline_trees(draft: DFlashDraft, target: Target, references: list[dict], budgets: Sequence[int]) -> dict:
    """Per set and pooled, for trees of each budget (`tree_lengths`): "tau" (walked, as the real loop
    visits anchors) and "tau_all" (every anchor), keyed "tree<budget>/..." like `offline_tau`'s."""
    walked: dict[tuple[int, str], list[int]] = {}
    every: dict[tuple[int, str], list[torch.Tensor]] = {}
    for r in references:
        lengths = tree_lengths(draft, target, r["prompt_ids"], r["response_ids"], budgets)
        for budget, v in lengths.items():
            for name in (r.get("set", "all"), "all"):
                walked.setdefault((budget, name), []).extend(walk(v))
                every.setdefault((budget, name), []).append(v.double())
    out = {}
    for (budget, name), v in walked.items():
        out[f"tree{budget}/tau/{name}"] = sum(v) / max(1, len(v))
        out[f"tree{budget}/tau_all/{name}"] = float(torch.cat(every[budget, name]).mean())
    return out
