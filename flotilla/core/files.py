"""Files written safely: secrets only their owner reads, and whole-or-nothing replacements."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """Create or replace a file only its owner can read, with no window where others could."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so a reader (another process) sees the old file or the
    new one, never half of one: a temporary file beside it, then a rename."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def write_private_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` whole and durably, readable by its owner only from birth: a
    temporary file beside it (mode 0600), fsync, rename; nothing left behind on failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
