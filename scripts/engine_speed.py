"""Batch-1 decode speed of this tree against an older commit, A/B in one process (issue 12, acceptance 2).

Both trees' `generate` run alternately, round after round, on twin copies of one random Llama target
(about 100M parameters) and one 2-layer DFlash draft, so that the machine's drift (clock, other load)
hits both alike: separate processes, one after the other, differed by 30% between rounds on our 2-core
machine. The older tree is imported under another package name (its imports are all relative).
Prints per round the paired ratio of decode time, then the medians; goal: after / before <= 1.03.

    python scripts/engine_speed.py [--before /tmp/flashdraft-28efc1d] [--rounds 8] [--dtype float32]

`git worktree add /tmp/flashdraft-28efc1d 28efc1d` makes the default older tree.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import flashdraft as after  # noqa: E402
from flashdraft.draft import init_draft_config  # noqa: E402


def import_tree(root: Path, name: str):
    """The `flashdraft` package of another checkout, as module `name`."""
    init = root / "flashdraft" / "__init__.py"
    if not init.exists():
        sys.exit(f"no flashdraft package under {root}: git worktree add {root} <commit>")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build(pkg, model, draft_state, cfg, block_size, dtype):
    draft_cfg = sys.modules[pkg.__name__ + ".draft"].init_draft_config(
        cfg, 2, mask_token_id=0, block_size=block_size
    )
    draft = pkg.DFlashDraft(draft_cfg).to(dtype)
    draft.load_state_dict(draft_state)
    target = pkg.Target(model)
    return target, pkg.DFlashProposer(draft, target)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, default=Path("/tmp/flashdraft-28efc1d"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    before = import_tree(args.before, "flashdraft_before")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    state = after.DFlashDraft(
        init_draft_config(cfg, 2, mask_token_id=0, block_size=args.block_size)
    ).state_dict()
    trees = {
        "before": (before, *build(before, copy.deepcopy(model), state, cfg, args.block_size, dtype)),
        "after": (after, *build(after, model, state, cfg, args.block_size, dtype)),
    }
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt,)).tolist()
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    print(f"{cpu}, {torch.get_num_threads()} threads, {args.dtype}; before: {args.before}; after: {ROOT}")
    print(
        f"target 100M-parameter random Llama, 2-layer draft, block {args.block_size}, {args.new} new tokens"
    )
    modes = {"greedy": dict(), "sampling t=0.8 top-p=0.9": dict(temperature=0.8, top_p=0.9)}
    for mode, sampling in modes.items():

        def run(name, n_new, sampling=sampling):
            pkg, target, proposer = trees[name]
            config = pkg.GenerationConfig(n_new, args.block_size, pkg.SamplingConfig(**sampling), seed=0)
            return pkg.generate(target, prompt, proposer, config)

        for name in trees:  # warm-up
            run(name, 8)
        steps = {name: [] for name in trees}
        ratios = []
        for r in range(args.rounds):
            res = {}
            for name in list(trees)[:: 1 if r % 2 else -1]:  # alternate who goes first
                res[name] = run(name, args.new)
                steps[name] += res[name].step_s
            if not sampling:
                assert res["before"].tokens == res["after"].tokens, "the two trees decode different tokens"
            ratios.append(res["after"].decode_s / res["before"].decode_s)
            print(
                f"{mode}, round {r + 1}: decode {res['before'].decode_s:.2f} s before, "
                f"{res['after'].decode_s:.2f} s after: {ratios[-1]:.3f}"
            )
        med = {name: statistics.median(s) * 1e3 for name, s in steps.items()}
        print(
            f"{mode}: median step {med['before']:.1f} ms before, {med['after']:.1f} ms after "
            f"({med['after'] / med['before']:.3f}); decode time after / before, median of {args.rounds} "
            f"paired rounds: {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
