"""Write the files that scripts/gpu_train.sh carries to a GPU box (no network, no data packages).

    python scripts/export_prompts.py [--turns 24000] [--gsm 4000 --gsm-seed 4] [--sharegpt 0]
                                     [--corpus 3000 --corpus-skip 2000]

data/prompts-train.jsonl, in a shuffled order (a time-limited datagen answers a sample of it): later turns of
ShareGPT training conversations, each with its recorded history (the multi-turn chat that first-turn
prompts lack), gsm-symbolic problems of a seed the committed data has not used (never the evaluation
seed) and, with --sharegpt N, first-turn ShareGPT training prompts after --sharegpt-skip (the committed
regenerated files answered most of the 9,139); data/prompts-code.jsonl: every code-stdlib function and
method prompt (answered greedily before: the GPU box samples them); data/prompts-eval-gsm.jsonl:
gsm-symbolic-eval; data/corpus-sharegpt.npz (with --corpus N): N teacher-forced ShareGPT (prompt,
recorded answer) pairs in SmolLM2's chat template, after skipping --corpus-skip, packed (about 2 MB a
thousand pairs): `flashdraft train --data sharegpt` without the sharegpt package.
"""

import argparse
import json
import random
import tempfile
from pathlib import Path

from flashdraft.data import load_corpus, load_dataset, write_prompts

ROOT = Path(__file__).resolve().parent.parent / "data"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=24000, help="later ShareGPT turns (with their history)")
    p.add_argument("--turns-skip", type=int, default=0, help="later turns skipped first")
    p.add_argument("--gsm", type=int, default=4000, help="gsm-symbolic problems")
    p.add_argument("--gsm-seed", type=int, default=4, help="the committed data used seeds 0-3")
    p.add_argument("--sharegpt", type=int, default=0, help="first-turn ShareGPT training prompts")
    p.add_argument("--sharegpt-skip", type=int, default=0, help="first-turn prompts skipped first")
    p.add_argument("--corpus", type=int, default=0, help="teacher-forced ShareGPT pairs to pack (0: none)")
    p.add_argument("--corpus-skip", type=int, default=2000, help="pairs of the corpus skipped first")
    p.add_argument("--seed", type=int, default=0, help="the shuffle of prompts-train.jsonl")
    args = p.parse_args()
    if args.corpus:
        export_corpus(args.corpus, args.corpus_skip, ROOT / "corpus-sharegpt.npz")
    turns = [ex for ex, _ in load_corpus("sharegpt-turns", limit=args.turns, skip=args.turns_skip)]
    first = load_dataset("sharegpt-train", limit=args.sharegpt_skip + args.sharegpt)[args.sharegpt_skip :]
    gsm = load_dataset("gsm-symbolic", limit=args.gsm, seed=args.gsm_seed) if args.gsm else []
    train = turns + first + gsm
    random.Random(args.seed).shuffle(train)
    code = load_dataset("code-stdlib") + load_dataset("code-stdlib-methods")
    ROOT.mkdir(exist_ok=True)
    write_prompts(train, ROOT / "prompts-train.jsonl")
    write_prompts(code, ROOT / "prompts-code.jsonl")
    write_prompts(load_dataset("gsm-symbolic-eval", limit=64), ROOT / "prompts-eval-gsm.jsonl")
    print(
        f"wrote {len(train)} training prompts ({len(turns)} later turns, {len(first)} first turns, {len(gsm)} "
        f"gsm-symbolic), {len(code)} code prompts and 64 evaluation prompts under {ROOT}"
    )


def export_corpus(n: int, skip: int, out: Path) -> None:
    from transformers import AutoTokenizer

    from flashdraft.models.load import ensure_converted
    from flashdraft.train.data import corpus_records
    from flashdraft.train.datagen import make_record, pack

    tok = AutoTokenizer.from_pretrained(ensure_converted("smollm2-135m-instruct"), local_files_only=True)
    records = corpus_records("sharegpt", tok, limit=n, skip=skip)
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = Path(tmp) / "corpus.jsonl"
        rows = (make_record(r["id"], "sharegpt", r["prompt_ids"], r["response_ids"], "stop") for r in records)
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
        info = pack([jsonl], out)
    print(
        f"wrote {out}: {info['records']} records, {info['response_tokens']} response tokens, {info['bytes']} bytes"
    )


if __name__ == "__main__":
    main()
