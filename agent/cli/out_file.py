"""Writing viiworkctl's output files (``init --out``) whole or not at all.

The text goes to a temporary file in the target's directory, is fsynced and renamed onto
the target, so a failure part-way (a full disk, a size limit, a kill) leaves the target as
it was, and the temporary file is removed. rename(2) replaces a symlink at the target
itself, never the file it points to; the target's kind is decided by ``lstat``, so a FIFO
or device there is refused without being opened.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

from viiwork.agent.cli.quoting import quote_path
from viiwork.agent.config.load import file_kind

NEW_FILE_MODE = 0o644  # a config holds paths and names, no secrets (keys are files of their own)


class OutFileError(Exception):
    """The file cannot be written: the message is the whole one-line error."""


def check_out(out: Path, force: bool) -> None:
    """OutFileError unless ``out`` may be written: absent, or (with ``force``) a regular file or a
    symlink. Decided by ``lstat``: nothing at ``out`` is opened."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OutFileError(f"cannot use --out {quote_path(out)}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise OutFileError(f"{quote_path(out)} is a directory")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise OutFileError(f"{quote_path(out)} is {file_kind(st.st_mode)}, not a regular file: "
                        "only a regular file is written")
    if not force:
        raise OutFileError(f"{quote_path(out)} exists; pass --force to overwrite it")


def write_whole(out: Path, data: bytes, replace: bool) -> None:
    """Write ``data`` as the file ``out``, whole or not at all.

    ``data`` goes to a temporary file in ``out``'s directory, fsynced, then renamed onto
    ``out`` (``replace``: ``os.replace``, which replaces a symlink itself, not its target) or
    hard-linked as ``out`` (not ``replace``: fails if ``out`` exists, even created meanwhile).
    A replaced regular file's mode (and owner, where this user may set it) is kept; a new
    file gets NEW_FILE_MODE. The temporary file never outlives the call. OutFileError on any
    failure, ``out`` then as it was.
    """
    shown = quote_path(out)
    mode, owner = NEW_FILE_MODE, None
    if replace:
        try:
            st = os.lstat(out)
            if stat.S_ISREG(st.st_mode):
                mode, owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise OutFileError(f"cannot write {shown}: {exc.strerror or exc}") from None
    tmp: str | None = None
    try:
        # The name bounded: a 255-byte FILE name plus the random part would pass NAME_MAX.
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name[:100]}.", suffix=".tmp", dir=out.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            if owner is not None and owner != (os.geteuid(), os.getegid()):
                with contextlib.suppress(PermissionError):  # not root: the file becomes ours
                    os.fchown(f.fileno(), *owner)
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, out)
        else:
            _move_new(tmp, out)
        tmp = None
    except FileExistsError:
        raise OutFileError(f"{shown} exists; pass --force to overwrite it") from None
    except OSError as exc:
        raise OutFileError(f"cannot write {shown}: {exc.strerror or exc}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    _fsync_directory(out.parent)


def _move_new(tmp: str, out: Path) -> None:
    """Move ``tmp`` to ``out``, FileExistsError if ``out`` exists: link(2) never replaces,
    so a file created at ``out`` meanwhile is kept. Where the file system has no hard links,
    a rename after a last check."""
    try:
        os.link(tmp, out)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        if os.path.lexists(out):
            raise FileExistsError(errno.EEXIST, "File exists", str(out)) from None
        os.rename(tmp, out)
    else:
        os.unlink(tmp)


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable; a file system that cannot fsync a directory is left as is."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
