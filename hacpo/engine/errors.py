"""Which errors are the user's to fix: a wrong config, dataset, run directory or resume.

Code that reads the user's input marks the errors it raises (:func:`user_errors`); the command
line reports a marked error in one line (exit status 2) and lets every other error, a bug or a
failure during training, propagate with its traceback."""
from __future__ import annotations

import contextlib
import errno

_MARK = "hacpo_user_error"
# what reading a config, a dataset, a run directory or a checkpoint raises
SETUP_ERRORS = (ValueError, KeyError, OSError, RuntimeError)


@contextlib.contextmanager
def user_errors(*types: type[BaseException]):
    """Mark an error of ``types`` (default :data:`SETUP_ERRORS`) raised inside as the user's."""
    try:
        yield
    except types or SETUP_ERRORS as e:
        setattr(e, _MARK, True)
        raise


def is_user_error(e: BaseException) -> bool:
    return bool(getattr(e, _MARK, False))


# what a full disk, a quota, a file-size limit (ulimit -f: Python ignores SIGXFSZ, so a write
# past it fails with EFBIG), a read-only mount or missing permissions make a write raise
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES,
                  errno.EPERM, errno.EIO)
_HINTS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
          errno.EFBIG: "a file-size limit: ulimit -f, or the file system's"}


class StorageError(OSError):
    """A file could not be written or a directory made (disk full, quota, file-size limit,
    read-only mount, permissions): its message, one line, names the path, the cause and what
    was kept. Marked as the user's to fix (:func:`is_user_error`); ``errno`` and ``filename``
    are the failing call's."""

    def __init__(self, message: str, errno_: int | None = None, filename: str | None = None):
        super().__init__(errno_, message)
        self.filename = filename
        setattr(self, _MARK, True)

    def __str__(self) -> str:
        return self.strerror

    @classmethod
    def like(cls, e: OSError, message: str, filename: str | None = None) -> "StorageError":
        """A StorageError that is also ``e``'s kind (NotADirectoryError, PermissionError,
        ...: what callers catch), with ``e``'s errno."""
        if isinstance(e, cls):
            return type(e)(message, e.errno, filename)
        kind = type(e)
        if not isinstance(e, OSError) or kind is OSError:
            return cls(message, getattr(e, "errno", None), filename)
        sub = _KINDS.get(kind)
        if sub is None:
            sub = _KINDS[kind] = type(cls.__name__, (cls, kind), {})
        return sub(message, e.errno, filename)


_KINDS: dict[type, type] = {}


def os_error_in(e: BaseException) -> OSError | None:
    """``e`` if it is an OSError; for a RuntimeError, the OSError it was raised from or while
    handling (torch.save reports a failed write as RuntimeError "unexpected pos" raised while
    handling the OSError); else None (another error raised while handling an OSError is
    that error: a bug keeps its traceback)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        if not isinstance(e, RuntimeError):
            return None
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def describe_os_error(e: OSError) -> str:
    """The cause of ``e`` in words: the system's (``strerror``), with what it likely means
    for a full disk, a quota or a file-size limit."""
    what = e.strerror or f"{type(e).__name__}: {e}"
    hint = _HINTS.get(e.errno)
    return f"{what} ({hint})" if hint else what
