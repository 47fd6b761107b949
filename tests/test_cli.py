"""The command line, end to end in subprocesses, on tiny random models saved to disk."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import make_hf_model

from flashdraft import DFlashDraft
from flashdraft.cli import main


def run(*args, ok=True):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "flashdraft", *args], capture_output=True, text=True, env=env, timeout=300
    )
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    make_hf_model("qwen3", layers=6).save_pretrained(root / "target")
    run(
        "init-draft",
        "--target",
        str(root / "target"),
        "--layers",
        "2",
        "--block-size",
        "8",
        "--mask-token-id",
        "5",
        "--dtype",
        "float64",
        "--out",
        str(root / "draft"),
    )
    return root / "target", root / "draft"


def test_init_draft_writes_a_loadable_draft(dirs):
    _, draft_dir = dirs
    d = DFlashDraft.from_pretrained(draft_dir)
    assert d.config.target_layer_ids == [1, 3] and d.config.block_size == 8 and d.config.mask_token_id == 5
    assert d.fc.weight.dtype == torch.float64
    assert oct((draft_dir / "model.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


def test_generate_json_speculative_equals_plain(dirs):
    target, draft = dirs
    common = [
        "generate",
        "--target",
        str(target),
        "--prompt-ids",
        "3,17,42,9",
        "--max-new-tokens",
        "20",
        "--dtype",
        "float64",
        "--json",
    ]
    plain = json.loads(run(*common, "--block-size", "1").stdout)
    spec = json.loads(run(*common, "--draft", str(draft)).stdout)
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 20
    for key in ("token_ids", "text", "acceptance_lengths", "tau", "tokens_per_s"):
        assert key in spec
    assert sum(spec["acceptance_lengths"]) == 19 and spec["tau"] >= 1


def test_generate_sampling_is_seeded(dirs, capsys):
    target, draft = dirs
    args = [
        "generate",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--prompt-ids",
        "3,17",
        "--json",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "4",
    ]
    outs = []
    for _ in range(2):
        assert main(args) == 0
        outs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 12


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prompt-ids", ""], "prompt is empty"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "300"], "exceeds the target's context"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt-ids", "1,2", "--block-size", "0"], "block_size must be >= 1"),
        (["--prompt", "hi"], "no tokenizer"),
    ],
)
def test_generate_bad_input_exits_with_a_message(dirs, extra, message, capsys):
    target, draft = dirs
    argv = ["generate", "--target", str(target), "--draft", str(draft), "--dtype", "float32", *extra]
    with pytest.raises(SystemExit) as exit_:
        sys.exit(main(argv))
    assert exit_.value.code not in (0, None) and message in str(exit_.value.code) + capsys.readouterr().err


def test_mismatched_draft_is_refused(dirs, tmp_path, capsys):
    _, draft = dirs
    other = tmp_path / "llama"
    make_hf_model("llama", layers=4).save_pretrained(other)
    assert main(["generate", "--target", str(other), "--draft", str(draft), "--prompt-ids", "1"]) == 2
    assert "draft and target do not match" in capsys.readouterr().err


def test_a_draft_passed_as_target_is_refused(dirs, capsys):
    target, draft = dirs
    assert main(["generate", "--target", str(draft), "--draft", str(target), "--prompt-ids", "1"]) == 2
    assert "is a DFlash draft, not a target model: pass it as --draft" in capsys.readouterr().err


def test_a_target_with_missing_weights_is_refused(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "partial"
    make_hf_model("llama", layers=2).save_pretrained(broken)
    state = load_file(str(broken / "model.safetensors"))
    save_file({k: v for k, v in state.items() if "layers.1.mlp" not in k}, str(broken / "model.safetensors"))
    assert main(["generate", "--target", str(broken), "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert "lacks 3 weight(s)" in err and "layers.1.mlp" in err


def test_version_and_defaults_in_help(capsys):
    from flashdraft import __version__

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"flashdraft {__version__}"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "default: 128" in capsys.readouterr().out  # --max-new-tokens
