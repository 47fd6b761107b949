"""The one way files are written: to a temporary file beside the target, fsynced, then renamed over it, so
that a crash or Ctrl-C leaves the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a temporary file; it then replaces `path` (created with the usual permissions)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; checkpoints and data are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda p: Path(p).write_text(text, encoding="utf-8"))


def write_json(path: str | os.PathLike, obj, indent: int | None = 2) -> None:
    write_text(path, json.dumps(obj, indent=indent) + "\n")
