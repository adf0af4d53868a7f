"""Wait until a Ray cluster has every expected node, with a deadline, for the launchers.

Used by the sbatch script (``python -m hacpo.launch.ray_wait ...``) and by ``hacpo launch
local``. On failure the message names what did not come up: the head (its GCS port never
opened), a node whose ``ray start`` process exited (with the tail of its log), or the nodes
missing when the deadline passed.

The node list comes from the GCS directly (``GcsClient.get_all_node_info``, ray 2.60): it
answers in milliseconds and names each node's IP, which ``ray status`` (several seconds per
call here, no IPs) does not. Connecting to a GCS that is not (or no longer) serving blocks for
~40 s inside Ray, so each query runs in a background thread: the wait keeps watching the
``ray start`` processes and the deadline meanwhile.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field


# Ray makes its AF_UNIX sockets inside a cluster's temp dir, the longest path (measured, Ray
# 2.60) <temp dir>/session_<YYYY-mm-dd_HH-MM-SS_micros>_<pid>/sockets/plasma_store, and refuses
# one over the AF_UNIX limit only as its processes start (a traceback after the warm-up).
# RAY_SOCKET_TAIL is that tail with a 7-digit pid (Linux's largest) and 2 spare bytes (".N": a
# socket name Ray found taken). Here (no side effects on import) for the sbatch script too.
LINUX_AF_UNIX_PATH_MAX = 107     # bytes: sun_path's 108, less the NUL (macOS: 104)
RAY_SOCKET_TAIL = len("/session_2026-01-31_12-00-00_000000_4194304/sockets/plasma_store") + 2


class ClusterTimeout(RuntimeError):
    """The cluster did not reach the expected nodes before the deadline."""


class ClusterRefused(ClusterTimeout):
    """The head's GCS refused this process's token (or its lack of one): waiting longer cannot
    help. A :class:`ClusterTimeout` so that the launchers report it the same way."""


def refused(error: BaseException) -> bool:
    """True for Ray's error for a token the cluster does not accept (or a missing one)."""
    try:
        from ray.exceptions import AuthenticationError
    except ImportError:     # a ray without token authentication
        return False
    return isinstance(error, AuthenticationError)


@dataclass
class Node:
    """One node the cluster must contain: a name for messages, the IP its raylet registers
    with (None: any IP; Ray registers a node started on 127.0.0.1 under the host's external
    IP), and optionally the pid of the local process that runs its ``ray start --block`` (the
    ``srun`` step, or the process itself) and that process's log."""
    name: str
    ip: str | None
    pid: int | None = None
    log: str | None = None
    exited: bool = field(default=False, repr=False)


def _port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie child counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def log_tail(path: str | None, n: int = 15) -> str:
    if not path:
        return ""
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()[-n:]
    except OSError as e:
        return f"    (log {path} unreadable: {e})"
    if not lines:
        return "    (empty so far)"
    return "".join("    | " + ln for ln in lines).rstrip("\n")


def _exited_message(node: Node, what: str) -> str:
    where = f"{node.name} ({node.ip})" if node.ip else node.name
    msg = f"Ray {what} on node {where} exited before the cluster was up (pid {node.pid})"
    if node.log:
        msg += f"; last lines of {node.log}:\n{log_tail(node.log)}"
    return msg


def alive_node_ips(address: str, timeout_s: float = 5.0) -> list[str]:
    """IPs of the alive nodes registered with the GCS at ``address`` (one entry per node)."""
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo
    info = GcsClient(address=address).get_all_node_info(timeout=timeout_s)
    return [n.node_manager_address for n in info.values() if n.state == GcsNodeInfo.ALIVE]


class _Query:
    """One :func:`alive_node_ips` call in a daemon thread (it may block for ~40 s)."""

    def __init__(self, address: str):
        self.done = threading.Event()
        self.ips: list[str] = []
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(address,), daemon=True).start()

    def _run(self, address: str) -> None:
        try:
            self.ips = alive_node_ips(address)
        except Exception as e:
            self.error = e
        finally:
            self.done.set()


def wait_for_cluster(address: str, nodes: list[Node], deadline: float, *, poll_s: float = 1.0,
                     log=print) -> float:
    """Block until every node in ``nodes`` is registered and alive in the cluster at
    ``address`` (``host:port`` of the head's GCS), or raise :class:`ClusterTimeout`.

    ``deadline`` is an absolute ``time.time()``. Nodes are matched by IP and multiplicity
    (several may share one IP); nodes with ``ip=None`` match any IP left over. ``nodes[0]`` is
    the head.
    Returns the seconds spent waiting."""
    t0 = time.time()
    host, port = address.rsplit(":", 1)
    head = nodes[0]

    def check_processes(what):
        for n in nodes:
            if n.pid is not None and not n.exited and not _pid_alive(n.pid):
                n.exited = True
                raise ClusterTimeout(_exited_message(n, what if n is head else "worker"))

    # 1. the head's GCS port accepts connections
    while not _port_open(host, int(port)):
        check_processes("head")
        if time.time() >= deadline:
            raise ClusterTimeout(
                f"Ray head on node {head.name} did not come up in time (waited "
                f"{time.time() - t0:.0f}s, to the launch deadline): nothing listening on "
                f"{address}"
                + (f"; last lines of {head.log}:\n{log_tail(head.log)}" if head.log else ""))
        time.sleep(poll_s)
    # 2. every node registered
    have: list[str] = []
    query: _Query | None = None
    while True:
        check_processes("head")
        if query is None:
            query = _Query(address)
        if query.done.wait(poll_s):
            if query.error is not None and refused(query.error):
                raise ClusterRefused(
                    f"the Ray cluster at {address} refused this process's authentication "
                    f"token ({query.error}); the launch's nodes and its cluster queries must "
                    f"share RAY_AUTH_MODE=token and one RAY_AUTH_TOKEN")
            if query.error is not None:   # GCS still starting: retried until the deadline
                log(f"[ray_wait] GCS at {address} not answering yet "
                    f"({type(query.error).__name__})")
            else:
                have = query.ips
                if not _unmatched(nodes, have):
                    return time.time() - t0
            query = None
        if time.time() >= deadline:
            names = ", ".join(f"{n.name} ({n.ip or 'any IP'})" for n in _unmatched(nodes, have))
            raise ClusterTimeout(
                f"Ray cluster at {address} not complete in time (waited "
                f"{time.time() - t0:.0f}s, to the launch deadline): {len(have)} of "
                f"{len(nodes)} nodes registered; missing: {names}")
        if query is None:
            time.sleep(poll_s)


def _unmatched(nodes: list[Node], have: list[str]) -> list[Node]:
    """The expected nodes not accounted for by the registered node IPs ``have``, in order:
    fixed IPs first take their matches, then ``ip=None`` nodes take any leftover."""
    left = list(have)
    missing = set()
    for i, n in enumerate(nodes):
        if n.ip is not None:
            if n.ip in left:
                left.remove(n.ip)
            else:
                missing.add(i)
    for i, n in enumerate(nodes):
        if n.ip is None:
            if left:
                left.pop()
            else:
                missing.add(i)
    return [n for i, n in enumerate(nodes) if i in missing]


def _parse_node(spec: str) -> Node:
    """``NAME=IP[:PID[:LOG]]``"""
    try:
        name, rest = spec.split("=", 1)
        parts = rest.split(":", 2)
        return Node(name, parts[0], int(parts[1]) if len(parts) > 1 and parts[1] else None,
                    parts[2] if len(parts) > 2 else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--node wants NAME=IP[:PID[:LOG]], got {spec!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hacpo.launch.ray_wait",
                                 description="wait until a Ray cluster has all expected nodes")
    ap.add_argument("--address", required=True, help="HEAD_IP:PORT of the head's GCS")
    ap.add_argument("--node", action="append", type=_parse_node, required=True,
                    help="NAME=IP[:PID[:LOG]], the head first; repeat per node")
    ap.add_argument("--deadline", type=float, required=True,
                    help="absolute UNIX time by which the cluster must be complete")
    ap.add_argument("--phase", default="cluster", help="label for messages")
    args = ap.parse_args(argv)
    try:
        took = wait_for_cluster(args.address, args.node, args.deadline)
    except ClusterTimeout as e:
        print(f"[hacpo launch] ERROR ({args.phase}): {e}", file=sys.stderr, flush=True)
        return 3
    print(f"[hacpo launch] {args.phase}: {len(args.node)} node(s) up at {args.address} "
          f"after waiting {took:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
