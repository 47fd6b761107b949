"""`flashdraft train`: the training mask, labels and loss against brute-force references (and the three
pitfalls of the paper's section 4, each shown to be caught), training forward == inference forward, 2-rank
torchrun == 1 process, kill -9 + --resume == uninterrupted, refused resumes, NaN stop, bad data."""

import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DRAFT_OPTIONS, make_draft, make_hf_model
from safetensors.torch import load_file

from flashdraft import DFlashDraft, DFlashProposer, GenerationConfig, Target
from flashdraft.engine.sequence import Row
from flashdraft.models import masks
from flashdraft.train import config as TC
from flashdraft.train import data as TD
from flashdraft.train import loop as T
from flashdraft.train import loss as TL
from flashdraft.train import state as TS

VOCAB, MASK, B = 128, 3, 4  # tiny models: block size 4, mask id 3 (never in the data)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: a second thread only adds synchronisation (x1000 slower on a busy 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- references -----------------------------------------------------------------------------------


def reference_mask(anchors: list[list[int]], ctx_len: int, block_size: int) -> torch.Tensor:
    """The visibility rules of the paper (section 4), one (query, key) pair at a time. anchors[i] lists the real
    anchors of sequence i; the batch is padded to the longest list."""
    n_max = max(len(a) for a in anchors)
    q = n_max * block_size
    out = torch.zeros(len(anchors), q, ctx_len + q, dtype=torch.bool)
    for i, seq_anchors in enumerate(anchors):
        for qi in range(q):
            b = qi // block_size
            if b >= len(seq_anchors):
                continue  # padding sees nothing
            for key in range(ctx_len + q):
                if key < ctx_len:  # a context position
                    out[i, qi, key] = key < seq_anchors[b]
                else:  # a block token: visible iff it belongs to the same block
                    out[i, qi, key] = (key - ctx_len) // block_size == b
    return out


def _padded(anchors):
    n_max = max(len(a) for a in anchors)
    return torch.tensor([a + [-1] * (n_max - len(a)) for a in anchors])


def pitfall_le_anchor(anchors, ctx_len, block_size):
    """`<= anchor`: the block also sees the anchor position's own target features."""
    m = masks.training_blocks(_padded(anchors), ctx_len, block_size).clone()
    a = _padded(anchors).repeat_interleave(block_size, dim=1)
    m[..., :ctx_len] = (torch.arange(ctx_len)[None, None] <= a[..., None]) & (a[..., None] >= 0)
    return m


def pitfall_ctx_by_block_index(anchors, ctx_len, block_size):
    """Context visibility decided by the block's index (as if blocks tiled the sequence), not its anchor."""
    m = masks.training_blocks(_padded(anchors), ctx_len, block_size).clone()
    a = _padded(anchors)
    start = (torch.arange(a.shape[1]) * block_size)[None].expand_as(a)
    start = torch.where(a >= 0, start, torch.full_like(a, -1)).repeat_interleave(block_size, dim=1)
    m[..., :ctx_len] = torch.arange(ctx_len)[None, None] < start[..., None]
    return m


def pitfall_blocks_see_earlier(anchors, ctx_len, block_size):
    """Cross-block visibility by block index: a block also attends to the blocks listed before it."""
    m = masks.training_blocks(_padded(anchors), ctx_len, block_size).clone()
    a = _padded(anchors).repeat_interleave(block_size, dim=1)
    slot = torch.arange(a.shape[1]) // block_size
    real = a >= 0
    m[..., ctx_len:] = (slot[None, :, None] >= slot[None, None, :]) & real[..., None] & real[:, None, :]
    return m


PITFALLS = [pitfall_le_anchor, pitfall_ctx_by_block_index, pitfall_blocks_see_earlier]
ANCHOR_SETS = [[[5, 6, 13, 20]], [[2, 9], [4, 5, 6, 15, 16]], [[0, 11, 12]]]  # overlapping blocks, padding


@pytest.mark.parametrize("anchors", ANCHOR_SETS)
def test_mask_matches_brute_force_and_pitfalls_do_not(anchors):
    ctx_len = 24
    ref = reference_mask(anchors, ctx_len, B)
    assert torch.equal(masks.training_blocks(_padded(anchors), ctx_len, B), ref)
    for pitfall in PITFALLS:
        assert not torch.equal(pitfall(anchors, ctx_len, B), ref), pitfall.__name__


def test_padding_rows_are_made_safe_and_nothing_else_changes():
    anchors = [[2, 9], [4, 5, 6]]
    m = masks.training_blocks(_padded(anchors), 20, B)
    pad_rows = ~m.any(-1)
    assert int(pad_rows.sum()) == B  # one padding block in sequence 0
    safe = masks.rows_safe(m, 20)
    assert safe.any(-1).all()
    assert torch.equal(safe[~pad_rows], m[~pad_rows])
    rows = pad_rows.nonzero()
    for i, qi in rows.tolist():
        assert safe[i, qi].nonzero().flatten().tolist() == [20 + qi]  # only its own key


def test_labels_are_same_position_and_weights_decay():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB, (30,), generator=g)
    loss_mask = torch.zeros(30, dtype=torch.bool)
    loss_mask[8:] = True
    loss_mask[17] = False  # a hole: its label gets no weight
    anchors = torch.tensor([8, 9, 14, 26, 28])  # 28: the last two indices fall past the end
    gamma = 2.5
    labels, weights = TL.block_targets(ids, loss_mask, anchors, B, gamma)
    for b, a in enumerate(anchors.tolist()):
        for k in range(B):
            p = a + k
            want_w = 0.0 if k == 0 or p >= 30 or not loss_mask[p] else math.exp(-(k - 1) / gamma)
            assert weights[b, k].item() == pytest.approx(want_w, abs=1e-12)
            if p < 30:
                assert labels[b, k] == ids[p]  # same position: index k predicts x[a + k]
    shifted = torch.stack([ids[(a + torch.arange(B) + 1).clamp(max=29)] for a in anchors.tolist()])
    real = weights > 0
    assert not torch.equal(shifted[real], labels[real])  # the shifted-labels pitfall would be caught


def test_block_loss_is_weighted_mean_of_cross_entropy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(12, VOCAB, generator=g, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (12,), generator=g)
    w = TL.block_weights(B, 7.0).repeat(3)
    wce, wsum = TL.block_loss(logits, labels, w)
    logp = torch.log_softmax(logits, -1)
    manual = sum(-w[i] * logp[i, labels[i]] for i in range(12)) / w.sum()
    assert (wce / wsum).item() == pytest.approx(manual.item(), rel=1e-12)
    assert TL.block_weights(16, 7.0)[1:].tolist() == pytest.approx(
        [math.exp(-(k - 1) / 7) for k in range(1, 16)]
    )
    assert TL.block_weights(16, 7.0)[0] == 0
    assert [TC.resolve_gamma(b, None) for b in (16, 10, 8)] == [7, 5, 2]
    with pytest.raises(TC.TrainError, match="explicit --gamma"):
        TC.resolve_gamma(12, None)


def test_sample_anchors_rules():
    mask = torch.zeros(40, dtype=torch.bool)
    mask[10:] = True
    a = TD.sample_anchors(mask, B, 512, torch.Generator().manual_seed(0))
    assert a.tolist() == list(range(10, 40 - B + 1))  # every response position with room for a block
    picks = [TD.sample_anchors(mask, B, 5, TD._generator(0, "anchors", e, 0)) for e in range(3)]
    for p in picks:
        assert p.numel() == 5 and torch.equal(p, p.sort().values) and p.unique().numel() == 5
        assert int(p.min()) >= 10 and int(p.max()) <= 40 - B
    assert not torch.equal(picks[0], picks[1])  # resampled every epoch


def test_lr_schedule():
    lrs = [T.lr_at(s, 100, 1.0, 0.04) for s in range(100)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert lrs[-1] < 0.01
    # warmup-stable-decay: flat after the warmup, then linear to 0 over the last 20 steps
    wsd = [T.lr_at(s, 100, 1.0, 0.04, decay=0.2) for s in range(101)]
    assert wsd[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and set(wsd[4:81]) == {1.0}
    assert wsd[80:] == pytest.approx([(100 - s) / 20 for s in range(80, 101)])


# -- training forward == inference forward ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    model = make_hf_model("llama", vocab=VOCAB)
    target = Target(model)
    draft = make_draft(model, layers=2, block_size=B, mask_token_id=MASK)
    return target, draft


@pytest.fixture(scope="module")
def option_drafts(tiny):
    """The tiny target's draft with each of DRAFT_OPTIONS turned on (built on first use)."""
    target, _ = tiny
    drafts = {}

    def get(option: str):
        if option not in drafts:
            drafts[option] = make_draft(
                target.model, layers=2, block_size=B, mask_token_id=MASK, option=option
            )
        return drafts[option]

    return get


def _inference_logits(draft, target, ids, feats, a):
    """The draft at decode time: context features go through the KV cache in two chunks (as prefill
    and a verify step would add them), then the block [x[a], MASK...] at positions a..a+B-1, its
    embeddings scaled as the config says."""
    cache = draft.new_cache()
    scale = float(draft.config.extra.get("input_embedding_scale", 1.0))
    emb = target.embed(torch.full((1, B), MASK)).to(torch.float64) * scale
    c1 = a // 2
    pos = torch.arange(a + B)[None]
    if c1:
        draft(emb, torch.arange(c1, c1 + B)[None], feats[:, :c1], pos[:, :c1], cache=cache)  # block discarded
    block = torch.full((1, B), MASK)
    block[0, 0] = ids[a]
    hidden = draft(
        target.embed(block).to(torch.float64) * scale, pos[:, a:], feats[:, c1:a], pos[:, c1:a], cache=cache
    )
    return draft.logits(hidden, target.lm_head)[0]


OPTION_CASES = [pytest.param(None, o, id=f"correct-{o}") for o in DRAFT_OPTIONS] + [
    pytest.param(p, "plain", id=p.__name__) for p in PITFALLS
]


@pytest.mark.parametrize("pitfall, option", OPTION_CASES)
def test_training_forward_equals_inference_forward(tiny, option_drafts, pitfall, option):
    """On a draft with each config option on (DRAFT_OPTIONS), and against each pitfall of the mask."""
    target, _ = tiny
    draft = option_drafts(option)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(4, VOCAB, (30,), generator=g)
    loss_mask = torch.zeros(30, dtype=torch.bool)
    loss_mask[8:] = True
    anchors = [8, 9, 15, 16, 26]
    batch = TL.build_batch([(ids, loss_mask)], [torch.tensor(anchors)], B, MASK, 4.0)
    if pitfall is not None:
        batch.mask = pitfall([anchors], batch.ids.shape[1], B)
    feats = TL.target_features(target, batch, draft.config.target_layer_ids)
    with torch.no_grad():
        train_logits = draft.logits(
            TL.draft_hidden(draft, target, batch, torch.float64, feats), target.lm_head
        )[0]
        diffs = []
        for b, a in enumerate(anchors):
            inf = _inference_logits(draft, target, ids, feats, a)
            diffs.append((train_logits[b * B : (b + 1) * B] - inf).abs().max().item())
    if pitfall is None:
        assert max(diffs) < 1e-10, diffs
    else:
        assert max(diffs) > 1e-6, f"{pitfall.__name__} went unnoticed"
    if option != "plain":  # the option changes what the draft computes: the test can see it dropped
        with torch.no_grad():
            plain = option_drafts("plain")
            base = TL.draft_hidden(plain, target, batch, torch.float64)
            base = plain.logits(base, target.lm_head)[0]
        assert (train_logits - base).abs().max() > 1e-3, f"{option} changes nothing here"


@pytest.mark.parametrize("option", [*DRAFT_OPTIONS, "draft_vocab"])
def test_training_forward_matches_proposer_and_padding_changes_nothing(tiny, option_drafts, option):
    """On a draft with each config option on (DRAFT_OPTIONS), and on one with a draft vocabulary, whose
    proposer computes only its rows of the LM head (-inf elsewhere), scaled and capped like the rest."""
    target, _ = tiny
    if option == "draft_vocab":  # with the logit extras, which its own LM-head path must apply too
        draft = make_draft(
            target.model, layers=2, block_size=B, mask_token_id=MASK, option="output_multiplier"
        )
        draft.config.extra["final_logit_softcapping"] = 2.0
        draft.set_vocab(list(range(0, VOCAB, 3)))
    else:
        draft = option_drafts(option)
    g = torch.Generator().manual_seed(3)
    seqs = [(torch.randint(4, VOCAB, (n,), generator=g), torch.arange(n) >= 6) for n in (26, 18)]
    anchors = [torch.tensor([6, 7, 12, 19]), torch.tensor([9])]
    batch = TL.build_batch(seqs, anchors, B, MASK, 4.0)
    with torch.no_grad():
        both = draft.logits(TL.draft_hidden(draft, target, batch, torch.float64), target.lm_head)
        assert torch.isfinite(both).all()  # padded rows (sequence 1 has one block of four) are safe
        for i, (s, a) in enumerate(zip(seqs, anchors, strict=True)):
            alone = TL.build_batch([s], [a], B, MASK, 4.0)
            one = draft.logits(TL.draft_hidden(draft, target, alone, torch.float64), target.lm_head)[0]
            assert (both[i, : one.shape[0]] - one).abs().max() < 1e-10
            # the real proposer, fed the context like the decode loop, drafts the argmax of these logits
            ids = s[0]
            feats = TL.target_features(target, alone, draft.config.target_layer_ids)
            for b, anc in enumerate(a.tolist()):
                proposer = DFlashProposer(draft, target)
                row = Row("x", ids[: anc // 2].tolist(), GenerationConfig(), B, None)
                row.tokens = ids[anc // 2 : anc + 1].tolist()
                proposer.join([row], [feats[0, : anc // 2]])
                proposer.accept(feats[:, anc // 2 : anc], [anc - anc // 2])
                ((drafted, _),) = proposer.propose([row], [B - 1])
                want = one[b * B + 1 : (b + 1) * B]
                if draft.vocab is not None:  # the proposer proposes from the draft vocabulary only
                    outside = torch.ones(VOCAB, dtype=torch.bool)
                    outside[draft.vocab] = False
                    want = want.masked_fill(outside, float("-inf"))
                assert drafted.tolist() == want.argmax(-1).tolist()
                got, finite = proposer.last_logits[0], torch.isfinite(want)
                assert torch.equal(torch.isfinite(got), finite)
                assert (got[finite] - want[finite]).abs().max() < 1e-10  # logit level, not only argmax
    # gradients through a padded batch stay finite and equal the sum of the parts
    wce, w = TL.batch_loss(draft, target, TL.FrozenHead(target.lm_head), batch, torch.float64)
    parts = [
        TL.batch_loss(
            draft,
            target,
            TL.FrozenHead(target.lm_head),
            TL.build_batch([s], [a], B, MASK, 4.0),
            torch.float64,
        )
        for s, a in zip(seqs, anchors, strict=True)
    ]
    assert wce.item() == pytest.approx(sum(p[0].item() for p in parts), rel=1e-10)
    assert w.item() == pytest.approx(sum(p[1].item() for p in parts), rel=1e-12)
    wce.backward()
    assert all(torch.isfinite(p.grad).all() for p in draft.parameters() if p.grad is not None)
    draft.zero_grad(set_to_none=True)


# -- whole runs --------------------------------------------------------------------------------


def write_data(
    path: Path, n: int, seed: int = 0, short: int = 0, vocab: int = VOCAB, no_response: bool = False
):
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            p = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 8))]
            r_len = 0 if no_response else (rng.randint(2, 2 * B - 1) if i < short else rng.randint(10, 28))
            r = [rng.randrange(4, vocab) for _ in range(r_len)]
            f.write(
                json.dumps(
                    {
                        "id": f"s{i}",
                        "dataset": "toy",
                        "prompt_ids": p,
                        "response_ids": r,
                        "loss_mask": [0] * len(p) + [1] * len(r),
                        "finish": "stop",
                    }
                )
                + "\n"
            )
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    make_hf_model("llama", vocab=VOCAB, max_pos=512).save_pretrained(root / "target")
    make_hf_model("llama", vocab=VOCAB, max_pos=512, seed=5).save_pretrained(root / "other_target")
    write_data(root / "data.jsonl", 14, short=2)
    write_data(root / "data2.jsonl", 14, seed=1)
    return root


def config(files, out, **kw) -> TC.TrainConfig:
    base = dict(
        target=str(files / "target"),
        data=[str(files / "data.jsonl")],
        out=str(out),
        layers=1,
        block_size=B,
        gamma=2.0,
        anchors=6,
        lr=3e-3,
        batch_tokens=90,
        max_len=64,
        eval_prompts=0,
        dtype="float32",
        mask_token_id=MASK,
        seed=7,
        progress=False,
        save_dtype="float32",
        epochs=3,
    )
    base.update(kw)
    return TC.TrainConfig(**base)


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, atol: float):
    assert a.keys() == b.keys()
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= atol, worst


def test_run_writes_metrics_plot_checkpoints_and_a_loadable_draft(files, tmp_path):
    out = tmp_path / "run"
    summary = T.train(
        config(files, out, eval_prompts=2, eval_every=3, eval_max_new_tokens=6, max_steps=6, save_every=3)
    )
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "tau" in rows[0] and "loss" not in rows[0]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    for r in train_rows:
        assert {"epoch", "loss", "lr", "grad_norm", "blocks_per_s"} <= r.keys()
        assert math.isfinite(r["loss"]) and r["blocks"] > 0
    assert [r["step"] for r in rows if "tau" in r] == [0, 3, 6]
    assert all(1.0 <= r["tau"] <= B for r in rows if "tau" in r)
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000006"]
    assert summary["data"]["dropped_short"] == 2 and summary["data"]["held_out"] == 2
    draft = DFlashDraft.from_pretrained(out / "draft")
    assert draft.config.block_size == B and draft.config.mask_token_id == MASK
    assert_same_weights(weights(out / "draft"), weights(out / "checkpoints" / "step-00000006"), 0.0)
    cfg = json.loads((out / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["mask_token_id"] == MASK


def test_bad_inputs_fail_clearly(files, tmp_path):
    other_vocab = write_data(tmp_path / "big.jsonl", 4, vocab=5000)
    with pytest.raises(TC.TrainError, match="outside the vocabulary.*another tokenizer"):
        T.train(config(files, tmp_path / "a", data=[str(other_vocab)]))
    empty = write_data(tmp_path / "empty.jsonl", 4, no_response=True)
    with pytest.raises(TC.TrainError, match="no record .* has response tokens"):
        T.train(config(files, tmp_path / "b", data=[str(empty)]))
    with pytest.raises(TC.TrainError, match="block size 16 cannot fit"):
        T.train(config(files, tmp_path / "c", block_size=16, gamma=None, max_len=512))
    with pytest.raises(TC.TrainError, match="cannot fit"):
        T.train(config(files, tmp_path / "d", block_size=40, max_len=64))
    with pytest.raises(TC.TrainError, match="block-size must be >= 2"):
        T.train(config(files, tmp_path / "e", block_size=1))


def test_nan_loss_stops_with_step_and_keeps_last_good_checkpoint(files, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = TL.batch_loss

    def poisoned(*args, **kw):
        calls["n"] += 1
        wce, w = real(*args, **kw)
        return (wce * float("nan"), w) if calls["n"] > 12 else (wce, w)

    monkeypatch.setattr(T, "batch_loss", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(
        TC.TrainError, match=r"loss is nan at step (\d+).*last good checkpoint is .*step-0+(\d+)"
    ) as e:
        T.train(config(files, out, save_every=2, max_steps=10))
    failed, kept = map(int, re.search(r"step (\d+) .*step-0+(\d+)", str(e.value)).groups())
    assert kept == (failed - 1) // 2 * 2 and kept >= 2
    assert [p.name for p in TS.checkpoint_dirs(out)][-1] == f"step-{kept:08d}"
    DFlashDraft.from_pretrained(out / "checkpoints" / f"step-{kept:08d}")  # the kept checkpoint loads


def test_resume_refuses_another_run(files, tmp_path):
    out = tmp_path / "run"
    T.train(config(files, out, max_steps=2))
    with pytest.raises(TC.TrainError, match="pass --resume"):
        T.train(config(files, out, max_steps=2))
    with pytest.raises(TC.TrainError, match="different run.*--block-size: checkpoint 4, now 8"):
        T.train(config(files, out, max_steps=2, block_size=8, gamma=None, resume=True))
    with pytest.raises(TC.TrainError, match="different run.*data files"):
        T.train(config(files, out, max_steps=2, data=[str(files / "data2.jsonl")], resume=True))
    with pytest.raises(TC.TrainError, match="different run.*target model"):
        T.train(config(files, out, max_steps=2, target=str(files / "other_target"), resume=True))
    with pytest.raises(TC.TrainError, match="no checkpoint"):
        T.train(config(files, tmp_path / "fresh", resume=True))
    T.train(config(files, out, max_steps=2, resume=True, eval_every=5))  # the same run: accepted


KILLER = """
import os, signal, sys
import flashdraft.train.loop as T
import flashdraft.train.state as TS
kind, at = os.environ["KILL_AT"].split(":")
at = int(at)
now = {"step": -1}
real_lr, real_loss, real_save = T.lr_at, T.batch_loss, TS.save_file

def lr_at(step, *a):
    now["step"] = step
    return real_lr(step, *a)

def batch_loss(*a, **k):
    out = real_loss(*a, **k)
    if kind == "step" and now["step"] + 1 == at:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-step: after the forward, before backward and update
    return out

def save_file(tensors, path, *a, **k):
    real_save(tensors, path, *a, **k)
    if kind == "save" and f"step-{at:08d}" in path:
        os.kill(os.getpid(), signal.SIGKILL)  # inside a checkpoint write: weights written, the rest not
T.lr_at, T.batch_loss, TS.save_file = lr_at, batch_loss, save_file
from flashdraft.cli import main
sys.exit(main(sys.argv[1:]))
"""


def cli_args(files, out, resume=False, **over):
    opts = {
        "target": files / "target",
        "data": files / "data.jsonl",
        "out": out,
        "layers": 1,
        "block-size": B,
        "gamma": 2,
        "anchors": 6,
        "epochs": 3,
        "lr": 3e-3,
        "batch-tokens": 90,
        "max-len": 64,
        "eval-prompts": 0,
        "dtype": "float32",
        "mask-token-id": MASK,
        "seed": 7,
        "save-dtype": "float32",
        "save-every": 2,
        "max-steps": 8,
    }
    opts.update(over)
    args = ["train", "--no-progress"] + [x for k, v in opts.items() for x in (f"--{k}", str(v))]
    return args + (["--resume"] if resume else [])


def test_kill9_then_resume_ends_at_the_uninterrupted_weights(files, tmp_path):
    ref = tmp_path / "ref"
    T.train(config(files, ref, save_every=2, max_steps=8))
    out = tmp_path / "killed"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    for resume, kill in ((False, "step:5"), (True, "save:6")):  # mid-step 5, then inside the save of step 6
        proc = subprocess.run(
            [sys.executable, "-c", KILLER, *cli_args(files, out, resume)],
            env=dict(env, KILL_AT=kill),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == -9, proc.stderr[-3000:]
        assert TS.checkpoint_dirs(out)[-1].name == "step-00000004"
    assert list(
        (out / "checkpoints").glob(".step-00000006.*.tmp")
    )  # the half-written checkpoint is a temp dir
    T.train(config(files, out, save_every=2, max_steps=8, resume=True))
    assert not list((out / "checkpoints").glob(".*.tmp"))
    assert_same_weights(weights(out / "draft"), weights(ref / "draft"), 1e-6)
    ref_rows = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows]  # no duplicated or lost steps
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref_rows], rel=1e-6)


def test_torchrun_two_ranks_match_one_process(files, tmp_path):
    common = dict(dtype="float64", max_steps=3, save_every=3, batch_tokens=80, micro_batch=1)
    T.train(config(files, tmp_path / "one", **common))
    args = cli_args(
        files,
        tmp_path / "two",
        **{"dtype": "float64", "max-steps": 3, "save-every": 3, "batch-tokens": 80, "micro-batch": 1},
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "flashdraft",
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "world 2" in proc.stderr
    one = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["sequences"] for r in one] == [r["sequences"] for r in two]
    assert any(r["sequences"] % 2 for r in one)  # an odd split: one rank runs a zero-weight pass
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-10)
    assert [r["grad_norm"] for r in two] == pytest.approx([r["grad_norm"] for r in one], rel=1e-9)
    assert_same_weights(
        weights(tmp_path / "two" / "checkpoints" / "step-00000003"),
        weights(tmp_path / "one" / "checkpoints" / "step-00000003"),
        1e-10,
    )
    opt_one = load_file(str(tmp_path / "one" / "checkpoints" / "step-00000003" / "optimizer.safetensors"))
    opt_two = load_file(str(tmp_path / "two" / "checkpoints" / "step-00000003" / "optimizer.safetensors"))
    assert opt_one.keys() == opt_two.keys()
    assert_same_weights(opt_one, opt_two, 1e-10)


def test_cli_help_lists_the_issue_options():
    from flashdraft.cli import build_parser

    text = build_parser().parse_args(
        ["train", "--target", "t", "--data", "a.jsonl,b.jsonl", "--out", "o", "--gamma", "auto"]
    )
    cfg = TC.TrainConfig.from_args(text)
    assert cfg.data == ["a.jsonl", "b.jsonl"] and cfg.gamma is None and cfg.anchors == 48 and cfg.epochs == 6
    assert cfg.layers == 5 and cfg.max_len == 3072 and cfg.batch_tokens == 2048 and cfg.grad_clip == 4.0
    assert cfg.block_size is None and TC.resolve_block_size(cfg).block_size == TC.NEW_DRAFT_BLOCK_SIZE == 8


def test_a_continued_draft_gets_the_continuation_schedule_unless_told_otherwise():
    """A new draft warms up to 6e-4 and follows a cosine; a draft continued from --init-draft takes 1.5e-4
    at once, constant, then decays over the last 30%; what the user passes wins either way."""
    from flashdraft.cli import build_parser

    def resolved(*extra):
        args = build_parser().parse_args(
            ["train", "--target", "t", "--data", "a.jsonl", "--out", "o", *extra]
        )
        return TC.resolve_schedule(TC.TrainConfig.from_args(args))

    new, cont = resolved(), resolved("--init-draft", "d")
    assert (new.lr, new.warmup, new.decay) == (6e-4, 0.04, None)
    assert (cont.lr, cont.warmup, cont.decay) == (1.5e-4, 0.0, 0.3)
    mine = resolved("--init-draft", "d", "--lr", "3e-4", "--warmup", "0.1", "--decay", "0.5")
    assert (mine.lr, mine.warmup, mine.decay) == (3e-4, 0.1, 0.5)
    assert TC.resolve_schedule(mine) == mine  # resolving twice changes nothing
    # the schedule the trainer runs: constant 1.5e-4 from the first step, 0 at the end
    lrs = [T.lr_at(s, 100, cont.lr, cont.warmup, cont.decay) for s in range(100)]
    assert lrs[0] == lrs[69] == 1.5e-4 and lrs[99] < 1e-5


def test_autocast_auto_is_on_where_bf16_is_native(files, tmp_path, monkeypatch, capsys):
    import flashdraft.models.target as target_module

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(target_module, "cpu_has_fast_bf16", lambda: False)
    assert not TC.use_autocast("auto", cpu, torch.bfloat16)  # emulated bf16: slower than fp32
    assert TC.use_autocast("auto", cuda, torch.float32) and TC.use_autocast("on", cpu, torch.float32)
    monkeypatch.setattr(target_module, "cpu_has_fast_bf16", lambda: True)
    assert TC.use_autocast("auto", cpu, torch.bfloat16)
    assert not TC.use_autocast("auto", cpu, torch.float32)  # a float32 target asks for that precision
    assert not TC.use_autocast("off", cuda, torch.bfloat16)
    # and the run uses it
    T.train(config(files, tmp_path / "run", dtype="bfloat16", max_steps=1, save_every=1))
    assert "autocast bf16" in capsys.readouterr().err


def test_features_are_the_serving_runners_bits_on_a_bf16_cpu_run(files, tmp_path, monkeypatch):
    """--features auto with a bf16 target on a CPU: every feature the draft trains on is the bits the
    served target (`load_target` as `serve` calls it) gives, not transformers' dense forward; a checkpoint
    made so refuses to resume on transformers' features."""
    from flashdraft.models.load import load_target

    seen, real = [], T.target_features

    def spy(target, batch, layers):
        feats = real(target, batch, layers)
        seen.append((batch, list(layers), feats))
        return feats

    monkeypatch.setattr(T, "target_features", spy)
    out = tmp_path / "run"
    T.train(config(files, out, dtype="bfloat16", max_steps=2, save_every=1))
    served = load_target(str(files / "target"), "auto", "cpu")
    dense = load_target(str(files / "target"), "bfloat16", "cpu", runner="transformers")
    assert seen
    for batch, layers, feats in seen:
        assert torch.equal(feats, real(served, batch, layers))
        assert not torch.equal(feats, real(dense, batch, layers))  # the two differ: the test can tell
    with pytest.raises(TC.TrainError, match="--features: checkpoint 'runner', now 'transformers'"):
        T.train(config(files, out, dtype="bfloat16", max_steps=2, features="transformers", resume=True))


# -- sample-efficiency options: block layout, sub-vocabulary, distillation, init from target ------


def test_block_layout_equals_dense_mask_on_a_padded_batch(tiny):
    target, draft = tiny
    g = torch.Generator().manual_seed(4)
    seqs = [(torch.randint(4, VOCAB, (n,), generator=g), torch.arange(n) >= 5) for n in (27, 16)]
    anchors = [torch.tensor([5, 6, 11, 20, 23]), torch.tensor([7, 9])]
    fast = TL.build_batch(seqs, anchors, B, MASK, 4.0)
    dense = TL.build_batch(seqs, anchors, B, MASK, 4.0)
    dense.mask = masks.training_blocks(dense.anchors, dense.ids.shape[1], B)
    with torch.no_grad():
        a = TL.draft_hidden(draft, target, fast, torch.float64)
        b = TL.draft_hidden(draft, target, dense, torch.float64)
    real = fast.weights > 0
    assert (a[real] - b[real]).abs().max() < 1e-10


def test_sub_vocabulary_loss_and_rows():
    seqs = [
        TD.Sequence("a", torch.tensor([9, 5, 5, 5, 7, 7, 1]), torch.tensor([0, 1, 1, 1, 1, 1, 1]).bool(), 1),
        TD.Sequence("b", torch.tensor([2, 7, 3]), torch.tensor([0, 1, 1]).bool(), 1),
    ]
    rows, cover = TD.head_rows(seqs, 2, 12)
    assert rows.tolist() == [5, 7] and cover == pytest.approx(6 / 8)  # 9 and 2 are prompt tokens
    lm_head = torch.nn.Linear(8, 12, bias=False)
    head = TL.FrozenHead(lm_head, torch.float64, torch.tensor([1, 5, 7]))
    h = torch.randn(4, 8, dtype=torch.float64)
    assert torch.allclose(head(h), lm_head.double()(h)[:, [1, 5, 7]])
    assert head.index[torch.tensor([5, 7, 1, 3])].tolist() == [1, 2, 0, -1]


def test_sub_vocabulary_and_distillation_against_brute_force(tiny):
    target, draft = tiny
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, VOCAB, (24,), generator=g)
    seqs = [(ids, torch.arange(24) >= 6)]
    anchors = [torch.tensor([6, 8, 9, 14, 20])]  # 6, 8 and 9 overlap: shared teacher positions
    batch = TL.build_batch(seqs, anchors, B, MASK, 4.0)
    rows = torch.arange(0, VOCAB, 2)  # even ids only: odd labels must carry no loss
    head = TL.FrozenHead(target.lm_head, torch.float64, rows)
    full = TL.FrozenHead(target.lm_head, torch.float64)
    feats = TL.target_features(target, batch, draft.config.target_layer_ids + [target.num_layers - 1])
    n = len(draft.config.target_layer_ids) * target.hidden_size
    with torch.no_grad():
        hidden = TL.draft_hidden(draft, target, batch, torch.float64, feats[..., :n])[0]
        sub_ce, sub_w = TL.batch_loss(draft, target, head, batch, torch.float64, features=feats[..., :n])
        kl, kl_w = TL.batch_loss(
            draft, target, full, batch, torch.float64, features=feats[..., :n], teacher=feats[..., n:]
        )
    teacher_all = target.model(ids[None]).logits[0].double()  # the target's own next-token logits
    ref_ce = ref_w = ref_kl = ref_kw = 0.0
    for b, a in enumerate(anchors[0].tolist()):
        for k in range(1, B):
            w = float(batch.weights[0, b * B + k])
            if w == 0:
                continue
            logits = draft.logits(hidden[b * B + k], target.lm_head).double()
            label = int(ids[a + k])
            if label % 2 == 0:
                ref_ce += w * -torch.log_softmax(logits[rows], -1)[label // 2].item()
                ref_w += w
            p = torch.log_softmax(teacher_all[a + k - 1], -1)  # position a+k-1 predicts x[a+k]
            ref_kl += w * (p.exp() * (p - torch.log_softmax(logits, -1))).sum().item()
            ref_kw += w
    assert sub_ce.item() == pytest.approx(ref_ce, rel=1e-9) and sub_w.item() == pytest.approx(ref_w)
    assert kl.item() == pytest.approx(ref_kl, rel=1e-6) and kl_w.item() == pytest.approx(ref_kw)
    assert TL.block_loss(teacher_all[:3], None, torch.ones(3), teacher_all[:3])[0].abs() < 1e-12


def test_init_from_target_copies_the_top_layers(tiny):
    target, _ = tiny
    model = target.model
    draft = make_draft(model, layers=2, block_size=B, mask_token_id=MASK, target_layer_ids=[0, 1])
    note = T.init_from_target(draft, target)
    assert "target layers 2..3" in note
    top = model.model.layers[2]
    assert torch.equal(draft.layers[0].self_attn.q_proj.weight, top.self_attn.q_proj.weight)
    assert torch.equal(draft.layers[1].mlp.down_proj.weight, model.model.layers[3].mlp.down_proj.weight)
    assert torch.equal(draft.norm.weight, model.model.norm.weight)
    h = target.hidden_size
    assert torch.equal(draft.fc.weight[:, h:], torch.eye(h, dtype=torch.float64))  # layer 1 feeds layer 2
    assert not draft.fc.weight[:, :h].any()


def test_run_with_all_sample_efficiency_options(files, tmp_path):
    summary = T.train(
        config(
            files,
            tmp_path / "run",
            distill=True,
            head_vocab=40,
            init_from_target=True,
            cache_features=True,
            epochs=4,
        )
    )
    assert summary["last_loss"] < summary["first_loss"]
    draft = DFlashDraft.from_pretrained(tmp_path / "run" / "draft")
    # It proposes only from the rows it was trained on: the 40 most frequent response tokens.
    data = TD.prepare_data(config(files, tmp_path / "x"), VOCAB)[0]
    assert draft.vocab.tolist() == TD.head_rows(data, 40, VOCAB)[0].tolist()


def test_the_loop_reads_the_configured_layers_and_resamples_anchors(files, tmp_path, monkeypatch):
    """The loop's wiring, not only its self-consistency: every target forward captures the configured
    layers (plus the last one, the teacher, with --distill), and each sequence gets fresh anchors
    every epoch."""
    layers, anchors = [], {}
    real_features, real_anchors = TL.target_features, TD.sample_anchors

    def spy_features(target, batch, ids):
        layers.append(list(ids))
        return real_features(target, batch, ids)

    def spy_anchors(loss_mask, block_size, max_anchors, generator=None):
        out = real_anchors(loss_mask, block_size, max_anchors, generator)
        anchors.setdefault(id(loss_mask), []).append(out.tolist())
        return out

    monkeypatch.setattr(T, "target_features", spy_features)
    monkeypatch.setattr(T, "sample_anchors", spy_anchors)
    T.train(config(files, tmp_path / "run", target_layer_ids=[0, 2], distill=True, epochs=2))
    assert layers and all(x == [0, 2, 3] for x in layers)
    twice = [a for a in anchors.values() if len(a) >= 2]
    assert twice and sum(a[0] != a[1] for a in twice) >= len(twice) // 2
