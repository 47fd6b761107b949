"""Our C++ kernels under AddressSanitizer and UndefinedBehaviorSanitizer (`make sanitize`).

Builds the kernels with FLASHDRAFT_SANITIZE=1 (kernels.SANITIZE: -fsanitize=address,undefined -O1 -g,
any report fatal; a cache file of its own), then runs the kernel, runner, tree and batch tests once per
code path the CPU runs (reference, avx2, avx512; the slow reference path without its slowest tests, see
REFERENCE_SUBSET), each in a python started with the ASan runtime and libstdc++ preloaded, with that path
forced before every test (a test that picks its own paths still does; one that resets to auto gets the
forced path back at the next test). Ends with one line per path and exits 1 on any sanitizer report or
failed test.

    python scripts/sanitize.py                          # every path, the four test files (reference: a subset)
    python scripts/sanitize.py --full                   # every test on every path (about 25 min)
    python scripts/sanitize.py --paths avx2 -k qgemm    # one path, a subset (pytest's -k)

The recipe, for running anything else so (kernels.ASAN_RECIPE): FLASHDRAFT_SANITIZE=1
LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)" ASAN_OPTIONS=detect_leaks=0
python ... (python itself leaks by ASan's standards; without libstdc++ preloaded ASan aborts at the first C++
exception: "CHECK failed: asan_interceptors.cpp:320 ... real___cxa_throw").
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_kernels.py",
    "tests/test_runner.py",
    "tests/test_runner_gemma.py",
    "tests/test_tree.py",
    "tests/test_batch.py",
]
PATHS = ["reference", "avx2", "avx512"]  # slowest to fastest, as kernels.PATHS numbers them
ASAN_OPTIONS = "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86"
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1:exitcode=87"
# The scalar reference path under ASan ran the four files in 957 s (avx2 249 s, avx512 240 s: 2 cores, busy),
# so by default it runs without its 18 slowest of 144 tests (220 of its 301 s unsanitized), which call
# no entry point the rest do not: every GEMM kind through qgemm, argmax_rows, llama_new / llama_free,
# llama_forward with and without mask, lengths, features and the fused head, draft_forward with and
# without mask and head, reorder_slots (each recorded per test). --full runs them too.
REFERENCE_SUBSET = (
    "not (quantized_row_does_not_depend_on_its_batch or sampled_tree_decoding or tree_node_logits_equal"
    " or native_layers_give_the_same_bits_on_every_path or sampling_test_has_power"
    " or batched_sampling_matches_plain or sampling_with_a_spread_draft)"
)
REPORT = re.compile(r"(Address|Leak|UndefinedBehavior)Sanitizer:|runtime error:|ASan runtime")


def sanitized_env() -> dict[str, str]:
    """This environment with the sanitized kernels and the ASan runtime and libstdc++ preloaded (the
    compiler's own)."""
    cxx = os.environ.get("CXX") or "g++"
    libs = []
    for name in ("libasan.so", "libstdc++.so"):
        lib = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not Path(lib).is_file():
            sys.exit(f"sanitize: {cxx} has no {name} (apt-get install g++ brings it; got {lib!r})")
        libs.append(lib)
    preload = " ".join(filter(None, [*libs, os.environ.get("LD_PRELOAD", "")]))
    return dict(
        os.environ,
        FLASHDRAFT_SANITIZE="1",
        LD_PRELOAD=preload,
        ASAN_OPTIONS=os.environ.get("ASAN_OPTIONS", ASAN_OPTIONS),
        UBSAN_OPTIONS=os.environ.get("UBSAN_OPTIONS", UBSAN_OPTIONS),
    )


def run(argv: list[str], env: dict[str, str]) -> tuple[int, list[str], list[str]]:
    """Run, echoing the output as it comes: the exit status, the output's lines, the sanitizer reports'
    first lines."""
    lines, reports = [], []
    with subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as p:
        for line in p.stdout:
            sys.stdout.write(line)
            lines.append(line.rstrip())
            if REPORT.search(line) or (reports and len(reports) < 12):
                reports.append(line.rstrip())
        return p.wait(), lines, reports


def child(path: str, pytest_args: list[str]) -> int:
    """In the sanitized python: pytest with `path` forced before every test."""
    import pytest

    from flashdraft.models.runner import kernels

    if not kernels.available():
        print(f"sanitize: the sanitized kernels did not load on the {path} path (see the line above)")
        return 3

    class Force:
        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_setup(self, item):
            kernels.force(path)

    print(f"sanitize: {path} path forced for every test (this CPU's best: {kernels.best()})", flush=True)
    return int(pytest.main(pytest_args, plugins=[Force()]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # pytest's arguments whole (-k included)
        return child(argv[1], argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--paths", nargs="+", choices=PATHS, default=PATHS, help="the code paths to run (default: all)"
    )
    ap.add_argument(
        "--tests",
        nargs="+",
        default=TESTS,
        help="test files (default: kernels, runner, runner_gemma, tree, batch)",
    )
    ap.add_argument("-k", help="pytest's -k: a subset of the tests (on every path)")
    ap.add_argument("--full", action="store_true", help="every test on the reference path too (about 16 min)")
    args, rest = ap.parse_known_args(argv)  # the rest goes to pytest

    env = sanitized_env()
    print(f"sanitize: LD_PRELOAD={env['LD_PRELOAD']} ASAN_OPTIONS={env['ASAN_OPTIONS']}", flush=True)
    build = "from flashdraft.models.runner import kernels; assert kernels.available(); print(kernels.best())"
    t0 = time.perf_counter()
    rc, lines, reports = run([sys.executable, "-c", build], env)
    if rc or not lines or lines[-1] not in PATHS:
        print(
            f"sanitize: FAIL: the sanitized kernels did not build or load (exit {rc})", *lines[-12:], sep="\n"
        )
        return 1
    best = lines[-1]
    print(f"sanitize: built and loaded in {time.perf_counter() - t0:.0f} s; this CPU runs up to {best}")

    results = []
    # --capture=sys: pytest leaves fd 2 alone, so a report printed as the process dies is seen
    pytest_args = ["-q", "-p", "no:cacheprovider", "--capture=sys", *args.tests, *rest]
    for path in args.paths:
        if PATHS.index(path) > PATHS.index(best):
            results.append((path, "skipped (this CPU does not run it)", 0.0, []))
            continue
        k = args.k or (REFERENCE_SUBSET if path == "reference" and not args.full else None)
        t0 = time.perf_counter()
        argv = [sys.executable, __file__, "--child", path, *pytest_args, *(["-k", k] if k else [])]
        rc, _, reports = run(argv, env)
        seconds = time.perf_counter() - t0
        if reports or rc in (86, 87):  # ASAN_OPTIONS' and UBSAN_OPTIONS' exit codes
            verdict = (
                f"FAILED: {'UBSan' if rc == 87 else 'ASan' if rc == 86 else 'sanitizer'} report (exit {rc})"
            )
        elif rc:
            verdict = f"FAILED: exit {rc} (tests failed or the process died)"
        else:
            verdict = "clean (all tests passed, no sanitizer report)"
        results.append((path, verdict + (" (a subset: -k)" if k else ""), seconds, reports))

    print(
        f"\n== sanitize summary (ASan + UBSan, {' '.join(args.tests)}"
        + (f", -k {args.k!r})" if args.k else ")")
    )
    for path, verdict, seconds, reports in results:
        print(f"{path:>9}: {verdict}" + (f" in {seconds:.0f} s" if seconds else ""))
        for line in reports[:6]:
            print(f"           {line[:200]}")
    failed = [r for r in results if r[1].startswith("FAILED")]
    print("sanitize: FAIL" if failed else "sanitize: PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
