"""A live writer for the temp-file cleanup tests: another process holding a POSIX lock on a
file, as a writer holds its temp file until the rename."""
import contextlib
import subprocess
import sys

_HOLDER = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("ready", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def held_lock(path):
    """Another process holds an exclusive lock on ``path`` (created if missing) inside."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        yield
    finally:
        holder.kill()
        holder.wait()
