"""The command line's edges: wrong options refused before any model loads, no silent overwrite of a
draft, text that ends its line, files of the usual mode, writes that survive Ctrl-C, and every refusal
of `export` on the fixture that triggers it."""

import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import make_draft, make_hf_model

from flashdraft import DFlashDraft, Target
from flashdraft import files as files_module
from flashdraft.cli import main
from flashdraft.models import draft as draft_module
from flashdraft.models import load as models_module
from flashdraft.models.export import ExportError, export_transformers


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny target, a draft for it, and a data file, on disk."""
    root = tmp_path_factory.mktemp("edges")
    model = make_hf_model("llama", layers=4)
    model.save_pretrained(root / "target")
    make_draft(model, layers=1, block_size=4).save_pretrained(root / "draft")
    rec = {
        "id": "a",
        "dataset": "d",
        "prompt_ids": [5, 6],
        "response_ids": [7] * 12,
        "loss_mask": [0] * 2 + [1] * 12,
        "finish": "stop",
    }
    (root / "data.jsonl").write_text(json.dumps(rec) + "\n")
    import transformers as tf

    small = dict(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2
    )
    tf.OlmoForCausalLM(tf.OlmoConfig(**small)).save_pretrained(root / "olmo")
    return root


class LoadingStarted(BaseException):
    """Raised by every model loader in these tests: a check that comes too late fails with it."""


@pytest.fixture
def no_loading(monkeypatch):
    def boom(*args, **kw):
        raise LoadingStarted(f"a model started loading ({args[:1]}) before the options were checked")

    monkeypatch.setattr(Target, "from_pretrained", boom)
    monkeypatch.setattr(DFlashDraft, "from_pretrained", boom)
    for name in ("load_hf_model", "load_gguf", "ensure_converted"):
        monkeypatch.setattr(models_module, name, boom)


MISSING = "no/such/dir/anywhere"  # not a Hub id either (two slashes)

# (verb, its other arguments with {t} the target, {d} the draft, {data}, {out}), bad options, message
BASE = {
    "generate": ["--target", "{t}", "--prompt-ids", "1,2"],
    "serve": ["--target", "{t}"],
    "datagen": ["--target", "{t}", "--dataset", "humaneval", "--out", "{out}/x.jsonl"],
    "bench": ["--target", "{t}", "--draft", "{d}", "--out", "{out}/b"],
    "train": ["--target", "{t}", "--data", "{data}", "--out", "{out}/run"],
    "init-draft": ["--target", "{t}", "--out", "{out}/new"],
    "export": ["--to", "transformers", "{d}", "{out}/hf", "--target", "{t}"],
}
BAD = [
    ("generate", ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    ("generate", ["--temperature", "-0.5"], "--temperature must be >= 0 (0 = greedy), got -0.5"),
    ("generate", ["--top-p", "1.5"], "--top-p must be in (0, 1] (1 = off), got 1.5"),
    ("generate", ["--top-k", "-1"], "--top-k must be >= 0 (0 = off), got -1"),
    ("generate", ["--block-size", "0"], "--block-size must be >= 1, got 0"),
    ("generate", ["--draft", MISSING], f"--draft {MISSING}: {MISSING}/config.json not found"),
    ("generate", ["--draft", "{t}"], "flashdraft loads DFlashDraftModel drafts only"),  # a target as draft
    ("generate", ["--target", MISSING], f"target {MISSING!r} is not a built-in name"),
    ("generate", ["--target", "{d}"], "is a DFlash draft, not a target model: pass it as --draft"),
    ("generate", ["--target", "{out}"], "is not a model directory (no config.json)"),
    ("generate", ["--target", "{out}/none.gguf"], "none.gguf not found"),
    ("generate", ["--device", "tpu"], "--device must be auto, cpu or cuda"),
    ("generate", ["--prompt-ids", "1,x"], "--prompt-ids: expected comma-separated integers"),
    ("generate", ["--prompt-ids", ""], "--prompt-ids is empty"),
    ("serve", ["--port", "99999"], "--port must be a TCP port, 1-65535, got 99999"),
    ("serve", ["--port", "0"], "--port must be a TCP port, 1-65535, got 0"),
    ("serve", ["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
    ("serve", ["--draft", MISSING], f"--draft {MISSING}:"),
    ("serve", ["--block-size", "-3"], "--block-size must be >= 1, got -3"),
    ("datagen", ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    ("datagen", ["--temperature", "-0.5"], "--temperature must be >= 0"),
    ("datagen", ["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    ("datagen", ["--top-k", "-1"], "--top-k must be >= 0"),
    ("datagen", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    ("datagen", ["--target", MISSING], "is not a built-in name"),
    ("bench", ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    ("bench", ["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    ("bench", ["--samples", "0"], "--samples must be >= 1, got 0"),
    ("bench", ["--draft", MISSING], f"--draft {MISSING}:"),
    ("bench", ["--target", MISSING], "is not a built-in name"),
    ("bench", ["--datasets", "mt-bench,no-such-set"], "unknown data set 'no-such-set'"),
    ("datagen", ["--dataset", "humaneval,{out}/missing.jsonl"], "missing.jsonl': known names are"),
    ("train", ["--block-size", "0"], "--block-size must be >= 1, got 0"),
    ("train", ["--block-size", "1"], "--block-size must be >= 2"),
    ("train", ["--layers", "0"], "--layers must be >= 1, got 0"),
    ("train", ["--lr", "0"], "--lr must be > 0"),
    ("train", ["--target", MISSING], "is not a built-in name"),
    ("train", ["--data", "{out}/missing.jsonl"], "cannot read data file"),
    ("init-draft", ["--layers", "0"], "--layers must be >= 1, got 0"),
    ("init-draft", ["--block-size", "0"], "--block-size must be >= 1, got 0"),
    ("init-draft", ["--mask-token-id", "-1"], "--mask-token-id must be >= 0, got -1"),
    ("init-draft", ["--target-layer-ids", "1,x"], "--target-layer-ids: expected comma-separated integers"),
    ("init-draft", ["--target", MISSING], "is not a built-in name"),
    ("export", ["--target", MISSING], "is not a built-in name"),
    ("export", ["--to", "gguf"], "--to gguf needs the target as a GGUF (a built-in name or a .gguf file)"),
    (
        "generate",
        ["--runner", "transformers", "--quantize", "int8"],
        "--quantize int8 needs the native runner",
    ),
    ("serve", ["--runner", "transformers", "--quantize", "int4"], "--quantize int4 needs the native runner"),
    ("bench", ["--runner", "transformers", "--quantize", "int8"], "--quantize int8 needs the native runner"),
    ("generate", ["--target", "{olmo}", "--runner", "native"], "the native runner covers llama"),
    ("serve", ["--target", "{olmo}", "--runner", "native"], "not 'olmo': use --runner auto or transformers"),
]


@pytest.mark.parametrize("verb, bad, message", BAD, ids=[f"{v} {' '.join(b)}" for v, b, _ in BAD])
def test_bad_options_are_refused_before_any_model_loads(
    dirs, tmp_path, no_loading, capsys, verb, bad, message
):
    """One line, exit code 2, and no model has started loading (the loaders raise LoadingStarted)."""
    fill = {"t": dirs / "target", "d": dirs / "draft", "data": dirs / "data.jsonl", "out": tmp_path}
    fill["olmo"] = dirs / "olmo"  # an architecture the native runner does not cover
    argv = [verb, *(a.format(**fill) for a in BASE[verb] + bad)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message.format(**fill) in err[-1], err


def test_export_of_a_target_as_draft_is_refused_before_loading(dirs, tmp_path, no_loading, capsys):
    argv = [
        "export",
        "--to",
        "transformers",
        str(dirs / "target"),
        str(tmp_path / "hf"),
        "--target",
        str(dirs / "target"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"DRAFT {dirs / 'target'}:" in err and "DFlashDraftModel drafts only" in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("extra", [[], ["--chat"]], ids=["plain", "chat"])
def test_a_prompt_that_is_not_utf8_is_refused_before_loading(dirs, no_loading, capsys, extra):
    """Bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape); tokenizers would raise
    a TypeError deep inside. The line names --prompt, the byte and UTF-8."""
    argv = ["generate", "--target", str(dirs / "target"), "--prompt", "caf\udcff!", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --prompt is not valid UTF-8 (byte 0xff at character 3)"), err
    assert "pass UTF-8 text" in err[-1]


def test_a_prompts_file_that_is_not_utf8_names_the_file_and_line(dirs, tmp_path, no_loading, capsys):
    prompts = tmp_path / "prompts.jsonl"
    good = json.dumps({"id": "p/1", "dataset": "p", "turns": ["hello"]}).encode()
    prompts.write_bytes(good + b"\n" + b'{"id": "p/2", "dataset": "p", "turns": ["caf\xe9"]}\n')
    argv = [
        "datagen",
        "--target",
        str(dirs / "target"),
        "--dataset",
        str(prompts),
        "--out",
        str(tmp_path / "o.jsonl"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{prompts} line 2 is not UTF-8 (byte 0xe9" in err and "save the file as UTF-8" in err, err


# -- init-draft never overwrites a draft unasked ---------------------------------------------------------


def test_init_draft_refuses_an_existing_draft_without_force(dirs, tmp_path, capsys):
    out = tmp_path / "mine"
    trained = DFlashDraft.from_pretrained(dirs / "draft")
    trained.set_vocab(torch.arange(10, 60), torch.zeros(50, trained.config.hidden_size))
    trained.save_pretrained(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    argv = [
        "init-draft",
        "--target",
        str(dirs / "target"),
        "--layers",
        "1",
        "--block-size",
        "4",
        "--out",
        str(out),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--out {out} already exists and is not empty" in err and "--force" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing touched
    assert main([*argv, "--force"]) == 0  # asked for: replaced (no stale vocabulary left behind)
    assert (
        DFlashDraft.from_pretrained(out).vocab is None
        and "draft_vocab_size" not in (out / "config.json").read_text()
    )
    (tmp_path / "empty").mkdir()
    argv[-1] = str(tmp_path / "empty")
    assert main(argv) == 0  # an empty directory is no draft: written


@pytest.mark.parametrize("verb", ["generate", "datagen"])
def test_ctrl_c_ends_with_one_line_and_exit_code_130(dirs, tmp_path, monkeypatch, capsys, verb):
    """No traceback; datagen (resumable) says the same command continues it. (train: test_train_stop.py)"""
    from flashdraft import cli
    from flashdraft.train import datagen

    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_target", interrupted)
    monkeypatch.setattr(datagen, "run_datagen", interrupted)
    out = tmp_path / "x.jsonl"
    argv = {
        "generate": ["generate", "--target", str(dirs / "target"), "--prompt-ids", "1"],
        "datagen": ["datagen", "--target", str(dirs / "target"), "--dataset", "humaneval", "--out", str(out)],
    }[verb]
    try:
        code = main(argv)
    except KeyboardInterrupt:  # pytest would take it for the user's own Ctrl-C and stop the whole run
        pytest.fail("Ctrl-C escaped main (a traceback)")
    assert code == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("interrupted") and "Traceback" not in err
    if verb == "datagen":
        assert f"{out} keeps every finished record; continue with: flashdraft {' '.join(argv)}" in err


# -- output ----------------------------------------------------------------------------------------------


def test_generate_text_ends_with_a_newline(dirs, capsys):
    common = ["generate", "--target", str(dirs / "target"), "--prompt-ids", "3,17", "--max-new-tokens", "4"]
    assert main([*common, "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1 and len(out.split()) == 4, repr(out)
    assert main([*common, "--dtype", "float64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"]  # --json: one JSON line, as before


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_files_are_written_with_the_usual_mode(dirs, tmp_path, umask_022):
    """mkstemp and transformers' save_pretrained make 0600 files; ours are 0644 under umask 022."""
    files_module.write_text(tmp_path / "a.txt", "x")
    assert oct((tmp_path / "a.txt").stat().st_mode & 0o777) == "0o644"
    argv = [
        "export",
        "--to",
        "transformers",
        str(dirs / "draft"),
        str(tmp_path / "hf"),
        "--target",
        str(dirs / "target"),
    ]
    assert main(argv) == 0
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


# -- atomic writes under Ctrl-C --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
def test_atomic_write_interrupted_by_ctrl_c_keeps_the_old_file(tmp_path, monkeypatch, where):
    path = tmp_path / "state.json"
    path.write_text("old")

    def write(tmp):
        Path(tmp).write_text("new, half")
        if where == "write":
            raise KeyboardInterrupt

    def interrupt(*args, **kw):
        raise KeyboardInterrupt

    if where != "write":
        monkeypatch.setattr(files_module.os, where, interrupt)
    with pytest.raises(KeyboardInterrupt):
        files_module.atomic_write(path, write)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]


def test_atomic_write_dir_interrupted_keeps_the_old_files(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").write_text("old")

    def write(tmp):
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_text("new, half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files_module.atomic_write_dir(out, write)
    assert os.listdir(tmp_path) == ["hf"] and os.listdir(out) == ["model.safetensors"]
    assert (out / "model.safetensors").read_text() == "old"


# -- every refusal of export, on the fixture that triggers it --------------------------------------------


def _refused(draft, target, tmp_path, reason):
    with pytest.raises((ExportError, draft_module.DraftError), match=reason):
        export_transformers(draft, target, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # nothing written


@pytest.fixture(scope="module")
def llama():
    model = make_hf_model("llama", layers=4)
    return Target(model), make_draft(model, layers=1, block_size=4)


@pytest.mark.parametrize(
    "extra", [{"input_embedding_scale": 2.0}, {"output_multiplier": 2.0}, {"final_logit_softcapping": 30.0}]
)
def test_export_refuses_draft_options_transformers_ignores(llama, tmp_path, extra):
    target, base = llama
    draft = DFlashDraft(base.config.replace(extra=extra)).to(torch.float64)
    draft.load_state_dict(base.state_dict())
    _refused(draft, target, tmp_path, rf"not a pure renaming: the draft config has \['{next(iter(extra))}'\]")


def test_export_refuses_rope_scaling(llama, tmp_path):
    target, base = llama
    draft = DFlashDraft(base.config.replace(rope_scaling={"rope_type": "linear", "factor": 2.0})).to(
        torch.float64
    )
    draft.load_state_dict(base.state_dict())
    _refused(draft, target, tmp_path, "not a pure renaming: the draft uses rope_scaling")


def test_export_refuses_a_target_whose_embedding_scales(tmp_path):
    """Gemma 3 multiplies its embedding rows by sqrt(hidden) inside its embedding module."""
    model = make_hf_model("gemma3", layers=4)
    assert type(model.get_input_embeddings()) is not torch.nn.Embedding  # the fixture is what we think
    _refused(make_draft(model, layers=1, block_size=4), Target(model), tmp_path, "embedding module is Gemma3")


def test_export_refuses_a_draft_of_another_target(llama, tmp_path):
    target, _ = llama
    other = make_draft(make_hf_model("llama", layers=6), layers=1, block_size=4)
    _refused(other, target, tmp_path, "draft and target do not match")


def test_export_refuses_where_transformers_has_no_dflash(llama, tmp_path, monkeypatch):
    import transformers

    class WithoutDFlash(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("MuseGlimmerAssistant"):
                raise AttributeError(name)
            return getattr(transformers, name)

    monkeypatch.setitem(sys.modules, "transformers", WithoutDFlash("transformers"))
    target, draft = llama
    _refused(draft, target, tmp_path, "this transformers has no DFlash assistant model")
