"""A private Ray cluster's temp dir (sockets, session logs) is removed when the cluster stops;
a process killed with SIGKILL left it in the temp directory for good. Its owner now holds a
lock on a file inside it, and the next private cluster removes the dirs whose owner died."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hacpo.launch import ray_cluster  # first: its environment must precede `import ray`
from hacpo.launch.ray_cluster import (AF_UNIX_PATH_MAX, OWNER_LOCK, STALE_AFTER_S, TEMP_PREFIX,
                                      longest_socket_path, sweep_dead_temp_dirs, temp_root)

HOLD = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(600)
""")


def _dir(root, name, *, lock=True, age_s=2 * STALE_AFTER_S):
    d = root / name
    d.mkdir()
    (d / "session.log").write_text("ray logs")
    if lock:
        (d / OWNER_LOCK).write_text("")
        old = time.time() - age_s
        os.utime(d / OWNER_LOCK, (old, old))
    return d


def test_sweep_removes_only_dirs_whose_owner_died(tmp_path):
    dead = _dir(tmp_path, TEMP_PREFIX + "dead")
    live = _dir(tmp_path, TEMP_PREFIX + "live")
    fresh = _dir(tmp_path, TEMP_PREFIX + "fresh", age_s=0)      # maybe not locked yet
    unknown = _dir(tmp_path, TEMP_PREFIX + "nolock", lock=False)   # not ours to judge
    other = _dir(tmp_path, "other-dead")                          # another prefix
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(live / OWNER_LOCK)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert sweep_dead_temp_dirs(str(tmp_path)) == [str(dead)]
        assert not dead.exists()
        assert all(d.exists() for d in (live, fresh, unknown, other))
    finally:
        holder.kill()
        holder.wait()
    assert sweep_dead_temp_dirs(str(tmp_path)) == [str(live)]     # its holder is gone now


def test_a_killed_drivers_cluster_dir_is_removed_by_the_next_cluster(tmp_path):
    """A real private cluster whose process is SIGKILLed leaves its temp dir, with the lock
    file; the sweep a new private cluster runs first removes it, while this process's own
    live cluster dir (and its lock) would be kept."""
    code = textwrap.dedent("""
        import time
        from hacpo.launch import ray_cluster
        c = ray_cluster.connect("", num_cpus=1)
        print(c.temp_dir, flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        temp_dir = p.stdout.readline().strip()
        assert os.path.basename(temp_dir).startswith(TEMP_PREFIX), temp_dir
        assert os.path.exists(os.path.join(temp_dir, OWNER_LOCK))
        assert temp_dir not in sweep_dead_temp_dirs()     # held while its owner lives
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    time.sleep(1)
    assert os.path.isdir(temp_dir)                        # left behind by the kill
    assert temp_dir not in sweep_dead_temp_dirs()         # too fresh to judge
    old = time.time() - 2 * STALE_AFTER_S
    os.utime(os.path.join(temp_dir, OWNER_LOCK), (old, old))
    assert temp_dir in sweep_dead_temp_dirs()
    assert not os.path.exists(temp_dir)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_the_private_cluster_starts_leaves_no_cluster_or_dir(sig):
    """Ctrl-C while ``ray.init`` starts a private cluster is held until it is up (interrupted
    halfway, its driver's core worker was left running and the process could die with SIGSEGV
    at exit), then the cluster is stopped and its temp dir removed before KeyboardInterrupt
    goes on. A SIGTERM meets Ray's own handler while ``ray.init`` runs (``sys.exit(15)``):
    the cluster and its dir go too, and ``hacpo``'s handler turns it into exit 143. (Both
    used to leave the temp dir until a later cluster's sweep, the SIGTERM exit status 15.)"""
    code = textwrap.dedent("""
        import os, signal, sys
        from hacpo.launch import ray_cluster
        from hacpo.launch.cli import _raise_terminated
        import ray
        signal.signal(signal.SIGTERM, _raise_terminated)
        sig, real, up = sys.argv[1], ray.init, []

        def init(*args, **kwargs):
            print(kwargs["_temp_dir"], flush=True)
            if sig == "SIGINT":               # a terminal's Ctrl-C as the cluster starts
                os.kill(os.getpid(), signal.SIGINT)
            ctx = real(*args, **kwargs)
            up.append(True)
            if sig == "SIGTERM":              # Ray's handler is in place until connect returns
                os.kill(os.getpid(), signal.SIGTERM)
            return ctx
        ray.init = init
        try:
            ray_cluster.connect("", num_cpus=1)
        except BaseException as e:
            print(type(e).__name__, getattr(e, "code", None), bool(up), ray.is_initialized(),
                  flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", code, sig], capture_output=True, text=True,
                       timeout=120, start_new_session=True,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    temp_dir, result = p.stdout.split("\n")[:2]
    assert os.path.basename(temp_dir).startswith(TEMP_PREFIX), p.stdout
    # Ctrl-C: raised once ray.init returned; SIGTERM: hacpo's exit status; no Ray left either way
    assert result == ("KeyboardInterrupt None True False" if sig == "SIGINT"
                      else "SystemExit 143 True False"), p.stdout + p.stderr
    assert not os.path.exists(temp_dir)


def test_what_ray_init_changed_in_the_process_is_put_back_at_shutdown():
    """ray.init points PYTHONBREAKPOINT at Ray's remote debugger (a later breakpoint() in a
    notebook or sweep script did not stop), sets RAY_AUTH_MODE (inherited by every later
    subprocess) and its own sys.excepthook; ray.shutdown left them. A private cluster's
    shutdown puts back each one still as Ray left it, and leaves one changed since alone."""
    code = textwrap.dedent("""
        import json, os, sys
        from hacpo.launch import ray_cluster
        env, hook = dict(os.environ), sys.excepthook
        c = ray_cluster.connect("", num_cpus=1)
        during = {k: os.environ.get(k) for k in os.environ.keys() | env.keys()
                  if os.environ.get(k) != env.get(k)}
        changed_hook = sys.excepthook is not hook
        os.environ["RAY_AUTH_MODE"] = "mine"      # changed after ray.init: left as it is
        c.shutdown()
        after = {k: os.environ.get(k) for k in os.environ.keys() | env.keys()
                 if os.environ.get(k) != env.get(k)}
        print(json.dumps({"during": during, "hook": changed_hook, "after": after,
                          "hook_back": sys.excepthook is hook}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["during"]["PYTHONBREAKPOINT"] == "ray.util.rpdb._driver_set_trace"
    assert "RAY_AUTH_MODE" in got["during"] and got["hook"]
    assert got["after"] == {"RAY_AUTH_MODE": "mine"} and got["hook_back"]


# --------------------------------------------------------------------------------------------
# a TMPDIR too long for Ray's socket paths (AF_UNIX: 107 bytes on Linux). A per-job TMPDIR
# (/local/scratch/<job id>) made the cluster's start a traceback after the warm-up:
# "validate_socket_filename failed: AF_UNIX path length cannot exceed 107 bytes"
# --------------------------------------------------------------------------------------------
def _ray_socket(temp_dir: str) -> str:
    """The longest socket path Ray 2.60 makes in a cluster's temp dir: its session dir (date
    with microseconds, the head's pid: at most 7 digits on Linux), then sockets/plasma_store."""
    return os.path.join(temp_dir, "session_2026-12-06_20-12-43_248115_4194304", "sockets",
                        "plasma_store")


@pytest.mark.parametrize("prefix", [TEMP_PREFIX, TEMP_PREFIX + "launch-"])
def test_temp_root_keeps_tmpdir_only_while_rays_sockets_fit(prefix):
    assert temp_root(prefix, "/tmp") == ("/tmp", None)
    for n in range(1, 120):   # every length of TMPDIR: kept while the paths fit (2 spare bytes)
        root = "/" + "d" * n
        longest = len(_ray_socket(os.path.join(root, prefix + "abcdefgh")))  # mkdtemp's 8
        got, note = temp_root(prefix, root)
        if longest + 2 <= AF_UNIX_PATH_MAX:
            assert (got, note) == (root, None), n
        else:
            assert got == "/tmp", n
            assert note == (f"Ray's socket paths under the temp directory {root} (TMPDIR) "
                            f"would be up to {longest_socket_path(root, prefix)} bytes, over "
                            f"the AF_UNIX limit of {AF_UNIX_PATH_MAX}: the Ray cluster's temp "
                            f"dir goes under /tmp instead")
    # the explorer's TMPDIR: a traceback after the warm-up before; /tmp now
    assert temp_root(TEMP_PREFIX, "/tmp/ex_paths/scratch/job_1234")[0] == "/tmp"
    long = "/" + "d" * 60
    with pytest.raises(ValueError, match=f"under the temp directory {long} .*, and under "
                                         f"{long} too: set TMPDIR to a shorter folder"):
        temp_root(prefix, long, fallback=long)


def _long_tmpdir(tmp_path) -> str:
    d = tmp_path / "scratch" / "job_1234567"
    d.mkdir(parents=True)
    assert longest_socket_path(str(d)) > AF_UNIX_PATH_MAX     # too long: the case at hand
    return str(d)


def test_new_temp_dir_goes_under_tmp_with_a_warning_when_tmpdir_is_too_long(
        tmp_path, monkeypatch, caplog):
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", _long_tmpdir(tmp_path))
    with caplog.at_level("WARNING", logger="hacpo"):
        d = ray_cluster.new_temp_dir()
    try:
        assert os.path.dirname(d) == "/tmp" and os.path.basename(d).startswith(TEMP_PREFIX)
        assert longest_socket_path("/tmp") <= AF_UNIX_PATH_MAX
        assert [r.getMessage() for r in caplog.records] == [
            temp_root(root=tempfile.tempdir)[1]]
    finally:
        ray_cluster.remove_temp_dir(d)


def test_train_on_a_private_cluster_with_no_room_for_rays_sockets_fails_before_any_work(
        tmp_path, monkeypatch):
    """Neither TMPDIR nor the fallback leaves room: one error line before the run dir, the
    data and the warm-up, not Ray's traceback after them."""
    import tempfile

    from hacpo.engine.run_config import load_config
    from hacpo.engine.trainer import train
    long = _long_tmpdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", long)
    monkeypatch.setattr(ray_cluster, "SHORT_TEMP_ROOT", long)
    cfg = load_config("tiny3", overrides={"out_dir": str(tmp_path / "run"), "threads": 1,
                                          "rollout.engine": "ray"})
    with pytest.raises(ValueError, match=f"under {long} too: set TMPDIR to a shorter folder"):
        train(cfg, echo=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_a_private_cluster_under_a_long_tmpdir_starts_under_tmp(tmp_path):
    """A real private cluster with a TMPDIR too long for Ray's socket paths: up (it was
    Ray's OSError), its temp dir under /tmp, one warning naming TMPDIR; removed at shutdown."""
    code = textwrap.dedent("""
        from hacpo.launch import ray_cluster
        c = ray_cluster.connect("", num_cpus=1)
        print(c.temp_dir, flush=True)
        c.shutdown()
    """)
    long = _long_tmpdir(tmp_path)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": long})
    assert p.returncode == 0, p.stderr[-2000:]
    temp_dir = p.stdout.strip().splitlines()[-1]
    assert os.path.dirname(temp_dir) == "/tmp", temp_dir
    assert p.stderr.count(f"under the temp directory {long} (TMPDIR)") == 1, p.stderr
    assert not os.path.exists(temp_dir)
