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
from flashdraft.models.runner import kernels


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
    spec = json.loads(run(*common, "--draft", str(draft), "--speculation", "fixed").stdout)
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 20
    for key in ("token_ids", "text", "acceptance_lengths", "tau", "tokens_per_s"):
        assert key in spec
    assert sum(spec["acceptance_lengths"]) == 19 and spec["tau"] >= 1
    # The adaptive rule, the default (a random draft: it soon stops drafting), gives the same tokens.
    adaptive = json.loads(run(*common, "--draft", str(draft)).stdout)
    assert adaptive["token_ids"] == plain["token_ids"] and adaptive["speculation"] == "adaptive"
    assert adaptive["adaptive"]["skipped_steps"] > 0 and spec["adaptive"] is None


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
        (["--prompt-ids", ""], "--prompt-ids is empty"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "300"], "exceeds the target's context"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt-ids", "1,2", "--block-size", "0"], "--block-size must be >= 1"),
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


VERB_ARGS = {  # each verb with its required options, so that the typo is the only problem
    "generate": ["--target", "t", "--prompt-ids", "1"],
    "train": ["--target", "t", "--data", "d", "--out", "o"],
    "bench": ["--target", "t", "--draft", "d", "--out", "o"],
    "serve": ["--target", "t"],
    "datagen": ["--target", "t", "--dataset", "d", "--out", "o"],
}


@pytest.mark.parametrize("verb", list(VERB_ARGS))
def test_a_typo_shows_the_verbs_usage_and_exits_2(verb, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([verb, *VERB_ARGS[verb], "--tagret", "x"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"usage: flashdraft {verb}" in err and "--tagret" in err


def test_verbs_parse_without_the_web_stack_and_serve_says_what_is_missing(tmp_path):
    """Slim installs (the GPU box's carried wheels) lack fastapi and friends: building the parser, which
    every verb does, must not import them, and `serve` names what to install instead of a traceback."""
    (tmp_path / "config.json").write_text("{}")  # passes the option checks, which read no further
    code = (
        "import sys\n"
        "for m in ('fastapi', 'starlette', 'uvicorn', 'pydantic', 'prometheus_client'): sys.modules[m] = None\n"
        "from flashdraft.cli import build_parser, main\n"
        "assert build_parser().parse_args(['train', '--target', 't', '--data', 'd', '--out', 'o']).cmd\n"
        f"sys.exit(main(['serve', '--target', {str(tmp_path)!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "error: flashdraft serve needs the server's packages" in r.stderr and "pip install" in r.stderr


def test_input_errors_exit_2_with_one_line(tmp_path, capsys):
    """Every kind of wrong input ends the same way, whatever the verb: exit code 2 and an `error:` line."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    cases = [
        ["generate", "--target", str(tmp_path / "none"), "--prompt-ids", "1"],
        ["generate", "--target", str(tmp_path), "--prompt-ids", "1,x"],
        ["pack-data", str(bad), "--out", str(tmp_path / "x.npz")],
        ["init-draft", "--target", str(tmp_path / "none"), "--out", str(tmp_path / "d")],
    ]
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err and err[-1].startswith("error: "), (argv, err)


def test_export_to_transformers_gives_our_tokens_in_stock_generate(dirs, tmp_path):
    """`flashdraft export --to transformers`: stock transformers runs the exported draft as its DFlash
    assistant and commits exactly our greedy tokens (float64, a draft that sees its context)."""
    from conftest import make_draft
    from transformers import MuseGlimmerAssistantModel

    from flashdraft import DFlashProposer, GenerationConfig, Target, generate

    target_dir, _ = dirs
    target = Target.from_pretrained(target_dir, dtype=torch.float64)
    base = make_draft(target.model, layers=2, block_size=8)
    draft = DFlashDraft(base.config.replace(rope_theta=50_000.0)).to(torch.float64)  # not the default theta
    draft.load_state_dict(base.state_dict())
    draft.save_pretrained(tmp_path / "draft")
    assert main(["export", "--to", "transformers", str(tmp_path / "draft"), str(tmp_path / "hf"),
                 "--target", str(target_dir)]) == 0  # fmt: skip
    assistant = MuseGlimmerAssistantModel.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    # the exported model computes our draft's hidden states (float32-level: its norms run in float32)
    feats = torch.randn(
        1, 5, draft.fc.in_features, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    block = target.embed(torch.tensor([[3] + [draft.config.mask_token_id] * 7]))
    pos = torch.arange(13)[None]
    with torch.no_grad():
        theirs = assistant(
            noise_embeds=block, context_hidden_states=feats, position_ids=pos
        ).last_hidden_state
        torch.testing.assert_close(theirs, draft(block, pos[:, 5:], feats, pos[:, :5]), rtol=1e-5, atol=1e-5)
    ours = DFlashProposer(DFlashDraft.from_pretrained(tmp_path / "draft"), target)
    for prompt in ([3, 17, 42, 9], [5, 6, 7, 8, 9, 10, 11]):
        x = torch.tensor([prompt])
        with torch.no_grad():
            hf = target.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                assistant_model=assistant,
                speculation_type="dflash",
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert hf[0, len(prompt) :].tolist() == generate(target, prompt, ours, GenerationConfig(16)).tokens
    # a draft transformers would run differently is refused with the reason
    scaled = DFlashDraft.from_pretrained(tmp_path / "draft")
    scaled.config.extra["output_multiplier"] = 2.0
    scaled.save_pretrained(tmp_path / "scaled")
    assert main(["export", "--to", "transformers", str(tmp_path / "scaled"), str(tmp_path / "x"),
                 "--target", str(target_dir)]) == 2  # fmt: skip


def test_generate_reports_what_runs_and_warns_where_it_is_not_exact(dirs):
    """The JSON names device, dtype and runner; the one-line note appears exactly for the settings whose
    verify rounds differently from one-token steps (bf16 without quantized weights), not for the
    default bf16 (native runner, q8_0 on our kernels) nor for float64."""
    target, draft = dirs
    common = ["generate", "--target", str(target), "--prompt-ids", "3,17,42", "--max-new-tokens", "4"]
    common += ["--draft", str(draft), "--json"]
    exact = run(*common, "--dtype", "float64")
    out = json.loads(exact.stdout)
    assert out["device"] == "cpu" and out["dtype"] == "float64" and "note:" not in exact.stderr
    assert out["runner"] == "native runner, dense weights, float64"
    default = run(*common, "--dtype", "bfloat16")
    ours = (
        f"q8_0 weights, bfloat16, {kernels.path_name()} kernels"
        if kernels.available()
        else "int8 weights, bfloat16"
    )
    assert (
        json.loads(default.stdout)["runner"] == f"native runner, {ours}"
    )  # int8: torch's, where no compiler
    assert "note:" not in default.stderr
    for extra, what in (
        (["--quantize", "none"], "native runner, dense weights, bfloat16"),
        (["--runner", "transformers"], "transformers, dense weights, bfloat16"),
    ):
        proc = run(*common, "--dtype", "bfloat16", *extra)
        assert json.loads(proc.stdout)["runner"] == what
        assert f"note: {what}: a verify pass" in proc.stderr and "--dtype float32" in proc.stderr


def test_device_auto_and_a_missing_gpu():
    from flashdraft.models.target import TargetError, resolve_device

    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(TargetError, match="no CUDA device; use --device cpu"):
            resolve_device("cuda")
    with pytest.raises(TargetError, match="--device must be auto, cpu or cuda"):
        resolve_device("tpu-ish")


def test_generate_chat_template_kwargs_reach_the_template():
    """`--chat-template-kwargs` (thinking mode and the like) is passed to the chat template."""
    from test_serve import make_tokenizer

    from flashdraft.cli import _prompt_ids, build_parser

    class Stub:
        tokenizer = make_tokenizer()

    base = ["generate", "--target", "x", "--prompt", "hi", "--chat"]
    plain = _prompt_ids(build_parser().parse_args(base), Stub)
    off = build_parser().parse_args([*base, "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert len(_prompt_ids(off, Stub)) > len(plain)
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--chat-template-kwargs", "[1, 2]"])


def test_hub_ids_from_the_local_cache(dirs, tmp_path):
    """`--target owner/name` and `--draft owner/name` load from the Hugging Face cache while offline (the
    default); an id that is not cached gives one line that says how to fetch it."""
    import shutil

    target, draft = dirs
    cache = tmp_path / "hub"
    for repo, src in (("acme/tiny-target", target), ("acme/tiny-draft", draft)):
        root = cache / f"models--{repo.replace('/', '--')}"
        shutil.copytree(src, root / "snapshots" / "0123abcd")
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text("0123abcd")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "home"))
    common = ["generate", "--prompt-ids", "3,17,42", "--max-new-tokens", "6", "--dtype", "float64", "--json"]

    def cli(*args):
        cmd = [sys.executable, "-m", "flashdraft", *args]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)

    by_path = cli(*common, "--target", str(target), "--draft", str(draft))
    by_id = cli(*common, "--target", "acme/tiny-target", "--draft", "acme/tiny-draft")
    assert by_id.returncode == 0, by_id.stderr
    assert json.loads(by_id.stdout)["token_ids"] == json.loads(by_path.stdout)["token_ids"]
    missing = cli(*common, "--target", "acme/not-there")
    assert missing.returncode == 2
    assert (
        "not in the local Hugging Face cache" in missing.stderr
        and "hf download acme/not-there" in missing.stderr
    )
