"""Continuing a draft across sittings (--init-draft): the view budget (`flashdraft.train.lineage`: a
draft's lineage draws each data source at most --max-views times, and says so in its lineage.json), the
optimizer moments a checkpoint carries, and growing a draft by layers that start as the identity."""

import json

import pytest
import torch
from conftest import make_draft, make_hf_model
from test_train import config, files, one_thread, write_data  # noqa: F401  (fixtures)

from flashdraft.train import data as TD
from flashdraft.train import lineage as TLin
from flashdraft.train import loop as T
from flashdraft.train.config import TrainError
from flashdraft.train.datagen import pack, read_packed


def test_plan_without_a_budget_is_the_plain_epoch_order():
    lengths = [5, 9, 3, 7, 4, 6]
    plans = TD.plan_epochs([0] * 6, lengths, None, seed=3, epochs=2, batch_tokens=12)
    assert plans == [TD.epoch_batches(lengths, 12, 3, e) for e in range(2)]


def test_plan_takes_no_more_than_the_budget_leaves():
    sources = [0] * 4 + [1] * 2  # weights 1:1 draw source 1's two sequences 1.5 times an epoch
    plans = TD.plan_epochs(sources, [4] * 6, [1.0, 1.0], seed=0, epochs=4, batch_tokens=8, allowed=[6, 4])
    drawn = [[sources[i] for b in plan for i in b] for plan in plans]
    assert [d.count(0) for d in drawn] == [3, 3, 0, 0]  # 6 allowed: two epochs of 3
    assert [d.count(1) for d in drawn] == [3, 1, 0, 0]  # 4 allowed: 3, then the last 1
    assert sum(map(len, plans[2:])) == 0


def test_source_key_is_the_content_not_the_file(tmp_path):
    a = write_data(tmp_path / "a.jsonl", 6, seed=1)
    pack([a], tmp_path / "a.npz")
    records = [json.loads(x) for x in a.read_text().splitlines()]
    packed = list(read_packed(tmp_path / "a.npz"))
    assert TLin.source_key(records) == TLin.source_key(packed)
    other = [r | {"response_ids": r["response_ids"][::-1]} for r in records]  # other answers, same prompts
    assert TLin.source_key(other) != TLin.source_key(records)


def test_the_budget_holds_across_sittings(files, tmp_path):  # noqa: F811
    """Sitting 1 reads data.jsonl twice (--max-views 2, 5 epochs asked); sitting 2 from its draft cannot
    read it again, and with a fresh file beside it reads only the fresh one."""
    first = T.train(config(files, tmp_path / "s1", epochs=5, max_views=2))
    uncapped = T.train(config(files, tmp_path / "s0", epochs=5, max_views=0))
    assert 0 < first["steps"] < uncapped["steps"]
    lineage = json.loads((tmp_path / "s1" / "draft" / "lineage.json").read_text())
    (entry,) = lineage["sources"]
    assert entry["views"] == pytest.approx(2.0) and entry["sequences"] == 12  # 2 of 14 too short to train
    ckpt = sorted((tmp_path / "s1" / "checkpoints").iterdir())[-1]
    assert json.loads((ckpt / "lineage.json").read_text()) == lineage  # a checkpoint can be shipped too

    with pytest.raises(TrainError, match="every --data source has been read --max-views 2"):
        T.train(config(files, tmp_path / "s2", init_draft=str(tmp_path / "s1" / "draft"), max_views=2))

    both = [str(files / "data.jsonl"), str(files / "data2.jsonl")]
    T.train(config(files, tmp_path / "s3", data=both, init_draft=str(tmp_path / "s1" / "draft"), max_views=2))
    after = {s["name"]: s["views"] for s in TLin.read_lineage(tmp_path / "s3" / "draft").values()}
    assert after == {
        str(files / "data.jsonl"): pytest.approx(2.0),
        str(files / "data2.jsonl"): pytest.approx(2.0),
    }


def test_a_checkpoint_as_init_draft_carries_its_optimizer_moments(files, tmp_path):  # noqa: F811
    """Continuity across sittings: --init-draft OUT/checkpoints/step-N starts AdamW from that sitting's
    moments (a draft folder, which holds none, starts it fresh); grown by a layer, the draft keeps the
    moments of the parameters it grew from, and the new layer's start at zero."""
    from safetensors.torch import load_file

    from flashdraft.train import state as TS

    T.train(config(files, tmp_path / "s1", max_steps=3, save_every=3))
    ckpt = tmp_path / "s1" / "checkpoints" / "step-00000003"
    saved = load_file(str(ckpt / TS.OPTIM_NAME))

    def moments(init, **kw):
        cfg = config(files, tmp_path / f"s2-{init.name}-{len(kw)}", init_draft=str(init), **kw)
        d, device = TS.setup(cfg)
        run, _, _ = T._open_run(cfg, d, device)
        T._make_draft(run, None, None)
        names = {id(p): n for n, p in run.draft.named_parameters()}
        return {names[id(p)]: st for p, st in run.optimizer.state.items()}

    carried = moments(ckpt)
    assert carried and all(
        torch.equal(st["exp_avg"], saved[f"{n}::exp_avg"])
        and torch.equal(st["exp_avg_sq"], saved[f"{n}::exp_avg_sq"])
        for n, st in carried.items()
    )
    assert moments(tmp_path / "s1" / "draft") == {}
    layers = config(files, tmp_path).layers
    grown = moments(ckpt, grow_to=layers + 1)
    assert grown.keys() == carried.keys() and all(
        torch.equal(st["exp_avg_sq"], carried[n]["exp_avg_sq"]) for n, st in grown.items()
    )


def test_a_grown_draft_proposes_exactly_what_it_grew_from():
    """Two layers grown to four: the same hidden states to the last bit (float64), the old weights kept,
    the new layers' output projections zero; training then moves them (a step's gradient reaches them)."""
    model = make_hf_model("llama")
    small = make_draft(model, layers=2, block_size=4).double()
    big = small.grown(4)
    assert big.config.num_hidden_layers == 4 and len(big.layers) == 4
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(2, 4, 64, generator=g, dtype=torch.float64)
    ctx = torch.randn(2, 5, small.fc.in_features, generator=g, dtype=torch.float64)
    pos, ctx_pos = torch.arange(5, 9).expand(2, -1), torch.arange(5).expand(2, -1)
    with torch.no_grad():
        assert torch.equal(big(embeds, pos, ctx, ctx_pos), small(embeds, pos, ctx, ctx_pos))
    for name, p in small.state_dict().items():
        assert torch.equal(big.state_dict()[name], p), name
    big(embeds, pos, ctx, ctx_pos).square().sum().backward()
    assert big.layers[3].mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(Exception, match="grows, it does not shrink"):
        big.grown(3)


def test_train_grow_to_continues_a_draft_with_more_layers(files, tmp_path):  # noqa: F811
    T.train(config(files, tmp_path / "s1", max_steps=2))
    summary = T.train(
        config(files, tmp_path / "s2", init_draft=str(tmp_path / "s1" / "draft"), grow_to=3, max_steps=2)
    )
    from flashdraft import DFlashDraft

    grown = DFlashDraft.from_pretrained(tmp_path / "s2" / "draft")
    assert grown.config.num_hidden_layers == 3 and summary["steps"] == 2
    assert grown.layers[2].mlp.down_proj.weight.abs().sum() > 0  # trained away from zero
    with pytest.raises(TrainError, match="--grow-to grows the draft of --init-draft"):
        T.train(config(files, tmp_path / "s3", grow_to=3))
