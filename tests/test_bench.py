"""`flashdraft bench` on tiny random models: the structure and internal consistency of its results.

A 16-token vocabulary makes random drafts and n-gram lookups accept now and then, so histograms,
tau and per-position rates are not trivially 1. In float64, every greedy method (ours, transformers'
generate / prompt lookup / DFlash, the authors' loop) must reproduce plain decoding exactly, and the
three DFlash loops (same draft, same algorithm) must accept exactly the same tokens step by step,
which also checks the acceptance lengths that the bench reconstructs from hooks on the target.
"""

import json
import math
import random

import numpy as np
import pytest
import torch
from conftest import make_draft, make_hf_model

from flashdraft import SamplingConfig, Target
from flashdraft.bench import bench
from flashdraft.bench.bench import (
    BenchConfig,
    BenchError,
    BenchPrompt,
    Method,
    Run,
    explain_mismatches,
    final_number,
    first_divergence,
    run_bench,
    top2_margin,
)
from flashdraft.cli import main
from flashdraft.engine.adaptive import TREE_NODES
from flashdraft.models.export import hf_dflash_assistant

BLOCKS = (4, 8)


def _prompts(n: int = 4, seed: int = 0) -> list[BenchPrompt]:
    rng = random.Random(seed)
    return [
        BenchPrompt(
            f"p{i}", ("set-a", "set-b")[i % 2], [rng.randrange(16) for _ in range(rng.randint(3, 12))]
        )
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def tiny():
    model = make_hf_model("llama", vocab=16, layers=4)
    return Target(model), make_draft(model, layers=1, block_size=8)


@pytest.fixture(scope="module")
def greedy(tiny, tmp_path_factory):
    target, draft = tiny
    out = tmp_path_factory.mktemp("bench")
    cfg = BenchConfig(
        max_new_tokens=16, block_sizes=BLOCKS, numerics_samples=2, numerics_max_new_tokens=8, progress=False
    )
    prompts = _prompts()
    return run_bench(target, draft, prompts, cfg, out), prompts, out


def _check_consistency(res: dict, prompts: list[BenchPrompt]) -> None:
    blocks = {m["name"]: m["block_size"] for m in res["methods"]}
    for name, runs in res["runs"].items():
        assert [r["prompt"] for r in runs] == [p.id for p in prompts]
        for r in runs:
            assert len(r["tokens"]) == r["prefill_tokens"] + sum(r["lengths"])
            assert all(1 <= n <= blocks[name] for n in r["lengths"])
            if name in ("plain", "ngram", "adaptive") or name.startswith("dflash-"):
                assert r["prefill_tokens"] == 1
    for ds, rows in res["summary"].items():
        idx = [i for i, p in enumerate(prompts) if ds == "all" or p.dataset == ds]
        plain = rows["plain"]
        assert plain["tau"] == 1 and plain["speedup"] == pytest.approx(1.0)
        for name, s in rows.items():
            runs = [res["runs"][name][i] for i in idx]
            lengths = [n for r in runs for n in r["lengths"]]
            hist = s["histogram"]
            assert sum(hist) == s["target_forwards"] == len(lengths)
            assert sum(k * c for k, c in enumerate(hist, 1)) == s["decode_tokens"] == sum(lengths)
            assert s["decode_tokens"] == sum(len(r["tokens"]) - r["prefill_tokens"] for r in runs)
            assert s["tau"] == pytest.approx(s["decode_tokens"] / s["target_forwards"])
            rates = s["position_acceptance"]
            assert len(rates) == len(hist) - 1
            assert all(0 <= x <= 1 for x in rates) and all(
                a >= b for a, b in zip(rates, rates[1:], strict=False)
            )
            for k, x in enumerate(rates, 1):
                assert x == pytest.approx(sum(n > k for n in lengths) / len(lengths))
            assert s["decode_s"] == pytest.approx(sum(r["decode_s"] for r in runs))
            assert s["time_per_token_s"] == pytest.approx(s["decode_s"] / s["decode_tokens"])
            assert s["speedup"] == pytest.approx(plain["time_per_token_s"] / s["time_per_token_s"])
            assert s["tokens_per_s"] == pytest.approx(1 / s["time_per_token_s"])


def test_results_are_complete_and_consistent(greedy):
    res, prompts, _ = greedy
    names = [m["name"] for m in res["methods"]]
    expected = ["plain", "hf-generate", "hf-prompt-lookup", "ngram"]
    expected += [f"dflash-b{b}" for b in BLOCKS] + [f"tree-n{TREE_NODES}", "adaptive"]
    expected += [f"{k}-b{b}" for k in ("reference", "hf-dflash") for b in BLOCKS]
    assert names == expected
    assert all(m["available"] for m in res["methods"]), res["methods"]
    assert res["datasets"] == ["set-a", "set-b"] and set(res["summary"]) == {"set-a", "set-b", "all"}
    _check_consistency(res, prompts)
    for rows in res["summary"].values():  # bootstrap intervals over prompts; plain against itself is 1
        assert all(
            s["speedup_ci"][0] <= s["speedup_ci"][1] and s["tau_ci"][0] <= s["tau_ci"][1]
            for s in rows.values()
        )
        assert rows["plain"]["speedup_ci"] == pytest.approx([1, 1]) and rows["plain"][
            "tau_ci"
        ] == pytest.approx([1, 1])
        tau = rows["dflash-b8"]["tau_ci"]
        assert 1 <= tau[0] <= tau[1] <= 8
    for key in ("command", "config", "versions", "machine", "wall_s", "phases", "cost_model"):
        assert key in res
    assert res["versions"]["torch"] and res["machine"]["dtype"] == "float64"


def test_float64_greedy_outputs_equal_plain_decoding(greedy):
    res, prompts, _ = greedy
    for ds, rows in res["summary"].items():
        for name, s in rows.items():
            assert s["mismatches"] == 0 and s["equal_to_plain"] == s["prompts"], (ds, name)
    assert res["mismatches"] == []
    plain = [r["tokens"] for r in res["runs"]["plain"]]
    assert all(len(t) == 16 for t in plain)  # no stop ids: every output runs to max_new_tokens


def test_three_dflash_loops_accept_the_same_tokens(greedy):
    res, _, _ = greedy
    for b in BLOCKS:
        ours = [r["lengths"] for r in res["runs"][f"dflash-b{b}"]]
        assert [r["lengths"] for r in res["runs"][f"reference-b{b}"]] == ours
        assert [r["lengths"] for r in res["runs"][f"hf-dflash-b{b}"]] == ours
    # the random draft does accept sometimes, so the comparison above is not between all-ones lists
    assert res["summary"]["all"]["dflash-b8"]["tau"] > 1
    assert res["summary"]["all"]["ngram"]["tau"] > 1


def test_cost_model_follows_from_calibration(greedy):
    res, prompts, _ = greedy
    calib = res["calibration"]
    assert len(calib) == len(prompts)
    for ds, per in res["cost_model"].items():
        idx = [i for i, p in enumerate(prompts) if ds == "all" or p.dataset == ds]
        c_step = sum(calib[i]["c_step_s"] for i in idx) / len(idx)
        assert set(per) == {f"dflash-b{b}" for b in BLOCKS}
        for b in BLOCKS:
            c = per[f"dflash-b{b}"]
            c_verify = sum(calib[i]["c_verify_s"][b] for i in idx) / len(idx)
            c_draft = sum(calib[i]["c_draft_s"][b] for i in idx) / len(idx)
            assert c["c_step_s"] == pytest.approx(c_step)
            assert c["c_verify_over_step"] == pytest.approx(c_verify / c_step)
            assert c["c_draft_over_step"] == pytest.approx(c_draft / c_step)
            assert c["ideal_speedup"] == pytest.approx(
                c["tau"] / (c["c_verify_over_step"] + c["c_draft_over_step"])
            )
            assert c["measured_speedup"] == res["summary"][ds][f"dflash-b{b}"]["speedup"]
            assert c["efficiency"] == pytest.approx(c["measured_speedup"] / c["ideal_speedup"])
            assert 0 <= c["loop_overhead"] < 1


def test_numerics_and_reference_comparison(greedy):
    res, prompts, _ = greedy
    n = res["numerics"]
    shortest = sorted(prompts, key=lambda p: len(p.ids))[:2]
    assert n["prompts"] == [p.id for p in shortest] and n["block_size"] == max(BLOCKS)
    comparisons = [r["comparison"] for r in n["rows"]]
    assert comparisons == [
        "dflash-b8 vs plain, transformers, dense weights, bfloat16",
        "dflash-b8 vs plain, transformers, dense weights, float32",
        "plain (transformers, dense weights, bfloat16) vs plain (transformers, dense weights, float32)",
    ]
    for r in n["rows"]:
        div = [d for d in r["first_divergence"] if d is not None]
        assert r["equal"] == r["outputs"] - len(div) and r["outputs"] == 2
        assert r["mean_first_divergence"] == (sum(div) / len(div) if div else None)
        assert len(r["margins"]) == 2
        assert all(m is None for m, d in zip(r["margins"], r["first_divergence"], strict=True) if d is None)
    rows = res["reference_comparison"]
    assert {(r["dataset"], r["block_size"]) for r in rows} == {
        (ds, b) for ds in ("set-a", "set-b", "all") for b in BLOCKS
    }
    for r in rows:
        assert r["tau_ours"] == r["tau_reference"] == r["tau_hf_dflash"]


def test_output_files(greedy):
    res, _, out = greedy
    loaded = json.loads((out / "results.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert (
        loaded["summary"]["all"]["plain"]["decode_tokens"] == res["summary"]["all"]["plain"]["decode_tokens"]
    )
    md = (out / "results.md").read_text()
    for m in res["methods"]:
        assert f"| {m['name']} |" in md
    for name in ("speedup.png", "acceptance_histogram.png", "position_acceptance.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sampling_runs_report_tau_and_speedup_without_equality(tiny):
    target, draft = tiny
    cfg = BenchConfig(
        max_new_tokens=12,
        block_sizes=(8,),
        sampling=SamplingConfig(0.8, top_p=0.9),
        kinds=("plain", "hf-generate", "ngram", "dflash", "reference"),
        numerics_samples=0,
        progress=False,
    )
    prompts = _prompts(2, seed=1)
    res = run_bench(target, draft, prompts, cfg)
    _check_consistency(res, prompts)
    assert "mismatches" not in res and "numerics" not in res
    for s in res["summary"]["all"].values():
        assert "equal_to_plain" not in s and s["tau"] >= 1 and math.isfinite(s["speedup"])


def test_hf_dflash_assistant_is_a_renaming_of_our_draft(tiny):
    target, draft = tiny
    assistant, reason = hf_dflash_assistant(draft, target)
    assert reason is None
    torch.manual_seed(0)
    feats = torch.randn(1, 5, draft.fc.in_features, dtype=torch.float64)
    block = target.embed(torch.tensor([[3] + [draft.config.mask_token_id] * 7]))
    pos = torch.arange(13)[None]
    with torch.no_grad():
        ours = draft(block, pos[:, 5:], feats, pos[:, :5])
        theirs = assistant(
            noise_embeds=block, context_hidden_states=feats, position_ids=pos
        ).last_hidden_state
    # Their RMSNorm and rotary compute in float32 even for float64 inputs: float32-level agreement.
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)

    scaled = make_draft(target.model, layers=1, block_size=8)
    scaled.config.extra["output_multiplier"] = 2.0
    assistant, reason = hf_dflash_assistant(scaled, target)
    assert assistant is None and "not a pure renaming" in reason and "output_multiplier" in reason


def test_mismatches_are_explained_by_the_top2_margin(tiny):
    target, _ = tiny
    prompts = _prompts(2)
    plain = [Run([5, 6, 7, 8], [1, 1, 1], 0.1, 0.3), Run([1, 2], [1], 0.1, 0.1)]
    other = [Run([5, 6, 9, 8], [2, 1], 0.1, 0.2), Run([1, 2], [1], 0.1, 0.1)]
    methods = [Method("plain", "plain", 1, None), Method("x", "dflash", 4, None)]
    rows = explain_mismatches(target, methods, prompts, {"plain": plain, "x": other})
    assert rows == [
        {
            "method": "x",
            "prompt": "p0",
            "first_diff": 2,
            "margin": top2_margin(target, prompts[0].ids, [5, 6]),
            "plain_token": 7,
            "method_token": 9,
        }
    ]
    logits = target.model(torch.tensor([prompts[0].ids + [5, 6]])).logits[0, -1]
    top = logits.topk(2).values
    assert rows[0]["margin"] == pytest.approx(float(top[0] - top[1]), rel=1e-9) and rows[0]["margin"] >= 0


def test_helpers():
    assert final_number("so 3 + 4 = 7, and the answer is \\boxed{1,234}. Check: 5") == 1234.0
    assert final_number("The total is 42.") == 42.0 and final_number("-3.5 degrees") == -3.5
    assert final_number("no digits here") is None
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize(
    "cfg, message",
    [
        (BenchConfig(block_sizes=(1, 8)), "block sizes must be >= 2"),
        (BenchConfig(kinds=("dflash",)), "must include plain"),
        (BenchConfig(kinds=("plain", "medusa")), "must include plain"),
        (BenchConfig(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (BenchConfig(numerics_dtypes=("float16",)), "numerics dtypes"),
    ],
)
def test_bad_config_is_refused(tiny, cfg, message):
    target, draft = tiny
    with pytest.raises(BenchError, match=message):
        run_bench(target, draft, _prompts(1), cfg)


# -- the command line, on a tiny model with a tiny word-level tokenizer ---------------------------

WORDS = (
    "the a an of to and in is are what how many each if he she they it for on with his her their per "
    "day days has have had total does do much more than please reason step by your final answer within "
    "boxed put write compose blog post about trip 0 1 2 3 4 5 6 7 8 9 . , ? !"
).split()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("bench-cli")
    vocab = {w: i for i, w in enumerate(["[UNK]", "<eos>", *dict.fromkeys(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    model = make_hf_model("qwen3", vocab=128, layers=4, max_pos=1024).to(torch.float32)
    model.save_pretrained(root / "target")
    fast.save_pretrained(root / "target")
    make_draft(model, layers=1, block_size=4, dtype=torch.float32).save_pretrained(root / "draft")
    return root


def test_cli_bench_writes_all_outputs(model_dirs, capsys):
    out = model_dirs / "out"
    argv = ["bench", "--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft")]
    argv += ["--datasets", "mt-bench,gsm-symbolic-eval", "--samples", "1", "--max-new-tokens", "6"]
    argv += ["--methods", "dflash,reference", "--numerics-samples", "1"]  # block size: the draft's (4)
    argv += ["--numerics-max-new-tokens", "4", "--dtype", "float32", "--out", str(out), "--no-progress"]
    argv += ["--allow-implausible"]  # a tiny model's timings on a shared machine: flags are its own test
    assert main(argv) == 0, capsys.readouterr().err
    res = json.loads((out / "results.json").read_text())
    assert [m["name"] for m in res["methods"]] == ["plain", "dflash-b4", "reference-b4"]
    assert [p["dataset"] for p in res["prompts"]] == ["mt-bench", "gsm-symbolic-eval"]
    assert res["prompts"][1]["answer"] is not None and res["prompts"][1]["id"].startswith(
        "gsm-symbolic/s1000/"
    )
    assert set(res["gsm_accuracy"]) == {"plain", "dflash-b4", "reference-b4"}
    for a in res["gsm_accuracy"].values():
        assert a["n"] == 1 and a["differs_from_plain"] == 0
    assert res["config"]["block_sizes"] == [4] and res["command"] == ""
    assert "wrote" in capsys.readouterr().out
    for name in ("results.md", "speedup.png", "acceptance_histogram.png", "position_acceptance.png"):
        assert (out / name).is_file()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--block-sizes", "4,x"], "--block-sizes takes comma-separated integers"),
        (["--methods", "plain,medusa"], "must include plain"),
        (["--samples", "0"], "--samples must be >= 1"),
        (["--datasets", "nope"], "unknown data set"),
    ],
)
def test_cli_bad_input(model_dirs, tmp_path, extra, message, capsys):
    argv = ["bench", "--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft")]
    argv += ["--out", str(tmp_path), "--no-progress", "--dtype", "float32", *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# -- implausible timings are flagged ---------------------------------------------------------------


def _record(speedup=1.4, tau=1.6, efficiency=0.85, plain_step_s=0.023, c_step_s=0.022):
    """A fabricated bench result (summary, cost model) of one data set: plain and dflash-b16."""
    plain = {"tau": 1.0, "speedup": 1.0, "decode_s": 100 * plain_step_s, "target_forwards": 100}
    dflash = {"tau": tau, "speedup": speedup, "decode_s": 1.0, "target_forwards": 40}
    summary = {"all": {"plain": plain, "dflash-b16": dflash}}
    cost = {"all": {"dflash-b16": {"c_step_s": c_step_s, "efficiency": efficiency}}}
    return summary, cost


IDLE = {"cores": 2, "torch_threads": 2, "load_avg_mean": 1.9, "load_avg_max": 2.1, "others_share": 0.03}


@pytest.mark.parametrize(
    "record, load, where, problem",
    [
        (_record(speedup=13.4, tau=1.4), IDLE, "dflash-b16", "speedup 13.40x above tau 1.40"),
        (_record(efficiency=1.43), IDLE, "dflash-b16", "efficiency 143% above 100%"),
        (_record(plain_step_s=0.88, c_step_s=0.022), IDLE, "plain", "is 40.0x its calibrated cost"),
        (_record(plain_step_s=0.008, c_step_s=0.022), IDLE, "plain", "is 0.4x its calibrated cost"),
        (_record(), {**IDLE, "load_avg_mean": 3.6, "load_avg_max": 4.0}, None, "load average 3.6"),
        (_record(), {**IDLE, "others_share": 0.45}, None, "other processes used 45%"),
    ],
)
def test_implausible_timings_are_flagged(record, load, where, problem):
    flags = bench.plausibility(*record, load)
    assert [(f["dataset"], f["method"]) for f in flags] == [(None if where is None else "all", where)]
    assert problem in flags[0]["problems"][0]


def test_plausible_timings_are_not_flagged():
    assert bench.plausibility(*_record(), IDLE) == []
    # the bounds themselves (within the timing-noise slack) are plausible; missing numbers are not checked
    assert bench.plausibility(*_record(speedup=1.6, efficiency=1.0, plain_step_s=0.044), IDLE) == []
    assert bench.timing_problems(speedup=float("nan"), tau=1.0, step_s=None, calibrated_step_s=0.02) == []


def test_machine_load_reads_the_load_average(monkeypatch):
    """A busy machine is seen through os.getloadavg, also where /proc/stat does not exist."""
    monkeypatch.setattr(bench, "_cpu_ticks", lambda: None)
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    for avg, busy in ((1.8, False), (6.5, True)):
        monkeypatch.setattr(bench.os, "getloadavg", lambda avg=avg: (avg, avg, avg))
        load = bench.MachineLoad()
        load.sample()
        summary = load.summary()
        assert summary["load_avg_mean"] == avg and summary["cores"] == 2 and summary["others_share"] is None
        assert bool(bench.load_problems(summary)) == busy


def test_machine_load_counts_other_processes_cpu_time(monkeypatch):
    """/proc/stat's busy ticks minus this process's own CPU time: what other processes (and the
    hypervisor) took. 1000 ticks of all cores, 600 busy, this process 100 ticks: others 50%."""
    ticks = iter([(1000, 10, 5000), (1600, 40, 6000)])
    own = iter([2.0, 3.0])
    monkeypatch.setattr(bench, "_cpu_ticks", lambda: next(ticks))
    monkeypatch.setattr(bench, "_own_cpu_s", lambda: next(own))
    monkeypatch.setattr(bench.os, "sysconf", lambda name: 100)
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (0.5, 0.5, 0.5))  # not this machine's own load
    summary = bench.MachineLoad().summary()
    assert summary["others_share"] == pytest.approx(0.5) and summary["steal_share"] == pytest.approx(0.03)
    # others took a core's worth: too much beside 2 threads on 2 cores, not beside 1 thread on 4
    assert "other processes used 50%" in bench.load_problems({**summary, "cores": 2, "torch_threads": 2})[0]
    assert bench.load_problems({**summary, "cores": 4, "torch_threads": 1}) == []


def test_cli_bench_flags_a_busy_machine_in_table_plot_and_exit_status(
    model_dirs, tmp_path, monkeypatch, capsys
):
    """A load average far above the cores: exit status 3 with the reasons on stderr, IMPLAUSIBLE in the
    table and the warning atop results.md; --allow-implausible writes the same and exits 0."""
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (40.0, 40.0, 40.0))
    argv = ["bench", "--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft")]
    argv += ["--datasets", "mt-bench", "--samples", "1", "--max-new-tokens", "4", "--methods", "dflash"]
    argv += ["--numerics-samples", "0", "--dtype", "float32", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == bench.EXIT_IMPLAUSIBLE
    err = capsys.readouterr().err
    assert "implausible timings" in err and "load average 40.0" in err and "--allow-implausible" in err
    md = (tmp_path / "a" / "results.md").read_text()
    assert "## WARNING: implausible timings" in md and "load average 40.0" in md
    res = json.loads((tmp_path / "a" / "results.json").read_text())
    assert res["implausible"][0]["method"] is None and res["load"]["load_avg_mean"] == 40.0
    assert (tmp_path / "a" / "speedup.png").is_file()
    assert main([*argv, "--out", str(tmp_path / "b"), "--allow-implausible"]) == 0
    assert "implausible timings" in capsys.readouterr().err


def test_cli_bench_exits_0_on_plausible_timings(model_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "plausibility", lambda *a: [])  # tiny models on a shared machine: no verdict
    argv = ["bench", "--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft")]
    argv += ["--datasets", "mt-bench", "--samples", "1", "--max-new-tokens", "4", "--methods", "dflash"]
    argv += ["--numerics-samples", "0", "--dtype", "float32", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert "IMPLAUSIBLE" not in capsys.readouterr().out + (tmp_path / "results.md").read_text()


def test_implausible_rows_are_marked_in_the_markdown(greedy):
    res, _, _ = greedy
    flagged = {**res, "implausible": [{"dataset": "set-a", "method": "ngram", "problems": ["speedup 9x"]}]}
    md = bench.render_markdown(flagged)
    assert "## WARNING: implausible timings" in md and "- set-a ngram: speedup 9x" in md
    rows = [line for line in md.splitlines() if line.startswith("| ngram |")]
    assert rows[0].endswith("| IMPLAUSIBLE |") and not any(r.endswith("| IMPLAUSIBLE |") for r in rows[1:])
    assert "WARNING" not in bench.render_markdown({**res, "implausible": []})


# -- the numerics part benches the draft it was given ---------------------------------------------


def test_cast_draft_keeps_the_draft_vocabulary(tiny):
    target, draft = tiny
    reduced = make_draft(target.model, layers=1, block_size=8)
    reduced.set_vocab([0, 2, 3, 5, 7, 11, 13], target.lm_head.weight)
    cast = bench._cast_draft(reduced, torch.float32)
    assert next(cast.parameters()).dtype == torch.float32 and cast is not reduced
    assert cast.vocab.tolist() == reduced.vocab.tolist()
    assert torch.equal(cast.vocab_rows, reduced.vocab_rows)  # it saves as it was loaded
    hidden = torch.randn(1, 3, reduced.config.hidden_size, dtype=torch.float64)
    want = reduced.propose_logits(hidden, target.lm_head)
    head = torch.nn.Linear(target.lm_head.in_features, target.lm_head.out_features, bias=False)
    head.weight.data = target.lm_head.weight.detach().float()
    got = cast.propose_logits(hidden.float(), head)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)) and torch.isfinite(want).sum() == 21


# -- the bootstrap interval against a reference computation ----------------------------------------


def test_bootstrap_interval_is_the_95_percent_percentile_interval():
    """bootstrap_ci against scipy's percentile bootstrap of the same statistics (ratios of sums over the
    resampled prompts, plain and method resampled together) at 95%. The resamples differ, so the
    endpoints agree to Monte-Carlo precision; the 90% interval is far outside it (checked), so an
    interval of another level cannot pass."""
    from scipy.stats import bootstrap

    rng = random.Random(7)
    plain, runs = [], []
    for _ in range(12):
        n = rng.randint(20, 60)
        plain.append(Run([0] * (n + 1), [1] * n, 0.1, n * rng.uniform(0.02, 0.03)))
        lengths = [rng.randint(1, 6) for _ in range(rng.randint(5, 25))]
        runs.append(Run([0] * (sum(lengths) + 1), lengths, 0.1, len(lengths) * rng.uniform(0.02, 0.06)))
    idx = list(range(12))
    ours_speedup, ours_tau = bench.bootstrap_ci(plain, runs, idx, n=20_000)

    columns = [
        [r.decode_s for r in plain],
        [sum(r.lengths) for r in plain],
        [r.decode_s for r in runs],
        [sum(r.lengths) for r in runs],
        [len(r.lengths) for r in runs],
    ]

    def speedup(p_s, p_n, s, n, _steps):
        return (sum(p_s) / sum(p_n)) / (sum(s) / sum(n))

    def tau(_p_s, _p_n, _s, n, steps):
        return sum(n) / sum(steps)

    for ours, stat in ((ours_speedup, speedup), (ours_tau, tau)):
        ref = {}
        for level in (0.95, 0.90):
            res = bootstrap(
                columns,
                stat,
                paired=True,
                vectorized=False,
                n_resamples=20_000,
                confidence_level=level,
                method="percentile",
                random_state=np.random.default_rng(0),
            )
            ref[level] = [res.confidence_interval.low, res.confidence_interval.high]
        width = ref[0.95][1] - ref[0.95][0]
        tol = 0.02 * width  # Monte-Carlo precision of the endpoints of 20,000 resamples
        assert min(ref[0.90][0] - ref[0.95][0], ref[0.95][1] - ref[0.90][1]) > 2 * tol  # the test has power
        assert ours == pytest.approx(ref[0.95], abs=tol), (stat.__name__, ours, ref)
