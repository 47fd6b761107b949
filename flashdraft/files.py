"""The one way files are written: to a temporary file beside the target, fsynced, then renamed over it, so
that a crash or Ctrl-C leaves the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def usual_mode(path: str | os.PathLike, mode: int = 0o666) -> None:
    """Give `path` the mode a plain `open()` would (0644 under umask 022): mkstemp and transformers'
    `save_pretrained` make 0600 files, but checkpoints, drafts and data are meant to be shared."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a temporary file; it then replaces `path` (created with the usual permissions)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        usual_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_dir(directory: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """`write(tmp)` fills a temporary directory beside `directory` (e.g. another library's
    `save_pretrained`); each file it wrote then gets the usual mode, is fsynced and replaces its namesake
    in `directory`, so every file there is old or new, never half of one."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".tmp"))
    try:
        write(tmp)
        directory.mkdir(exist_ok=True)
        for f in sorted(tmp.iterdir()):
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
            usual_mode(f)
            os.replace(f, directory / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda p: Path(p).write_text(text, encoding="utf-8"))


def write_json(path: str | os.PathLike, obj, indent: int | None = 2) -> None:
    write_text(path, json.dumps(obj, indent=indent) + "\n")
