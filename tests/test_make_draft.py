"""`flashdraft make-draft`: one command from a target to a draft; a crash and a rerun end with the draft
an uninterrupted run makes; bad input gets one line.

A tiny random Llama with SmolLM2's tokenizer and chat template, count budgets (prompts and steps, so
the runs are reproducible) and a tiny recipe."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import make_chat_target
from safetensors.torch import load_file

from flashdraft.cli import main
from flashdraft.models.draft import DFlashDraft
from flashdraft.train.make import MakeConfig, make_draft


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("make") / "tiny"
    make_chat_target(d)
    return d


def _cfg(target, out, **kw):
    base = dict(
        target=str(target),
        out=str(out),
        hours=10.0,  # the counts end every stage first
        prompts=("gsm-symbolic", "code-stdlib"),
        eval_sets=("humaneval",),
        eval_prompts=2,
        max_prompts=5,
        max_steps=4,
        max_new_tokens=24,
        eval_max_new_tokens=12,
        layers=1,
        block_size=4,
        batch_size=3,
        progress=False,
        train_options=dict(
            gamma=2.0, batch_tokens=120, anchors=6, save_every=2, head_vocab=0, cache_features=False
        ),
    )
    return MakeConfig(**(base | kw))


def _args(cfg: MakeConfig) -> list[str]:
    return [
        *("make-draft", "--target", cfg.target, "--out", cfg.out, "--hours", str(cfg.hours)),
        *("--prompts", ",".join(cfg.prompts), "--eval-sets", ",".join(cfg.eval_sets)),
        *("--eval-prompts", str(cfg.eval_prompts), "--max-prompts", str(cfg.max_prompts)),
        *("--max-steps", str(cfg.max_steps), "--max-new-tokens", str(cfg.max_new_tokens)),
        *("--layers", str(cfg.layers), "--no-progress"),
    ]


KILLER = """
import os, signal, sys
import flashdraft.train.loop as T
import flashdraft.train.make as M
at = int(os.environ["KILL_AT"])
now = {"step": -1}
real_lr, real_loss = T.lr_at, T.batch_loss

def lr_at(step, *a):
    now["step"] = step
    return real_lr(step, *a)

def batch_loss(*a, **k):
    out = real_loss(*a, **k)
    if now["step"] + 1 == at:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-step, past a checkpoint
    return out
T.lr_at, T.batch_loss = lr_at, batch_loss
cfg = M.MakeConfig(**{**__import__("json").loads(sys.argv[1])})
M.make_draft(cfg)
"""


def test_one_command_makes_a_working_draft_and_a_crash_changes_nothing(tiny, tmp_path):
    whole = _cfg(tiny, tmp_path / "whole")
    n = make_draft(whole)
    draft = tmp_path / "whole" / "draft"
    for name in ("config.json", "model.safetensors", "lineage.json", "training.png", "MODEL_CARD.md"):
        assert (draft / name).is_file(), name
    card = (draft / "MODEL_CARD.md").read_text()
    assert n["serve"] in card and f"flashdraft serve --target {tiny}" in n["serve"]
    assert n["steps"] == 4 and n["real_tau"] >= 1.0 and n["offline_tau"] >= 1.0
    assert set(n["answers"]) == {"answers-gsm-symbolic.jsonl", "answers-code-stdlib.jsonl"}
    assert all(v["answers"] == 5 for v in n["answers"].values())
    DFlashDraft.from_pretrained(str(draft))  # loads as a draft

    # Killed mid-step 3 (after the checkpoint of step 2), then the same command again.
    crashed = _cfg(tiny, tmp_path / "crashed")
    spec = {k: v for k, v in crashed.__dict__.items()}
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, json.dumps(spec)],
        env=dict(os.environ, KILL_AT="3", HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    state = json.loads((tmp_path / "crashed" / "make-draft.json").read_text())
    assert "training" not in state["done"] and "answers:code-stdlib" in state["done"]
    again = make_draft(crashed)
    a = load_file(str(draft / "model.safetensors"))
    b = load_file(str(tmp_path / "crashed" / "draft" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert again["real_tau"] == n["real_tau"] and again["offline_curve"] == n["offline_curve"]

    # A finished run asked again: no stage runs again (their seconds stay), the same draft stays.
    before = json.loads((tmp_path / "crashed" / "make-draft.json").read_text())
    assert make_draft(crashed)["real_tau"] == n["real_tau"]
    assert json.loads((tmp_path / "crashed" / "make-draft.json").read_text()) == before
    with pytest.raises(ValueError, match=r"other settings: max_steps 4 \(now 5\)"):
        make_draft(_cfg(tiny, tmp_path / "crashed", max_steps=5))


def test_bad_input_gets_one_line(tiny, tmp_path, capsys):
    draft_dir = tmp_path / "a-draft"
    assert main(["init-draft", "--target", str(tiny), "--out", str(draft_dir), "--layers", "1"]) == 0
    capsys.readouterr()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = {
        "no-such-model": (_cfg("no-such-model", tmp_path / "o1"), "is not a built-in name"),
        "a draft": (_cfg(draft_dir, tmp_path / "o2"), "is a DFlash draft, not a target model"),
        "unwritable": (_cfg(tiny, blocker / "out"), "cannot write to --out"),
        "no budget": (_cfg(tiny, tmp_path / "o3", hours=0), "--hours must be more than 0"),
    }
    for name, (cfg, message) in cases.items():
        assert main(_args(cfg)) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], (name, err)
    # The library call checks the same before it writes anything.
    with pytest.raises(ValueError, match="is a DFlash draft, not a target model"):
        make_draft(_cfg(draft_dir, tmp_path / "o4"))
    assert not (tmp_path / "o4").exists()
