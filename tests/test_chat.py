"""Chat template options (`--chat-template-kwargs`): every verb that renders chat prompts passes them to
the template (generate, datagen, bench, train's corpora and evaluation, serve), checked the same way.

The test target's template reacts to `enable_thinking`, as Qwen3's and SmolLM3's do: with it false, the
assistant turn opens with an empty <think></think>, so a verb that drops the options is visible."""

import argparse

import pytest
from conftest import make_chat_target

from flashdraft import chat
from flashdraft.bench import bench
from flashdraft.cli import build_parser
from flashdraft.train import data as TD
from flashdraft.train.datagen import DatagenConfig, DataGenError, read_meta, read_records, run_datagen

THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>\n{% endif %}{% endif %}"
)
OFF = {"enable_thinking": False}
MARK = "<think></think>"


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and a thinking-switch chat template, on disk."""
    import transformers as tf

    d = tmp_path_factory.mktemp("chat") / "tiny"
    make_chat_target(d, hidden=16, layers=1)
    (d / "chat_template.jinja").write_text(THINKING)
    tok = tf.AutoTokenizer.from_pretrained(d)
    assert MARK in tok.decode(chat.chat_ids(tok, [{"role": "user", "content": "hi"}], OFF))
    return d, tok


def test_options_are_checked_the_same_everywhere():
    assert chat.parse_kwargs('{"enable_thinking": false}') == OFF
    with pytest.raises(ValueError, match="not JSON"):
        chat.parse_kwargs("{enable_thinking: false}")
    with pytest.raises(ValueError, match="must be a JSON object"):
        chat.parse_kwargs("[1, 2]")
    with pytest.raises(ValueError, match=r"may not set \['tokenize'\]"):
        chat.check_kwargs({"tokenize": False})
    for verb in (
        ["generate", "--target", "x", "--prompt", "p", "--chat"],
        ["bench", "--target", "x", "--draft", "d", "--out", "o"],
        ["datagen", "--target", "x", "--dataset", "d", "--out", "o"],
        ["train", "--target", "x", "--data", "d", "--out", "o"],
    ):
        args = build_parser().parse_args([*verb, "--chat-template-kwargs", '{"enable_thinking": false}'])
        assert args.chat_template_kwargs == OFF, verb[0]
        assert build_parser().parse_args(verb).chat_template_kwargs is None, verb[0]
        with pytest.raises(SystemExit):
            build_parser().parse_args([*verb, "--chat-template-kwargs", '{"return_dict": true}'])


def test_bench_and_train_render_with_the_options(thinking):
    _, tok = thinking
    target = argparse.Namespace(tokenizer=tok)
    for kwargs, want in ((None, False), (OFF, True)):
        prompts = bench.load_prompts(target, ["mt-bench"], 2, kwargs)
        assert all((MARK in tok.decode(p.ids)) == want for p in prompts)
        evals = TD.dataset_prompts("humaneval", 2, tok, kwargs)
        assert all((MARK in tok.decode(ids)) == want for ids in evals)
        records = TD.corpus_records("sharegpt", tok, 3, template_kwargs=kwargs)
        for r in records:
            assert (MARK in tok.decode(r["prompt_ids"])) == want
            assert r["loss_mask"] == [0] * len(r["prompt_ids"]) + [1] * len(r["response_ids"])
            assert MARK not in tok.decode(r["response_ids"])  # the answer follows the rendered prompt


def test_datagen_renders_records_and_refuses_to_mix_modes(thinking, tmp_path):
    d, tok = thinking
    out = tmp_path / "gen.jsonl"

    def cfg(kwargs, limit):
        return DatagenConfig(
            target=str(d), datasets=["humaneval"], out=out, max_new_tokens=2, batch_size=2, dtype="float32",
            limit=limit, progress=False, chat_template_kwargs=kwargs,
        )  # fmt: skip

    assert run_datagen(cfg(OFF, 2)).written == 2
    assert all(MARK in tok.decode(r["prompt_ids"]) for r in read_records(out, vocab_size=len(tok)))
    assert read_meta(out)["chat_template_kwargs"] == OFF
    with pytest.raises(DataGenError, match="--chat-template-kwargs"):
        run_datagen(cfg(None, 3))
    assert run_datagen(cfg(OFF, 3)).written == 1
