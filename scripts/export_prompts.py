"""Write the prompt files that scripts/gpu_train.sh carries to a GPU box (no network, no data packages).

    python scripts/export_prompts.py [--gsm 4000] [--sharegpt 4000]

data/prompts-train.jsonl: gsm-symbolic (seeds 2.., never the evaluation seed), every code-stdlib
function and the first ShareGPT training prompts; data/prompts-eval-gsm.jsonl: gsm-symbolic-eval.
"""

import argparse
from pathlib import Path

from flashdraft.data import load_dataset, write_prompts

ROOT = Path(__file__).resolve().parent.parent / "data"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gsm", type=int, default=4000, help="gsm-symbolic problems (seed 2)")
    p.add_argument("--sharegpt", type=int, default=4000, help="ShareGPT training prompts")
    args = p.parse_args()
    train = (
        load_dataset("gsm-symbolic", limit=args.gsm, seed=2)
        + load_dataset("code-stdlib")
        + load_dataset("sharegpt-train", limit=args.sharegpt)
    )
    ROOT.mkdir(exist_ok=True)
    write_prompts(train, ROOT / "prompts-train.jsonl")
    write_prompts(load_dataset("gsm-symbolic-eval", limit=64), ROOT / "prompts-eval-gsm.jsonl")
    print(f"wrote {len(train)} training prompts and 64 evaluation prompts under {ROOT}")


if __name__ == "__main__":
    main()
