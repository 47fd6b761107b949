"""Every code block of the README runs, as written, with tiny stand-ins where a block would take minutes.

The built-in target name `smollm2-135m-instruct` resolves, through a private FLASHDRAFT_CACHE, to a tiny
random Llama with SmolLM2's tokenizer and chat template, so the commands keep their text. Blocks run in
dependency order (training first, since serve and the load test use its draft), shell commands in
process (`flashdraft ...` through `cli.main`, `python scripts/x.py` through runpy), `flashdraft serve` as
a server the later blocks talk to, `curl` as itself. `...` in a command stands for the arguments of the
last full command of the same verb. A block that cannot run here is listed in EXEMPT with the reason; a
new block that is in neither list fails the test, so the README cannot grow commands nobody ran.
"""

from __future__ import annotations

import re
import runpy
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import make_chat_target

ROOT = Path(__file__).resolve().parents[1]
KEY = "KEY"  # the README's placeholder key, used as is


@dataclass
class Block:
    line: int
    lang: str
    text: str

    @property
    def head(self) -> str:
        return self.text.strip().splitlines()[0].strip()


def readme_blocks() -> list[Block]:
    blocks, lines = [], (ROOT / "README.md").read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append(Block(i + 1, m.group(1), "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return blocks


# Blocks that do not run here, by first line, and why.
EXEMPT = {
    "make demo   # installs into .venv, then runs the main job on the built-in target and draft": (
        "CI runs `make test` itself; `make demo` loads the real 135M target and benchmarks it (minutes)"
    ),
    "# vLLM: the draft proposes num_speculative_tokens = B - 1 tokens after the anchor": (
        "vLLM and SGLang are GPU servers, not installed here"
    ),
    "# one node, 8 GPUs": "torchrun on GPUs; the same training under 2 CPU ranks is tests/test_train.py's",
    "flashdraft bench --target smollm2-135m-instruct --draft checkpoints/smollm2-135m-instruct-dflash --out runs/bench-default": (
        "the record of a measured run: the Benchmark block runs the same command with its defaults spelled out"
    ),
}

# The blocks that run, by first line, in this order, each with its tiny stand-ins (text replaced first).
SHIPPED = "checkpoints/smollm2-135m-instruct-dflash"  # the real draft fits only the real target
RUN = {
    "# 1. regenerate responses with the target itself (resumable; rerun to continue)": [
        ("--limit 256", "--limit 3"),
        ("--max-new-tokens 192", "--max-new-tokens 40"),
        ("--max-steps 75", "--max-steps 2"),
        ("--eval-prompts 8 --eval-every 25 --eval-max-new-tokens 40 --save-every 25",
         "--eval-prompts 1 --eval-every 2 --eval-max-new-tokens 4 --save-every 2"),
        ('--prompt "..."', '--prompt "Hi" --max-new-tokens 4'),
    ],
    "flashdraft train ...same options... --resume": [],
    "flashdraft models                                   # the built-in target names": [
        ("--max-new-tokens 64", "--max-new-tokens 6"),
    ],
    "from flashdraft import DFlashDraft, DFlashProposer, GenerationConfig, SamplingConfig, generate, load_target": [
        ("max_new_tokens=64", "max_new_tokens=8"),
    ],
    "flashdraft serve --target smollm2-135m-instruct --draft runs/my-draft/draft \\": [("[", ""), ("]", "")],
    "from openai import OpenAI": [("max_tokens=64", "max_tokens=8")],
    'curl http://127.0.0.1:8000/v1/chat/completions -H "Authorization: Bearer KEY" -H "Content-Type: application/json" \\': [
        ("curl ", "curl -sS --fail-with-body "),
    ],
    "python scripts/load_test.py --target smollm2-135m-instruct --draft runs/my-draft/draft --out load.json  # starts a server": [
        ("--out load.json", "--out load.json --requests 2 --max-tokens 4"),
        ("--api-key KEY", "--api-key KEY --requests 2 --max-tokens 4"),
    ],
    "flashdraft export --to transformers checkpoints/smollm2-135m-instruct-dflash runs/hf-draft \\": [
        (SHIPPED, "drafts/random"),
    ],
    "from transformers import MuseGlimmerAssistantModel": [],
    "flashdraft bench --target smollm2-135m-instruct --draft checkpoints/smollm2-135m-instruct-dflash \\": [
        (SHIPPED, "drafts/random"),
        ("mt-bench,humaneval,gsm-symbolic-eval,sharegpt-eval --samples 2 --max-new-tokens 48",
         "mt-bench,gsm-symbolic-eval --samples 1 --max-new-tokens 6"),
    ],
}  # fmt: skip


def test_every_block_runs_or_says_why_not():
    heads = [b.head for b in readme_blocks()]
    unknown = [f"README.md:{b.line}: {b.head}" for b in readme_blocks() if b.head not in RUN | EXEMPT]
    assert not unknown, (
        "README blocks neither run nor exempted here (add them to RUN or EXEMPT):\n" + "\n".join(unknown)
    )
    stale = [h for h in [*RUN, *EXEMPT] if h not in heads]
    assert not stale, f"RUN / EXEMPT name blocks the README no longer has: {stale}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commands(text: str) -> list[str]:
    """Shell text -> commands: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line for line in joined.splitlines() if shlex.split(line, comments=True)]


class Runner:
    def __init__(self, port: int):
        self.port, self.last, self.server = port, {}, None

    def shell(self, text: str, where: str) -> None:
        for line in _commands(text):
            argv = shlex.split(line, comments=True)
            if argv[0] == "flashdraft":
                argv = self._expand(argv)
                if argv[1] == "serve":
                    self._serve(argv, where)
                    continue
                from flashdraft.cli import main

                assert main(argv[1:]) == 0, f"{where}: {line}"
            elif argv[0] == "python" and argv[1].startswith("scripts/"):
                self._script(argv[1:], where, line)
            elif argv[0] == "curl" and shutil.which("curl") is None:
                warnings.warn(f"{where}: curl is not installed; skipped {line}", stacklevel=1)
            elif argv[0] == "curl":
                out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
                assert out.returncode == 0, f"{where}: {line}\n{out.stdout}\n{out.stderr}"
                assert out.stdout.strip(), f"{where}: {line} printed nothing"
            else:
                raise AssertionError(f"{where}: no way to run {line!r}")

    def _expand(self, argv: list[str]) -> list[str]:
        """`flashdraft VERB ... more` -> the last full VERB command's arguments, then `more`."""
        verb, rest = argv[1], argv[2:]
        if rest and rest[0] in ("...", "...same", "...same options..."):
            rest = rest[1:]
            if rest and rest[0] == "options...":
                rest = rest[1:]
            return ["flashdraft", verb, *self.last[verb], *rest]
        self.last[verb] = rest
        return argv

    def _script(self, argv: list[str], where: str, line: str) -> None:
        saved = sys.argv
        sys.argv = [str(ROOT / argv[0]), *argv[1:]]
        try:
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
        except SystemExit as e:
            assert e.code in (0, None), f"{where}: {line} exited with {e.code}"
        finally:
            sys.argv = saved

    def _serve(self, argv: list[str], where: str) -> None:
        self.server = subprocess.Popen(
            [sys.executable, "-m", "flashdraft", *argv[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.server.poll() is None, (
                f"{where}: serve exited: {self.server.stderr.read().decode()[-2000:]}"
            )
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"{where}: serve did not come up in 120 s")


@pytest.fixture
def tiny_builtin(tmp_path, monkeypatch):
    """`smollm2-135m-instruct` as a tiny random model: a sound converted-cache entry in a private cache."""
    from flashdraft import models

    spec = models.get_spec("smollm2-135m-instruct")
    cache = tmp_path / "cache"
    d = cache / "targets" / "smollm2-135m-instruct"
    make_chat_target(d, hidden=32, layers=6)  # reads the real cache for SmolLM2's tokenizer
    models.write_manifest(d, {"package": spec.package, "version": models._package_version(spec.package)})
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(cache))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return d


def test_readme_blocks_run(tiny_builtin, monkeypatch):
    port = _free_port()
    by_head = {b.head: b for b in readme_blocks()}
    runner = Runner(port)
    namespace_extra = {}
    try:
        for head, subs in RUN.items():
            block = by_head[head]
            text = block.text.replace("8000", str(port))
            for old, new in subs:
                assert old in text, f"README.md:{block.line}: stand-in {old!r} no longer matches the block"
                text = text.replace(old, new)
            where = f"README.md:{block.line}"
            if block.lang == "python":
                if "target_model" in text and not namespace_extra:
                    import torch
                    from transformers import AutoModelForCausalLM

                    namespace_extra = {
                        "target_model": AutoModelForCausalLM.from_pretrained(tiny_builtin),
                        "ids": torch.tensor([[1, 2, 3, 4]]),
                    }
                scope = dict(namespace_extra) if "target_model" in text else {}
                exec(compile(text, where, "exec"), scope)  # noqa: S102 - the README's own code
            else:
                runner.shell(text, where)
    finally:
        if runner.server is not None:
            runner.server.terminate()
            runner.server.wait(timeout=30)
