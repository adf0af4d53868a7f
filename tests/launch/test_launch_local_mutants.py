"""``hacpo launch local`` and :mod:`hacpo.engine.signals` without a Ray cluster: what a
mutation audit found the Ray-backed tests (test_launch_local.py, test_timeouts.py) did not pin.
``ray start`` is replaced by a stand-in process (it exits 0 on SIGTERM, as ``ray start
--block`` stops its node) and the cluster wait by a recorder; the driver is a real child."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hacpo.engine.signals import signals_deferred
from hacpo.launch import launch_local as ll
from hacpo.launch import ray_cluster
from hacpo.launch.ray_wait import ClusterTimeout, Node
from hacpo.launch.slurm import LaunchError, WaitTimeout

# a `ray start --block` stand-in: ends cleanly 0.5 s after SIGTERM; its child (its "raylet")
# shares its process group and ignores SIGTERM, so only the group's SIGKILL ends it
_NODE = ("import signal, subprocess, sys, time\n"
         "def stop(signum, frame):\n"
         "    time.sleep(0.5); sys.exit(0)\n"    # stopping its node takes a while
         "signal.signal(signal.SIGTERM, stop)\n"
         "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
         "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
         "time.sleep(120)'], stdout=subprocess.PIPE)\n"
         "child.stdout.readline()\n"
         "print(child.pid, flush=True)\n"
         "time.sleep(120)\n")


def _gone(pid: int, within_s: float = 30.0) -> bool:
    """``pid`` no longer runs (absent or a zombie) within ``within_s``."""
    end = time.time() + within_s
    while time.time() < end:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


class _Fake:
    """``_launch_local`` with its Ray and config parts replaced: records every Popen (argv,
    kwargs, the process) and every cluster wait (address, node names, deadline)."""

    def __init__(self, monkeypatch, tmp_path: Path, driver_code: str, **over):
        self.popens: list[tuple[list[str], dict, subprocess.Popen]] = []
        self.waits: list[tuple[str, list[str], float]] = []
        self.out = tmp_path / "run"
        self.args = SimpleNamespace(**{
            "wait_timeout": None, "workers": 1, "cpus_per_node": 3, "gpus_per_node": 0,
            "ray_timeout": 240.0, "object_store_mb": 200, "ray_port": None, **over})
        self.resources = []

        def popen(argv, **kw):
            real = [sys.executable, "-c", _NODE] if str(argv[0]).endswith("/ray") else argv
            if real is not argv:
                kw = {**kw, "stdout": subprocess.PIPE}
            p = subprocess.Popen(real, **kw)
            if real is not argv:      # its SIGTERM handler and its child are in place
                p.child_pid = int(p.stdout.readline())
            self.popens.append((list(argv), kw, p))
            return p

        def wait_for_cluster(address, nodes, deadline, **kw):
            self.waits.append((address, [n.name for n in nodes], deadline))
            return 0.0

        monkeypatch.setattr(ll, "subprocess", SimpleNamespace(
            Popen=popen, STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired))
        monkeypatch.setattr(ll, "load_run", lambda args: SimpleNamespace(out_dir=str(self.out)))
        monkeypatch.setattr(ll, "check_resources", lambda *a: self.resources.append(a[1:]))
        monkeypatch.setattr(ll, "driver_argv", lambda args, cfg, py: [py, "-c", driver_code])
        monkeypatch.setattr(ll, "wait_for_cluster", wait_for_cluster)
        self.auth = []
        monkeypatch.setattr(ll, "use_auth_env", self.auth.append)
        monkeypatch.setattr(ll, "NODE_EXIT_GRACE_S", 0.2)

    def nodes(self):
        return [(a, kw, p) for a, kw, p in self.popens if str(a[0]).endswith("/ray")]

    def driver(self):
        return [(a, kw, p) for a, kw, p in self.popens if not str(a[0]).endswith("/ray")]

    def cleanup(self):
        for _, _, p in self.popens:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_ray_nodes_are_started_on_loopback_with_their_resources_and_torn_down(
        monkeypatch, tmp_path):
    port = 53219
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")    # inherited: overridden
    f = _Fake(monkeypatch, tmp_path, "import sys; sys.exit(0)", ray_port=port, gpus_per_node=2)
    try:
        assert ll.launch_local(f.args) == 0
    finally:
        f.cleanup()
    address = f"127.0.0.1:{port}"
    assert f.resources == [(2, 3, 2)]                      # 1 head + 1 worker node
    (head, head_kw, head_p), (worker, worker_kw, worker_p) = f.nodes()
    tmp = head[head.index("--block") - 3].split("=", 1)[1]
    assert Path(tmp).name.startswith("hacpo-ray-launch-")   # swept if its launcher is killed
    node_args = ["--node-ip-address=127.0.0.1", f"--temp-dir={tmp}", "--num-cpus=3",
                 "--num-gpus=2", "--block", f"--object-store-memory={200 * 1024 * 1024}"]
    ray = str(Path(sys.executable).parent / "ray")
    assert head == [ray, "start", "--head", f"--port={port}", "--include-dashboard=false",
                    *node_args]
    assert worker == [ray, "start", f"--address={address}", *node_args]
    assert f.waits[0][:2] == (address, ["head"])           # the head first, then all nodes
    assert f.waits[1][:2] == (address, ["head", "worker1"])
    ((driver, driver_kw, driver_p),) = f.driver()
    assert driver[-1] == f"rollout.ray_address={address}" and driver_p.returncode == 0
    tokens = set()
    for _, kw, _ in f.popens:
        assert kw["start_new_session"] is True             # its group is what gets killed
        env = kw["env"]
        assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"
        assert env["RAY_USAGE_STATS_ENABLED"] == "0" and env["RAY_AUTH_MODE"] == "token"
        tokens.add(env["RAY_AUTH_TOKEN"])
    assert len(tokens) == 1 and len(tokens.pop()) == 64    # one fresh token for all
    # ... which this process's cluster queries present too
    assert [a["RAY_AUTH_TOKEN"] for a in f.auth] == [head_kw["env"]["RAY_AUTH_TOKEN"]]
    # each node was asked to stop (SIGTERM: exit 0), then its group was SIGKILLed
    for p in (head_p, worker_p):
        assert p.returncode == 0
        assert _gone(p.child_pid), "a node's child (its group) was left running"
    assert not Path(tmp).exists() and tmp not in ray_cluster._owner_fds   # lock released
    assert (f.out / "launch-local").is_dir()


def test_the_printed_driver_command_can_be_pasted_into_a_shell(monkeypatch, tmp_path, capsys):
    """A value with spaces or quotes (a --set value, a config path) was printed unquoted."""
    code = "import sys; print('it ran'); sys.exit(0)  # a 'quoted' note"
    f = _Fake(monkeypatch, tmp_path, code, workers=0)
    try:
        assert ll.launch_local(f.args) == 0
    finally:
        f.cleanup()
    line = next(ln for ln in capsys.readouterr().out.splitlines()
                if ln.startswith("[hacpo launch] driver: "))
    argv = shlex.split(line.split(": ", 1)[1])
    assert argv[:3] == [sys.executable, "-c", code] and len(argv) == 4
    assert argv[3].startswith("rollout.ray_address=127.0.0.1:")


def test_the_driver_exit_status_is_passed_through(monkeypatch, tmp_path, capsys):
    f = _Fake(monkeypatch, tmp_path, "import sys; sys.exit(3)", workers=0)
    try:
        assert ll.launch_local(f.args) == 3
        assert "[hacpo launch] driver exited with 3" in capsys.readouterr().out
    finally:
        f.cleanup()
    f = _Fake(monkeypatch, tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
              workers=0)
    try:
        assert ll.launch_local(f.args) == 128 + signal.SIGKILL
        assert "[hacpo launch] driver was killed by SIGKILL" in capsys.readouterr().out
    finally:
        f.cleanup()


def test_ctrl_c_is_passed_on_to_the_driver_as_sigint(monkeypatch, tmp_path, capsys):
    """A KeyboardInterrupt while the driver runs: its process group gets SIGINT (not SIGTERM),
    the nodes are stopped, the temp dir goes, exit 130."""
    seen, ready = tmp_path / "seen", tmp_path / "ready"
    code = (f"import signal, sys, time\n"
            f"def on(signum, frame):\n"
            f"    open({str(seen)!r}, 'w').write(signal.Signals(signum).name); sys.exit(0)\n"
            f"signal.signal(signal.SIGINT, on); signal.signal(signal.SIGTERM, on)\n"
            f"open({str(ready)!r}, 'w').close()\n"
            f"time.sleep(60)\n")

    def interrupted(driver, procs, nodes, wall):
        end = time.time() + 60
        while not ready.exists() and time.time() < end:
            time.sleep(0.05)
        raise KeyboardInterrupt

    f = _Fake(monkeypatch, tmp_path, code, workers=0)
    monkeypatch.setattr(ll, "_wait_driver", interrupted)
    try:
        assert ll.launch_local(f.args) == 128 + signal.SIGINT
    finally:
        f.cleanup()
    assert seen.read_text() == "SIGINT"
    ((_, _, driver_p),) = f.driver()
    assert driver_p.returncode == 0
    assert "[hacpo launch] interrupted (Ctrl-C)" in capsys.readouterr().err
    ((head, _, head_p),) = f.nodes()
    assert head_p.returncode == 0
    assert not Path(head[head.index("--block") - 3].split("=", 1)[1]).exists()


def test_wait_timeout_while_ray_comes_up_is_exit_124(monkeypatch, tmp_path):
    """The cluster wait's deadline is the earlier of --ray-timeout and --wait-timeout; a
    ClusterTimeout once --wait-timeout passed is a WaitTimeout (124), before it a LaunchError."""
    f = _Fake(monkeypatch, tmp_path, "raise SystemExit(0)", workers=0, wait_timeout=0.3)

    def slow(address, nodes, deadline, **kw):
        f.waits.append((address, [n.name for n in nodes], deadline))
        time.sleep(max(0.0, min(deadline, time.time() + 5) - time.time()) + 0.05)
        raise ClusterTimeout("Ray head on node head did not come up in time")

    monkeypatch.setattr(ll, "wait_for_cluster", slow)
    t0 = time.time()
    try:
        with pytest.raises(WaitTimeout) as e:
            ll.launch_local(f.args)
    finally:
        f.cleanup()
    assert f.waits[0][2] < t0 + 10                        # not --ray-timeout 240 s away
    assert "did not finish within --wait-timeout 0.3s (Ray was still coming up: Ray head on " \
           "node head did not come up in time;" in str(e.value)
    assert "killed the driver" not in str(e.value) and not f.driver()

    f = _Fake(monkeypatch, tmp_path, "raise SystemExit(0)", workers=0)
    monkeypatch.setattr(ll, "wait_for_cluster", slow)
    f.args.ray_timeout = 0.3
    try:
        with pytest.raises(LaunchError) as e:
            ll.launch_local(f.args)
    finally:
        f.cleanup()
    assert type(e.value) is LaunchError
    assert str(e.value) == "Ray head on node head did not come up in time"


def test_wait_timeout_ends_the_driver_with_sigterm_and_names_it(monkeypatch, tmp_path):
    """SIGTERM to the driver's group, and its grace: it takes 0.5 s to stop (exit 3)."""
    code = ("import signal, sys, time\n"
            "def stop(signum, frame):\n"
            "    time.sleep(0.5); sys.exit(3)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "time.sleep(60)\n")
    # 8 s: the driver's Python must be up with its handler in place before the limit passes,
    # also on a loaded machine
    f = _Fake(monkeypatch, tmp_path, code, workers=0, wait_timeout=8)
    try:
        with pytest.raises(WaitTimeout) as e:
            ll.launch_local(f.args)
    finally:
        f.cleanup()
    ((_, _, driver_p),) = f.driver()
    assert driver_p.returncode == 3
    assert "(the driver was still running; " in str(e.value)
    assert f"killed the driver's process group {driver_p.pid} and stopped the Ray cluster; " \
           f"Ray logs: {f.out.resolve() / 'launch-local'}/, run dir: {f.out.resolve()}" \
           in str(e.value)


def _py(code: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, **kw)


def test_wait_driver_names_each_stopped_node_once(monkeypatch, tmp_path, capsys):
    """A node that exits while the driver runs is named once (it is polled many times), by
    its role; one that exits just after a failed driver is still named (the grace)."""
    log = tmp_path / "ray-worker1.log"
    log.write_text("a line of the worker's log\n")
    head, worker = _py("import time; time.sleep(60)"), _py("raise SystemExit(7)")
    driver = _py("import time; time.sleep(1); raise SystemExit(1)")
    nodes = [Node("head", None, head.pid, str(tmp_path / "ray-head.log")),
             Node("worker1", None, worker.pid, str(log))]
    try:
        rc, lost = ll._wait_driver(driver, [head, worker], nodes, None, poll_s=0.05)
        assert (rc, lost) == (1, ["worker node worker1"])
        err = capsys.readouterr().err
        assert err == (f"[hacpo launch] the Ray worker node worker1 stopped while the driver "
                       f"ran: its `ray start --block` (pid {worker.pid}) exited with 7; last "
                       f"lines of {log}:\n{ll.log_tail(str(log))}\n")
        # the head's `ray start` exits 0.5 s after the driver failed
        monkeypatch.setattr(ll, "NODE_EXIT_GRACE_S", 30.0)
        head2 = _py("import time; time.sleep(0.5)")
        driver = _py("raise SystemExit(1)")
        rc, lost = ll._wait_driver(driver, [head2], nodes[:1], None, poll_s=0.05)
        assert (rc, lost) == (1, ["head node"])
    finally:
        for p in (head, worker):
            p.kill()
            p.wait()


def test_wait_driver_raises_once_the_wall_passed(tmp_path, capsys):
    """... and a node that stopped meanwhile is named at once, while the driver still runs."""
    driver, head = _py("import time; time.sleep(10)"), _py("raise SystemExit(9)")
    head.wait()
    log = tmp_path / "ray-head.log"
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            ll._wait_driver(driver, [head], [Node("head", None, head.pid, str(log))],
                            time.time() + 1.0, poll_s=0.05)
        assert driver.poll() is None                      # the caller ends it
        assert capsys.readouterr().err.startswith(
            f"[hacpo launch] the Ray head node stopped while the driver ran: its `ray start "
            f"--block` (pid {head.pid}) exited with 9; last lines of {log}:")
    finally:
        driver.kill()
        driver.wait()


def test_launcher_sigterm_and_ctrl_c_exit_codes_and_handler_restored(monkeypatch, capsys):
    def before(signum, frame):
        pass

    previous = {s: signal.signal(s, before) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for exc, rc, line in ((ll._Terminated(signal.SIGTERM), 143, "terminated (SIGTERM)"),
                              (ll._Terminated(signal.SIGHUP), 129,
                               "terminated (SIGHUP: the terminal closed)"),
                              (KeyboardInterrupt(), 130, "interrupted (Ctrl-C)")):
            def body(args):
                for s in (signal.SIGTERM, signal.SIGHUP):
                    assert signal.getsignal(s) is ll._on_stop_signal
                raise exc

            monkeypatch.setattr(ll, "_launch_local", body)
            assert ll.launch_local(None) == rc
            assert f"[hacpo launch] {line}: the driver and the Ray cluster were stopped" \
                in capsys.readouterr().err
            for s in (signal.SIGTERM, signal.SIGHUP):
                assert signal.getsignal(s) is before
        with pytest.raises(ll._Terminated):
            ll._on_stop_signal(signal.SIGTERM, None)
        # nohup: an ignored SIGHUP stays ignored (the launch is meant to outlive its terminal)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

        def ignored(args):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            return 0
        monkeypatch.setattr(ll, "_launch_local", ignored)
        assert ll.launch_local(None) == 0
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def test_teardown_holds_the_signals_hurries_once_and_restores(capsys):
    def mine(signum, frame):
        pass

    saved = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    p = _py("import time; time.sleep(60)")
    try:
        with ll._Teardown() as t:
            for s in (signal.SIGINT, signal.SIGTERM):
                assert signal.getsignal(s) == t._hurry
            assert t.wait(p, 0.2) is False and not t.hurried
            t._hurry(signal.SIGINT, None)
            t._hurry(signal.SIGTERM, None)
            assert t.hurried and t.wait(p, 600) is False   # no grace left
        assert capsys.readouterr().err == (
            "[hacpo launch] SIGINT while stopping: killing the driver's process group and the "
            "Ray nodes now (SIGKILL)\n")
        for s in (signal.SIGINT, signal.SIGTERM):
            assert signal.getsignal(s) is mine
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        p.kill()
        p.wait()


def test_kill_group_gives_the_leader_its_grace_then_kills_the_group(tmp_path):
    """``first`` goes to the group; the leader's own handling (exit 5 after 0.3 s) is waited
    for; then the group is SIGKILLed (a child that ignores SIGINT/SIGTERM included)."""
    code = ("import signal, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGINT, signal.SIG_IGN); print(1, flush=True); "
            "time.sleep(120)'], stdout=subprocess.PIPE)\n"
            "child.stdout.readline()\n"
            "def on(signum, frame):\n"
            "    time.sleep(0.3); sys.exit(5)\n"
            "signal.signal(signal.SIGINT, on)\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(120)\n")
    p = _py(code, stdout=subprocess.PIPE)
    child = int(p.stdout.readline())
    try:
        with ll._Teardown() as t:
            ll._kill_group(p, t, grace_s=60, first=signal.SIGINT)
        assert p.returncode == 5
        assert _gone(child)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_signal_name_of_an_unknown_number():
    assert ll._signal_name(signal.SIGKILL) == "SIGKILL"
    assert ll._signal_name(1000) == "signal 1000"


# --------------------------------------------------------------------------------------------
# hacpo.engine.signals.signals_deferred
# --------------------------------------------------------------------------------------------
def test_signals_deferred_holds_a_signal_until_the_body_ends():
    got = []

    def mine(signum, frame):
        got.append(signum)

    previous = signal.signal(signal.SIGUSR1, mine)
    try:
        with signals_deferred(signal.SIGUSR1):
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            assert got == []                               # not in the body's middle
            with signals_deferred(signal.SIGUSR1):         # nested: the outermost handles it
                os.kill(os.getpid(), signal.SIGUSR1)
            assert got == []
        assert got[:1] == [signal.SIGUSR1]                 # after the body
        assert signal.getsignal(signal.SIGUSR1) is mine
        n = len(got)
        with signals_deferred(signal.SIGUSR1):
            pass
        assert len(got) == n and signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_signals_deferred_raises_past_a_failed_body_and_leaves_non_python_handlers():
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    ign = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt) as e:
            with signals_deferred(signal.SIGUSR1, signal.SIGUSR2):
                assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
                os.kill(os.getpid(), signal.SIGUSR1)
                raise ValueError("the body failed")
        assert isinstance(e.value.__context__, ValueError)
        assert signal.getsignal(signal.SIGUSR1) is interrupt
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGUSR2, ign)


def test_signals_deferred_is_a_no_op_off_the_main_thread():
    seen = []

    def body():
        with signals_deferred(signal.SIGINT):
            seen.append(signal.getsignal(signal.SIGINT))

    before = signal.getsignal(signal.SIGINT)
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [before]


@pytest.mark.parametrize("over,message", [
    ({"workers": -1}, "--workers must be >= 0, got -1"),
    ({"ray_timeout": 0}, "--ray-timeout must be a finite number of seconds > 0, got 0"),
    ({"ray_timeout": float("nan")}, "--ray-timeout must be a finite number of seconds > 0"),
    ({"ray_port": 70000}, "--ray-port must be a port in 1..65535, got 70000")])
def test_bad_counts_are_refused_before_anything_starts(monkeypatch, tmp_path, over, message):
    f = _Fake(monkeypatch, tmp_path, "raise SystemExit(0)", **over)
    with pytest.raises(LaunchError, match=message):
        ll.launch_local(f.args)
    assert not f.popens


def test_cpus_per_node_zero_reaches_the_resource_check(monkeypatch, tmp_path):
    """--cpus-per-node 0 was read as "not given" (this machine's CPU count) and started the
    cluster; it goes to check_resources as 0, which refuses it (as launch slurm does)."""
    from hacpo.launch.slurm import check_resources
    f = _Fake(monkeypatch, tmp_path, "raise SystemExit(0)", cpus_per_node=0)
    ll.launch_local(f.args)
    assert [r[1] for r in f.resources] == [0]
    with pytest.raises(LaunchError, match="--cpus-per-node must be >= 1, got 0"):
        check_resources(None, 2, 0, 0)


@pytest.mark.parametrize("which", ["head", "worker", "driver"])
def test_a_signal_as_a_process_starts_still_stops_it(monkeypatch, tmp_path, capsys, which):
    """A SIGTERM handled at the very end of subprocess.Popen (the child runs; launch_local has
    not recorded it yet) left that Ray node, or the driver, running after the launcher exited
    143: now the signal is held until the process is recorded, then stops it with the rest."""
    f = _Fake(monkeypatch, tmp_path, "import time; time.sleep(60)", workers=1)
    fake_popen = ll.subprocess.Popen

    def popen(argv, **kw):
        p = fake_popen(argv, **kw)
        is_node = str(argv[0]).endswith("/ray")
        kind = ("head" if "--head" in argv else "worker") if is_node else "driver"
        if kind == which:
            os.kill(os.getpid(), signal.SIGTERM)   # handled here, as at Popen's last bytecode
        return p

    monkeypatch.setattr(ll.subprocess, "Popen", popen)
    try:
        assert ll.launch_local(f.args) == 128 + signal.SIGTERM
        started = [p for _, _, p in f.popens]
        assert len(started) == {"head": 1, "worker": 2, "driver": 3}[which]
        assert all(_gone(p.pid, within_s=30) for p in started), \
            "a process started as the signal came was left running"
    finally:
        f.cleanup()
    assert "terminated (SIGTERM)" in capsys.readouterr().err
