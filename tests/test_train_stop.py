"""How a training run stops early: Ctrl-C ends with one line naming the last checkpoint and the exact
`--resume` command (which then works), and a `--max-minutes` stop saves its step once, never deleting a
checkpoint it has just written."""

import re
import shlex

import pytest
from test_train import cli_args, config, files  # noqa: F401 (files: the tiny target and data)

from flashdraft.cli import main
from flashdraft.train import loop as T
from flashdraft.train import state as TS


def test_ctrl_c_in_train_prints_one_line_with_the_checkpoint_and_the_resume_command(
    files,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    out = tmp_path / "run"
    real, calls = T._step, {"n": 0}

    def interrupted_at_the_fifth_step(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(T, "_step", interrupted_at_the_fifth_step)
    argv = cli_args(files, out, **{"save-every": 2, "max-steps": 8})
    try:
        code = main(argv)
    except KeyboardInterrupt:  # pytest would take it for the user's own Ctrl-C and stop the whole run
        pytest.fail("Ctrl-C escaped main (a traceback)")
    assert code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "interrupted" in line]
    ckpt = out / "checkpoints" / "step-00000004"
    assert len(lines) == 1 and str(ckpt) in lines[0], err
    command = lines[0].split("continue with: ", 1)[1]
    assert command == shlex.join(["flashdraft", *argv, "--resume"])
    # the saved state is as the interrupted run left it: whole checkpoints only, no temporary directory
    assert [p.name for p in TS.checkpoint_dirs(out)] == ["step-00000002", "step-00000004"]
    assert not list((out / "checkpoints").glob(".*"))
    # and the printed command continues the run to its end
    monkeypatch.setattr(T, "_step", real)
    assert main(shlex.split(command)[1:]) == 0
    assert [p.name for p in TS.checkpoint_dirs(out)][-1] == "step-00000008"
    done = [line for line in capsys.readouterr().err.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and re.search(r"loss \d+\.\d{4} -> \d+\.\d{4}, ", done[0]), done


def test_ctrl_c_before_the_first_checkpoint_says_so(files, tmp_path, monkeypatch, capsys):  # noqa: F811
    def interrupted(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(T, "_step", interrupted)
    argv = cli_args(files, tmp_path / "run")
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted before the first checkpoint: nothing to resume" in err
    assert err.rstrip().endswith(shlex.join(["flashdraft", *argv]))


@pytest.mark.parametrize("save_every", [1, 5], ids=["step-just-saved", "step-not-saved"])
def test_max_minutes_stop_saves_its_step_exactly_once(files, tmp_path, monkeypatch, save_every):  # noqa: F811
    """A budget of a few nanoseconds runs out after the first step (every step takes longer): the run stops
    at step 1 and must save it once: again when --save-every 1 has just saved it would delete and rewrite
    the checkpoint (the old check compared against unpadded names and never matched)."""
    saved = []
    real = T.save_checkpoint

    def spy(out, step, *args, **kw):
        saved.append(step)
        return real(out, step, *args, **kw)

    monkeypatch.setattr(T, "save_checkpoint", spy)
    out = tmp_path / "run"
    summary = T.train(config(files, out, max_minutes=1e-9, save_every=save_every, max_steps=8))
    assert summary["steps"] == 1 and saved == [1]
    assert [p.name for p in TS.checkpoint_dirs(out)] == ["step-00000001"]
