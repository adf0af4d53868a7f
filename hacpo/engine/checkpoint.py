"""Atomic checkpoints: write to a temporary file in the same directory, fsync, rename. A crash
(even kill -9) leaves either the previous checkpoint or the new one, never half of one."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import pickle
import re
import signal
import socket
import tempfile
import time
import zipfile

import torch

from .errors import StorageError, describe_os_error, os_error_in
from .signals import signals_deferred

log = logging.getLogger(__name__)


def _temp_prefix(base: str) -> str:
    # the writer's host and pid in the name: where the filesystem cannot lock (below), a later
    # save tells a dead writer's leftover (kill -9 mid-save: possibly gigabytes) by them
    return f".tmp-{base}.{socket.gethostname()}.{os.getpid()}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # another user's live process
        return True
    return True


_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def _lock_temp(fd: int) -> None:
    """The writer's lock on its temp file, held until the file is renamed into place (a POSIX
    record lock: released when the writer dies, kill -9 included, whatever host or PID
    namespace it ran in). A filesystem without locks leaves the file unlocked."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise


def writer_dead(path: str, pid_host: tuple[str, int] | None = None) -> bool:
    """Whether the temp file at ``path`` was left by a writer that died: nobody holds its lock
    (a live writer holds it until its rename). Where the filesystem cannot lock, only a file
    of this host whose pid no longer runs counts as dead."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:                  # gone already, or not ours to take
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False             # a live writer holds it
        if e.errno not in _NO_LOCKS:
            raise
        return (pid_host is not None and pid_host[0] == socket.gethostname()
                and pid_host[1] != os.getpid() and not _alive(pid_host[1]))
    finally:
        os.close(fd)                 # drops only this process's own lock on it


# a temp file modified this recently is never taken for a leftover: between creating it and
# locking it a live writer holds no lock (a dead writer's file is older: it stopped writing)
FRESH_S = 30.0


def remove_stale_temps(path: str) -> list[str]:
    """Delete the temporary files that writers of ``path`` left when they died mid-save (no
    process holds their lock: any host on a shared filesystem, any PID namespace); a live
    writer's file is kept, and so is one modified in the last ``FRESH_S`` seconds. Returns the
    paths removed."""
    d, base = os.path.split(os.path.abspath(path))
    prefix = f".tmp-{base}."
    named = re.compile(re.escape(prefix) + r"(.+)\.(\d+)\.[^.]*$")
    removed = []
    for name in os.listdir(d):
        if not name.startswith(prefix):
            continue
        m = named.match(name)
        owner = (m.group(1), int(m.group(2))) if m else None
        if owner == (socket.gethostname(), os.getpid()):
            continue                 # this process's own (another thread's write)
        full = os.path.join(d, name)
        try:
            if time.time() - os.stat(full).st_mtime < FRESH_S:
                continue             # maybe just created, its writer not yet holding the lock
        except FileNotFoundError:
            continue
        if writer_dead(full, owner):
            try:
                os.unlink(full)
                removed.append(full)
            except FileNotFoundError:   # another process cleaned it first
                pass
            except OSError as e:        # e.g. a read-only cache dir: not ours to clean
                log.warning("cannot remove %s, left by a writer that died mid-save: %s",
                            full, describe_os_error(e))
    return removed


def _write_atomic(path: str, write) -> None:
    # A Ctrl-C / SIGTERM during the write is handled once the file is whole: cut inside
    # torch.save, torch's zip writer raised its own RuntimeError ("unexpected pos") in place of
    # the KeyboardInterrupt, so an interrupted run ended with a traceback instead of the
    # "continue it with --resume" line; and the step's checkpoint is kept.
    with signals_deferred(signal.SIGINT, signal.SIGTERM):
        _write_atomic_now(path, write)


def _write_atomic_now(path: str, write) -> None:
    d = os.path.dirname(os.path.abspath(path))
    try:
        ensure_dir(d, "directory")
    except OSError as e:
        raise StorageError.like(e, f"cannot write {path}: {e}", path) from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(os.path.basename(path)), dir=d)
    except OSError as e:
        raise _write_error(path, e, "") from None
    f = os.fdopen(fd, "wb")
    try:
        with contextlib.suppress(OSError):  # a file system without modes keeps its own
            os.fchmod(fd, 0o666 & ~current_umask())    # the mode open() gives (mkstemp's: 0600)
        _lock_temp(fd)               # held through the rename: see remove_stale_temps
        write(f)
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException as e:
        # a failed write leaves unwritten bytes in f's buffer: closing it tries them again and
        # raises a second error (on a full disk: "File too large" with no path) over this one
        with contextlib.suppress(OSError):
            f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        oserr = os_error_in(e) if isinstance(e, Exception) else None
        if oserr is not None and not isinstance(e, StorageError):
            raise _write_error(path, oserr, " (the write went to a temporary file, removed)") \
                from e
        raise
    finally:
        f.close()
    removed = remove_stale_temps(path)
    if removed:
        log.warning("removed %d temporary file(s) left by a writer of %s that died mid-save: "
                    "%s", len(removed), path, ", ".join(removed))


def _write_error(path: str, e: OSError, how: str) -> StorageError:
    """A failed write of ``path`` as one line: the path, the cause, and that ``path`` itself
    (the last good file, if any) is untouched."""
    kept = (f"{path} is unchanged" if os.path.exists(path) else f"{path} was not written")
    return StorageError.like(e, f"cannot write {path}: {describe_os_error(e)}; {kept}{how}",
                             path)


def current_umask() -> int:
    """The process's umask (Linux: read, not set and restored, which would race with threads
    creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def ensure_dir(path: str, what: str) -> None:
    """Create directory ``path`` (and its parents) if needed; an OSError whose one-line
    message names ``what`` and ``path`` and the cause if it cannot be, or cannot be written:
    a file in its place, a dangling symbolic link, a read-only or full file system, no
    permission. Checked before work that would write there, so the work is not lost."""
    if os.path.islink(path) and not os.path.exists(path):
        raise NotADirectoryError(f"{what} {path} is a symbolic link to "
                                 f"{os.readlink(path)}, which does not exist: create its "
                                 f"target or give another path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{what} {path} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and e.filename != path else ""
        raise StorageError.like(e, f"cannot create {what} {path}{where}: "
                                   f"{describe_os_error(e)}", path) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StorageError.like(PermissionError(errno.EACCES, "not writable"),
                                f"{what} {path} is not writable (" + (
                                    "the file system is read-only" if _read_only(path)
                                    else "permission denied") + ")", path)


def first_missing(path: str) -> str | None:
    """The outermost folder of ``path`` (``path`` itself or an ancestor) that does not exist,
    i.e. the one :func:`ensure_dir` would create; None if ``path`` exists."""
    path, missing = os.path.abspath(path), None
    while not os.path.lexists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def remove_made_dirs(path: str, made: str | None) -> None:
    """Undo :func:`ensure_dir` for work that failed before writing: remove ``path`` if it is
    empty, then the empty folders above it up to ``made`` (from :func:`first_missing` before;
    None: nothing was made, nothing removed). Never raises: a folder something else filled
    meanwhile is kept."""
    if made is None:
        return
    d = os.path.abspath(path)
    try:
        while True:
            os.rmdir(d)
            if d == made:
                return
            d = os.path.dirname(d)
    except OSError:
        pass


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def save_atomic(obj, path: str) -> None:
    """torch.save ``obj`` to ``path`` atomically (temp file in the same directory, fsync,
    rename); afterwards, temp files of ``path`` left by dead writers are removed."""
    _write_atomic(path, lambda f: torch.save(obj, f))


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: a reader, or a crash, sees the old file
    or the new one, never part of one; concurrent writers leave one whole file."""
    data = text.encode()
    _write_atomic(path, lambda f: f.write(data))


# A checkpoint is a pickle: loading one with arbitrary Python objects can run arbitrary code.
# hacpo's own checkpoints hold tensors, numbers, strings, lists and dicts only, so they load with
# torch.load(weights_only=True), which refuses anything else; this variable (=1) allows a full
# unpickle for a file one trusts (e.g. a checkpoint written before that rule).
TRUST_ENV = "HACPO_TRUSTED_CHECKPOINTS"


def _failed_crc(path: str) -> str | None:
    """The first part of the zip archive torch.save wrote whose bytes fail the CRC-32 stored
    with them (torch.load does not check it: a flipped byte loads as a wrong weight or config
    value), or None. A file that is no whole zip archive: None (torch.load's errors name it)."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError):
        return None


def load(path: str):
    """The object saved at ``path``, unpickled with ``weights_only=True`` (tensors and plain
    containers only; see :data:`TRUST_ENV`). A file that cannot be read, fails the CRC check
    of its archive (damaged after it was written), or holds other objects, is a RuntimeError
    naming it."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"checkpoint {path} is a directory, not a checkpoint file")
    if os.path.getsize(path) == 0:   # torch: "EOFError: " and nothing more
        raise RuntimeError(f"checkpoint {path} cannot be read: the file is empty (0 bytes: "
                           f"truncated, or a copy cut short)")
    bad = _failed_crc(path)
    if bad is not None:
        raise RuntimeError(f"checkpoint {path} is corrupted: its part {bad!r} fails its CRC "
                           f"check (the file was damaged after it was written: a disk or copy "
                           f"error); not loaded")
    trusted = os.environ.get(TRUST_ENV) == "1"
    try:
        return torch.load(path, map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as e:
        # torch.save writes a zip archive: one whose pickle the weights-only unpickler refused
        # holds other objects; anything else is not a (whole) checkpoint
        if not trusted and not zipfile.is_zipfile(path):
            # torch's message here advises weights_only=False, unsafe for a foreign file
            raise _not_a_torch_zip(path) from None
        if trusted:
            raise RuntimeError(f"checkpoint {path} cannot be read (UnpicklingError: "
                               f"{str(e).splitlines()[0]})") from e
        detail = next((ln.strip() for ln in str(e).splitlines()
                       if re.search(r"GLOBAL|Unsupported|Can only build|got <", ln)), "")
        raise RuntimeError(
            f"checkpoint {path} holds Python objects other than tensors and plain containers "
            f"(a foreign file, or one written by an older hacpo), which could run code when "
            f"loaded; not loaded. If you trust it, set {TRUST_ENV}=1"
            + (f" (torch: {detail[:300]})" if detail else "")) from None
    except OSError as e:    # unreadable (permissions, an I/O error)
        if e.filename is None and not zipfile.is_zipfile(path):
            # torch's zip reader on a file cut short in its last bytes (the zip directory): a
            # bare "[Errno 22] Invalid argument" that would read as an I/O error
            raise _not_a_torch_zip(path) from None
        raise RuntimeError(f"checkpoint {path} cannot be read: {describe_os_error(e)}") from e
    except Exception as e:  # truncated or foreign file
        if not zipfile.is_zipfile(path):   # torch: "failed finding central directory" etc.
            raise _not_a_torch_zip(path) from None
        raise RuntimeError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e})") from e


def _not_a_torch_zip(path: str) -> RuntimeError:
    return RuntimeError(f"checkpoint {path} cannot be read: it is not the zip archive torch.save "
                        f"writes (a truncated file, or another kind of file)")
