"""`flashdraft bench`: every decoding method on the same prompts, in one process, interleaved.

For each prompt, every method runs once before the next prompt starts (the method order rotates
from prompt to prompt), so machine drift and other people's jobs hit all methods alike. Methods:

- `plain`: our loop without a proposer, the denominator of every speedup;
- `hf-generate`: transformers `generate` (greedy or sampling), a sanity baseline for `plain`;
- `hf-prompt-lookup`: transformers prompt-lookup decoding (`prompt_lookup_num_tokens`);
- `ngram`: prompt lookup (`NgramProposer`) inside our verifier;
- `dflash-bB`: our loop with the DFlash draft at block size B;
- `tree-nN`: our loop verifying trees of N drafted tokens built from the draft's block marginals
  (`flashdraft.engine.tree`), at most the draft's block size - 1 deep;
- `adaptive`: DFlash and n-gram lookup behind `AdaptiveProposer` (per step: draft or not, and where to
  cut the block, from measured costs and acceptance);
- `reference-bB`: the authors' loop (`dflash.model.dflash_generate`, PyPI `dflash==0.1.0`) with the
  same draft and target;
- `hf-dflash-bB`: transformers' built-in DFlash assisted generation (`speculation_type="dflash"`),
  with the draft's weights renamed into its DFlash assistant model (see `hf_dflash_assistant`).

Timing excludes the prefill, as in the paper: time to first token (TTFT) is reported on its own and
"decode" is everything after it. Acceptance length = tokens committed per decode-time target
forward (bonus token included); tau is its mean, i.e. committed decode tokens / target forwards.
Our loop reports these itself; for the external loops they come from hooks on the target model
that record the position of every forward (the cache length before a forward grows by exactly
what the previous forward committed). A warm-up generation per method runs first, untimed.

After each prompt, the cost model's isolated forwards are timed at that prompt's context
(`calibrate`). A separate, small numerics part compares greedy outputs in bf16 and float32.

The bench checks its own timings (`plausibility`): a speedup above tau, a cost-model efficiency above
100%, a plain step far off its calibrated cost, or a machine busy with other jobs (load average,
/proc/stat) are flagged in the tables, on the plot and by exit status 3 (`--allow-implausible`: 0).

Time of the default command (4 data sets x 2 prompts x 48 new tokens, 7 methods at the draft's block size,
numerics 2 prompts x 32 tokens). Measured on our 2-core machine (float32 SmolLM2 at 7.7 tokens/s, the
shipped draft at tau 1.02): the old defaults (64 tokens, block sizes 8 and 16, 10 methods) took 1378 s.
The three DFlash-type methods cost about 2.4 plain steps per token each with that draft, so dropping
block size 8 and 16 of the 64 tokens scales this to about 1378 x (4 + 3 x 2.4) / (4 + 6 x 2.4) x 0.75
= 630 s, plus loading and numerics; measured: 622 s in all (10.4 min) with the shipped draft.
A draft that accepts more makes it faster. Lower --samples, --max-new-tokens or --numerics-samples to
go faster still; `--block-sizes 8,16` adds the 8-token runs (about +9 min here).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from flashdraft import chat
from flashdraft.chat import chat_ids
from flashdraft.engine.adaptive import TREE_NODES, AdaptiveProposer
from flashdraft.engine.decode import GenerationConfig, generate
from flashdraft.engine.proposers import DFlashProposer, NgramProposer
from flashdraft.engine.sampling import SamplingConfig
from flashdraft.engine.sequence import Row
from flashdraft.models.draft import DFlashDraft, DraftConfig
from flashdraft.models.export import hf_dflash_assistant
from flashdraft.models.target import DTYPES, Target, cpu_has_fast_bf16
from flashdraft.train.acceptance import position_acceptance

# gsm-symbolic-eval: the held-out gsm-symbolic problems (a seed that `gsm-symbolic`, the training
# side, refuses); ShareGPT's eval split is held out by prompt hash.
DEFAULT_DATASETS = ("mt-bench", "humaneval", "gsm-symbolic-eval", "sharegpt-eval")
KINDS = (
    "plain",
    "hf-generate",
    "hf-prompt-lookup",
    "ngram",
    "dflash",
    "tree",
    "adaptive",
    "reference",
    "hf-dflash",
)


class BenchError(ValueError):
    """A benchmark that cannot run as asked (the message says how to fix it)."""


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    dataset: str
    ids: list[int]  # the prompt token ids, chat template applied
    answer: str | None = None  # reference final answer (gsm-symbolic), for accuracy


@dataclass
class BenchConfig:
    max_new_tokens: int = 48
    block_sizes: tuple[int, ...] = (16,)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0  # sampling seed of prompt i is seed + i, the same for every method
    ngram_tokens: int = 8  # tokens proposed per lookup, ours and transformers' prompt lookup alike
    ngram_max: int = 3  # longest n-gram matched (both)
    warmup_tokens: int = 8
    kinds: tuple[str, ...] = KINDS  # which methods to run
    tree_nodes: int = TREE_NODES  # drafted tokens per tree (the `tree` method)
    numerics_samples: int = 2  # 0: no numerics part
    numerics_max_new_tokens: int = 32
    numerics_dtypes: tuple[str, ...] = ("bfloat16", "float32")
    progress: bool = True

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise BenchError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.block_sizes or min(self.block_sizes) < 2:
            raise BenchError(f"block sizes must be >= 2 (1 is plain decoding), got {list(self.block_sizes)}")
        unknown = set(self.kinds) - set(KINDS)
        if unknown or "plain" not in self.kinds:
            raise BenchError(
                f"methods must include plain (the speedup denominator) and come from {', '.join(KINDS)}; "
                f"got {', '.join(self.kinds)}"
            )
        bad = set(self.numerics_dtypes) - set(DTYPES)
        if bad:
            raise BenchError(f"numerics dtypes must be among {', '.join(DTYPES)}, got {sorted(bad)}")
        if self.ngram_tokens < 1 or self.ngram_max < 1:
            raise BenchError("ngram_tokens and ngram_max must be >= 1")
        if self.tree_nodes < 1:
            raise BenchError(f"tree_nodes must be >= 1, got {self.tree_nodes}")


@dataclass
class Run:
    """One generation of one method on one prompt."""

    tokens: list[int]
    lengths: list[int]  # tokens committed per decode-time target forward
    prefill_s: float  # time to first token
    decode_s: float  # everything after it
    prefill_tokens: int = 1  # committed by the prefill forward (transformers' prompt lookup may verify there)
    draft_s: float | None = None  # our loop only: summed over steps
    verify_s: float | None = None
    step_s: float | None = None


# -- the methods ---------------------------------------------------------------------------------


@dataclass
class Method:
    name: str
    kind: str
    block_size: int  # longest block one target forward can commit
    run: (
        Callable[[list[int], int, int], Run] | None
    )  # (prompt ids, seed, max new tokens) -> Run; None: unavailable
    note: str = ""


def _ours(target: Target, proposer, block_size: int, bc: BenchConfig, stop_ids):
    def run(ids: list[int], seed: int, max_new: int) -> Run:
        cfg = GenerationConfig(max_new, block_size, bc.sampling, stop_ids, seed)
        r = generate(target, ids, proposer, cfg)
        return Run(
            r.tokens,
            r.acceptance_lengths,
            r.prefill_s,
            r.decode_s,
            1,
            sum(r.draft_s),
            sum(r.verify_s),
            sum(r.step_s),
        )

    return run


class ForwardLog:
    """Records the start position of every forward of an HF model, and when the first one ended.

    A forward that starts at position s follows a cache of s tokens; in every loop here (ours,
    transformers' assisted generation, the reference) the cache holds all committed tokens but the
    last, so consecutive starts differ by what a forward committed."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.starts, self.first_end = model, [], None

    def _pre(self, _module, _args, kwargs):
        pos = kwargs.get("position_ids")
        if pos is None:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            self.starts.append(0 if cache is None else int(cache.get_seq_length()))
        else:
            self.starts.append(int(pos.reshape(-1)[0]))

    def _post(self, _module, _args, _kwargs, _output):
        if self.first_end is None:
            self.first_end = time.perf_counter()

    def __enter__(self):
        self._hooks = [
            self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.model.register_forward_hook(self._post, with_kwargs=True),
        ]
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.t_end = time.perf_counter()
        for h in self._hooks:
            h.remove()

    def result(self, n_prompt: int, tokens: list[int]) -> Run:
        starts = self.starts[1:] + [n_prompt + len(tokens) - 1]  # the last one: where it would start next
        lengths = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        first = self.first_end if self.first_end is not None else self.t_end
        return Run(tokens, lengths, first - self.t0, self.t_end - first, starts[0] - n_prompt + 1)


def _hf_generation_config(target: Target, bc: BenchConfig, stop_ids, max_new: int, **extra):
    from transformers import GenerationConfig as HFConfig

    s = bc.sampling
    pad = getattr(target.model.generation_config, "pad_token_id", None)
    kw = dict(
        max_new_tokens=max_new,
        do_sample=not s.greedy,
        eos_token_id=list(stop_ids) or None,
        pad_token_id=pad if pad is not None else (stop_ids[0] if stop_ids else 0),
        **extra,
    )
    if not s.greedy:
        kw.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)  # top_k None would mean 50
    return HFConfig(**kw)


def _hf(target: Target, bc: BenchConfig, stop_ids, assistant=None, **extra):
    def run(ids: list[int], seed: int, max_new: int) -> Run:
        gen_cfg = _hf_generation_config(target, bc, stop_ids, max_new, **extra)
        torch.manual_seed(seed)
        x = torch.tensor([ids], device=target.device)
        kw = {} if assistant is None else {"assistant_model": assistant}
        with torch.inference_mode(), ForwardLog(target.model) as log:
            out = target.model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen_cfg, **kw)
        return log.result(len(ids), out[0, len(ids) :].tolist())

    return run


def _reference(target: Target, ref_draft, block_size: int, bc: BenchConfig, stop_ids):
    from dflash.model import dflash_generate

    s = bc.sampling

    def run(ids: list[int], seed: int, max_new: int) -> Run:
        torch.manual_seed(seed)
        x = torch.tensor([ids], device=target.device)
        with warnings.catch_warnings(), ForwardLog(target.model) as log:
            warnings.simplefilter("ignore", FutureWarning)  # it passes past_key_values, renamed in 5.x
            out = dflash_generate(
                ref_draft,
                target.model,
                x,
                max_new,
                list(stop_ids) or None,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                block_size=block_size,
            )
        return log.result(len(ids), out[0, len(ids) :].tolist())

    return run


def build_methods(
    target: Target, draft: DFlashDraft, bc: BenchConfig, stop_ids, workdir: Path
) -> list[Method]:
    """Every method of `bc.kinds`, in run order; unavailable ones carry the reason in `note`."""
    ms: list[Method] = []
    want = set(bc.kinds)
    ms.append(Method("plain", "plain", 1, _ours(target, None, 1, bc, stop_ids)))
    if "hf-generate" in want:
        ms.append(Method("hf-generate", "hf-generate", 1, _hf(target, bc, stop_ids)))
    n = bc.ngram_tokens
    if "hf-prompt-lookup" in want:
        run = _hf(target, bc, stop_ids, prompt_lookup_num_tokens=n, max_matching_ngram_size=bc.ngram_max)
        ms.append(Method("hf-prompt-lookup", "hf-prompt-lookup", n + 1, run))
    if "ngram" in want:
        proposer = NgramProposer(max_ngram=bc.ngram_max, min_ngram=1, block_size=n + 1)
        ms.append(Method("ngram", "ngram", n + 1, _ours(target, proposer, n + 1, bc, stop_ids)))
    trained = draft.config.block_size

    def note(b: int, reason: str = "") -> str:
        over = f"block size above the draft's trained {trained}: drafts past it are out of training"
        return "; ".join(x for x in (reason, over if b > trained else "") if x)

    if "dflash" in want:
        proposer = DFlashProposer(draft, target)
        for b in bc.block_sizes:
            ms.append(Method(f"dflash-b{b}", "dflash", b, _ours(target, proposer, b, bc, stop_ids), note(b)))
    if "tree" in want:
        proposer, n = DFlashProposer(draft, target, tree=bc.tree_nodes), bc.tree_nodes
        ms.append(Method(f"tree-n{n}", "tree", trained, _ours(target, proposer, trained, bc, stop_ids)))
    if "adaptive" in want:  # DFlash and n-gram lookup, cut and skipped by the measured costs
        proposer = AdaptiveProposer(
            DFlashProposer(draft, target),
            NgramProposer(max_ngram=bc.ngram_max, min_ngram=1, block_size=trained),
        )
        ms.append(Method("adaptive", "adaptive", trained, _ours(target, proposer, trained, bc, stop_ids)))
    if "reference" in want:
        ref, reason = None, ""
        try:
            import dflash.model as dflash_model

            path = workdir / "draft"
            draft.save_pretrained(path)
            ref = dflash_model.DFlashDraftModel.from_pretrained(
                str(path), dtype=next(draft.parameters()).dtype
            )
            ref = ref.to(target.device).eval()
        except ImportError:
            reason = "the authors' package is not installed: pip install --no-deps dflash==0.1.0"
        for b in bc.block_sizes:
            run = _reference(target, ref, b, bc, stop_ids) if ref is not None else None
            ms.append(Method(f"reference-b{b}", "reference", b, run, note(b, reason)))
    if "hf-dflash" in want:
        assistant, reason = hf_dflash_assistant(draft, target)
        for b in bc.block_sizes:
            run = None
            if assistant is not None:
                run = _hf_dflash_run(target, assistant, b, bc, stop_ids)
            ms.append(Method(f"hf-dflash-b{b}", "hf-dflash", b, run, note(b, reason or "")))
    return ms


def _hf_dflash_run(target, assistant, block_size, bc, stop_ids):
    inner = _hf(target, bc, stop_ids, assistant=assistant, speculation_type="dflash")

    def run(ids: list[int], seed: int, max_new: int) -> Run:
        assistant.config.block_size = block_size  # read by the candidate generator at each generate
        return inner(ids, seed, max_new)

    return run


# -- statistics ----------------------------------------------------------------------------------


def _div(a: float, b: float) -> float:
    return a / b if b else float("nan")


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two outputs differ (a shorter output differs where it ends)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize_runs(runs: list[Run], block_size: int) -> dict:
    """tau, histogram, per-position acceptance and timing of a pooled set of runs."""
    lengths = [n for r in runs for n in r.lengths]
    steps, tokens = len(lengths), sum(lengths)
    decode_s = sum(r.decode_s for r in runs)
    top = max([block_size, *lengths])
    hist = [lengths.count(k) for k in range(1, top + 1)]
    out = {
        "prompts": len(runs),
        "output_tokens": sum(len(r.tokens) for r in runs),
        "decode_tokens": tokens,
        "target_forwards": steps,
        "tau": _div(tokens, steps),
        "histogram": hist,  # histogram[k-1]: decode steps that committed k tokens
        "position_acceptance": position_acceptance(lengths, block_size),
        "decode_s": decode_s,
        "ttft_s": _div(sum(r.prefill_s for r in runs), len(runs)),
        "time_per_token_s": _div(decode_s, tokens),
        "tokens_per_s": _div(tokens, decode_s),
    }
    if runs and runs[0].step_s is not None:
        out["draft_s"] = sum(r.draft_s for r in runs)
        out["verify_s"] = sum(r.verify_s for r in runs)
        out["step_s"] = sum(r.step_s for r in runs)
    return out


def bootstrap_ci(
    plain: list[Run], runs: list[Run], idx: list[int], n: int = 1000, seed: int = 0
) -> tuple[list[float], list[float]]:
    """95% intervals of speedup (against plain) and tau, by resampling the prompts with replacement: how
    much the numbers could move with other prompts of the same kind. Ratios of sums, like the point values."""
    if len(idx) < 2:
        return [float("nan")] * 2, [float("nan")] * 2
    g = torch.Generator().manual_seed(seed)
    picks = torch.tensor(idx)[torch.randint(len(idx), (n, len(idx)), generator=g)]

    def sums(rs: list[Run], field) -> torch.Tensor:
        values = torch.tensor([float(field(r)) for r in rs], dtype=torch.float64)
        return values[picks].sum(1)

    tokens = sums(runs, lambda r: sum(r.lengths))
    speedup = (sums(plain, lambda r: r.decode_s) / sums(plain, lambda r: sum(r.lengths))) / (
        sums(runs, lambda r: r.decode_s) / tokens
    )
    tau = tokens / sums(runs, lambda r: len(r.lengths)).clamp(min=1)

    def interval(x: torch.Tensor) -> list[float]:
        x = x[torch.isfinite(x)]
        return [float(x.quantile(0.025)), float(x.quantile(0.975))] if x.numel() else [float("nan")] * 2

    return interval(speedup), interval(tau)


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The last number of a model answer (a \\boxed{} one first): GSM-style final-answer extraction."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    for source in (boxed[-1] if boxed else "", text):
        found = NUMBER.findall(source)
        if found:
            try:
                return float(found[-1].replace(",", ""))
            except ValueError:
                return None
    return None


def _answer_correct(tokenizer, tokens: list[int], answer: str) -> bool:
    pred = final_number(tokenizer.decode(tokens, skip_special_tokens=True))
    ref = final_number(answer)
    return pred is not None and ref is not None and abs(pred - ref) < 1e-6


# -- plausibility --------------------------------------------------------------------------------

# On an idle machine a speculative step costs at least a plain step (one target forward) and commits tau
# tokens on average, so no method's speedup exceeds its tau; the cost model's efficiency (measured over
# ideal speedup) is at most 100%; a plain step takes about its isolated, calibrated cost. Another job on
# the cores breaks all three (measured: 13.4x at tau 1.4, 143%, a 1,055 ms step calibrated at 22 ms).
SLACK = 1.2  # timing noise allowed past a hard bound before a number is called impossible
STEP_RANGE = (0.5, 2.0)  # plain step time / calibrated c_step outside this: far off the calibration
# Busy: more work than cores, by more than BUSY_CORES: the mean 1-minute load average over the run
# (runnable threads, ours included) against the cores, and, from /proc/stat, our torch threads plus the
# cores' worth of CPU time that other processes used (or the hypervisor stole) against the cores.
BUSY_CORES = 0.5
EXIT_IMPLAUSIBLE = 3  # `flashdraft bench` exit status when it flags its own timings


def _finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def timing_problems(
    speedup: float | None = None,
    tau: float | None = None,
    efficiency: float | None = None,
    step_s: float | None = None,
    calibrated_step_s: float | None = None,
) -> list[str]:
    """Why these timings cannot come from an idle machine (empty: they can). The bench and the demo
    both ask this one function; numbers not given are not checked."""
    out = []
    if _finite(speedup, tau) and speedup > SLACK * tau:
        out.append(f"speedup {speedup:.2f}x above tau {tau:.2f} (at most tau on an idle machine)")
    if _finite(efficiency) and efficiency > SLACK:
        out.append(f"cost-model efficiency {100 * efficiency:.0f}% above 100%")
    if _finite(step_s, calibrated_step_s) and calibrated_step_s > 0:
        ratio = step_s / calibrated_step_s
        if not STEP_RANGE[0] <= ratio <= STEP_RANGE[1]:
            out.append(
                f"plain step {1e3 * step_s:.1f} ms is {ratio:.1f}x its calibrated cost "
                f"{1e3 * calibrated_step_s:.1f} ms"
            )
    return out


def _cpu_ticks() -> tuple[int, int, int] | None:
    """(busy, steal, total) clock ticks of all cores since boot, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal, steal, sum(fields)


class MachineLoad:
    """How busy the machine was while timings were taken: the 1-minute load average, sampled at
    start, at every `sample()` and at the end, and (from /proc/stat) the share of all cores' time that
    other processes used or the hypervisor stole, i.e. everything busy but this process."""

    def __init__(self):
        self.loads: list[float] = []
        self.ticks0, self.own0 = _cpu_ticks(), _own_cpu_s()
        self.sample()

    def sample(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # no load average on this OS
            self.loads.append(os.getloadavg()[0])

    def summary(self) -> dict:
        self.sample()
        out = {
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_avg_mean": sum(self.loads) / len(self.loads) if self.loads else None,
            "load_avg_max": max(self.loads) if self.loads else None,
            "others_share": None,
            "steal_share": None,
        }
        ticks = _cpu_ticks()
        if self.ticks0 is not None and ticks is not None and ticks[2] > self.ticks0[2]:
            busy, steal, total = (b - a for a, b in zip(self.ticks0, ticks, strict=True))
            own = (_own_cpu_s() - self.own0) * os.sysconf("SC_CLK_TCK")
            out["others_share"] = max(0.0, busy - own) / total
            out["steal_share"] = steal / total
        return out


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def load_problems(load: dict | None) -> list[str]:
    """Why the machine was too busy for its timings to mean anything (empty: it was not)."""
    if not load:
        return []
    out = []
    cores, mean = load.get("cores"), load.get("load_avg_mean")
    threads, others = load.get("torch_threads"), load.get("others_share")
    if _finite(cores, mean) and mean > cores + BUSY_CORES:
        out.append(
            f"busy machine: 1-minute load average {mean:.1f} (max {load['load_avg_max']:.1f}) on {cores} cores"
        )
    if _finite(cores, threads, others) and threads + others * cores > cores + BUSY_CORES:
        steal = load.get("steal_share") or 0.0
        out.append(
            f"busy machine: other processes used {100 * others:.0f}% of the CPU time of {cores} cores "
            f"({100 * steal:.0f}% stolen by the hypervisor) beside {threads} torch threads"
        )
    return out


def plausibility(summary: dict, cost_model: dict, load: dict | None) -> list[dict]:
    """Every implausible number of a bench's results: {"dataset", "method", "problems"} per flagged row
    (dataset and method None for the machine's load). Empty: nothing an idle machine could not give."""
    flags = []
    if problems := load_problems(load):
        flags.append({"dataset": None, "method": None, "problems": problems})
    for ds, rows in summary.items():
        costs = cost_model.get(ds, {})
        c_step = next(iter(costs.values()), {}).get("c_step_s")
        for name, s in rows.items():
            cost = costs.get(name, {})
            step = _div(s["decode_s"], s["target_forwards"]) if name == "plain" else None
            problems = timing_problems(s["speedup"], s["tau"], cost.get("efficiency"), step, c_step)
            if problems:
                flags.append({"dataset": ds, "method": name, "problems": problems})
    return flags


def flag_lines(flags: list[dict]) -> list[str]:
    """One line per flagged row: where, and what is wrong."""
    return [
        (f"{f['dataset']} {f['method']}: " if f["method"] else "") + "; ".join(f["problems"]) for f in flags
    ]


def _flagged(results: dict, ds: str, name: str) -> bool:
    return any(f["dataset"] == ds and f["method"] == name for f in results.get("implausible", ()))


# -- the run -------------------------------------------------------------------------------------


def _progress(total: int, enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="gen", file=sys.stderr, dynamic_ncols=True)


def run_bench(
    target: Target,
    draft: DFlashDraft,
    prompts: Sequence[BenchPrompt],
    config: BenchConfig | None = None,
    out_dir: str | os.PathLike | None = None,
    command: str = "",
    info: dict | None = None,
) -> dict:
    """Run every method on every prompt (interleaved), return the results dict and, with `out_dir`,
    write results.json, results.md and the plots there. `info` is merged into the results
    (e.g. the target and draft names)."""
    bc = config or BenchConfig()
    bc.validate()
    if not prompts:
        raise BenchError("no prompts to benchmark: pass at least one prompt (or --samples >= 1)")
    draft.check_target(target)
    stop_ids = list(target.stop_ids)
    t_start = time.perf_counter()
    phases = {}
    with tempfile.TemporaryDirectory(prefix="flashdraft-bench-") as tmp:
        methods = build_methods(target, draft, bc, stop_ids, Path(tmp))
        for m in methods:  # warm-up: first calls pay for lazy initialisation
            if m.run is not None and bc.warmup_tokens > 0:
                try:
                    m.run(prompts[0].ids, bc.seed, bc.warmup_tokens)
                except Exception as e:  # an external loop that cannot run here: report, do not crash
                    if m.kind in ("plain", "ngram", "dflash", "tree"):
                        raise
                    m.run, m.note = None, f"failed in warm-up: {type(e).__name__}: {e}"
        phases["setup_and_warmup_s"] = time.perf_counter() - t_start
        load = MachineLoad()  # over the timed runs only
        live = [m for m in methods if m.run is not None]
        runs: dict[str, list[Run]] = {m.name: [] for m in live}
        calib: list[dict | None] = []
        dflash = "dflash" in bc.kinds
        with _progress(len(prompts) * (len(live) + dflash), bc.progress) as bar:
            for i, p in enumerate(prompts):
                order = live[i % len(live) :] + live[: i % len(live)]  # rotate: no method always first
                for m in order:
                    if bar is not None:
                        bar.set_postfix_str(f"{p.dataset} {m.name}")
                    runs[m.name].append(m.run(p.ids, bc.seed + i, bc.max_new_tokens))
                    if bar is not None:
                        bar.update()
                if dflash:  # the cost model's isolated forwards, measured between the same prompts
                    if bar is not None:
                        bar.set_postfix_str(f"{p.dataset} cost-model calibration")
                    answer = runs["plain"][i].tokens
                    seq = list(p.ids) + answer[: len(answer) // 2]
                    calib.append(calibrate(target, draft, seq, bc.block_sizes) if len(seq) >= 2 else None)
                    if bar is not None:
                        bar.update()
                else:
                    calib.append(None)
                load.sample()
        phases["runs_s"] = time.perf_counter() - t_start - phases["setup_and_warmup_s"]
        busy = load.summary()
    results = summarize(target, methods, prompts, runs, calib, bc)
    results["calibration"] = calib
    results["load"] = busy
    results["implausible"] = plausibility(results["summary"], results["cost_model"], busy)
    if bc.numerics_samples > 0 and "dflash" in bc.kinds:
        t0 = time.perf_counter()
        results["numerics"] = numerics(target, draft, prompts, bc, stop_ids)
        phases["numerics_s"] = time.perf_counter() - t0
    results["phases"] = phases
    results["wall_s"] = time.perf_counter() - t_start
    results["command"] = command
    results["config"] = _config_dict(bc)
    results["versions"], results["machine"] = versions(), machine(target)
    results.update(info or {})
    if out_dir is not None:
        write_outputs(results, Path(out_dir))
    return results


def _config_dict(bc: BenchConfig) -> dict:
    d = asdict(bc)
    d["sampling"] = asdict(bc.sampling)
    return d


def summarize(
    target: Target,
    methods: list[Method],
    prompts: Sequence[BenchPrompt],
    runs: dict[str, list[Run]],
    calib: list[dict | None],
    bc: BenchConfig,
) -> dict:
    datasets = list(dict.fromkeys(p.dataset for p in prompts))
    groups = {ds: [i for i, p in enumerate(prompts) if p.dataset == ds] for ds in datasets}
    groups["all"] = list(range(len(prompts)))
    greedy = bc.sampling.greedy
    summary: dict[str, dict] = {}
    for ds, idx in groups.items():
        rows = {}
        for m in methods:
            if m.name not in runs:
                continue
            rows[m.name] = s = summarize_runs([runs[m.name][i] for i in idx], m.block_size)
            if greedy:
                diffs = [first_divergence(runs["plain"][i].tokens, runs[m.name][i].tokens) for i in idx]
                s["equal_to_plain"] = sum(d is None for d in diffs)
                s["mismatches"] = len(diffs) - s["equal_to_plain"]
        plain = rows["plain"]["time_per_token_s"]
        for name, s in rows.items():
            s["speedup"] = _div(plain, s["time_per_token_s"])
            s["speedup_ci"], s["tau_ci"] = bootstrap_ci(runs["plain"], runs[name], idx)
        summary[ds] = rows
    results = {
        "datasets": datasets,
        "methods": [
            {
                "name": m.name,
                "kind": m.kind,
                "block_size": m.block_size,
                "available": m.run is not None,
                "note": m.note,
            }
            for m in methods
        ],
        "prompts": [
            {"id": p.id, "dataset": p.dataset, "prompt_tokens": len(p.ids), "answer": p.answer}
            for p in prompts
        ],
        "runs": {
            name: [
                {"prompt": prompts[i].id, **{k: v for k, v in asdict(r).items()}} for i, r in enumerate(rs)
            ]
            for name, rs in runs.items()
        },
        "summary": summary,
        "cost_model": cost_model(methods, summary, calib, prompts, bc),
        "reference_comparison": reference_comparison(methods, summary, bc),
    }
    if greedy:
        results["mismatches"] = explain_mismatches(target, methods, prompts, runs)
    results["gsm_accuracy"] = gsm_accuracy(target, methods, prompts, runs)
    return results


@torch.inference_mode()
def calibrate(
    target: Target, draft: DFlashDraft, seq: list[int], block_sizes: Sequence[int], reps: int = 3
) -> dict:
    """Isolated costs of the forwards our DFlash loop is made of, at the context length of `seq` (a
    prompt plus the first half of its answer, i.e. the mean context while decoding it):

    - c_step: one 1-token target forward (a plain decoding step);
    - c_verify(B): one B-token target forward that also captures the draft's features;
    - c_draft(B): one draft call: one new context token, a block of B, the LM head on B-1 positions.

    Medians of `reps` timings, in seconds. Token values do not matter for timing, so the blocks are
    filler. Everything else a real step does (acceptance, commit, crops, feature hand-over) is left
    out: that is what the efficiency of the cost model charges the loop for."""
    proposer = DFlashProposer(draft, target)
    layers = proposer.feature_layers
    n, top = len(seq), max(block_sizes)
    tokens = torch.tensor([list(seq) + [seq[-1]] * (top + reps * len(block_sizes))], device=target.device)
    pos = torch.arange(tokens.shape[1], device=target.device)[None]
    cache = target.new_cache()
    _, feats = target.forward(tokens[:, : n - 1], pos[:, : n - 1], cache, logits_to_keep=1, features=layers)
    # The draft sees the context as in decoding: the prompt joins, then one committed token per call.
    row = Row("calibrate", list(seq[:-1]), GenerationConfig(), top, None, tokens=[seq[-1]])
    proposer.join([row], [feats[0]])
    proposer.propose([row], [top - 1])  # the context enters the draft cache, untimed

    def median(fn, before=None) -> float:
        times = []
        for _ in range(reps):
            if before:
                before()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            target.crop(cache, n - 1)
        return sorted(times)[len(times) // 2]

    def verify(b: int, features: list[int] | None):
        return lambda: target.forward(
            tokens[:, n - 1 : n - 1 + b], pos[:, n - 1 : n - 1 + b], cache, features=features
        )

    def commit_one():  # the last call's anchor is committed: one new context token for the next call
        proposer.accept(feats[:, -1:], [1])
        row.tokens.append(seq[-1])

    return {
        "context_tokens": n,
        "c_step_s": median(verify(1, None)),
        "c_verify_s": {b: median(verify(b, layers)) for b in block_sizes},
        "c_draft_s": {
            b: median(lambda b=b: proposer.propose([row], [b - 1]), commit_one) for b in block_sizes
        },
    }


def cost_model(
    methods: list[Method], summary: dict, calib: list[dict | None], prompts, bc: BenchConfig
) -> dict:
    """Per data set and DFlash block size: c_verify(B) / c_step and c_draft(B) / c_step from the
    per-prompt calibrations (means over the data set's prompts), the ideal speedup
    tau / ((c_verify + c_draft) / c_step), and efficiency = measured speedup / ideal. Next to it,
    from the runs themselves, the share of our loop's step time spent outside the draft and verify
    forwards (`loop_overhead`)."""
    out = {}
    names = {m.name for m in methods}
    for ds, rows in summary.items():
        idx = [i for i, p in enumerate(prompts) if (ds == "all" or p.dataset == ds) and calib[i] is not None]
        if not idx:
            continue
        c_step = sum(calib[i]["c_step_s"] for i in idx) / len(idx)
        per = {}
        for b in bc.block_sizes:
            name = f"dflash-b{b}"
            if name not in names or name not in rows:
                continue
            s = rows[name]
            c_verify = sum(calib[i]["c_verify_s"][b] for i in idx) / len(idx)
            c_draft = sum(calib[i]["c_draft_s"][b] for i in idx) / len(idx)
            ideal = _div(s["tau"] * c_step, c_verify + c_draft)
            per[name] = {
                "c_step_s": c_step,
                "c_verify_over_step": _div(c_verify, c_step),
                "c_draft_over_step": _div(c_draft, c_step),
                "tau": s["tau"],
                "ideal_speedup": ideal,
                "measured_speedup": s["speedup"],
                "efficiency": _div(s["speedup"], ideal),
                "loop_overhead": _div(s["step_s"] - s["draft_s"] - s["verify_s"], s["step_s"]),
            }
        out[ds] = per
    return out


def reference_comparison(methods: list[Method], summary: dict, bc: BenchConfig) -> list[dict]:
    """Ours vs the authors' loop (and transformers' DFlash) per data set and block size."""
    rows = []
    for ds, s in summary.items():
        for b in bc.block_sizes:
            ours, ref, hf = s.get(f"dflash-b{b}"), s.get(f"reference-b{b}"), s.get(f"hf-dflash-b{b}")
            if ours is None:
                continue
            row = {
                "dataset": ds,
                "block_size": b,
                "tau_ours": ours["tau"],
                "ms_per_token_ours": 1e3 * ours["time_per_token_s"],
            }
            for tag, other in (("reference", ref), ("hf_dflash", hf)):
                if other is not None:
                    row[f"tau_{tag}"] = other["tau"]
                    row[f"ms_per_token_{tag}"] = 1e3 * other["time_per_token_s"]
                    row[f"ours_faster_than_{tag}"] = _div(other["time_per_token_s"], ours["time_per_token_s"])
            rows.append(row)
    return rows


@torch.inference_mode()
def top2_margin(target: Target, prompt: Sequence[int], prefix: Sequence[int]) -> float:
    """The target's top-1 minus top-2 logit for the token after prompt + prefix (one forward)."""
    ids = torch.tensor([list(prompt) + list(prefix)], device=target.device)
    pos = torch.arange(ids.shape[1], device=target.device)[None]
    logits, _ = target.forward(ids, pos, target.new_cache(), logits_to_keep=1)
    top = logits[0, -1].double().topk(2).values
    return float(top[0] - top[1])


@torch.inference_mode()
def explain_mismatches(target: Target, methods, prompts, runs, limit: int = 20) -> list[dict]:
    """Greedy outputs that differ from plain decoding, with the target's top-2 logit margin at the
    first differing position (computed in one forward over the prompt and plain's prefix). A tiny
    margin means a near-tie that rounding decided; a large one would point at a bug."""
    out = []
    for m in methods:
        if m.name == "plain" or m.name not in runs:
            continue
        for i, r in enumerate(runs[m.name]):
            plain = runs["plain"][i].tokens
            d = first_divergence(plain, r.tokens)
            if d is None:
                continue
            row = {"method": m.name, "prompt": prompts[i].id, "first_diff": d, "margin": None}
            if d < len(plain) and d < len(r.tokens) and len(out) < limit:
                margin = top2_margin(target, prompts[i].ids, plain[:d])
                row.update(plain_token=plain[d], method_token=r.tokens[d], margin=margin)
            out.append(row)
    return out


def gsm_accuracy(target: Target, methods, prompts, runs) -> dict:
    """Final-answer accuracy per method on the prompts that carry a reference answer."""
    idx = [i for i, p in enumerate(prompts) if p.answer is not None]
    if not idx or target.tokenizer is None:
        return {}
    out = {}
    for name, rs in runs.items():
        correct = [_answer_correct(target.tokenizer, rs[i].tokens, prompts[i].answer) for i in idx]
        n, k = len(correct), sum(correct)
        acc = k / n
        out[name] = {
            "correct": k,
            "n": n,
            "accuracy": acc,
            "stderr": math.sqrt(acc * (1 - acc) / n),
            # outputs cut by max_new_tokens before a stop token: their final answer may be missing
            "truncated": sum(not set(rs[i].tokens[-1:]) & set(target.stop_ids) for i in idx),
            "differs_from_plain": sum(
                c != _answer_correct(target.tokenizer, runs["plain"][i].tokens, prompts[i].answer)
                for c, i in zip(correct, idx, strict=True)
            ),
        }
    return out


def _cast_target(target: Target, dtype: torch.dtype) -> Target:
    """The same target in another dtype (a fresh module, so the original keeps its dtype and hooks); the
    transformers one, dense, when the benched target is the native runner in another dtype: the numerics
    then compare the runner against the float reference."""
    if target.dtype == dtype:
        return target
    model = type(target.model)(target.model.config)
    model.load_state_dict(target.model.state_dict())
    return Target(model.to(device=target.device, dtype=dtype), target.tokenizer)


@torch.inference_mode()
def numerics(
    target: Target, draft: DFlashDraft, prompts: Sequence[BenchPrompt], bc: BenchConfig, stop_ids
) -> dict:
    """Greedy equality per dtype: DFlash vs plain decoding in the same dtype, next to plain bf16 vs
    plain float32 (the noise floor every bf16 user has). Uses the shortest prompts, since a bf16
    prefill is expensive on CPUs without native bf16; always greedy, whatever the benchmark's
    temperature."""
    picks = sorted(prompts, key=lambda p: len(p.ids))[: bc.numerics_samples]
    block = max(bc.block_sizes)
    cfg = GenerationConfig(bc.numerics_max_new_tokens, None, SamplingConfig(), stop_ids)
    outputs: dict[str, dict[str, list[list[int]]]] = {}
    rows = []

    def compare(t: Target, a: list[list[int]], b: list[list[int]]) -> dict:
        """a is the baseline; margins are `t`'s, after a's prefix, where both outputs go on."""
        diffs = [first_divergence(x, y) for x, y in zip(a, b, strict=True)]
        div = [d for d in diffs if d is not None]
        margins = [
            top2_margin(t, p.ids, x[:d]) if d is not None and d < min(len(x), len(y)) else None
            for p, x, y, d in zip(picks, a, b, diffs, strict=True)
        ]
        return {
            "outputs": len(diffs),
            "equal": len(diffs) - len(div),
            "mean_first_divergence": sum(div) / len(div) if div else None,
            "first_divergence": diffs,
            "margins": margins,
        }

    targets = {}
    for name in bc.numerics_dtypes:
        dtype = DTYPES[name]
        t = targets[name] = _cast_target(target, dtype)
        proposer = DFlashProposer(_cast_draft(draft, dtype), t)
        plain = [generate(t, p.ids, None, cfg).tokens for p in picks]
        cfg_b = GenerationConfig(cfg.max_new_tokens, block, cfg.sampling, stop_ids)
        spec = [generate(t, p.ids, proposer, cfg_b).tokens for p in picks]
        outputs[name] = {"plain": plain, "dflash": spec}
        rows.append({"comparison": f"dflash-b{block} vs plain, {t.describe()}", **compare(t, plain, spec)})
    if "bfloat16" in outputs and "float32" in outputs:
        a, b = targets["bfloat16"], targets["float32"]
        cmp = compare(b, outputs["float32"]["plain"], outputs["bfloat16"]["plain"])
        rows.append({"comparison": f"plain ({a.describe()}) vs plain ({b.describe()})", **cmp})
    return {
        "prompts": [p.id for p in picks],
        "max_new_tokens": bc.numerics_max_new_tokens,
        "block_size": block,
        "rows": rows,
        "outputs": outputs,
    }


def _cast_draft(draft: DFlashDraft, dtype: torch.dtype) -> DFlashDraft:
    """The same draft in another dtype, draft vocabulary included (it is no parameter, so
    `load_state_dict` does not carry it): the numerics must measure the draft being benched."""
    if next(draft.parameters()).dtype == dtype:
        return draft
    twin = DFlashDraft(draft.config)
    twin.load_state_dict(draft.state_dict())
    twin.set_vocab(draft.vocab, draft.vocab_rows)
    return twin.to(device=next(draft.parameters()).device, dtype=dtype).eval()


# -- environment ---------------------------------------------------------------------------------


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("flashdraft", "torch", "transformers", "dflash", "numpy"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def machine(target: Target) -> dict:
    cpu = platform.processor() or None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "native_bf16": cpu_has_fast_bf16(),
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "runner": target.describe(),
    }


# -- outputs -------------------------------------------------------------------------------------


def _clean(x):
    """JSON without NaN/inf (they become null)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_outputs(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(_clean(results), indent=1) + "\n")
    (out_dir / "results.md").write_text(render_markdown(results))
    plot(results, out_dir)


def _f(x, fmt: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _ci(ci) -> str:
    """ " [lo, hi]" for a bootstrap interval over prompts, "" when there is none (fewer than 2 prompts)."""
    if not ci or any(v is None or not math.isfinite(v) for v in ci):
        return ""
    return f" [{ci[0]:.2f}, {ci[1]:.2f}]"


def _pct(x, fmt: str = ".0f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(100 * x, fmt) + "%"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def render_markdown(r: dict) -> str:
    """results.md: one section per part of the results, in reading order."""
    parts = (
        _md_header,
        _md_implausible,
        _md_summary,
        _md_acceptance,
        _md_cost,
        _md_reference,
        _md_mismatches,
        _md_gsm,
        _md_numerics,
    )
    lines = [line for part in parts for line in part(r)]
    lines += ["Plots: speedup.png, acceptance_histogram.png, position_acceptance.png.", ""]
    return "\n".join(lines)


def _md_header(r: dict) -> list[str]:
    """Title, command, machine, and notes on methods that are off or qualified."""
    cfg = r["config"]
    temp = cfg["sampling"]["temperature"]
    m = r["machine"]
    lines = [
        "# flashdraft bench",
        "",
        f"`{r.get('command') or 'run_bench(...)'}`",
        "",
        f"target {r.get('target', '?')} ({m.get('runner', m['dtype'])}), draft {r.get('draft', '?')}, "
        f"temperature {temp}, {cfg['max_new_tokens']} new tokens, {len(r['prompts'])} prompts; "
        f"{m['cpu']} ({m['cpu_count']} cores, {m['torch_threads']} torch threads), "
        f"torch {r['versions']['torch']}, transformers {r['versions']['transformers']}; "
        f"wall time {r['wall_s']:.0f} s.",
        "",
        "Speedup = plain decoding's time per output token / the method's, prefill excluded (TTFT is "
        "shown apart). tau = decode tokens / target forwards. Warm-up runs are excluded; methods run "
        "interleaved prompt by prompt.",
        "",
    ]
    off = [x for x in r["methods"] if not x["available"] or x["note"]]
    if off:
        lines += ["Notes on methods:", ""]
        lines += [f"- `{x['name']}`: {'unavailable: ' if not x['available'] else ''}{x['note']}" for x in off]
        lines.append("")
    return lines


def _md_implausible(r: dict) -> list[str]:
    """A warning first of all when the timings cannot be right (`plausibility`), with the machine's load."""
    if not r.get("implausible"):
        return []
    lines = [
        "## WARNING: implausible timings",
        "",
        "These numbers cannot come from an idle machine (rows marked IMPLAUSIBLE below): another job was "
        "probably running. Rerun on an idle machine; the speedups here are not measurements.",
        "",
    ]
    lines += [f"- {x}" for x in flag_lines(r["implausible"])]
    load = r.get("load") or {}
    mean, others = load.get("load_avg_mean"), load.get("others_share")
    lines += [
        f"- load over the runs: 1-minute load average {_f(mean, '.1f')} on {load.get('cores')} cores "
        f"({load.get('torch_threads')} torch threads), other processes {_pct(others)} of the CPU time",
        "",
    ]
    return lines


def _mark(r: dict, ds: str, name: str) -> str:
    return "IMPLAUSIBLE" if _flagged(r, ds, name) else ""


def _md_summary(r: dict) -> list[str]:
    """Per data set and pooled: tau, speed, speedup with intervals, TTFT, equality to plain."""
    lines: list[str] = []
    for ds in [*r["datasets"], "all"]:
        rows = []
        for name, x in r["summary"][ds].items():
            eq = f"{x['equal_to_plain']}/{x['prompts']}" if "equal_to_plain" in x else "-"
            rows.append(
                [
                    name,
                    _f(x["tau"]) + _ci(x.get("tau_ci")),
                    _f(x["tokens_per_s"], ".1f"),
                    _f(1e3 * x["time_per_token_s"] if x["decode_tokens"] else None, ".1f"),
                    _f(x["speedup"]) + _ci(x.get("speedup_ci")),
                    _f(1e3 * x["ttft_s"], ".0f"),
                    eq,
                    _mark(r, ds, name),
                ]
            )
        lines += [f"## {ds}", ""]
        header = ["method", "tau [95% CI]", "decode tok/s", "ms/token", "speedup [95% CI]", "TTFT ms"]
        lines += _table([*header, "equal to plain", "flag"], rows)
        lines.append("")
    return lines


def _md_acceptance(r: dict) -> list[str]:
    """Acceptance-length histogram and per-position acceptance, pooled."""
    lines = [
        "## Acceptance",
        "",
        "Acceptance-length histogram (steps committing 1, 2, ... tokens) and "
        "per-position acceptance (share of steps that accepted the drafted token at position k), "
        "all data sets pooled.",
        "",
    ]
    rows = []
    for name, x in r["summary"]["all"].items():
        if x["histogram"] and len(x["histogram"]) > 1:
            rows.append(
                [
                    name,
                    " ".join(str(c) for c in x["histogram"]),
                    " ".join(_f(v) for v in x["position_acceptance"]),
                ]
            )
    lines += _table(["method", "histogram (1..B)", "acceptance at position 1..B-1"], rows) + [""]
    return lines


def _md_cost(r: dict) -> list[str]:
    """The cost model: ideal against measured speedup."""
    lines = [
        "## Cost model",
        "",
        "Measured here, between the same prompts, at each prompt's mean decoding context (means over the "
        "data set): c_step = one 1-token target forward; c_verify(B) = one B-token target forward with "
        "feature capture; c_draft(B) = one draft call. Ideal speedup = tau / ((c_verify + c_draft) / c_step); "
        "efficiency = measured speedup / ideal. Loop overhead = share of our step time outside the draft "
        "and verify forwards, from the runs.",
        "",
    ]
    rows = []
    for ds, per in r["cost_model"].items():
        for name, c in per.items():
            rows.append(
                [
                    ds,
                    name,
                    _f(1e3 * c["c_step_s"], ".1f"),
                    _f(c["c_verify_over_step"]),
                    _f(c["c_draft_over_step"]),
                    _f(c["tau"]),
                    _f(c["ideal_speedup"]),
                    _f(c["measured_speedup"]),
                    _pct(c["efficiency"]),
                    _pct(c["loop_overhead"], ".1f"),
                    _mark(r, ds, name),
                ]
            )
    header = ["data set", "method", "c_step ms", "c_verify/c_step", "c_draft/c_step", "tau", "ideal"]
    lines += _table([*header, "measured", "efficiency", "loop overhead", "flag"], rows) + [""]
    return lines


def _md_reference(r: dict) -> list[str]:
    """Our loop against the authors' and transformers' DFlash loops on the same draft."""
    lines: list[str] = []
    if r["reference_comparison"]:
        lines += ["## Our loop vs the authors' loop and transformers' DFlash (same draft)", ""]
        rows = [
            [
                x["dataset"],
                x["block_size"],
                _f(x["tau_ours"]),
                _f(x.get("tau_reference")),
                _f(x.get("tau_hf_dflash")),
                _f(x["ms_per_token_ours"], ".1f"),
                _f(x.get("ms_per_token_reference"), ".1f"),
                _f(x.get("ms_per_token_hf_dflash"), ".1f"),
                _f(x.get("ours_faster_than_reference")),
            ]
            for x in r["reference_comparison"]
        ]
        lines += _table(
            [
                "data set",
                "B",
                "tau ours",
                "tau ref",
                "tau hf",
                "ms/tok ours",
                "ms/tok ref",
                "ms/tok hf",
                "ref time / ours (>1: ours faster)",
            ],
            rows,
        ) + [""]
    return lines


def _md_mismatches(r: dict) -> list[str]:
    """Greedy outputs that differ from plain decoding, with the logit margin there."""
    lines: list[str] = []
    if "mismatches" in r:
        lines += ["## Greedy outputs that differ from plain decoding", ""]
        if not r["mismatches"]:
            lines += ["None: every greedy output equals plain decoding token for token.", ""]
        else:
            lines += [
                "The margin is the target's top-1 minus top-2 logit at the first differing position, after "
                "plain decoding's prefix: a margin near the dtype's rounding error is a near-tie that a "
                "16-token verify pass and a 1-token step round differently.",
                "",
            ]
            rows = [
                [
                    x["method"],
                    x["prompt"],
                    x["first_diff"],
                    x.get("plain_token", "-"),
                    x.get("method_token", "-"),
                    _f(x["margin"], ".2e"),
                ]
                for x in r["mismatches"]
            ]
            lines += _table(
                ["method", "prompt", "first diff", "plain token", "method token", "margin"], rows
            ) + [""]
    return lines


def _md_gsm(r: dict) -> list[str]:
    """gsm-symbolic final-answer accuracy per method."""
    lines: list[str] = []
    if r["gsm_accuracy"]:
        lines += [
            "## gsm-symbolic final-answer accuracy",
            "",
            "The last number of the answer (a \\boxed{} one first) against the reference; truncated = "
            "cut by max_new_tokens before a stop token.",
            "",
        ]
        rows = [
            [
                name,
                f"{a['correct']}/{a['n']}",
                _f(a["accuracy"]),
                _f(a["stderr"]),
                a["truncated"],
                a["differs_from_plain"],
            ]
            for name, a in r["gsm_accuracy"].items()
        ]
        lines += _table(
            ["method", "correct", "accuracy", "std. error", "truncated", "differs from plain"], rows
        )
        lines.append("")
    return lines


def _md_numerics(r: dict) -> list[str]:
    """Greedy equality per dtype."""
    lines: list[str] = []
    if "numerics" in r:
        n = r["numerics"]
        lines += [
            "## Numerics: greedy equality per dtype",
            "",
            f"The {len(n['prompts'])} shortest prompts, {n['max_new_tokens']} new tokens, greedy, "
            f"DFlash at block size {n['block_size']}. Per diverging output: the first differing token "
            "and the baseline's top-1/top-2 logit margin there (in the baseline's dtype).",
            "",
        ]
        rows = []
        for x in n["rows"]:
            each = [
                f"{d} ({_f(m, '.2g')})"
                for d, m in zip(x["first_divergence"], x["margins"], strict=True)
                if d is not None
            ]
            mean = _f(x["mean_first_divergence"], ".1f") if x["mean_first_divergence"] is not None else "-"
            rows.append([x["comparison"], f"{x['equal']}/{x['outputs']}", mean, ", ".join(each) or "-"])
        header = ["comparison", "equal outputs", "mean first divergence", "first divergence (margin)"]
        lines += _table(header, rows) + [""]
    return lines


def _colors(names: list[str]) -> dict:
    """One hue per family of methods (ours with the draft, n-gram lookup, the reference and transformers'
    DFlash, baselines), shades within a family: few colours, related methods alike."""
    import matplotlib.pyplot as plt

    families = {
        "dflash-": "Blues",
        "tree-": "Blues",
        "adaptive": "Greens",
        "ngram": "Oranges",
        "hf-prompt-lookup": "Oranges",
    }
    families |= {"reference-": "Purples", "hf-dflash-": "Purples", "hf-generate": "Greys", "plain": "Greys"}
    members: dict[str, list[str]] = {}
    for n in names:
        fam = next((cmap for prefix, cmap in families.items() if n.startswith(prefix)), "Greys")
        members.setdefault(fam, []).append(n)
    out = {}
    for fam, ns in members.items():
        for i, n in enumerate(ns):
            out[n] = plt.get_cmap(fam)(0.45 + 0.45 * (i + 1) / (len(ns) + 1))
    return out


def plot(r: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = r["datasets"]
    names = [x["name"] for x in r["methods"] if x["available"]]
    colors = _colors(names)

    bars = [n for n in names if n != "plain"]  # plain is the dashed line at 1
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(datasets) * max(1, len(bars)) / 4), 4.8))
    width = 0.8 / max(1, len(bars))
    for j, n in enumerate(bars):
        rows = [r["summary"][ds][n] for ds in [*datasets, "all"]]
        ys = [x["speedup"] if x["speedup"] is not None and math.isfinite(x["speedup"]) else 0 for x in rows]
        cis = [x.get("speedup_ci") or [None, None] for x in rows]
        ok = [lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi) for lo, hi in cis]
        pairs = list(zip(ys, cis, ok, strict=True))
        err = [
            [max(0.0, y - lo) if good else 0 for y, (lo, _), good in pairs],
            [max(0.0, hi - y) if good else 0 for y, (_, hi), good in pairs],
        ]
        xs = [i + (j - (len(bars) - 1) / 2) * width for i in range(len(ys))]
        ax.bar(xs, ys, width, label=n, color=colors[n], yerr=err, capsize=2, error_kw={"lw": 0.8})
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(datasets) + 1), [*datasets, "all"])
    ax.set_ylabel("speedup over plain decoding (time per token)")
    ax.set_title(f"decode speedup, temperature {r['config']['sampling']['temperature']}")
    if r.get("implausible"):  # say it on the picture too: plots travel without their results.md
        note = "IMPLAUSIBLE TIMINGS (busy machine?): " + "\n".join(flag_lines(r["implausible"])[:4])
        ax.text(
            0.5,
            0.5,
            note,
            transform=ax.transAxes,
            ha="center",
            va="center",
            color="red",
            fontsize=8,
            wrap=True,
            bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "red"},
        )
    ax.legend(fontsize=8, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out_dir / "speedup.png", dpi=120)
    plt.close(fig)

    # Our speculative methods and transformers' prompt lookup; the reference and transformers' DFlash
    # run the same algorithm as dflash-bB (identical curves at temperature 0): see results.md.
    spec = [
        n
        for n in names
        if n.startswith(("dflash-", "tree-", "ngram", "hf-prompt-lookup", "adaptive"))
        and len(r["summary"]["all"][n]["histogram"]) > 1
    ]
    panels = [*datasets, "all"]
    for fname, key, xlabel, ylabel, offset in (
        (
            "acceptance_histogram.png",
            "histogram",
            "acceptance length (tokens per target forward)",
            "share of steps",
            1,
        ),
        (
            "position_acceptance.png",
            "position_acceptance",
            "block position k",
            "share of steps accepting position k",
            1,
        ),
    ):
        cols = min(3, len(panels))
        rows_ = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows_, cols, figsize=(5 * cols, 3.6 * rows_), squeeze=False)
        for ax, ds in zip(axes.flat, panels, strict=False):
            for n in spec:
                x = r["summary"][ds][n]
                ys = list(x[key])
                if key == "histogram":
                    total = sum(ys)
                    ys = [c / total if total else 0 for c in ys]
                if ys:
                    ax.plot(range(offset, offset + len(ys)), ys, marker="o", ms=3, label=n, color=colors[n])
            ax.set_title(ds)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            if key == "histogram":  # most steps commit one token: a log axis shows the long tail
                ax.set_yscale("log")
                ax.set_ylim(1e-3, 1.05)
            else:
                ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(panels) :]:
            ax.axis("off")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.tight_layout()
        if handles:
            fig.legend(
                handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(6, len(labels))
            )
        fig.savefig(out_dir / fname, dpi=110, bbox_inches="tight")
        plt.close(fig)


# -- command line --------------------------------------------------------------------------------


def load_prompts(
    target: Target, datasets: Sequence[str], samples: int, template_kwargs: dict | None = None
) -> list[BenchPrompt]:
    """The first `samples` examples of each data set, first turn, in the target's chat template."""
    from flashdraft.data import load_dataset

    tok = target.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise BenchError("the target has no tokenizer with a chat template: bench prompts are chat prompts")
    out = []
    for name in datasets:
        for ex in load_dataset(name, limit=samples):
            ids = chat_ids(tok, ex.messages(), template_kwargs)
            answer = ex.answer if name.startswith("gsm-symbolic") else None
            out.append(BenchPrompt(ex.id, name, ids, answer))
    return out


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(p) -> None:
    p.add_argument(
        "--target", required=True, help="built-in name, a .gguf file or a local HF model directory"
    )
    p.add_argument("--draft", required=True, help="DFlash draft directory")
    p.add_argument("--datasets", default=",".join(DEFAULT_DATASETS), help="comma-separated data set names")
    p.add_argument(
        "--samples",
        "--prompts",
        dest="samples",
        type=int,
        default=2,
        help="prompts per data set (the first N)",
    )
    chat.add_argument(p, "the benchmark prompts")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (outputs checked against plain)"
    )
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    p.add_argument(
        "--block-sizes",
        default="",
        help="comma-separated DFlash block sizes, e.g. 8,16 (default: the draft's)",
    )
    p.add_argument(
        "--methods",
        default=",".join(KINDS),
        help=f"comma-separated subset of {','.join(KINDS)} (plain is always run); a kind covers all block sizes",
    )
    p.add_argument(
        "--ngram-tokens", type=int, default=8, help="tokens per prompt lookup (ours and transformers')"
    )
    p.add_argument("--tree-nodes", type=int, default=TREE_NODES, help="drafted tokens per tree (method tree)")
    p.add_argument(
        "--numerics-samples", type=int, default=2, help="prompts of the bf16/float32 equality part; 0 = off"
    )
    p.add_argument("--numerics-max-new-tokens", type=int, default=32)
    p.add_argument(
        "--dtype", choices=["auto", *DTYPES], default="auto", help="auto: bf16 where the hardware has it"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:N]")
    p.add_argument("--out", required=True, help="output directory (results.json, results.md, plots)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--allow-implausible",
        action="store_true",
        help=f"exit 0 even when the timings look implausible (default: exit status {EXIT_IMPLAUSIBLE})",
    )
    p.epilog = (
        f"Exit status: 0 done; 2 bad arguments or inputs; {EXIT_IMPLAUSIBLE} the results were written but "
        "their timings cannot come from an idle machine (a speedup above tau, a cost-model efficiency "
        "above 100%, a plain step far off its calibrated cost, or a busy machine): they are marked "
        "IMPLAUSIBLE in results.md and on the plot. --allow-implausible exits 0 all the same."
    )


def main_from_args(args) -> int:
    from flashdraft.engine.sampling import SamplingConfig
    from flashdraft.models.load import load_target, local_dir
    from flashdraft.models.target import resolve_device

    try:
        block_sizes = tuple(int(b) for b in _csv(args.block_sizes))
    except ValueError:
        raise BenchError(f"--block-sizes takes comma-separated integers, got {args.block_sizes!r}") from None
    # The draft's trained block size: a draft trained at 8 drafts past its training at 16 (not the reverse).
    block_sizes = block_sizes or (DraftConfig.read(local_dir(args.draft)).block_size,)
    kinds = tuple(dict.fromkeys(["plain", *_csv(args.methods)]))
    config = BenchConfig(
        max_new_tokens=args.max_new_tokens,
        block_sizes=block_sizes,
        sampling=SamplingConfig(args.temperature, args.top_k, args.top_p),
        seed=args.seed,
        ngram_tokens=args.ngram_tokens,
        kinds=kinds,
        tree_nodes=args.tree_nodes,
        numerics_samples=args.numerics_samples,
        numerics_max_new_tokens=args.numerics_max_new_tokens,
        progress=not args.no_progress,
    )
    config.validate()
    if args.samples < 1:
        raise BenchError(f"--samples must be >= 1, got {args.samples}")
    device = resolve_device(args.device)
    target = load_target(args.target, args.dtype, str(device), args.runner, args.quantize)
    draft = DFlashDraft.from_pretrained(local_dir(args.draft), dtype=target.dtype, device=target.device)
    prompts = load_prompts(target, _csv(args.datasets), args.samples, args.chat_template_kwargs)
    command = "flashdraft " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else ""
    results = run_bench(
        target,
        draft,
        prompts,
        config,
        args.out,
        command,
        info={"target": args.target, "draft": args.draft, "chat_template_kwargs": args.chat_template_kwargs},
    )
    all_ = results["summary"]["all"]
    for name, x in all_.items():
        mark = "  IMPLAUSIBLE" if _flagged(results, "all", name) else ""
        print(
            f"{name:>18}: tau {_f(x['tau'])}, {_f(x['tokens_per_s'], '.1f')} tok/s, "
            f"speedup {_f(x['speedup'])}{mark}"
        )
    print(f"wrote {Path(args.out) / 'results.json'}, results.md and plots ({results['wall_s']:.0f} s)")
    if not results["implausible"]:
        return 0
    print(
        "warning: implausible timings (was another job running? rerun on an idle machine):", file=sys.stderr
    )
    for line in flag_lines(results["implausible"]):
        print(f"  {line}", file=sys.stderr)
    if args.allow_implausible:
        return 0
    print(
        f"exit status {EXIT_IMPLAUSIBLE}: pass --allow-implausible to accept these numbers", file=sys.stderr
    )
    return EXIT_IMPLAUSIBLE
