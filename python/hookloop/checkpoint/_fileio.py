"""Local-filesystem access for checkpoints: a small ``PathManager`` and atomic writes.

An atomic write puts the bytes in a temporary file in the target's directory, flushes and
fsyncs it, renames it over the target and fsyncs the directory. A reader (or a process that
starts after a ``kill -9``) sees either the old file or the new one, never a part of one.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import tempfile
from typing import IO, Any, Callable, List, Optional

__all__ = ["LocalPathManager", "atomic_write"]

logger = logging.getLogger(__name__)

# Temporary files are ``.<basename>.<host>~<pid>~<random>.tmp``: hidden, not ``*.pth`` (so
# ``get_all_checkpoint_files`` never lists one), and naming the process that writes them, so
# that the next save can remove those of a process that was killed.
_TMP_SUFFIX = ".tmp"
_TMP_NAME = re.compile(r"\.(?P<base>.+)\.(?P<host>[^.~]*)~(?P<pid>\d+)~[a-z0-9_]+\.tmp")


def _host() -> str:
    return re.sub(r"[.~/]", "_", socket.gethostname())


class LocalPathManager:
    """The subset of iopath's ``PathManager`` that the checkpointers use, for local paths.

    A project with its own storage backend assigns an object with these methods to
    ``Checkpointer.path_manager``; atomic saves then happen only if its ``open`` provides them.
    """

    def open(self, path: str, mode: str = "r", **kwargs: Any) -> IO[Any]:
        return open(path, mode, **kwargs)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def ls(self, path: str) -> List[str]:
        return os.listdir(path)

    def mkdirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rm(self, path: str) -> None:
        os.remove(path)

    def get_local_path(self, path: str, **kwargs: Any) -> str:
        return path


def _io_error(what: str, path: str, err: BaseException) -> OSError:
    """An ``OSError`` whose message names ``path`` (and keeps the cause's errno)."""
    code = err.errno if isinstance(err, OSError) else None
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    out = OSError(code, f"{what} {path}: {reason}")
    out.filename = path
    return out


def fsync_dir(directory: str) -> None:
    """Makes a rename in ``directory`` durable. Filesystems that cannot fsync a directory
    (some network and Windows filesystems) are skipped."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process
        return True
    return True


def remove_stale_tmp(directory: str) -> None:
    """Removes the temporary files left in ``directory`` by processes of this host that are
    gone (killed while saving). Another host's files are left alone: its pids mean nothing
    here."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    host = _host()
    for name in names:
        m = _TMP_NAME.fullmatch(name)
        if m is None or m["host"] != host or _alive(int(m["pid"])):
            continue
        try:
            os.remove(os.path.join(directory, name))
        except OSError:
            pass


def atomic_write(path: str, write: Callable[[Any], object], *, what: str) -> None:
    """Writes ``path`` atomically with ``write(file)``.

    Raises:
        OSError: naming ``path`` when the directory cannot be created or written, or the disk
            is full; no temporary file is left behind and ``path`` keeps its old content.
        Exception: what ``write`` raised for anything else (an object that does not pickle),
            with the same guarantees.
    """
    directory = os.path.dirname(path) or "."
    basename = os.path.basename(path)
    try:
        os.makedirs(directory, exist_ok=True)
        remove_stale_tmp(directory)
        prefix = f".{basename}.{_host()}~{os.getpid()}~"
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=_TMP_SUFFIX, dir=directory)
    except OSError as e:
        raise _io_error(f"Cannot write {what}", path, e) from e
    recorder = None
    try:
        with os.fdopen(fd, "wb") as f:
            recorder = _WriteErrors(f)
            write(recorder)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        # torch.save turns a failed write (a full disk) into a RuntimeError of its own.
        cause = recorder.error if recorder is not None and recorder.error else e
        if isinstance(cause, OSError):
            raise _io_error(f"Cannot write {what}", path, cause) from e
        raise
    try:
        fsync_dir(directory)
    except OSError as e:
        raise _io_error(f"Cannot write {what}", path, e) from e


class _WriteErrors:
    """A binary file that remembers the first ``OSError`` its ``write`` raised."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            if self.error is None:
                self.error = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)
