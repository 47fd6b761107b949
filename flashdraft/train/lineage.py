"""How often a draft's lineage has read each data source, and the view budget that keeps it from
memorising a small data set.

A draft continued sitting after sitting (`--init-draft`) sees the same files again unless something
counts: the SmolLM2 campaign read its 304 gsm-symbolic answers 46 times and its 197 code answers 31
times, and its training loss kept falling at every epoch boundary while held-out tau stood still. So
the trainer keeps, beside each draft it saves, `lineage.json`: every source any ancestor trained on,
with how many times its sequences were drawn ("views": draws / sequences). A run reads its
`--init-draft`'s lineage and draws each source at most `--max-views` times over the whole lineage;
when every source is spent the run ends early and says so.

A source is known by its content (a hash of its records' ids and token ids), not by its file name:
the same answers packed or as JSONL are one source; other answers to the same prompts are another.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

from flashdraft.files import write_json

LINEAGE_NAME = "lineage.json"
FORMAT = 1


def source_key(records: Sequence[dict]) -> str:
    """A source's identity: sha256 (first 16 hex digits) of its records' ids, prompts and responses."""
    h = hashlib.sha256()
    for r in sorted(records, key=lambda r: r["id"]):
        h.update(json.dumps([r["id"], list(r["prompt_ids"]), list(r["response_ids"])]).encode())
    return h.hexdigest()[:16]


def read_lineage(draft_dir: str | Path | None) -> dict[str, dict]:
    """The sources a draft's lineage read, by key ({} for a draft without a lineage file)."""
    if draft_dir is None:
        return {}
    path = Path(draft_dir) / LINEAGE_NAME
    if not path.is_file():
        return {}
    return {s["key"]: s for s in json.loads(path.read_text())["sources"]}


def allowed_draws(sources: Sequence[dict], prior: dict[str, dict], max_views: float) -> list[int] | None:
    """Per source of this run ({"key", "sequences"}), how many more draws the budget leaves (None: no
    budget). A source read `max_views` times already gets 0."""
    if not max_views:
        return None
    out = []
    for s in sources:
        seen = prior.get(s["key"], {}).get("views", 0.0)
        out.append(max(0, math.floor((max_views - seen) * s["sequences"] + 1e-9)))
    return out


def lineage_after(
    sources: Sequence[dict], draws: Sequence[int], prior: dict[str, dict], max_views: float
) -> dict:
    """The lineage of a draft that started from `prior` and drew `draws[g]` sequences of this run's
    source g: the ancestors' sources kept, this run's views added."""
    merged = {k: dict(v) for k, v in prior.items()}
    for s, n in zip(sources, draws, strict=True):
        old = merged.get(s["key"], {})
        views = old.get("views", 0.0) + n / max(1, s["sequences"])
        merged[s["key"]] = {
            "key": s["key"],
            "name": s["name"],
            "sequences": s["sequences"],
            "response_tokens": s.get("response_tokens"),
            "views": round(views, 3),
        }
    return {"format": FORMAT, "max_views": max_views, "sources": list(merged.values())}


def write_lineage(draft_dir: str | Path, lineage: dict) -> None:
    write_json(Path(draft_dir) / LINEAGE_NAME, lineage, indent=1)


def describe(lineage: dict) -> list[str]:
    """One line per source, most read first: for logs and model cards."""
    rows = sorted(lineage["sources"], key=lambda s: -s["views"])
    return [f"{s['views']:6.2f} views  {s['sequences']:6d} sequences  {s['name']} ({s['key']})" for s in rows]
