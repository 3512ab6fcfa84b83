"""One way to replace a file on disk so that a reader, or the daemon after a
crash, sees either the old content or the new, never a part (the house rule:
"state on disk stays consistent: atomic rename or a journal, fsync'd"), and
one way to read a file someone else writes without ever blocking on it
(``read_regular``: cgroup interface files, CDI specs). Every file the daemon
writes whole goes through ``write_atomically``.

The rule it follows is POSIX ``rename(2)``: replacing a name within one
directory is atomic. The temporary file is made in the target's own
directory (same filesystem), written and ``fsync``'d before the rename, and
the directory is ``fsync``'d after it so the new name survives a power loss
(ext4/xfs semantics; on tmpfs the fsyncs cost nothing).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

def read_regular(path: str, max_bytes: int, *, whole: bool = True) -> bytes:
    """At most ``max_bytes`` of a regular file, never blocking: opened
    ``O_NONBLOCK``, refused unless ``fstat`` says regular (a FIFO or a device
    would block a reader for ever, issue 34 items 5, 8). ``whole``: a larger file is an
    error; else its first ``max_bytes``. Raises OSError naming the path and why."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        data = os.read(fd, max_bytes + 1 if whole else max_bytes)
    finally:
        os.close(fd)
    if whole and len(data) > max_bytes:
        raise OSError(errno.EFBIG, f"{path} is larger than {max_bytes} bytes")
    return data


def write_atomically(path: str | os.PathLike[str], data: bytes | str, *, mode: int = 0o644,
                     make_parents: bool = False) -> Path:
    """Replace ``path`` with ``data`` (bytes, or str written as UTF-8).

    Args:
        path: the file to replace (or create).
        data: its whole new content.
        mode: the new file's permission bits (default 0644; applied before
            the rename, so the file is never visible with other bits).
        make_parents: create missing parent directories (mode 0755 less the
            umask) first.

    Returns the path. Raises OSError (the temporary file is removed, the old
    content is untouched).
    """
    target = Path(path)
    if make_parents:
        target.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dfd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return target
