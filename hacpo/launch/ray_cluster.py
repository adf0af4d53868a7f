"""Ray bring-up for the rollout pool: a private local cluster, or a connection to a running one.

``connect("")`` starts a private single-node cluster for this process: registered on loopback
(Ray's servers still listen on every interface; Ray's default token authentication guards
them unless RAY_AUTH_MODE=disabled is set), its own temp dir, no dashboard, no usage stats,
``num_cpus`` logical CPUs, an object store sized for the agents' weights (``weights``).
``connect("host:port")``
joins a cluster someone else started (e.g. the Slurm batch job's ``ray start --head``); the
driver then owns nothing and :meth:`RayCluster.shutdown` only disconnects. If this process is
already connected (a test fixture, an outer driver), that connection is reused and left alone.
"""
from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

from .ray_wait import LINUX_AF_UNIX_PATH_MAX, RAY_SOCKET_TAIL

log = logging.getLogger("hacpo")

# A private cluster binds to loopback only and reports no usage (ENVIRONMENT.md). Ray reads
# these when it is imported (the driver's own node-IP choice) and when its processes start, so
# they are set here, before this module's lazy ``import ray``; import this module before ray.
_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
            # the GCS keeps an event record of every task (Ray's cap: 100k tasks), for its
            # dashboard and state API, which hacpo does not use: a run's GCS grew ~30-40 KB a
            # step for thousands of steps; 10k keeps the recent ones and bounds it
            "RAY_task_events_max_num_task_in_gcs": "10000"}
for _k, _v in _RAY_ENV.items():
    os.environ.setdefault(_k, _v)
# the address this process joined a cluster by, keyed by the address the cluster reports
_joined: dict[str, str] = {}
_OBJECT_STORE_MIN = 256 * 1024 ** 2   # private cluster: at least this (rollouts, small weights)
_OBJECT_STORE_MEMORY_FRACTION = 0.3    # and at most this share of the machine's memory (Ray's
                                       # own default for a cluster it sizes itself)
_OBJECT_STORE_COPIES = 4               # copies of the weights it should hold (see below)


# Ray's GCS and raylets listen on every interface, whatever --node-ip-address says: a cluster
# a launcher starts requires a token (Ray's token authentication), fresh per launch, that only
# the launch's own processes get through their environment. (A private cluster gets Ray's own
# default, token authentication with ~/.ray/auth_token, unless RAY_AUTH_MODE says otherwise.)

def new_auth_env() -> dict[str, str]:
    """The environment that makes Ray processes require (``ray start``) and present (drivers,
    ``GcsClient``) a new random token: ``RAY_AUTH_MODE=token`` and a 256-bit
    ``RAY_AUTH_TOKEN``."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def use_auth_env(auth: dict[str, str]) -> None:
    """Make this process present ``auth``'s token to the clusters it queries or joins (sets
    ``os.environ``; if Ray is already loaded, refreshes its cached auth mode and token)."""
    os.environ.update(auth)      # RAY_AUTH_TOKEN outranks RAY_AUTH_TOKEN_PATH and ~/.ray's
    if "ray._raylet" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config
        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


# Ray's GPU accounting of a colocated vLLM engine and of the trainer rank whose GPU it shares
# (rollout.colocate): half a GPU each, in the same placement-group bundle.
COLOCATED_GPU_SHARE = 0.5

@dataclass
class ProcessChanges:
    """What ``ray.init`` changed in this process that outlives ``ray.shutdown``: environment
    variables (``PYTHONBREAKPOINT`` to Ray's remote debugger: a later ``breakpoint()`` does not
    stop; ``RAY_AUTH_MODE``, ... inherited by every later subprocess) and ``sys.excepthook``.
    :meth:`undo` puts back each one that is still as Ray left it (a notebook, a sweep script:
    the same process goes on after the run)."""

    env: dict[str, tuple[str | None, str | None]]     # name -> (before, as Ray left it)
    excepthook: tuple[object, object] | None          # (before, Ray's)

    @classmethod
    def since(cls, env: dict[str, str], excepthook) -> "ProcessChanges":
        """The changes from ``env`` / ``excepthook`` (taken before ``ray.init``) to now."""
        now = dict(os.environ)
        changed = {k: (env.get(k), now.get(k)) for k in env.keys() | now.keys()
                   if env.get(k) != now.get(k)}
        hook = None if sys.excepthook is excepthook else (excepthook, sys.excepthook)
        return cls(changed, hook)

    def undo(self) -> None:
        for k, (before, ray_s) in self.env.items():
            if os.environ.get(k) != ray_s:      # changed since by someone else: theirs
                continue
            if before is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = before
        if self.excepthook is not None and sys.excepthook is self.excepthook[1]:
            sys.excepthook = self.excepthook[0]


@dataclass
class RayCluster:
    """A connection to a Ray cluster. ``owned``: this process started it (and stops it)."""

    address: str
    owned: bool
    connected_here: bool       # this handle made the ray.init() call (else it reused one)
    temp_dir: str | None = None
    changes: ProcessChanges | None = None    # what its ray.init changed (connect sets it)

    def resources(self) -> dict[str, float]:
        """The cluster's logical resources ({"CPU": n, "GPU": n, ...}; free or not)."""
        import ray
        return ray.cluster_resources()

    def num_cpus(self) -> float:
        return float(self.resources().get("CPU", 0))

    def reserve(self, bundles: list[dict], *, what: str, hint: str, timeout_s: float):
        """A PACK placement group for ``bundles``, granted within ``timeout_s``; otherwise it is
        removed again and the error names ``what``, the cluster's free CPUs (and GPUs, when
        the bundles ask for any: those are what is usually short) and ``hint``."""
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group, remove_placement_group
        pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except GetTimeoutError:
            free = ray.available_resources()
            remove_placement_group(pg)
            total = self.resources()
            kinds = ["CPU"] + (["GPU"] if any(b.get("GPU", 0) for b in bundles) else [])
            have = " and ".join(f"{free.get(r, 0):g} free {r}s of {total.get(r, 0):g}"
                                for r in kinds)
            raise RuntimeError(
                f"{what} was not granted within {timeout_s:g} s (the Ray cluster at "
                f"{self.address} has {have}); {hint}") from None
        return pg

    def require(self, resource: str, need: float, *, what: str, hint: str) -> None:
        """An error "``what`` but the Ray cluster at ... has N; ``hint``" when the cluster has
        less than ``need`` of ``resource`` ("CPU", "GPU"; ``what`` says who needs them, e.g.
        "x needs 4 CPUs (...)")."""
        have = float(self.resources().get(resource, 0))
        if need > have:
            raise RuntimeError(f"{what} but the Ray cluster at {self.address} has {have:g}; "
                               f"{hint}")

    @staticmethod
    def release(actors, placement_groups) -> None:
        """Kill ``actors`` (no restart) and remove ``placement_groups``; ones already gone (or
        a Ray that is down) are fine."""
        import ray
        from ray.util.placement_group import remove_placement_group
        if not ray.is_initialized():
            return
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception as e:  # already gone
                log.debug("ray.kill: %s", e)
        for pg in placement_groups:
            try:
                remove_placement_group(pg)
            except Exception as e:
                log.debug("remove_placement_group: %s", e)

    @staticmethod
    def wait_started(ref, *, what: str, timeout_s: float):
        """ray.get of an actor's ready call; a timeout or a dead actor names ``what``."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError
        try:
            return ray.get(ref, timeout=timeout_s)
        except (GetTimeoutError, RayActorError) as e:
            raise RuntimeError(f"{what} did not start within {timeout_s:g} s: {e}") from e

    def shutdown(self) -> None:
        """Stop the cluster if this process started it, disconnect if it joined one; a reused
        connection is left as it was. Idempotent."""
        if not self.connected_here:
            return
        import ray
        if ray.is_initialized():
            ray.shutdown()       # a local cluster started by ray.init() stops with its driver
        self.connected_here = False
        if self.changes is not None:
            self.changes.undo()
        if self.owned and self.temp_dir:
            remove_temp_dir(self.temp_dir)


# A private cluster's temp dir (Ray's sockets, session logs: ~250 KB) is removed when the
# cluster stops; a process killed with SIGKILL cannot. Its owner holds a POSIX lock on
# OWNER_LOCK inside it for the cluster's life (released when the process ends, kill -9
# included), so the next private cluster on this machine removes the dirs nobody holds.
TEMP_PREFIX = "hacpo-ray-"
OWNER_LOCK = ".hacpo-owner.lock"
STALE_AFTER_S = 60.0     # a lock file younger than this may be its owner's, not yet locked
_owner_fds: dict[str, int] = {}      # temp dir -> this process's fd holding its lock


def _hold_owner_lock(temp_dir: str) -> None:
    import fcntl
    fd = os.open(os.path.join(temp_dir, OWNER_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:          # a filesystem without locks: the dir is never swept
        os.close(fd)
        return
    _owner_fds[temp_dir] = fd


def _release_owner_lock(temp_dir: str) -> None:
    fd = _owner_fds.pop(temp_dir, None)
    if fd is not None:
        os.close(fd)


# A per-job TMPDIR (/local/scratch/<job id>, PBS's /var/tmp/pbs.<id>.<server>) often leaves
# no room for Ray's socket paths (ray_wait.RAY_SOCKET_TAIL): the dir then goes under /tmp
AF_UNIX_PATH_MAX = 103 if sys.platform == "darwin" else LINUX_AF_UNIX_PATH_MAX
SHORT_TEMP_ROOT = "/tmp"
_MKDTEMP_RANDOM = 8      # the characters tempfile.mkdtemp adds to the prefix


def longest_socket_path(root: str, prefix: str = TEMP_PREFIX) -> int:
    """Bytes of the longest socket path of a Ray cluster whose temp dir is made in ``root``
    with ``prefix`` (:func:`new_temp_dir`)."""
    return len(os.path.join(root, prefix).encode()) + _MKDTEMP_RANDOM + RAY_SOCKET_TAIL


def temp_root(prefix: str = TEMP_PREFIX, root: str | None = None,
              fallback: str | None = None) -> tuple[str, str | None]:
    """The folder to make a Ray cluster's temp dir in: ``root`` (default the temp directory,
    TMPDIR) when Ray's socket paths under it fit an AF_UNIX path, else ``fallback`` (default
    SHORT_TEMP_ROOT) and a note saying why. A ValueError when they fit under neither."""
    root = root or tempfile.gettempdir()
    fallback = fallback or SHORT_TEMP_ROOT
    n = longest_socket_path(root, prefix)
    if n <= AF_UNIX_PATH_MAX:
        return root, None
    why = (f"Ray's socket paths under the temp directory {root} (TMPDIR) would be up to {n} "
           f"bytes, over the AF_UNIX limit of {AF_UNIX_PATH_MAX}")
    if longest_socket_path(fallback, prefix) > AF_UNIX_PATH_MAX:
        raise ValueError(f"{why}, and under {fallback} too: set TMPDIR to a shorter folder")
    return fallback, f"{why}: the Ray cluster's temp dir goes under {fallback} instead"


def new_temp_dir(prefix: str = TEMP_PREFIX) -> str:
    """A temp dir for a Ray cluster this process starts (``prefix`` must start with
    TEMP_PREFIX), in :func:`temp_root` (its note logged as a warning): the dirs of owners
    that died are swept first, and this process holds the owner lock of the new one until
    :func:`remove_temp_dir`."""
    root, note = temp_root(prefix)
    if note:
        log.warning(note)
    sweep_dead_temp_dirs(root)
    temp_dir = tempfile.mkdtemp(prefix=prefix, dir=root)
    _hold_owner_lock(temp_dir)
    return temp_dir


def remove_temp_dir(temp_dir: str) -> None:
    """Remove a :func:`new_temp_dir` (its cluster stopped) and release its owner lock."""
    shutil.rmtree(temp_dir, ignore_errors=True)
    _release_owner_lock(temp_dir)


def sweep_dead_temp_dirs(root: str | None = None) -> list[str]:
    """Remove the private clusters' temp dirs under ``root`` (the temp directory) whose owner
    died without removing them (SIGKILL): their OWNER_LOCK exists, is older than
    STALE_AFTER_S and no process holds its lock. A dir without the lock file, or one this
    process owns, is left alone. Returns the dirs removed (logged)."""
    from hacpo.engine.checkpoint import writer_dead
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(TEMP_PREFIX)]
    except OSError:
        return removed
    for name in names:
        d = os.path.join(root, name)
        lock = os.path.join(d, OWNER_LOCK)
        if d in _owner_fds:    # ours: opening and closing its lock file would release it
            continue
        try:
            if (time.time() - os.stat(lock).st_mtime < STALE_AFTER_S
                    or not writer_dead(lock)):    # a live owner holds it (or cannot lock)
                continue
        except OSError:        # no lock file (not ours to judge), gone meanwhile, odd lock error
            continue
        shutil.rmtree(d, ignore_errors=True)
        if not os.path.exists(d):
            removed.append(d)
    if removed:
        log.info("removed %d temp dir(s) of private Ray clusters whose process died: %s",
                 len(removed), ", ".join(removed))
    return removed


def call_deadline(timeout_s: float) -> float | None:
    """The ``time.monotonic()`` by which a call sent now must answer (None: ``timeout_s`` 0
    or infinite, no limit: Ray's waits cannot take an infinite timeout)."""
    return time.monotonic() + timeout_s if 0 < timeout_s < math.inf else None


def next_ready(refs, deadlines: dict) -> tuple[object, bool]:
    """Block until one of ``refs`` (ObjectRefs of actor calls) is ready or the earliest of
    their deadlines passes: a hung actor (alive, never answering) costs at most its deadline.

    ``deadlines`` maps a ref to an absolute ``time.monotonic()`` (a ref not in it, or mapped
    to None, waits without limit). Returns ``(ref, False)`` for a ref that is ready (results
    are taken before deadlines), or ``(ref, True)`` for one whose deadline passed first."""
    import ray
    refs = list(refs)
    while True:
        limits = [d for r in refs if (d := deadlines.get(r)) is not None]
        wait_s = None if not limits else max(0.0, min(limits) - time.monotonic())
        done, _ = ray.wait(refs, num_returns=1, timeout=wait_s)
        if done:
            return done[0], False
        now = time.monotonic()
        for r in refs:
            d = deadlines.get(r)
            if d is not None and d <= now:
                return r, True


def _stop_half_started() -> None:
    """Stop what an interrupted or failed ``ray.init`` of a private cluster started (its GCS,
    raylet and other processes, which write into the temp dir), before the dir is removed."""
    import ray
    try:
        ray.shutdown()
    except Exception as e:     # nothing started, or already gone
        log.debug("ray.shutdown after a failed start: %s", e)


def _host_port(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in host:
        return None
    return host.strip("[]"), int(port)


def wait_reachable(address: str, timeout_s: float) -> None:
    """Poll a TCP connect to ``host:port`` until it succeeds or ``timeout_s`` passes."""
    hp = _host_port(address)
    if hp is None:
        raise ValueError(f"rollout.ray_address {address!r} is not host:port (e.g. "
                         f"10.0.0.1:6379), 'auto', or '' for a private local cluster")
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        try:
            with socket.create_connection(hp, timeout=min(2.0, max(0.1, timeout_s))):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise ConnectionError(f"cannot reach the Ray cluster at {address!r} within "
                                  f"{timeout_s:g} s (last error: {last}); is `ray start --head` "
                                  f"running there, and is rollout.ray_address its GCS "
                                  f"address?")
        time.sleep(0.25)


def _check_token(address: str) -> None:
    """A ConnectionError now if the cluster at ``address`` refuses this process's token (or its
    lack of one): ``ray.init`` would retry for minutes. Any other failure of this one GCS query
    is left to ``ray.init`` to report."""
    from .ray_wait import alive_node_ips, refused
    try:
        alive_node_ips(address)
    except Exception as e:
        if not refused(e):
            return
        mode = os.environ.get("RAY_AUTH_MODE", "unset")
        token = "set" if os.environ.get("RAY_AUTH_TOKEN") else "unset"
        raise ConnectionError(
            f"the Ray cluster at {address!r} refused this process's authentication token "
            f"(RAY_AUTH_MODE={mode}, RAY_AUTH_TOKEN {token}): "
            f"run the driver with the cluster's RAY_AUTH_MODE=token and RAY_AUTH_TOKEN "
            f"(`hacpo launch` gives its driver both)") from None


def weight_bytes(policies) -> int:
    """The bytes of every policy's parameters (the driver's copies: what a weight sync puts
    into the object store)."""
    return sum(p.numel() * p.element_size() for pol in policies for p in pol.parameters())


_CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max",                      # cgroup v2
                         "/sys/fs/cgroup/memory/memory.limit_in_bytes")     # cgroup v1


def _machine_memory() -> int:
    """This machine's memory, or this process's cgroup limit where lower (a container, a
    Slurm job's allocation)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_MEMORY_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():            # v2 "max" / v1's huge number: no lower limit
            memory = min(memory, int(text))
    return memory


def private_object_store_bytes(weights: int, memory: int | None = None) -> int:
    """A private cluster's object store for a run whose agents' parameters take ``weights``
    bytes: room for them four times over (the Ray pool's pickled policies kept for actor
    restarts, the synced weights a restarted engine reloads, the next sync's, a trainer's
    weights on their way to the driver), at least 256 MiB, at most 30% of ``memory``
    (default: this machine's, or its cgroup limit where lower; Ray's own default share). Past
    that cap the weight syncs spill to disk, which is logged as a warning when the cluster
    starts."""
    memory = _machine_memory() if memory is None else memory
    return int(min(max(_OBJECT_STORE_MIN, _OBJECT_STORE_COPIES * weights),
                   _OBJECT_STORE_MEMORY_FRACTION * memory))


def connect(address: str = "", *, num_cpus: int | None = None,
            timeout_s: float = 60.0, weights: int = 0) -> RayCluster:
    """Connect this process to Ray (:func:`_connect`), keeping this process's Python SIGTERM
    handler: ``ray.init`` installs its own fatal-signal handler, which aborts the driver on
    SIGTERM (exit 134) instead of letting ``hacpo``'s handler unwind the run (closing reward
    workers, engines and the cluster). A SIGTERM that arrives while ``ray.init`` runs meets
    the handler ``ray.init`` sets first (``sys.exit(15)``: exit status 15, no message): that
    exit is handed to this process's own handler (``hacpo``'s: exit 143 with its line).
    What else ``ray.init`` changes in the process (:class:`ProcessChanges`) is put back by
    :meth:`RayCluster.shutdown`."""
    import threading
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    env, excepthook = dict(os.environ), sys.excepthook
    try:
        try:
            cluster = _connect(address, num_cpus=num_cpus, timeout_s=timeout_s,
                               weights=weights)
        except BaseException:       # a ray.init that failed (or was stopped): its changes too
            ProcessChanges.since(env, excepthook).undo()
            raise
        if cluster.connected_here:
            cluster.changes = ProcessChanges.since(env, excepthook)
        return cluster
    except SystemExit as e:
        if e.code == signal.SIGTERM and callable(handler):
            handler(signal.SIGTERM, None)       # raises hacpo's SystemExit(143)
        raise
    finally:
        if handler is not None:   # SIG_DFL / SIG_IGN too: ray.init's handler must not stay
            signal.signal(signal.SIGTERM, handler)


def _connect(address: str = "", *, num_cpus: int | None = None,
             timeout_s: float = 60.0, weights: int = 0) -> RayCluster:
    """Connect this process to Ray.

    Args:
        address: "" starts a private local cluster; "host:port" (GCS address) or "auto" joins
            a running one.
        num_cpus: logical CPUs of a private cluster (default ``os.cpu_count()``); ignored when
            joining.
        timeout_s: how long to wait for a cluster to be reachable before a clear error.
        weights: bytes of the run's agents' weights (:func:`weight_bytes`): a private
            cluster's object store is sized for them (:func:`private_object_store_bytes`);
            ignored when joining (``ray start --object-store-memory``, the launchers'
            ``--object-store-mb``).
    """
    import ray

    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        # the cluster may report another address for itself (its node IP) than the one this
        # process joined it by (e.g. 127.0.0.1): either names it
        if address and address != "auto" and address not in (current, _joined.get(current)):
            raise RuntimeError(f"this process is already connected to the Ray cluster at "
                               f"{current!r}; cannot also join rollout.ray_address={address!r}")
        return RayCluster(current, owned=False, connected_here=False)
    if not address:
        from ray._private import ray_constants
        if ray_constants.ENABLE_RAY_CLUSTER and os.environ.get(
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0":
            raise RuntimeError(
                "ray was imported before hacpo.launch.ray_cluster with "
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER unset, so a private cluster would bind to "
                "this machine's network address instead of loopback; import "
                "hacpo.launch.ray_cluster first or set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0")
        store = private_object_store_bytes(weights)
        if _OBJECT_STORE_COPIES * weights > store:
            log.warning("the agents' weights (%.0f MiB) need a %.0f MiB object store for "
                        "weight syncs without spilling; a private cluster gets at most %.0f "
                        "MiB (30%% of this machine's memory), so syncs will spill to disk",
                        weights / 2**20, _OBJECT_STORE_COPIES * weights / 2**20,
                        store / 2**20)
        temp_dir = new_temp_dir()     # short: Ray's socket paths live here
        try:
            # Ctrl-C held until ray.init returns (seconds): interrupted after it made the
            # driver's core worker but before it counts as connected, that core worker is left
            # running, ray.shutdown no longer stops it, and the process dies with SIGSEGV at
            # exit (Ray's metrics thread against its exit handlers)
            from hacpo.engine.signals import signals_deferred
            with signals_deferred(signal.SIGINT):
                ctx = ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1,
                               include_dashboard=False, _node_ip_address="127.0.0.1",
                               _temp_dir=temp_dir, object_store_memory=store,
                               log_to_driver=True, configure_logging=False)
            log.info("started a private Ray cluster at %s (temp dir %s, object store %.0f "
                     "MiB)", ctx.address_info["address"], temp_dir, store / 2**20)
            return RayCluster(ctx.address_info["address"], owned=True, connected_here=True,
                              temp_dir=temp_dir)
        except BaseException:    # Ctrl-C / SIGTERM while Ray starts too: no cluster, no dir
            _stop_half_started()
            remove_temp_dir(temp_dir)
            raise
    if address != "auto":
        from hacpo.engine.errors import user_errors
        with user_errors(ConnectionError, ValueError):   # the address, the token: the user's
            wait_reachable(address, timeout_s)
            _check_token(address)
    try:
        ctx = ray.init(address=address, log_to_driver=True, configure_logging=False)
    except (ConnectionError, TimeoutError) as e:
        raise ConnectionError(f"cannot connect to the Ray cluster at {address!r}: {e}") from e
    _joined[ray.get_runtime_context().gcs_address] = address
    log.info("joined the Ray cluster at %s", ctx.address_info["address"])
    return RayCluster(ctx.address_info["address"], owned=False, connected_here=True)
