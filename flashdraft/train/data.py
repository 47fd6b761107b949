"""Training data: records from datagen files and text corpora, held-out prompts, mixes, epochs and anchors.

Everything random is derived from (seed, epoch, sequence index), so the data order and the anchors of any
step are known without replaying the run."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from flashdraft.train.config import TrainConfig, TrainError, data_source
from flashdraft.train.lineage import source_key


@dataclass
class Sequence:
    id: str
    ids: torch.Tensor  # (S,) int64: prompt + response, truncated to max_len
    loss_mask: torch.Tensor  # (S,) bool: True on response tokens
    n_prompt: int
    source: int = 0  # index of its --data item


def is_corpus(name: str) -> bool:
    from flashdraft.data import CORPORA, EVAL_SETS

    return not Path(name).exists() and (name in CORPORA or name in EVAL_SETS)


def corpus_records(
    name: str,
    tokenizer,
    limit: int | None,
    seed: int = 0,
    skip: int = 0,
    template_kwargs: dict | None = None,
    progress: bool = True,
) -> list[dict]:
    """Records of a text corpus (`data.CORPORA`): each prompt through the chat template, and its recorded
    answer as the response, as the template renders an assistant turn. No regeneration: with --distill
    the labels are the target's own distributions over this text (teacher forcing)."""
    from flashdraft.chat import chat_ids
    from flashdraft.data import DataError, load_corpus

    if tokenizer is None:
        raise TrainError(f"--data {name}: a corpus needs the target's tokenizer, and this target has none")
    try:
        pairs = load_corpus(name, limit, seed, skip)
    except DataError as e:
        raise TrainError(f"--data {name}: {e}") from None
    eos = tokenizer.eos_token_id
    records = []
    for ex, answer in tqdm(
        pairs, desc=f"tokenizing {name}", unit="pair", leave=False, disable=not progress or len(pairs) < 500
    ):
        msgs = ex.asked()
        prompt = chat_ids(tokenizer, msgs, template_kwargs)
        full = chat_ids(tokenizer, msgs + [{"role": "assistant", "content": answer}], template_kwargs, False)
        if full[: len(prompt)] == prompt:
            response = full[len(prompt) :]
            if eos in response:  # what follows the end of turn is never generated
                response = response[: response.index(eos) + 1]
        else:
            response = tokenizer.encode(answer, add_special_tokens=False) + ([eos] if eos is not None else [])
        records.append(
            {
                "id": ex.id,
                "prompt_ids": prompt,
                "response_ids": response,
                "loss_mask": [0] * len(prompt) + [1] * len(response),
            }
        )
    return records


def read_records(path: str | os.PathLike, vocab_size: int) -> list[dict]:
    """Records of a datagen JSONL or packed .npz file, through datagen's reader (ids inside the target's
    vocabulary, a consistent loss mask; id, dataset and finish optional), its errors as TrainError."""
    from flashdraft.train.datagen import DataGenError
    from flashdraft.train.datagen import read_records as read_datagen_records

    try:
        return list(read_datagen_records(path, vocab_size, complete=False))
    except DataGenError as e:
        raise TrainError(str(e)) from None


def prepare_data(
    cfg: TrainConfig, vocab_size: int, tokenizer=None
) -> tuple[list[Sequence], dict[str, list[list[int]]], dict]:
    """Training sequences, evaluation prompts by set, and counts. The last `eval_prompts` records
    are held out (never trained on) unless `eval_data` names the evaluation sets: datagen files or
    built-in data set names (`gsm-symbolic-eval,humaneval`), `eval_prompts` from each."""
    records, groups, sources = [], [], []
    for item in cfg.data:
        name, weight = data_source(item)
        part = (
            corpus_records(
                name,
                tokenizer,
                cfg.corpus_limit,
                cfg.seed,
                cfg.corpus_skip,
                cfg.chat_template_kwargs,
                cfg.progress,
            )
            if is_corpus(name)
            else read_records(name, vocab_size)
        )
        records += [r | {"source": len(groups)} for r in part]
        groups.append(weight)
        label = f"{name} (pairs {cfg.corpus_skip}+, limit {cfg.corpus_limit})" if is_corpus(name) else name
        sources.append({"key": source_key(part), "name": label})
    if not records:
        raise TrainError(f"no records in {', '.join(cfg.data)}")
    if not any(any(r["loss_mask"]) for r in records):
        raise TrainError(
            f"no record in {', '.join(cfg.data)} has response tokens (loss_mask is 0 everywhere): "
            "the draft only learns responses; regenerate the data with `flashdraft datagen`"
        )
    held_out: list[dict] = []
    eval_sets: dict[str, list[list[int]]] = {}
    if cfg.eval_refs:
        from flashdraft.train.acceptance import read_references

        for r in read_references(cfg.eval_refs):
            eval_sets.setdefault(r.get("set", "refs"), []).append(r["prompt_ids"])
    elif cfg.eval_data:
        for item in (x for x in cfg.eval_data.split(",") if x):
            if Path(item).is_file() and not _is_prompt_file(item):
                eval_sets[Path(item).stem] = [
                    r["prompt_ids"]
                    for r in read_records(item, vocab_size)[: cfg.eval_prompts]
                    if r["prompt_ids"]
                ]
            else:
                eval_sets[item] = dataset_prompts(item, cfg.eval_prompts, tokenizer, cfg.chat_template_kwargs)
    elif cfg.eval_prompts:
        if cfg.eval_prompts >= len(records):
            raise TrainError(
                f"--eval-prompts {cfg.eval_prompts} would hold out all {len(records)} records: "
                "lower it or pass --eval-data"
            )
        records, held_out = records[: -cfg.eval_prompts], records[-cfg.eval_prompts :]
    if held_out:
        eval_sets["held-out"] = [r["prompt_ids"] for r in held_out if r["prompt_ids"]]
    seen = {tuple(p) for prompts in eval_sets.values() for p in prompts}
    leaked = [r["id"] for r in records if tuple(r["prompt_ids"]) in seen]
    if leaked:
        raise TrainError(
            f"{len(leaked)} training record(s) ask an evaluation prompt (first: {leaked[0]}): evaluation "
            "prompts can never be trained on; drop them from the data or evaluate on other prompts"
        )
    need = 2 * cfg.block_size
    seqs, dropped, longest = [], 0, 0
    for r in records:
        ids = torch.tensor(r["prompt_ids"] + r["response_ids"], dtype=torch.long)[: cfg.max_len]
        mask = torch.tensor(r["loss_mask"], dtype=torch.bool)[: cfg.max_len]
        n_resp = int(mask.sum())
        longest = max(longest, n_resp)
        if n_resp < need:
            dropped += 1
            continue
        seqs.append(Sequence(r["id"], ids, mask, len(r["prompt_ids"]), r["source"]))
    if not seqs:
        raise TrainError(
            f"block size {cfg.block_size} cannot fit: no sequence has 2 x {cfg.block_size} = {need} response "
            f"tokens within --max-len {cfg.max_len} (the longest has {longest}); lower --block-size or use "
            "longer responses"
        )
    stats = {
        "records": len(records),
        "sequences": len(seqs),
        "dropped_short": dropped,
        "held_out": 0 if cfg.eval_data or cfg.eval_refs else len(held_out),
        "eval_prompts": sum(map(len, eval_sets.values())),
        "tokens": sum(s.ids.numel() for s in seqs),
        "response_tokens": sum(int(s.loss_mask.sum()) for s in seqs),
        "weights": groups if any(w is not None for w in groups) else None,
        # Per --data item: its content key and trained sequences, for the view budget (train.lineage).
        "sources": [
            s
            | {
                "sequences": sum(q.source == g for q in seqs),
                "response_tokens": sum(int(q.loss_mask.sum()) for q in seqs if q.source == g),
            }
            for g, s in enumerate(sources)
        ],
    }
    return seqs, eval_sets, stats


def _is_prompt_file(path: str) -> bool:
    """A `data.write_prompts` file (prompts only), not datagen records."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return path.endswith(".jsonl") and '"turns"' in f.readline()


def dataset_prompts(name: str, n: int, tokenizer, template_kwargs: dict | None = None) -> list[list[int]]:
    """The first `n` prompts of a built-in data set, through the target's chat template."""
    from flashdraft.chat import chat_ids
    from flashdraft.data import DataError, load_dataset

    if tokenizer is None:
        raise TrainError(
            f"--eval-data {name}: not a file, and this target has no tokenizer to ask a data set with"
        )
    try:
        return [chat_ids(tokenizer, ex.messages(), template_kwargs) for ex in load_dataset(name, limit=n)[:n]]
    except DataError as e:
        raise TrainError(f"--eval-data {name} is neither a file nor a usable data set: {e}") from None


def file_fingerprint(paths: list[str]) -> list[str]:
    """What `--resume` compares: each data file's sha256; a corpus by its name (its package is pinned)."""
    out = []
    for item in paths:
        p, weight = data_source(item)
        if is_corpus(p):
            out.append(f"corpus:{item}")
            continue
        h = hashlib.sha256()
        try:
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except OSError as e:
            raise TrainError(f"cannot read data file {p}: {e}") from None
        out.append(h.hexdigest())
    return out


def _generator(*key) -> torch.Generator:
    """A generator seeded from a key (seed, purpose, epoch, ...): the same on every rank and sitting."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def epoch_mix(sources: list[int], weights: list[float], seed: int, epoch: int) -> list[int]:
    """The sequences of one epoch under mixing weights: as many sequences as there are in all, a
    `w / sum(w)` share of them from each source (drawn without replacement, cycling through a small
    source in fresh permutations), so the mix holds whatever the sources' sizes."""
    out = []
    for g, w in enumerate(weights):
        members = [i for i, s in enumerate(sources) if s == g]
        want, picked = round(len(sources) * w / sum(weights)), []
        while members and len(picked) < want:
            perm = torch.randperm(len(members), generator=_generator(seed, "mix", epoch, g, len(picked)))
            picked += [members[i] for i in perm.tolist()]
        out += picked[:want]
    return out


def plan_epochs(
    sources: list[int],
    lengths: list[int],
    weights: list[float] | None,
    seed: int,
    epochs: int,
    batch_tokens: int,
    allowed: list[int] | None = None,
) -> list[list[list[int]]]:
    """Every epoch's batches (`epoch_mix`, `epoch_batches`). `allowed[g]`: the draws source g has left
    under the view budget (`train.lineage`); an epoch takes no more than that from it, so once a source
    is spent later epochs shrink, and they end empty when every source is."""
    left = list(allowed) if allowed is not None else None
    plans = []
    for epoch in range(epochs):
        members = list(range(len(sources))) if weights is None else epoch_mix(sources, weights, seed, epoch)
        if left is not None:
            kept = []
            for i in members:
                if left[sources[i]] > 0:
                    left[sources[i]] -= 1
                    kept.append(i)
            members = kept
        plans.append(epoch_batches(lengths, batch_tokens, seed, epoch, members) if members else [])
    return plans


def drawn(plans: list[list[list[int]]], sources: list[int], steps: int, n_sources: int) -> list[int]:
    """How many sequences of each source the first `steps` batches of `plans` draw."""
    out = [0] * n_sources
    for batch in [b for plan in plans for b in plan][:steps]:
        for i in batch:
            out[sources[i]] += 1
    return out


def epoch_batches(
    lengths: list[int], batch_tokens: int, seed: int, epoch: int, members: list[int] | None = None
) -> list[list[int]]:
    """The global batches of one epoch: sequence indices (all, or `members`, see `epoch_mix`) in a
    shuffled order, packed greedily up to `batch_tokens` tokens per batch (a longer sequence gets a
    batch of its own)."""
    perm = torch.randperm(
        len(lengths) if members is None else len(members), generator=_generator(seed, "order", epoch)
    )
    order = perm.tolist() if members is None else [members[i] for i in perm.tolist()]
    batches, cur, tokens = [], [], 0
    for i in order:
        if cur and tokens + lengths[i] > batch_tokens:
            batches.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += lengths[i]
    if cur:
        batches.append(cur)
    return batches


def sample_anchors(
    loss_mask: torch.Tensor, block_size: int, max_anchors: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Sorted anchor positions: up to `max_anchors` response positions p with p <= S - B, drawn
    without replacement."""
    n = loss_mask.numel()
    candidates = loss_mask[: max(0, n - block_size + 1)].nonzero().flatten()
    if candidates.numel() > max_anchors:
        candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:max_anchors]]
    return candidates.sort().values


def head_rows(
    seqs: list[Sequence], n: int, vocab_size: int, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """The `n` most frequent response tokens of the data (ties by id), joined with `keep` (the vocabulary of
    the draft training continues from: a continued draft never loses a token it could propose), and the
    share of response tokens they cover: a softmax over them costs rows/V of the full LM head, which
    dominates a CPU step."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.ids[s.loss_mask], minlength=vocab_size)
    rows = torch.argsort(counts, descending=True, stable=True)[: min(n, vocab_size)]
    if keep is not None:
        rows = torch.cat([rows, keep.to(rows)])
    rows = torch.unique(rows)  # sorted
    return rows, float(counts[rows].sum()) / max(1, int(counts.sum()))
