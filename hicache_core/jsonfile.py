"""Writing a JSON file so that a reader never sees half of it: a temporary file beside it, then a rename."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

__all__ = ["write_json", "check_writable"]


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` whole or not at all: an interrupt, a full disk or a serialisation error
    leaves the previous file (or none) in place, never a truncated one.

    :raises OSError: the folder cannot be written (the previous file is kept).
    :raises TypeError, ValueError: ``data`` is not JSON-serialisable (nothing is written)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _mode(path))  # mkstemp makes it private: the permissions open() would have given, or the old file's
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _mode(path: str) -> int:
    """The permission bits of the file at ``path``, or those a new file gets under the process's umask."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def check_writable(path: str) -> str | None:
    """Why a file cannot be written at ``path`` (its folder cannot be made or written to), else ``None``; asked before
    long work whose result would otherwise be lost."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        return f"cannot create {folder} ({exc.strerror or exc})"
    if os.path.isdir(path):
        return f"{path} is a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write to {folder}"
    return None
