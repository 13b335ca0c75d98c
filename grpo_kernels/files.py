"""Files written whole or not at all: the text goes to a new temporary file beside the target (created exclusively,
so a planted name is never followed), is flushed to disk, and replaces the target in one rename. A symlink at the
target is replaced, never written through."""

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path, text: str, *, mode: int = 0o644) -> Path:
    """Write text to path atomically and durably (the file, then its directory, synced); returns the path."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path
