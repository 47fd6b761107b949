"""The kernels' build cache (flashdraft/models/runner/kernels: `_key`, `_build`) is keyed by everything the
build reads: the compiler's identity, the command line (flags, includes, the sources), torch's version and
every .cpp and header beside the kernels; the same inputs give the same key. FLASHDRAFT_SANITIZE=1 builds
into a file of its own and refuses, in one line, a python without the ASan runtime. No test here compiles:
the builds run a stand-in compiler."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from flashdraft.models.runner import kernels


@pytest.fixture
def kernel_dir(tmp_path):
    """A copy of the kernels' sources and headers."""
    d = tmp_path / "src"
    d.mkdir()
    for f in kernels._files():
        shutil.copy(f, d / f.name)
    return d


def key(root: Path, command=None, out="a.so") -> str:
    """The cache key of building the kernels' files in `root` with `command` (else today's)."""
    return kernels._key(command or kernels._command(Path(out)), kernels._files(root))


def test_the_same_inputs_give_the_same_key_wherever_the_output_goes(kernel_dir):
    assert key(kernel_dir) == key(kernel_dir) == key(kernel_dir, out="/elsewhere/b.so")
    assert key(kernel_dir) == key(kernels.HERE)  # a copy reads as the original


def test_the_compilers_identity_changes_the_key(kernel_dir, monkeypatch):
    before = key(kernel_dir)
    real = kernels._compiler(kernels._command(Path("a.so"))[0])
    assert "\n" in real and real.split("\n", 1)[1].strip()  # the resolved path, then its --version
    monkeypatch.setattr(kernels, "_compiler", lambda cxx: real.replace("12.", "13.").replace("1", "2") + " ")
    assert key(kernel_dir) != before
    monkeypatch.setattr(kernels, "_compiler", lambda cxx: real)
    assert key(kernel_dir) == before


def test_the_compiler_is_asked_once_per_process(monkeypatch):
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "g++ (Debian 12.2.0) 12.2.0\n", "")

    kernels._compiler.cache_clear()
    monkeypatch.setattr(subprocess, "run", run)
    try:
        first = kernels._compiler("g++")
        assert kernels._compiler("g++") == first and calls == [["g++", "--version"]]
        assert "12.2.0" in first
    finally:
        kernels._compiler.cache_clear()


@pytest.mark.parametrize("name", ("extra.h", "new.cpp"))
def test_a_new_file_beside_the_kernels_joins_the_key(kernel_dir, name):
    before = key(kernel_dir)
    (kernel_dir / name).write_text("// a new file\n")
    assert kernel_dir / name in kernels._files(kernel_dir)
    assert key(kernel_dir) != before


def test_an_edit_to_any_file_changes_the_key(kernel_dir):
    before = key(kernel_dir)
    for f in kernels._files(kernel_dir):
        text = f.read_bytes()
        f.write_bytes(text + b"\n")
        assert key(kernel_dir) != before, f.name
        f.write_bytes(text)
    assert key(kernel_dir) == before
    (kernel_dir / "kernels.h").rename(kernel_dir / "kernels2.h")  # the same bytes and order, another name
    assert key(kernel_dir) != before


def test_every_part_of_the_command_line_changes_the_key(kernel_dir, monkeypatch):
    before = key(kernel_dir)
    command = kernels._command(Path("a.so"))
    assert key(kernel_dir, command=command) == before
    for i, part in enumerate(command):
        if i in (command.index("-o"), command.index("-o") + 1):
            continue  # the output path, the one part that is not an input
        changed = [*command[:i], part + "x", *command[i + 1 :]]
        assert key(kernel_dir, command=changed) != before, part
    assert key(kernel_dir, command=[*command, "-DEXTRA"]) != before
    monkeypatch.setattr(kernels, "FLAGS", [f.replace("-O3", "-O2") for f in kernels.FLAGS])
    assert key(kernel_dir) != before
    monkeypatch.undo()
    assert key(kernel_dir) == before


def test_torchs_version_changes_the_key(kernel_dir, monkeypatch):
    before = key(kernel_dir)
    monkeypatch.setattr(kernels.torch, "__version__", "0.0.0")
    assert key(kernel_dir) != before


def test_the_build_compiles_every_cpp_beside_the_kernels():
    assert kernels.SOURCES == sorted(kernels.HERE.glob("*.cpp")) and len(kernels.SOURCES) >= 3
    command = kernels._command(Path("a.so"))
    assert all(str(f) in command for f in kernels.SOURCES)
    assert set(kernels._files()) >= {*kernels.SOURCES, kernels.HERE / "kernels.h"}


def test_sanitize_builds_with_asan_and_ubsan_into_its_own_file(kernel_dir, monkeypatch):
    plain = kernels._command(Path("a.so"))
    monkeypatch.setenv("FLASHDRAFT_SANITIZE", "1")
    command = kernels._command(Path("a.so"))
    assert "-O3" not in command and "-O1" in command and "-fsanitize=address,undefined" in command
    assert "-fno-sanitize-recover=all" in command and "-fopenmp" in command
    assert key(kernel_dir) != kernels._key(plain, kernels._files(kernel_dir))
    monkeypatch.setenv("FLASHDRAFT_SANITIZE", "0")
    assert kernels._command(Path("a.so")) == plain


def fake_compiler(tmp_path, then: str = "") -> Path:
    """A stand-in for g++: answers --version, writes the file after -o, then runs `then`."""
    cxx = tmp_path / "fake-g++"
    cxx.write_text(
        "#!/bin/sh\n"
        '[ "$1" = --version ] && { echo "fake-g++ 1.0"; exit 0; }\n'
        f'echo "$@" >> {tmp_path}/calls\n'
        'while [ "$1" != -o ]; do shift; done; echo built > "$2"\n' + then
    )
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    return cxx


@pytest.fixture
def fake_build(tmp_path, kernel_dir, monkeypatch):
    """`_build` on the copied sources with a stand-in compiler (no compiling here)."""
    monkeypatch.setattr(
        kernels, "_files", lambda root=kernel_dir: sorted([*root.glob("*.cpp"), *root.glob("*.h")])
    )
    monkeypatch.delenv("FLASHDRAFT_SANITIZE", raising=False)
    kernels._compiler.cache_clear()
    yield tmp_path / "cache"
    kernels._compiler.cache_clear()


def test_a_build_is_cached_under_its_key_and_rebuilt_when_an_input_changes(
    fake_build, tmp_path, kernel_dir, monkeypatch
):
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path)))
    lib = kernels._build(fake_build)
    assert lib.read_text() == "built\n" and lib.name.startswith("flashdraft-kernels-")
    assert kernels._build(fake_build) == lib and len((tmp_path / "calls").read_text().splitlines()) == 1
    (kernel_dir / "extra.h").write_text("#pragma once\n")
    assert kernels._build(fake_build) != lib and len((tmp_path / "calls").read_text().splitlines()) == 2
    monkeypatch.setenv("FLASHDRAFT_SANITIZE", "1")
    monkeypatch.setattr(kernels, "_asan_loaded", lambda: True)
    assert kernels._build(fake_build).name.startswith("flashdraft-kernels-asan-")


def test_a_file_edited_during_the_build_leaves_nothing_cached(fake_build, tmp_path, kernel_dir, monkeypatch):
    monkeypatch.setenv(
        "CXX", str(fake_compiler(tmp_path, then=f"echo '// edited' >> {kernel_dir}/kernels.h\n"))
    )
    with pytest.raises(RuntimeError, match="sources changed while they compiled"):
        kernels._build(fake_build)
    assert list(fake_build.iterdir()) == []


def test_sanitize_without_the_asan_runtime_is_refused_in_one_line(fake_build, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path)))
    monkeypatch.setenv("FLASHDRAFT_SANITIZE", "1")
    monkeypatch.setattr(kernels, "_asan_loaded", lambda: False)
    with pytest.raises(RuntimeError) as e:
        kernels._build(fake_build)
    assert "\n" not in str(e.value) and kernels.ASAN_RECIPE in str(e.value)
    assert "-print-file-name=libasan.so" in kernels.ASAN_RECIPE and "libstdc++" in kernels.ASAN_RECIPE
    assert not (tmp_path / "calls").exists()  # refused before compiling
