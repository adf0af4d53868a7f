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
from hacpo.launch.ray_cluster import OWNER_LOCK, STALE_AFTER_S, TEMP_PREFIX, sweep_dead_temp_dirs

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
