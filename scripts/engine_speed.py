"""Batch-1 decode speed of this tree against an older commit, A/B in one process (issue 12, acceptance 2).

Both trees' `generate` run alternately, round after round, on twin copies of one random Llama target
(about 100M parameters) and one 2-layer DFlash draft, so that the machine's drift (clock, other load)
hits both alike: separate processes, one after the other, differed by 30% between rounds on our 2-core
machine. The older tree is imported under another package name (its imports are all relative).
Prints per round the paired ratio of prefill and decode time (decode time alone before 2026-12-02),
then the medians; goal: after / before <= 1.03.

    python scripts/engine_speed.py [--before /tmp/flashdraft-28efc1d] [--rounds 8] [--dtype float32]
    python scripts/engine_speed.py --before /tmp/old --target smollm2-135m-instruct \
        --draft checkpoints/smollm2-135m-instruct-dflash --dtype bfloat16 --new 128

With `--target` and `--draft` the pair is a real one, on a chat prompt, and each round also times plain
decoding (block size 1) in both trees. In bf16 the two trees may decode different tokens where a change
of GEMM shapes flips a near-tie; the rounds say so instead of stopping.

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
from flashdraft.models.draft import init_draft_config  # noqa: E402


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


def random_pair(args, dtype, before):
    """Twin random Llama targets (about 100M parameters) with one random 2-layer draft, and a prompt."""
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
    return trees, prompt, f"target 100M-parameter random Llama, 2-layer draft, block {args.block_size}"


def real_pair(args, dtype, before):
    """The named target and the draft directory, loaded by each tree, and a chat prompt."""
    from flashdraft.chat import chat_ids
    from flashdraft.models.load import load_target

    target = load_target(args.target, dtype, "cpu")
    trees = {}
    for name, pkg in (("before", before), ("after", after)):
        twin = pkg.Target(target.model, target.tokenizer)
        draft = pkg.DFlashDraft.from_pretrained(args.draft, dtype=dtype)
        trees[name] = (pkg, twin, pkg.DFlashProposer(draft, twin))
    messages = [{"role": "user", "content": PROMPT}]
    prompt = list(chat_ids(target.tokenizer, messages))
    return (
        trees,
        prompt,
        f"{args.target} with {args.draft}, block {args.block_size}, {len(prompt)}-token prompt",
    )


PROMPT = (
    "A baker makes 24 muffins in the morning and twice as many in the afternoon. She sells 50 muffins "
    "and gives away a quarter of the rest. How many muffins are left? Explain step by step."
)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, default=Path("/tmp/flashdraft-28efc1d"))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens of the random target")
    ap.add_argument("--block-size", type=int, default=None, help="default: 16, or the draft's")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--target", help="a real target (with --draft) instead of the random pair")
    ap.add_argument("--draft", help="the draft directory for --target")
    args = ap.parse_args()
    if bool(args.target) != bool(args.draft):
        ap.error("--target and --draft go together")
    before = import_tree(args.before, "flashdraft_before")
    dtype = getattr(torch, args.dtype)
    if args.block_size is None:
        args.block_size = after.DraftConfig.read(args.draft).block_size if args.draft else 16
    trees, prompt, what = (real_pair if args.target else random_pair)(args, dtype, before)
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    print(f"{cpu}, {torch.get_num_threads()} threads, {args.dtype}; before: {args.before}; after: {ROOT}")
    print(f"{what}, {args.new} new tokens")
    modes = {
        "greedy": (dict(), args.block_size),
        "sampling t=0.8 top-p=0.9": (dict(temperature=0.8, top_p=0.9), args.block_size),
    }
    if args.target:
        modes["plain greedy"] = (dict(), 1)
    for mode, (sampling, block) in modes.items():

        def run(name, n_new, sampling=sampling, block=block):
            pkg, target, proposer = trees[name]
            config = pkg.GenerationConfig(n_new, block, pkg.SamplingConfig(**sampling), seed=0)
            return pkg.generate(target, prompt, proposer if block > 1 else None, config)

        for name in trees:  # warm-up
            run(name, 8)
        steps = {name: [] for name in trees}
        ratios = []
        for r in range(args.rounds):
            res = {}
            for name in list(trees)[:: 1 if r % 2 else -1]:  # alternate who goes first
                res[name] = run(name, args.new)
                steps[name] += res[name].step_s
            same = res["before"].tokens == res["after"].tokens
            if not sampling and dtype == torch.float32:
                assert same, "the two trees decode different tokens"
            wall = {name: x.prefill_s + x.decode_s for name, x in res.items()}
            ratios.append(wall["after"] / wall["before"])
            print(
                f"{mode}, round {r + 1}: {wall['before']:.2f} s before, {wall['after']:.2f} s after: "
                f"{ratios[-1]:.3f}{'' if same else ' (tokens differ)'}"
            )
        med = {name: statistics.median(s) * 1e3 for name, s in steps.items()}
        print(
            f"{mode}: median step {med['before']:.1f} ms before, {med['after']:.1f} ms after "
            f"({med['after'] / med['before']:.3f}); prefill and decode time after / before, median of "
            f"{args.rounds} paired rounds: {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()
