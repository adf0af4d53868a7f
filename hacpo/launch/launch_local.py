"""``hacpo launch local``: what the Slurm job does, on this machine without Slurm.

Starts a Ray head (``ray start --head --block``, its own temp dir, loopback, no dashboard,
token authentication with a fresh token: Ray listens on every interface) and
``--workers`` K more Ray nodes as local processes, waits until all 1 + K nodes are registered
(``--ray-timeout``), runs the driver ``hacpo train ... --set rollout.engine=ray
rollout.ray_address=127.0.0.1:PORT`` as a child process, then tears the cluster down by
signalling the processes it started (never ``ray stop``, which would stop every Ray on the
machine) and removes the temp dir. Exits with the driver's exit code (128 + N if a signal N
killed it); a Ray node whose ``ray start`` exits while the driver runs (e.g. the head's GCS
died: the driver then ends with exit 1 and no message of its own) is named on stderr with the
tail of its log. With ``--wait-timeout S``, a launch not finished S seconds after it started
(Ray bring-up included) kills the driver's process group (SIGTERM, SIGKILL after 10 s), tears
the cluster down the same way and exits 124 naming the driver's process group, the elapsed
time and where the logs are. SIGTERM to the launcher ends the driver's process group and the
cluster the same way (exit 143), and so does SIGHUP (the terminal closed; exit 129) unless it
is ignored (nohup). A SIGKILLed launcher cannot tear down: its driver and ``ray start``
processes get SIGTERM from the kernel when it dies (PR_SET_PDEATHSIG), and stop as they do on
a teardown's (the Ray temp dir is left). SIGUSR1 to the launcher is passed on to the driver,
which writes a checkpoint at the end of its step and stops (exit 75, as the launcher's then;
before the driver runs, SIGUSR1 stops the launch as SIGTERM does, exit 138; once the driver
has exited, it is ignored). Ctrl-C in the terminal (SIGINT to
the launcher's process group: the driver and the Ray nodes run in sessions of their own and do
not see it) is passed on to the driver's process group as SIGINT, so the run stops as an
interrupted ``hacpo train`` does; then the cluster is torn down and the launcher prints one
line and exits 130, also while Ray is still coming up. A second Ctrl-C (or a SIGTERM) while it
stops the driver and the cluster does not cut the teardown short: it hurries it (whatever is
still running is SIGKILLed at once, one line says so).
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hacpo._stop import CHECKPOINT_SIGNAL
from hacpo.engine.signals import signals_deferred

from .ray_cluster import (TEMP_PREFIX, new_auth_env, new_temp_dir, remove_temp_dir,
                          use_auth_env)
from .ray_wait import ClusterTimeout, Node, log_tail, wait_for_cluster
from .slurm import (LaunchError, WaitTimeout, check_launch_numbers, check_resources,
                    check_wait_timeout, driver_argv, load_run)

_HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((_HOST, 0))
        return s.getsockname()[1]


# what stops a launch (SIGINT: Ctrl-C, as KeyboardInterrupt)
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Teardown:
    """Held while the launcher stops the driver and the Ray nodes: Ctrl-C or SIGTERM then does
    not interrupt the teardown (a KeyboardInterrupt there left the Ray nodes running, after a
    traceback) but hurries it: the grace periods end at once and whatever is still running is
    SIGKILLed. One line says so. Main thread only (signal handlers)."""

    def __init__(self) -> None:
        self.hurried = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_Teardown":
        for sig in _STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:    # (nohup: SIGHUP stays ignored)
                self._previous[sig] = signal.signal(sig, self._hurry)
        # the driver is stopping already: its checkpoint request has nothing left to do
        self._previous[CHECKPOINT_SIGNAL] = signal.signal(CHECKPOINT_SIGNAL, lambda *_: None)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _hurry(self, signum, frame) -> None:
        if not self.hurried:
            print(f"[hacpo launch] {_signal_name(signum)} while stopping: killing the driver's "
                  f"process group and the Ray nodes now (SIGKILL)", file=sys.stderr, flush=True)
        self.hurried = True

    def wait(self, p: subprocess.Popen, timeout: float | None) -> bool:
        """Wait up to ``timeout`` s (None: no limit) for ``p`` to exit, less if hurried;
        True if it exited."""
        end = None if timeout is None else time.time() + timeout
        while not self.hurried:
            step = 0.1 if end is None else min(0.1, end - time.time())
            if step <= 0:
                break
            try:
                p.wait(timeout=step)
                return True
            except subprocess.TimeoutExpired:
                pass
        return p.poll() is not None


def _stop(procs: list[subprocess.Popen], teardown: _Teardown, grace_s: float = 30.0) -> None:
    """SIGTERM each started ``ray start --block`` (it stops its node's processes), then
    SIGKILL the process group of each (any still there after ``grace_s``, or at once if the
    teardown is hurried)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for p in procs:
        teardown.wait(p, max(0.1, deadline - time.time()))
    for p in procs:      # each was started in its own session: its group holds its Ray processes
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if p.poll() is None:
            p.wait()


def _kill_group(p: subprocess.Popen, teardown: _Teardown, grace_s: float = 10.0,
                first: signal.Signals = signal.SIGTERM) -> None:
    """Send ``first`` (SIGTERM; SIGINT passes a Ctrl-C on) to the process group of ``p``
    (started in its own session), SIGKILL the group once ``p`` exited or after ``grace_s``
    (at once if the teardown is hurried), and reap ``p``."""
    try:
        os.killpg(p.pid, first)
    except (ProcessLookupError, PermissionError):
        pass
    teardown.wait(p, grace_s)
    try:                  # the leader is gone (or is given no more time): end the whole group
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


# After a driver that failed: how long to watch for a Ray node's `ray start --block` exiting
# too (the cause to report), before reporting the driver's failure alone.
NODE_EXIT_GRACE_S = 5.0


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _wait_driver(driver: subprocess.Popen, procs: list[subprocess.Popen], nodes: list[Node],
                 wall: float | None, poll_s: float = 1.0) -> tuple[int, list[str]]:
    """Wait for the driver (until ``wall``, else ``subprocess.TimeoutExpired``) while watching
    the Ray nodes' ``ray start --block`` processes: a node whose process exits meanwhile (its
    Ray is gone: e.g. the head's GCS died, which ends the driver too, silently) is reported
    at once on stderr, with the tail of its log. Returns the driver's exit status and the
    nodes that stopped ("head node", "worker node worker1")."""
    lost: list[str] = []

    def check_nodes() -> None:
        for p, node in zip(procs, nodes):
            what = "head node" if node is nodes[0] else f"worker node {node.name}"
            if what in lost or p.poll() is None:
                continue
            lost.append(what)
            print(f"[hacpo launch] the Ray {what} stopped while the driver ran: its "
                  f"`ray start --block` (pid {p.pid}) exited with {p.returncode}; last lines "
                  f"of {node.log}:\n{log_tail(node.log)}", file=sys.stderr, flush=True)

    while True:
        step = poll_s if wall is None else min(poll_s, wall - time.time())
        if step <= 0:
            raise subprocess.TimeoutExpired(driver.args, 0)
        try:
            rc = driver.wait(timeout=step)
        except subprocess.TimeoutExpired:
            check_nodes()
            continue
        # a driver that failed because its cluster went away may end before the node's
        # `ray start --block` notices (it polls its processes about once a second)
        settle = time.time() + (NODE_EXIT_GRACE_S if rc != 0 else 0.0)
        while True:
            check_nodes()
            if lost or time.time() >= settle:
                return rc, lost
            time.sleep(0.2)


class _Terminated(BaseException):
    """SIGTERM (``kill``, ``timeout``, a scheduler) or SIGHUP (the terminal closed, an SSH
    session dropped) to the launcher: unwinds through its teardown like Ctrl-C, then exits
    128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Quiet:
    """A stream whose writes may fail (the terminal of a SIGHUP is gone: EIO) without ending
    the teardown that prints its progress."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self):
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _on_stop_signal(signum, frame):
    if signum == signal.SIGHUP:
        sys.stdout, sys.stderr = _Quiet(sys.stdout), _Quiet(sys.stderr)
    raise _Terminated(signum)


def _end_with_parent() -> None:
    """In a child (preexec_fn): SIGTERM when the launcher dies, even by SIGKILL (its own
    teardown never runs then; the children are in sessions of their own, which no terminal
    hang-up reaches)."""
    with contextlib.suppress(Exception):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


@contextlib.contextmanager
def _passed_on(signum: int, p: subprocess.Popen):
    """The body with signal ``signum`` to the launcher passed on to process ``p``; ignored
    after it (``p`` has exited: the launch's own end is not a stop before the driver ran).
    Main thread only, as every handler here."""
    signal.signal(signum, lambda *_: p.poll() is None and p.send_signal(signum))
    try:
        yield
    finally:
        signal.signal(signum, lambda *_: None)


def launch_local(args) -> int:
    """See the module docstring; SIGTERM, or SIGHUP (unless ignored: nohup), tears down the
    driver and the cluster as Ctrl-C does, and the launcher exits 128 + the signal. SIGUSR1
    is passed on to the driver (it checkpoints at the end of its step and stops, exit 75);
    before the driver runs, it stops the launch as SIGTERM does (exit 138)."""
    previous = {sig: signal.getsignal(sig)
                for sig in (signal.SIGTERM, signal.SIGHUP, CHECKPOINT_SIGNAL)}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _on_stop_signal)
    try:
        return _launch_local(args)
    except _Terminated as e:
        if e.signum == CHECKPOINT_SIGNAL:
            print("[hacpo launch] stopped (SIGUSR1) before the driver ran, with nothing to "
                  "checkpoint: the Ray cluster was stopped", file=sys.stderr, flush=True)
            return 128 + e.signum
        name = "SIGHUP: the terminal closed" if e.signum == signal.SIGHUP else "SIGTERM"
        print(f"[hacpo launch] terminated ({name}): the driver and the Ray cluster were "
              f"stopped", file=sys.stderr, flush=True)
        return 128 + e.signum
    except KeyboardInterrupt:    # a traceback before
        print("[hacpo launch] interrupted (Ctrl-C): the driver and the Ray cluster were "
              "stopped", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _launch_local(args) -> int:
    t_start = time.time()
    cfg = load_run(args)
    check_wait_timeout(args.wait_timeout)
    if args.workers < 0:
        raise LaunchError(f"--workers must be >= 0, got {args.workers}")
    cpus = args.cpus_per_node if args.cpus_per_node is not None else os.cpu_count() or 1
    check_resources(cfg, 1 + args.workers, cpus, args.gpus_per_node)
    check_launch_numbers(args)
    from hacpo.engine.trainer import run_dir_holder
    if holder := run_dir_holder(cfg.out_dir):   # its driver would be refused, after Ray is up
        raise LaunchError(f"{cfg.out_dir} is in use by another hacpo run (process {holder}): "
                          f"wait for it to end (or stop it), or choose another --out-dir")
    ray_bin = Path(sys.executable).parent / "ray"
    if not ray_bin.exists():
        raise LaunchError(f"{ray_bin} not found: ray is not installed in this Python "
                          f"environment (pip install ray==2.60.0)")
    run_dir = Path(cfg.out_dir).resolve()
    log_dir = run_dir / "launch-local"
    log_dir.mkdir(parents=True, exist_ok=True)
    port = args.ray_port or _free_port()
    address = f"{_HOST}:{port}"
    # Ray listens on every interface: the cluster requires a fresh token, which the nodes, the
    # driver and this process (its cluster queries) get through their environment
    auth = new_auth_env()
    use_auth_env(auth)
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (e.g. inherited) would refuse the worker nodes
    env = {**os.environ, **auth, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    # short: Ray's socket paths live here (under /tmp if TMPDIR is too long for them, one
    # warning says so). Held like a private cluster's: a launcher killed with SIGKILL cannot
    # remove it, the next launch or private cluster does
    try:
        tmp = new_temp_dir(TEMP_PREFIX + "launch-")
    except ValueError as e:     # no folder leaves room for Ray's socket paths
        raise LaunchError(str(e)) from None
    node_args = [f"--node-ip-address={_HOST}", f"--temp-dir={tmp}", f"--num-cpus={cpus}",
                 f"--num-gpus={args.gpus_per_node}", "--block"]
    if args.object_store_mb:
        node_args.append(f"--object-store-memory={args.object_store_mb * 1024 * 1024}")
    procs: list[subprocess.Popen] = []
    nodes: list[Node] = []
    driver: subprocess.Popen | None = None
    interrupted = False
    wall = None if args.wait_timeout is None else t_start + args.wait_timeout
    deadline = time.time() + args.ray_timeout
    if wall is not None:
        deadline = min(deadline, wall)

    def timed_out(phase: str, at: float | None = None) -> WaitTimeout:
        """``at``: when the limit was seen to pass (before any cleanup); default now."""
        elapsed = (time.time() if at is None else at) - t_start
        return WaitTimeout(
            f"the local launch did not finish within --wait-timeout {args.wait_timeout:g}s "
            f"({phase}; {elapsed:.0f}s elapsed): "
            + (f"killed the driver's process group {driver.pid} and " if driver else "")
            + f"stopped the Ray cluster; Ray logs: {log_dir}/, run dir: {run_dir}"
            + (" (the driver's output is above)" if driver else ""))

    def start(name, extra):
        log = log_dir / f"ray-{name}.log"
        # a Ctrl-C / SIGTERM while it starts is handled once it is recorded (then stopped)
        # appended: the logs of an earlier launch of this run dir (which its error named) stay
        with signals_deferred(*_STOP_SIGNALS, CHECKPOINT_SIGNAL), open(log, "a") as f:
            f.write(f"==== hacpo launch local (pid {os.getpid()}), "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}: ray start {name} ====\n")
            f.flush()
            p = subprocess.Popen([str(ray_bin), "start", *extra, *node_args], stdout=f,
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                 preexec_fn=_end_with_parent)
            procs.append(p)
            nodes.append(Node(name, None, p.pid, str(log)))   # Ray registers it under the host IP

    try:
        print(f"[hacpo launch] local Ray head at {address}, {args.workers} worker node(s); "
              f"temp dir {tmp}, logs in {log_dir}", flush=True)
        start("head", ["--head", f"--port={port}", "--include-dashboard=false"])
        wait_for_cluster(address, nodes[:1], deadline)
        for i in range(args.workers):
            start(f"worker{i + 1}", [f"--address={address}"])
        took = wait_for_cluster(address, nodes, deadline)
        print(f"[hacpo launch] Ray cluster of {len(nodes)} node(s) up ({took:.1f}s)",
              flush=True)
        argv = driver_argv(args, cfg, sys.executable) + [f"rollout.ray_address={address}"]
        # quoted: the line can be pasted into a shell (a config path or --set value with spaces)
        print("[hacpo launch] driver: " + shlex.join(argv), flush=True)
        # its own session: on a timeout (or if this launcher is interrupted) the whole driver
        # process group is ended, whatever it started
        with signals_deferred(*_STOP_SIGNALS, CHECKPOINT_SIGNAL):   # recorded, then stopped
            driver = subprocess.Popen(argv, env=env, start_new_session=True,
                                      preexec_fn=_end_with_parent)
        try:
            with _passed_on(CHECKPOINT_SIGNAL, driver):   # a checkpoint at its step's end
                rc, lost = _wait_driver(driver, procs, nodes, wall)
        except subprocess.TimeoutExpired:
            t_limit = time.time()
            print(f"[hacpo launch] --wait-timeout {args.wait_timeout:g}s passed: ending the "
                  f"driver (process group {driver.pid}) and the Ray cluster", flush=True)
            with _Teardown() as teardown:
                _kill_group(driver, teardown)
            raise timed_out("the driver was still running", t_limit) from None
        if rc < 0:           # killed by a signal: exit as a shell reports it (128 + N)
            print(f"[hacpo launch] driver was killed by {_signal_name(-rc)}", flush=True)
            rc = 128 - rc
        else:
            print(f"[hacpo launch] driver exited with {rc}", flush=True)
        if rc != 0 and lost:
            print(f"[hacpo launch] error: the driver failed (exit {rc}) after the Ray "
                  f"{' and '.join(lost)} stopped while it ran (see above): the run stops with "
                  f"its cluster; `--resume` continues it from its last checkpoint in "
                  f"{run_dir}", file=sys.stderr, flush=True)
        return rc
    except ClusterTimeout as e:
        if wall is not None and time.time() >= wall:
            raise timed_out(f"Ray was still coming up: {e}") from None
        raise LaunchError(str(e)) from None
    except KeyboardInterrupt:    # the terminal's Ctrl-C, passed on: the driver's own session
        interrupted = True       # does not see it
        raise
    finally:
        with _Teardown() as teardown:   # a second Ctrl-C / SIGTERM hurries it, never cuts it
            if driver is not None and driver.poll() is None:   # interrupted: end it too
                _kill_group(driver, teardown,
                            first=signal.SIGINT if interrupted else signal.SIGTERM)
            _stop(procs, teardown)
            remove_temp_dir(tmp)
