"""Atomic writes: every file the project writes appears whole or not at all, whatever kills the writer.

Write to `<path>.tmp`, fsync it, rename it over `path` (atomic on POSIX), fsync the folder. On any error
(disk full, a kill signal turned into an exception) the temporary file is removed and `path` keeps its old
content. Every writer in the project goes through `atomic_path`.
"""
import contextlib
import json
import os

from utils.errors import DISK_FULL, UserError, free_space


def _fsync(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a folder; the rename is still atomic
        if not directory:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path, keep_previous=None):
    """Yield a temporary path beside `path` to write to; on success it replaces `path`, on failure it is removed.
    With `keep_previous`, an existing `path` is first renamed to it (a second good copy, one write older)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp_path = path + ".tmp"
    try:
        yield tmp_path
        _fsync(tmp_path)
        if keep_previous and os.path.exists(path):
            os.replace(path, keep_previous)
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
        raise
    _fsync(folder, directory=True)


def write_bytes(path, data):
    """`data` (bytes or str) to `path`, atomically; a full disk (or quota) is a UserError naming the folder and its
    free space."""
    try:
        with atomic_path(path) as tmp_path, open(tmp_path, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    except OSError as err:
        if err.errno not in DISK_FULL:
            raise
        folder = os.path.dirname(os.path.abspath(path))
        raise UserError(f"writing '{path}' failed: the disk is full ({err.strerror}; {free_space(folder)} in "
                        f"'{folder}'); nothing was changed; free disk space (or raise the quota), or write "
                        "elsewhere") from None


def write_json(path, obj):
    """`obj` as indented JSON to `path`, atomically."""
    write_bytes(path, json.dumps(obj, indent=2) + "\n")
