"""Seed isolation: a seeded sampled request draws only from its own generator, so its tokens are the same
whatever the global random state and whatever shares its batch: plain and DFlash, alone and batched.

The tiny target samples from spread distributions (about 4 nats per token at temperature 1), so 40
tokens drawn from any other generator differ with near certainty; between steps the global generator is
reseeded and drawn from, and unseeded batch-mates draw from it too."""

import random

import pytest
import torch
from conftest import engine_target, make_draft, make_hf_model

from flashdraft import DFlashProposer, Engine, GenerationConfig, SamplingConfig, generate

SEEDED = GenerationConfig(40, sampling=SamplingConfig(1.0), seed=1234)
PROMPT = [5, 17, 3, 99, 42]


@pytest.fixture(scope="module")
def models():
    model = make_hf_model("llama", vocab=128, layers=2)
    return engine_target(model), make_draft(model, layers=1, block_size=4)


def run(target, draft, batched: bool, global_seed: int) -> tuple[list[int], dict[str, list[int]], list[int]]:
    """The seeded request's tokens, its unseeded batch-mates' tokens, and its acceptance lengths, with
    the global generator at `global_seed` and reseeded and drawn from between steps."""
    torch.manual_seed(global_seed)
    rng = random.Random(global_seed)
    proposer = None if draft is None else DFlashProposer(draft, target)
    engine = Engine(target, proposer, block_size=4 if draft is not None else 1, max_batch_size=4)
    if batched:  # unseeded sampled rows (the same in every run) draw from the global generator
        mates_rng = random.Random(0)
        for i in range(3):
            prompt = [mates_rng.randrange(128) for _ in range(mates_rng.randint(1, 9))]
            cfg = GenerationConfig(mates_rng.randint(10, 50), sampling=SamplingConfig(1.0))
            engine.add(f"mate{i}", prompt, cfg)
    row = engine.add("seeded", PROMPT, SEEDED)
    mates: dict[str, list[int]] = {}
    step = 0
    while engine.pending():
        for out in engine.step():
            if out.request_id != "seeded":
                mates.setdefault(out.request_id, []).extend(out.tokens)
        step += 1
        torch.manual_seed(global_seed * 1000 + step)
        torch.rand(rng.randint(1, 5))
    return row.tokens, mates, row.lengths


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dflash"])
@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_seeded_request_ignores_the_global_random_state(models, speculative, batched):
    target, draft = models
    draft = draft if speculative else None
    results = [run(target, draft, batched, s) for s in range(4)]
    tokens = [t for t, _, _ in results]
    assert len(tokens[0]) == SEEDED.max_new_tokens
    assert all(t == tokens[0] for t in tokens), "a seeded request's tokens depend on the global random state"
    # the same tokens as the request alone through `generate`: its batch-mates change nothing
    proposer = None if draft is None else DFlashProposer(draft, target)
    cfg = GenerationConfig(SEEDED.max_new_tokens, 4 if speculative else 1, SEEDED.sampling, seed=SEEDED.seed)
    assert generate(target, PROMPT, proposer, cfg).tokens == tokens[0]
    if batched:  # the global state really differed between the runs: the unseeded rows differ
        assert len({tuple(m["mate0"]) for _, m, _ in results}) == len(results)
    if speculative:  # drafts were accepted and rejected: both branches of the verifier drew from it
        lengths = results[0][2]
        assert max(lengths) > 1 and min(lengths) == 1
