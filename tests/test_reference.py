"""Interop with the authors' reference implementation (PyPI `dflash==0.1.0`, installed --no-deps).

Our checkpoints load in their code, and their loop with our draft reproduces our greedy output and
our drafted blocks: the two implementations agree on the architecture, the feature taps (including
the last layer, whose HF hidden state is final-normed) and the checkpoint format.
"""

import random
from pathlib import Path

import dflash.model as dflash_model  # `make test` installs it: pip install --no-deps dflash==0.1.0
import pytest
import torch
from conftest import make_draft, make_hf_model

from flashdraft import DFlashProposer, GenerationConfig, Target, generate
from flashdraft.engine.sequence import Row


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def pair(request, tmp_path_factory):
    model = make_hf_model(request.param, layers=6)
    ours = make_draft(model, layers=2, block_size=8)
    path = tmp_path_factory.mktemp("draft")
    ours.save_pretrained(path)
    theirs = dflash_model.DFlashDraftModel.from_pretrained(str(path), dtype=torch.float64).eval()
    return model, ours, theirs


def test_reference_loads_our_checkpoint(pair):
    _, ours, theirs = pair
    assert theirs.target_layer_ids == ours.config.target_layer_ids
    assert theirs.block_size == ours.config.block_size and theirs.mask_token_id == ours.config.mask_token_id
    ref_state = theirs.state_dict()
    for k, v in ours.state_dict().items():
        assert torch.equal(ref_state[k], v), k


def test_reference_loop_reproduces_our_greedy_output(pair):
    model, ours, theirs = pair
    target = Target(model)
    proposer = DFlashProposer(ours, target)
    rng = random.Random(0)
    for _ in range(8):
        prompt = [rng.randrange(128) for _ in range(rng.randint(1, 10))]
        stop = rng.randrange(128)
        mine = generate(target, prompt, proposer, GenerationConfig(24, stop_ids=[stop]))
        ref = dflash_model.dflash_generate(theirs, model, torch.tensor([prompt]), 24, [stop], block_size=8)
        assert ref[0, len(prompt) :].tolist() == mine.tokens


def test_reference_drafts_the_same_block(pair):
    model, ours, theirs = pair
    target = Target(model)
    proposer = DFlashProposer(ours, target)
    prompt = torch.tensor([[7, 3, 99, 12, 45, 8, 60, 2, 31]])
    with torch.no_grad():
        out = model(prompt, output_hidden_states=True)
    ref_feats = dflash_model.extract_context_feature(out.hidden_states, theirs.target_layer_ids)
    cache = target.new_cache()
    _, our_feats = target.forward(prompt, torch.arange(9)[None], cache, features=ours.config.target_layer_ids)
    torch.testing.assert_close(our_feats, ref_feats, rtol=1e-12, atol=1e-12)

    anchor = int(out.logits[0, -1].argmax())
    block = torch.tensor([[anchor] + [ours.config.mask_token_id] * 7])
    with torch.no_grad():
        hidden = theirs(
            target_hidden=ref_feats,
            noise_embedding=model.get_input_embeddings().weight[block],
            position_ids=torch.arange(17)[None],
            use_cache=False,
        )
        ref_logits = theirs.compute_logits(hidden[:, 1:], model.lm_head)

    row = Row("x", prompt[0].tolist(), GenerationConfig(), 8, None, tokens=[anchor])
    proposer.join([row], [our_feats[0]])
    with torch.no_grad():
        ((our_block, _),) = proposer.propose([row], [7])
        our_hidden = ours(target.embed(block), torch.arange(9, 17)[None], our_feats, torch.arange(9)[None])
        our_logits = ours.logits(our_hidden[:, 1:], model.lm_head)
    assert our_block.tolist() == ref_logits.argmax(-1)[0].tolist()
    # Their RMSNorm computes in float32 even for float64 inputs, hence the float32-level tolerance.
    torch.testing.assert_close(our_logits, ref_logits, rtol=1e-5, atol=1e-5)


SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-instruct-dflash"


def test_shipped_draft_drafts_the_same_tokens_in_the_reference():
    """The committed SmolLM2 draft, as published: the reference loads it and, step by step on real chat
    prompts (float32), its loop commits exactly our tokens with the same acceptance."""
    from flashdraft import DFlashDraft, load_target

    target = load_target("smollm2-135m-instruct", dtype="float32")
    # The reference runs the full LM head: compare like with like (our draft vocabulary is an extra).
    ours = DFlashDraft.from_pretrained(SHIPPED, dtype=torch.float32, vocab=False)
    theirs = dflash_model.DFlashDraftModel.from_pretrained(str(SHIPPED), dtype=torch.float32).eval()
    for k, v in ours.state_dict().items():
        assert torch.equal(theirs.state_dict()[k], v), k
    tok, proposer = target.tokenizer, DFlashProposer(ours, target)
    accepted = 0
    for text in [
        "What is 17 + 25? Put the answer in \\boxed{}.",
        "Write a Python function that reverses a list.",
    ]:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        mine = generate(target, prompt, proposer, GenerationConfig(32, stop_ids=target.stop_ids))
        ref = dflash_model.dflash_generate(
            theirs,
            target.model,
            torch.tensor([prompt]),
            32,
            target.stop_ids,
            block_size=ours.config.block_size,
        )
        assert ref[0, len(prompt) :].tolist() == mine.tokens
        accepted += sum(mine.acceptance_lengths) - len(mine.acceptance_lengths)
    assert accepted > 0  # a trained draft: the comparison covers accepted drafts, not only bonus tokens
