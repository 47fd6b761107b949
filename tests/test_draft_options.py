"""Every option a draft config can carry (conftest.DRAFT_OPTIONS) in the two training layouts: the fast
block layout (`draft.block_attention`) equals dense attention under the training mask, padding included.
Training equal to inference on each option: tests/test_train.py; batched equal to alone:
tests/test_batch.py."""

import pytest
import torch
from conftest import DRAFT_OPTIONS, make_draft, make_hf_model

from flashdraft import DFlashDraft, Target
from flashdraft.models import masks
from flashdraft.train import loss as TL

VOCAB, MASK, B = 128, 3, 4


@pytest.fixture(scope="module")
def target():
    return Target(make_hf_model("llama", vocab=VOCAB))


@pytest.mark.parametrize("option", DRAFT_OPTIONS)
def test_block_layout_equals_dense_mask_with_each_option(target, option):
    draft = make_draft(target.model, layers=2, block_size=B, mask_token_id=MASK, option=option)
    g = torch.Generator().manual_seed(4)
    seqs = [(torch.randint(4, VOCAB, (n,), generator=g), torch.arange(n) >= 5) for n in (27, 16)]
    anchors = [torch.tensor([5, 6, 11, 20, 23]), torch.tensor([7, 9])]
    fast = TL.build_batch(seqs, anchors, B, MASK, 4.0)
    dense = TL.build_batch(seqs, anchors, B, MASK, 4.0)
    dense.mask = masks.training_blocks(dense.anchors, dense.ids.shape[1], B)
    with torch.no_grad():
        a = TL.draft_hidden(draft, target, fast, torch.float64)
        b = TL.draft_hidden(draft, target, dense, torch.float64)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    real = fast.weights > 0
    assert (a[real] - b[real]).abs().max() < 1e-10


@pytest.mark.parametrize("option", DRAFT_OPTIONS)
def test_each_option_survives_save_and_load(target, option, tmp_path):
    """The checkpoint carries every option: the loaded draft's config equals the saved one's."""
    draft = make_draft(target.model, layers=2, block_size=B, mask_token_id=MASK, option=option)
    draft.save_pretrained(tmp_path)
    assert DFlashDraft.from_pretrained(tmp_path).config == draft.config
