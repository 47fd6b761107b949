"""Write the files that scripts/gpu_train.sh carries to a GPU box (no network, no data packages).

    python scripts/export_prompts.py [--gsm 4000] [--sharegpt 4000] [--corpus 3000 --corpus-skip 2000]

data/prompts-train.jsonl: gsm-symbolic (seeds 2.., never the evaluation seed), every code-stdlib
function and the first ShareGPT training prompts; data/prompts-eval-gsm.jsonl: gsm-symbolic-eval;
data/corpus-sharegpt.npz (with --corpus N): N teacher-forced ShareGPT (prompt, recorded answer) pairs in
SmolLM2's chat template, after skipping --corpus-skip (the CPU campaign used the first 2,000), packed
(about 2 MB a thousand pairs): `flashdraft train --data sharegpt` without the sharegpt package.
"""

import argparse
import json
import tempfile
from pathlib import Path

from flashdraft.data import load_dataset, write_prompts

ROOT = Path(__file__).resolve().parent.parent / "data"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gsm", type=int, default=4000, help="gsm-symbolic problems (seed 2)")
    p.add_argument("--sharegpt", type=int, default=4000, help="ShareGPT training prompts")
    p.add_argument("--corpus", type=int, default=0, help="teacher-forced ShareGPT pairs to pack (0: none)")
    p.add_argument("--corpus-skip", type=int, default=2000, help="pairs of the corpus skipped first")
    args = p.parse_args()
    if args.corpus:
        export_corpus(args.corpus, args.corpus_skip, ROOT / "corpus-sharegpt.npz")
    train = (
        load_dataset("gsm-symbolic", limit=args.gsm, seed=2)
        + load_dataset("code-stdlib")
        + load_dataset("sharegpt-train", limit=args.sharegpt)
    )
    ROOT.mkdir(exist_ok=True)
    write_prompts(train, ROOT / "prompts-train.jsonl")
    write_prompts(load_dataset("gsm-symbolic-eval", limit=64), ROOT / "prompts-eval-gsm.jsonl")
    print(f"wrote {len(train)} training prompts and 64 evaluation prompts under {ROOT}")


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
