"""Do the tests fail when the code is wrong? Each entry plants one plausible bug (a text substitution in one
file), runs the tests aimed at it, and restores the file. A bug the tests pass is printed as MISSED.

    python scripts/test_teeth.py [--only NAME,...] [--json runs/teeth.json]

First the aimed tests run once unchanged (they must pass, or a failure would prove nothing). Run it on an
otherwise idle machine; it takes several minutes. The file is restored even when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name, file, original text, planted bug, tests aimed at it)
BUGS = [
    (
        "test drafts ignore their context (default 0.02 init)",
        "tests/conftest.py",
        "DRAFT_STD = 0.15",
        "DRAFT_STD = 0.02",
        "tests/test_draft.py::test_test_drafts_depend_on_their_context",
    ),
    (
        "batched sliding-window draft layers see the whole context",
        "flashdraft/proposers.py",
        '"sliding_attention": (diff >= 0) & (diff < self.window)}',
        '"sliding_attention": mask}',
        "tests/test_batch.py::test_sliding_window_draft_batched_equals_single_row",
    ),
    (
        "sliding-window drafts refused in batches (as before the engine)",
        "flashdraft/proposers.py",
        "        draft.check_target(target)\n        self.feature_layers",
        "        draft.check_target(target)\n        if 'sliding_attention' in draft.config.layer_types:\n"
        "            raise ValueError('batched decoding does not support sliding-window drafts')\n"
        "        self.feature_layers",
        "tests/test_serve.py",
    ),
    (
        "a row's dead block slots are visible to its draft (shorter blocks see the longest row's masks)",
        "flashdraft/proposers.py",
        "blk_kpos = torch.where(steps <= torch.tensor(ks, device=device)[:, None], blk_pos, DEAD)",
        "blk_kpos = blk_pos",
        "tests/test_batch.py::test_long_run_compacts_and_stays_exact",
    ),
    (
        "padded draft slots compared like drafts in batched greedy verification",
        "flashdraft/engine.py",
        "match &= steps[:k_max] < torch.tensor(ks, device=device)[:, None]",
        "match &= steps[:k_max] >= 0",
        "tests/test_batch.py::test_padding_equal_to_the_true_next_token_is_never_accepted",
    ),
    (
        "the proposer hands the verifier q of the wrong block positions",
        "flashdraft/proposers.py",
        "                out.append((sample(q, row.generator)[0], q))",
        "                out.append((sample(q, row.generator)[0], q.flip(1)))",
        "tests/test_batch.py::test_sampling_with_a_spread_draft_alone_and_batched",
    ),
    (
        "the adaptive cut looks at the sampled tokens' own q (then the verified drafts are not q's samples)",
        "flashdraft/adaptive.py",
        '                options.append(("dflash", tokens, q, self._confidence(b, k, q), self.calibration))',
        "                conf = self._confidence(b, k, q) if q is None else q[0].gather(-1, tokens[:, None])[:, 0]\n"
        '                options.append(("dflash", tokens, q, conf, self.calibration))',
        "tests/test_adaptive.py::test_sampling_adaptive_is_exact",
    ),
    (
        "the adaptive proposer never skips the draft",
        "flashdraft/adaptive.py",
        "        self.drafted = self.dflash is not None and any(s.wait == 0 for s in states)",
        "        self.drafted = self.dflash is not None",
        "tests/test_adaptive.py::test_a_useless_draft_is_mostly_skipped",
    ),
    (
        "the adaptive draft-or-not state carries over from one request to the next",
        "flashdraft/adaptive.py",
        "        self.rows = {r: self.rows.get(r) or self._new_row(batch) for r in rows}",
        "        self.rows = {r: self.rows.get(r) or next(iter(self.rows.values()), None) or self._new_row(batch) for r in rows}",
        "tests/test_adaptive.py::test_draft_or_not_is_decided_per_request",
    ),
    (
        "the adaptive proposer never verifies a source again once its chances fell below the cut",
        "flashdraft/adaptive.py",
        "        if best.value == 0.0 and options and st.idle >= EXPLORE:",
        "        if False:",
        "tests/test_adaptive.py::test_a_source_judged_hopeless_is_tried_again",
    ),
    (
        "the adaptive step never compares itself with a plain step",
        "flashdraft/adaptive.py",
        "        if longest and not self.pays(",
        "        if False and not self.pays(",
        "tests/test_adaptive.py::test_a_step_that_does_not_beat_a_plain_step_verifies_nothing",
    ),
    (
        "the plain step's cost is the speculative fit's a + b*n at one token per row",
        "flashdraft/adaptive.py",
        "        return (plain[0] + plain[1] * rows if plain else a + b * rows), a, b",
        "        return a + b * rows, a, b",
        "tests/test_adaptive.py::test_a_step_that_does_not_beat_a_plain_step_verifies_nothing",
    ),
    (
        "a new request's n-gram calibration starts at 1 in 2 whatever earlier requests showed",
        "flashdraft/adaptive.py",
        "ngram=Calibration(self.ngram_typical)",
        "ngram=Calibration()",
        "tests/test_adaptive.py::test_ngram_calibration_starts_from_all_requests",
    ),
    (
        "a new request relearns from a wait of 1 that the draft does not pay",
        "flashdraft/adaptive.py",
        "            st.backoff = EXPLORE",
        "            st.backoff = 1",
        "tests/test_adaptive.py::test_where_the_draft_does_not_pay_a_new_request_backs_off_at_once",
    ),
    (
        "autocast auto stays off on CPUs with native bf16 (CUDA only, as before)",
        "flashdraft/train_config.py",
        '    return device.type == "cuda" or (dtype == torch.bfloat16 and target.cpu_has_fast_bf16())',
        '    return device.type == "cuda"',
        "tests/test_train.py::test_autocast_auto_is_on_where_bf16_is_native",
    ),
    (
        "the run ignores the autocast rule",
        "flashdraft/train.py",
        "        autocast=use_autocast(cfg.autocast, device, dtype),",
        '        autocast=cfg.autocast == "on",',
        "tests/test_train.py::test_autocast_auto_is_on_where_bf16_is_native",
    ),
    (
        "shallow targets get the published layer rule (layer -1, repeated layers)",
        "flashdraft/draft.py",
        "    if num_target_layers < num_features + 3:",
        "    if False:",
        "tests/test_draft.py::test_default_target_layer_ids",
    ),
    (
        "datagen ignores --max-prompt-tokens",
        "flashdraft/datagen.py",
        "            if cfg.max_prompt_tokens is not None and len(p.prompt_ids) > cfg.max_prompt_tokens:",
        "            if False:",
        "tests/test_datagen.py::test_max_prompt_tokens_skips_long_prompts_and_counts_them",
    ),
    (
        "the accepted-token counters count drafted tokens",
        "flashdraft/engine.py",
        "            self._count_drafts(k, a)",
        "            self._count_drafts(k, k)",
        "tests/test_batch.py::test_speculative_counters_match_the_commits",
    ),
    (
        "chat_template_kwargs dropped by serve",
        "flashdraft/serve.py",
        "return chat_ids(self.tok, msgs, kwargs)",
        "return chat_ids(self.tok, msgs)",
        "tests/test_serve.py::test_chat_template_kwargs_reach_the_template",
    ),
    (
        "min_p silently ignored by serve",
        "flashdraft/serve.py",
        '    "min_p",\n',
        "",
        "tests/test_serve.py::test_bad_input_gets_an_openai_error",
    ),
    (
        "`generate` stays silent about bf16 rounding",
        "flashdraft/cli.py",
        '            print(BF16_NOTE.format(dtype=str(dtype).removeprefix("torch.")), file=sys.stderr)',
        "            pass",
        "tests/test_cli.py::test_generate_reports_device_and_dtype_and_warns_in_bf16",
    ),
    (
        "`generate --chat-template-kwargs` ignored",
        "flashdraft/cli.py",
        'chat.chat_ids(tok, [{"role": "user", "content": args.prompt}], args.chat_template_kwargs)',
        'chat.chat_ids(tok, [{"role": "user", "content": args.prompt}])',
        "tests/test_cli.py::test_generate_chat_template_kwargs_reach_the_template",
    ),
    (
        "Hub ids are not resolved for targets",
        "flashdraft/models.py",
        "    if HUB_ID.fullmatch(text):\n",
        "    if False:\n",
        "tests/test_cli.py::test_hub_ids_from_the_local_cache",
    ),
    (
        "a typo in a verb's option shows the top-level usage",
        "flashdraft/cli.py",
        "    args, extra = parser.parse_known_args(argv)",
        "    args, extra = parser.parse_args(argv), []",
        "tests/test_cli.py::test_a_typo_shows_the_verbs_usage_and_exits_2",
    ),
    (
        "the trainer reads the wrong target layers",
        "flashdraft/train.py",
        "feature_ids = list(dcfg.target_layer_ids) + ",
        "feature_ids = list(range(len(dcfg.target_layer_ids))) + ",
        "tests/test_train.py::test_the_loop_reads_the_configured_layers_and_resamples_anchors",
    ),
    (
        "anchors are drawn once, not fresh every epoch",
        "flashdraft/train.py",
        '_generator(cfg.seed, "anchors", epoch, i)',
        '_generator(cfg.seed, "anchors", 0, i)',
        "tests/test_train.py::test_the_loop_reads_the_configured_layers_and_resamples_anchors",
    ),
    (
        "the offline walk steps one token at a time",
        "flashdraft/acceptance.py",
        "        p += visited[-1]",
        "        p += 1",
        "tests/test_acceptance.py::test_offline_walk_is_the_real_loop_step_for_step",
    ),
    (
        "references ignore the stop ids",
        "flashdraft/acceptance.py",
        "max_new_tokens=min(max_new_tokens, target.max_length - len(p)), stop_ids=target.stop_ids",
        "max_new_tokens=min(max_new_tokens, target.max_length - len(p))",
        "tests/test_acceptance.py::test_greedy_references_are_plain_greedy_decoding",
    ),
    (
        "tokens outside the draft vocabulary get logit 0 instead of -inf",
        "flashdraft/draft.py",
        'full = sub.new_full((*sub.shape[:-1], weight.shape[0]), float("-inf"))',
        "full = sub.new_full((*sub.shape[:-1], weight.shape[0]), 0.0)",
        "tests/test_draft_vocab.py",
    ),
    (
        "the draft vocabulary is not saved",
        "flashdraft/draft.py",
        '            atomic_write(directory / VOCAB_NAME, lambda p: save_file(vocab, p, metadata={"format": "pt"}))',
        "            pass",
        "tests/test_draft_vocab.py::test_the_vocabulary_travels_beside_the_published_files",
    ),
    (
        "an evaluation prompt may enter training",
        "flashdraft/train_data.py",
        "    if leaked:",
        "    if False:",
        "tests/test_train_data.py::test_evaluation_prompts_never_enter_training",
    ),
    (
        "mixing weights ignored (each source by its size)",
        "flashdraft/train_data.py",
        "want, picked = round(len(sources) * w / sum(weights)), []",
        "want, picked = len(members), []",
        "tests/test_train_data.py::test_mixing_weights_hold_whatever_the_sizes",
    ),
    (
        "corpus answers run past the end of turn",
        "flashdraft/train_data.py",
        "                response = response[: response.index(eos) + 1]",
        "                pass",
        "tests/test_train_data.py::test_corpus_records_are_the_chat_template_and_the_recorded_answer",
    ),
    (
        "--init-draft loads the shape but not the weights",
        "flashdraft/train.py",
        "        draft.load_state_dict(start_from.state_dict())",
        "        pass",
        "tests/test_train_data.py::test_init_draft_starts_from_its_weights",
    ),
    (
        "--eval-refs ignored (evaluation by the decode loop instead)",
        "flashdraft/train.py",
        "refs=read_references(cfg.eval_refs) if cfg.eval_refs else None,",
        "refs=None,",
        "tests/test_train_data.py::test_eval_refs_evaluate_by_the_offline_walk_and_are_kept_out_of_training",
    ),
    (
        "the transformers export loses the draft's rope theta",
        "flashdraft/export.py",
        'rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}',
        'rope_parameters={"rope_type": "default", "rope_theta": 10000.0}',
        "tests/test_cli.py::test_export_to_transformers_gives_our_tokens_in_stock_generate",
    ),
    (
        "a DFlash draft loads as a target",
        "flashdraft/target.py",
        '        if "DFlashDraftModel" in architectures:',
        "        if False:",
        "tests/test_cli.py::test_a_draft_passed_as_target_is_refused",
    ),
    (
        "a target with missing weights loads (random weights there)",
        "flashdraft/target.py",
        "        if missing:  # loading would go on",
        "        if False:  # loading would go on",
        "tests/test_cli.py::test_a_target_with_missing_weights_is_refused",
    ),
    (
        "a tokenizer's BatchEncoding is not unpacked",
        "flashdraft/sequence.py",
        '    if hasattr(prompt_ids, "keys") and "input_ids" in prompt_ids:',
        "    if False:",
        "tests/test_decode.py::test_generate_accepts_what_tokenizers_return",
    ),
    (
        "datagen renders prompts without the chat template options",
        "flashdraft/datagen.py",
        "p.prompt_ids = chat_ids(tokenizer, p.messages, cfg.chat_template_kwargs)",
        "p.prompt_ids = chat_ids(tokenizer, p.messages)",
        "tests/test_chat.py::test_datagen_renders_records_and_refuses_to_mix_modes",
    ),
    (
        "datagen does not record the chat template options (a file could mix modes)",
        "flashdraft/datagen.py",
        '        "chat_template_kwargs": cfg.chat_template_kwargs or None,\n',
        "",
        "tests/test_chat.py::test_datagen_renders_records_and_refuses_to_mix_modes",
    ),
    (
        "datagen does not send the chat template options to an endpoint",
        "flashdraft/datagen.py",
        'body["chat_template_kwargs"] = cfg.chat_template_kwargs',
        "pass",
        "tests/test_datagen.py::test_endpoint_produces_the_same_record_format",
    ),
    (
        "bench renders prompts without the chat template options",
        "flashdraft/bench.py",
        "ids = chat_ids(tok, ex.messages(), template_kwargs)",
        "ids = chat_ids(tok, ex.messages())",
        "tests/test_chat.py::test_bench_and_train_render_with_the_options",
    ),
    (
        "train's evaluation prompts ignore the chat template options",
        "flashdraft/train_data.py",
        "chat_ids(tokenizer, ex.messages(), template_kwargs)",
        "chat_ids(tokenizer, ex.messages())",
        "tests/test_chat.py::test_bench_and_train_render_with_the_options",
    ),
    (
        "train's corpus prompts ignore the chat template options",
        "flashdraft/train_data.py",
        "prompt = chat_ids(tokenizer, msgs, template_kwargs)",
        "prompt = chat_ids(tokenizer, msgs)",
        "tests/test_chat.py::test_bench_and_train_render_with_the_options",
    ),
    (
        "a README command with a wrong flag",
        "README.md",
        "--layers 2 --mask-token-id 16 --out drafts/random",
        "--layers 2 --mask-id 16 --out drafts/random",
        "tests/test_readme.py::test_readme_blocks_run",
    ),
    (
        "a README block that nobody runs",
        "README.md",
        "## Serve\n",
        "## Serve\n\n```bash\nflashdraft serve --nonsense\n```\n",
        "tests/test_readme.py::test_every_block_runs_or_says_why_not",
    ),
    (
        "the draft's slot positions are dropped once its rows lose alignment",
        "flashdraft/proposers.py",
        "        if not self.aligned:  # aligned context",
        "        if False:  # aligned context",
        "tests/test_batch.py::test_long_run_compacts_and_stays_exact",
    ),
    (
        "rows of different prompt lengths treated as aligned after their prefill",
        "flashdraft/engine.py",
        "self.cache, self.kpos, self.length = cache, None if same else kpos, p_len",
        "self.cache, self.kpos, self.length = cache, None, p_len",
        "tests/test_batch.py",
    ),
    (
        "--speculation adaptive runs fixed blocks",
        "flashdraft/adaptive.py",
        '    if speculation == "fixed":\n        return dflash\n',
        "    return dflash\n",
        "tests/test_cli.py::test_generate_json_speculative_equals_plain",
    ),
]


def pytest(selectors: list[str]) -> tuple[bool, float, str]:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "--tb=no", "-p", "no:cacheprovider", *selectors]
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    return r.returncode == 0, time.perf_counter() - t0, tail[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated substrings of bug names")
    ap.add_argument("--json", default="")
    ap.add_argument("--skip-baseline", action="store_true", help="the whole suite just passed on this tree")
    args = ap.parse_args()
    bugs = [b for b in BUGS if not args.only or any(s in b[0] for s in args.only.split(","))]
    if not args.skip_baseline:
        ok, secs, tail = pytest(sorted({b[4] for b in bugs}))
        print(f"unchanged code, aimed tests: {'pass' if ok else 'FAIL'} ({secs:.0f} s): {tail}", flush=True)
        if not ok:
            return 1
    rows = []
    for name, rel, old, new, selector in bugs:
        path = ROOT / rel
        text = path.read_text()
        if text.count(old) != 1:
            rows.append(
                {"bug": name, "test": selector, "result": f"STALE: the text occurs {text.count(old)}x"}
            )
            print(f"STALE   {name}", flush=True)
            continue
        try:
            path.write_text(text.replace(old, new))
            passed, secs, tail = pytest([selector])
        finally:
            path.write_text(text)
        result = "MISSED" if passed else "caught"
        rows.append(
            {"bug": name, "file": rel, "test": selector, "result": result, "s": round(secs), "tail": tail}
        )
        print(f"{result:7} {name} ({secs:.0f} s) <- {selector}: {tail}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    missed = [r for r in rows if r["result"] != "caught"]
    print(f"{len(rows) - len(missed)} of {len(rows)} planted bugs caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
