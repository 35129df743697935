"""Atomic file writes: a file the package writes is either the old one or the whole new one.

Every writer in the package (weights files, benchmark reports, figures, README sections) goes
through :func:`atomic_write`: the data goes to a temporary file in the target's directory, is
flushed to disk (``fsync``) and then renamed over the target (``os.replace``, atomic on POSIX
and Windows). If anything fails before the rename, the temporary file is removed and the target
is left as it was, byte for byte.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


def _path_error(kind: type[OSError], code: int, message: str) -> OSError:
    """An ``OSError`` subclass whose text is ``message`` alone, its ``errno`` set."""
    err = kind(message)
    err.errno = code
    return err


def check_writable(path: str | os.PathLike[str], where: str = "write") -> None:
    """Refuses a path that cannot name a file to write, naming the path as the caller gave it.

    Raises:
        IsADirectoryError: ``path`` is a directory.
        FileNotFoundError: Its directory does not exist.
        NotADirectoryError: What should be its directory is a file.
    """
    target, shown = Path(path), repr(os.fspath(path))
    parent = target.parent
    if target.is_dir():
        raise _path_error(IsADirectoryError, errno.EISDIR,
                          f"{where}: path {shown} is a directory, expected a file path")
    if not parent.exists():
        raise _path_error(FileNotFoundError, errno.ENOENT, f"{where}: cannot write {shown}: "
                          f"the directory {os.fspath(parent)!r} does not exist")
    if not parent.is_dir():
        raise _path_error(NotADirectoryError, errno.ENOTDIR, f"{where}: cannot write {shown}: "
                          f"{os.fspath(parent)!r} is not a directory")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], where: str = "write") -> Iterator[BinaryIO]:
    """Opens a temporary file for binary writing that replaces ``path`` when the block ends.

    The temporary file is ``.<name>.<random>.tmp`` beside ``path``, created with the usual
    permissions (0o666 less the umask, as ``open`` would give). On leaving the block normally
    it is flushed, fsynced and renamed over ``path``, and the directory is fsynced where the
    platform allows it. On any exception it is closed and removed, and the exception goes on.
    A path that cannot name a file (:func:`check_writable`), and a failure to create or rename
    the temporary file, raise an ``OSError`` that names ``path``, not the temporary file.

    Args:
        path: The file to write.
        where: The caller's name, for the messages.

    Yields:
        The open temporary file.
    """
    check_writable(path, where)
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                     0o666)
    except OSError as err:
        raise _named(err, path, where) from None
    try:
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        try:
            os.replace(temporary, target)
        except OSError as err:
            raise _named(err, path, where) from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _sync_directory(target.parent)


def _named(err: OSError, path: str | os.PathLike[str], where: str) -> OSError:
    """``err`` (about the temporary file) as the same kind of error about ``path``."""
    why = err.strerror or str(err)
    return _path_error(type(err), err.errno or 0, f"{where}: cannot write {os.fspath(path)!r}: {why}")


def _sync_directory(directory: Path) -> None:
    """Makes a rename in ``directory`` durable (POSIX only; a no-op where it cannot be done)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike[str], data: bytes, where: str = "write") -> None:
    """Writes ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    with atomic_write(path, where) as file:
        file.write(data)


def write_text(path: str | os.PathLike[str], text: str, where: str = "write") -> None:
    """Writes ``text`` as UTF-8 to ``path`` atomically (see :func:`atomic_write`)."""
    write_bytes(path, text.encode("utf-8"), where)


def save_figure(figure: object, path: str | os.PathLike[str], **kwargs: object) -> None:
    """``figure.savefig(path, **kwargs)`` atomically; the format is taken from the suffix.

    Args:
        figure: A matplotlib figure.
        path: The image file; its suffix (``.png``, ``.svg``, ...) chooses the format.
        **kwargs: Passed to ``savefig`` (e.g. ``dpi``).
    """
    savefig: Callable[..., None] = figure.savefig  # type: ignore[attr-defined]
    suffix = Path(path).suffix.lstrip(".").lower() or None
    with atomic_write(path, "save_figure") as file:
        savefig(file, format=suffix, **kwargs)
