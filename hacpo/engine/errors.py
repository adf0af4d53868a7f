"""Which errors are the user's to fix: a wrong config, dataset, run directory or resume.

Code that reads the user's input marks the errors it raises (:func:`user_errors`); the command
line reports a marked error in one line (exit status 2) and lets every other error, a bug or a
failure during training, propagate with its traceback."""
from __future__ import annotations

import contextlib
import errno
import importlib
import importlib.util

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


# What installs each optional package (all but torch and numpy, setup.py's install_requires),
# by the name it is imported as: the requirement of setup.py's extras, at the version
# requirements/constraints.txt pins where the extras pin one (ray; transformers: a range
# there), unpinned as in the extras otherwise -- never a repository file, which an installed
# hacpo does not have
PIP = {"ray": "ray==2.60.0", "transformers": "transformers==5.19.0",
       "tokenizers": "transformers==5.19.0", "yaml": "pyyaml", "pyarrow": "pyarrow",
       "tensorboard": "tensorboard", "tqdm": "tqdm", "matplotlib": "matplotlib"}
DIST = {"yaml": "pyyaml"}        # a package's name on PyPI, where it is not its import name


class MissingPackageError(RuntimeError):
    """An optional package that a setting, an input or a command needs is not installed: one
    line naming what needs it, the package and the pip command. Marked as the user's to fix
    (:func:`is_user_error`); a RuntimeError, so the commands' input-error paths report it."""

    def __init__(self, message: str):
        super().__init__(message)
        setattr(self, _MARK, True)


def missing_package(module: str, needed_for: str, e: ImportError, hint: str = "") -> str:
    """The one-line message for ``e``, the ImportError of ``module`` that ``needed_for`` needs:
    the package and how to install it (``hint``: another way out, e.g. the setting that turns
    the feature off)."""
    top = module.split(".")[0]
    package = e.name.split(".")[0] if isinstance(e, ModuleNotFoundError) and e.name else top
    how = f"pip install {PIP.get(package, package)}"
    if isinstance(e, ModuleNotFoundError) and e.name and (package == top or package in PIP):
        why = f"the Python package {DIST.get(package, package)}, which is not installed"
    else:       # installed but broken (e.g. a version that lacks what hacpo imports): say how
        why = (f"the Python package {DIST.get(top, top)}, which cannot be imported "
               f"({type(e).__name__}: {e})")
    return f"{needed_for} needs {why}: {how}{f' ({hint})' if hint else ''}"


def require(module: str, needed_for: str, hint: str = ""):
    """``import module`` (returned); where it, or a package it imports, is missing, a
    :class:`MissingPackageError` saying what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingPackageError(missing_package(module, needed_for, e, hint)) from e


def require_installed(package: str, needed_for: str, hint: str = "") -> None:
    """:func:`require` without importing ``package`` (ray: its environment must be set before
    it is imported, hacpo.launch.ray_cluster): only that it is installed."""
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):       # a parent package missing, a broken __spec__
        found = False
    if not found:
        e = ModuleNotFoundError(f"No module named {package!r}", name=package)
        raise MissingPackageError(missing_package(package, needed_for, e, hint))


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
