"""What `flashdraft train` learns from: text corpora run through the target as they are (`--data sharegpt`),
weighted mixes of sources, evaluation prompts kept out of training, and `--init-draft`.

A tiny random Llama with SmolLM2's tokenizer and chat template stands in for the target, so the corpus
goes through a real chat template without any download."""

import dataclasses
import json
from collections import Counter

import pytest
import torch
from conftest import make_chat_target, make_hf_model
from safetensors.torch import load_file

from flashdraft.chat import chat_ids
from flashdraft.data import load_corpus, sharegpt_split
from flashdraft.train import config as TC
from flashdraft.train import data as TD
from flashdraft.train import loop as T

EOS = 2


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus") / "target"
    _, tok = make_chat_target(d)
    return d, tok


def corpus_config(target, out, **kw) -> TC.TrainConfig:
    base = dict(
        target=str(target),
        data=["sharegpt"],
        corpus_limit=6,
        out=str(out),
        layers=1,
        block_size=4,
        gamma=2.0,
        anchors=4,
        batch_tokens=1024,
        max_len=1024,
        eval_prompts=0,
        dtype="float32",
        mask_token_id=3,
        progress=False,
        save_dtype="float32",
        epochs=1,
        max_steps=2,
    )
    return TC.TrainConfig(**(base | kw))


def test_corpus_records_are_the_chat_template_and_the_recorded_answer(chat):
    _, tok = chat
    pairs = load_corpus("sharegpt", limit=4)
    records = TD.corpus_records("sharegpt", tok, limit=4)
    assert len(records) == 4
    for (ex, answer), r in zip(pairs, records, strict=True):
        assert sharegpt_split(ex.turns[0]) == "train"
        assert r["prompt_ids"] == chat_ids(tok, ex.messages())
        # The response is the answer as an assistant turn, ending on the end-of-turn token and no further.
        assert r["response_ids"][-1] == EOS and EOS not in r["response_ids"][:-1]
        assert tok.decode(r["response_ids"][:-1]).strip() == answer.strip()
        assert r["loss_mask"] == [0] * len(r["prompt_ids"]) + [1] * len(r["response_ids"])
    assert TD.corpus_records("sharegpt", tok, limit=2, skip=2) == records[2:]  # a fresh slice per sitting


def test_later_turns_carry_their_conversation(chat):
    """`sharegpt-turns`: turn k of a training conversation, asked after the recorded earlier exchanges
    (the most recent that fit the history budget), answered with the recorded answer."""
    from flashdraft.data import SHAREGPT_HISTORY_CHARS, sharegpt_conversations

    _, tok = chat
    pairs = load_corpus("sharegpt-turns", limit=40)
    records = TD.corpus_records("sharegpt-turns", tok, limit=40)
    convs = {}
    for conv in sharegpt_conversations():
        convs[str(conv.get("id"))] = [t for t in conv["conversations"] if t.get("from") != "system"]
        if len(convs) > 400:
            break
    checked = 0
    for (ex, answer), r in zip(pairs, records, strict=True):
        cid, k = ex.id.removeprefix("sharegpt/").split("@")
        turns = [str(t["value"]).strip() for t in convs.get(cid, [])]
        if not turns:
            continue
        k = 2 * (int(k) - 1)  # index of the asked user turn
        assert sharegpt_split(turns[0]) == "train" and k >= 2
        assert ex.turns[-1] == turns[k] and answer == turns[k + 1]
        history = list(ex.meta["answers"])
        n = len(history)
        assert list(ex.turns[:-1]) == turns[k - 2 * n : k : 2] and history == turns[k - 2 * n + 1 : k : 2]
        assert sum(map(len, ex.turns[:-1] + ex.meta["answers"])) <= SHAREGPT_HISTORY_CHARS
        if k >= 2 and len(turns[k - 2]) + len(turns[k - 1]) <= SHAREGPT_HISTORY_CHARS:
            assert n >= 1  # the previous exchange fits, so it is kept
        msgs = ex.messages(history)
        assert [m["role"] for m in msgs] == ["user", "assistant"] * n + ["user"]
        assert r["prompt_ids"] == chat_ids(tok, msgs)
        assert tok.decode(r["response_ids"][:-1]).strip() == answer.strip()
        checked += 1
    assert checked >= 20 and any(ex.meta["answers"] for ex, _ in pairs)


def test_train_on_a_corpus_with_distillation(chat, tmp_path):
    target, _ = chat
    summary = T.train(corpus_config(target, tmp_path / "run", distill=True, head_vocab=64, max_steps=3))
    assert summary["steps"] == 3 and summary["data"]["sequences"] + summary["data"]["dropped_short"] == 6
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["blocks"] > 0 and r["loss"] > 0 for r in rows)
    assert (tmp_path / "run" / "draft" / "model.safetensors").is_file()


def test_evaluation_prompts_never_enter_training(chat, tmp_path):
    target, tok = chat
    for name in ("sharegpt-eval", "gsm-symbolic-eval", "mt-bench"):
        with pytest.raises(TC.TrainError, match="evaluation set: it can never be trained on"):
            T.train(corpus_config(target, tmp_path / name, data=[name]))
    # A data file that smuggles an evaluation prompt in is refused too, whatever its name.
    leak = tmp_path / "leak.jsonl"
    prompt = TD.dataset_prompts("sharegpt-eval", 1, tok)[0]
    with leak.open("w") as f:
        for i, p in enumerate([[5, 6, 7], prompt]):
            resp = list(range(100, 140))
            rec = {"id": f"r{i}", "prompt_ids": p, "response_ids": resp, "loss_mask": [0] * len(p) + [1] * 40}
            f.write(json.dumps(rec) + "\n")
    with pytest.raises(TC.TrainError, match=r"1 training record.*evaluation prompt \(first: r1\)"):
        T.train(
            corpus_config(target, tmp_path / "x", data=[str(leak)], eval_data="sharegpt-eval", eval_prompts=1)
        )


def test_mixing_weights_hold_whatever_the_sizes():
    sources = [0] * 10 + [1] * 90  # a small and a large source, mixed half and half
    epochs = [TD.epoch_mix(sources, [1.0, 1.0], seed=0, epoch=e) for e in range(3)]
    for members in epochs:
        assert len(members) == 100
        share = Counter(sources[i] for i in members)
        assert share == {0: 50, 1: 50}
        small = [i for i in members if sources[i] == 0]
        assert Counter(small) == {i: 5 for i in range(10)}  # cycled whole, never one favoured
        assert len(set(i for i in members if sources[i] == 1)) == 50  # drawn without replacement
    assert epochs[0] != epochs[1]  # a fresh draw every epoch
    assert TC.data_source("sharegpt:0.7") == ("sharegpt", 0.7)
    assert TC.data_source("a.jsonl") == ("a.jsonl", None)
    with pytest.raises(TC.TrainError, match="weight after ':' must be > 0"):
        TC.data_source("sharegpt:0")


def test_mixed_run_draws_each_source_by_its_weight(chat, tmp_path):
    target, tok = chat
    small = tmp_path / "small.jsonl"
    with small.open("w") as f:
        resp = list(range(200, 240))
        f.write(
            json.dumps(
                {"id": "only", "prompt_ids": [9, 9], "response_ids": resp, "loss_mask": [0, 0] + [1] * 40}
            )
        )
        f.write("\n")
    cfg = corpus_config(
        target, tmp_path / "mix", data=["sharegpt:1", f"{small}:1"], batch_tokens=64, epochs=1
    )
    seqs, _, stats = TD.prepare_data(cfg, 49152, tok)
    assert stats["weights"] == [1.0, 1.0] and [s.source for s in seqs].count(1) == 1
    members = TD.epoch_mix([s.source for s in seqs], stats["weights"], 0, 0)
    assert Counter(seqs[i].id for i in members)["only"] == round(len(seqs) / 2) > 1
    with pytest.raises(TC.TrainError, match="give every item a mixing weight"):
        TC.check_config(corpus_config(target, tmp_path / "m2", data=["sharegpt:1", str(small)]))


def continue_from(tmp_path, vocab: list[int] | None = None, data_vocab: int = 128, **kw) -> TC.TrainConfig:
    """A tiny target, toy data (response tokens below `data_vocab`) and a 1-layer draft reading target
    layers 0 and 2 in blocks of 4 (with `vocab` as its draft vocabulary) saved as `start`; the config
    continues from it, with the default block size."""
    from conftest import make_draft
    from test_train import VOCAB, write_data

    make_hf_model("llama", vocab=VOCAB, max_pos=512).save_pretrained(tmp_path / "target")
    write_data(tmp_path / "data.jsonl", 8, vocab=data_vocab)
    model = make_hf_model("llama", vocab=VOCAB)
    start = make_draft(model, layers=1, block_size=4, target_layer_ids=[0, 2])
    start.set_vocab(vocab, model.get_output_embeddings().weight)
    start.save_pretrained(tmp_path / "start", dtype=torch.float32)
    base = dict(
        target=str(tmp_path / "target"),
        data=[str(tmp_path / "data.jsonl")],
        out=str(tmp_path / "run"),
        gamma=2.0,
        eval_prompts=0,
        dtype="float32",
        progress=False,
        save_dtype="float32",
        max_steps=1,
        init_draft=str(tmp_path / "start"),
    )
    return TC.TrainConfig(**(base | kw))


def test_init_draft_starts_from_its_weights(tmp_path):
    from flashdraft import DFlashDraft

    cfg = continue_from(tmp_path, layers=3, lr=1e-9, warmup=0.0)  # layers=3: the starting draft's shape wins
    T.train(cfg)
    before, after = (
        load_file(str(tmp_path / "start" / "model.safetensors")),
        load_file(str(tmp_path / "run" / "draft" / "model.safetensors")),
    )
    assert before.keys() == after.keys()
    assert max((before[k] - after[k]).abs().max().item() for k in before) < 1e-6
    saved = json.loads((tmp_path / "run" / "draft" / "config.json").read_text())
    assert saved["dflash_config"]["target_layer_ids"] == [0, 2]
    assert saved["block_size"] == 4  # the starting draft's: a continued draft keeps its block size unasked
    again = T.train(dataclasses.replace(cfg, out=str(tmp_path / "r8"), block_size=8))  # ... unless asked
    assert DFlashDraft.from_pretrained(again["draft"]).config.block_size == 8
    with pytest.raises(TC.TrainError, match="--init-draft .*not found"):
        T.train(dataclasses.replace(cfg, out=str(tmp_path / "r2"), init_draft=str(tmp_path)))


def test_init_draft_keeps_its_vocabulary_and_adds_the_new_datas(tmp_path):
    """Continuing from a draft with a vocabulary (`--head-vocab`): its tokens stay proposable even where the
    new data lacks them (a chat fine-tune must not cost the draft its arithmetic), and the new data's most
    frequent tokens join them."""
    from test_train import VOCAB

    from flashdraft import DFlashDraft

    # the data's response tokens are 4..63; the starting draft proposes 100, 101 and 127
    cfg = continue_from(tmp_path, vocab=[100, 101, 127], data_vocab=64, layers=1, head_vocab=5)
    T.train(cfg)
    top, _ = TD.head_rows(TD.prepare_data(TC.resolve_block_size(cfg), VOCAB)[0], 5, VOCAB)
    vocab = DFlashDraft.from_pretrained(tmp_path / "run" / "draft").vocab.tolist()
    assert vocab == sorted({100, 101, 127, *top.tolist()}) and len(vocab) == 8


def test_eval_refs_evaluate_by_the_offline_walk_and_are_kept_out_of_training(tmp_path):
    from test_train import VOCAB, write_data

    from flashdraft import Target
    from flashdraft.train.acceptance import greedy_references, write_references

    model = make_hf_model("llama", vocab=VOCAB, max_pos=512)
    model.save_pretrained(tmp_path / "target")
    write_data(tmp_path / "data.jsonl", 8)
    refs = greedy_references(Target(model.float()), {"x": [[5, 6, 7, 8], [9, 10, 11]]}, 20)
    write_references(refs, tmp_path / "refs.jsonl")
    cfg = TC.TrainConfig(
        target=str(tmp_path / "target"),
        data=[str(tmp_path / "data.jsonl")],
        out=str(tmp_path / "run"),
        layers=1,
        block_size=4,
        gamma=2.0,
        dtype="float32",
        progress=False,
        max_steps=2,
        eval_every=1,
        eval_refs=str(tmp_path / "refs.jsonl"),
    )
    T.train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "tau" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    assert all(r["anchors"] == sum(len(x["response_ids"]) - 1 for x in refs) and "tau/x" in r for r in evals)
    # A reference whose prompt is a training prompt is refused.
    first = json.loads((tmp_path / "data.jsonl").read_text().splitlines()[0])
    write_references(
        refs + [{"set": "x", "prompt_ids": first["prompt_ids"], "response_ids": [4, 5]}], tmp_path / "r2"
    )
    with pytest.raises(TC.TrainError, match="evaluation prompt"):
        T.train(dataclasses.replace(cfg, out=str(tmp_path / "run2"), eval_refs=str(tmp_path / "r2")))
