"""ray_wait's cluster wait without a cluster (a mutation audit's tests): the module's clock,
its GCS port probe and its node query are in-process stand-ins, so every wait is decided in
milliseconds and its messages are exact. Checked: the seconds returned and a GCS that is not
answering yet retried, the timeout naming the nodes missing and how long it waited, the head's
timeout with its log tail, a node whose ``ray start`` exits after the head is up, the pid check
where /proc or the process is out of reach, the command's exit status and messages, and the
query keeping only alive nodes. (tests/launch/test_slurm.py and test_ray_cluster_units.py wait
on real sockets and processes.)"""
import subprocess

import pytest

from hacpo.launch import ray_wait  # first: its environment must precede `import ray`
from hacpo.launch.ray_wait import ClusterTimeout, Node, wait_for_cluster

ADDR = "10.0.0.1:6379"
T0 = 1000.0


class _Clock:
    """ray_wait's ``time``: ``sleep`` advances it, nothing else does."""

    def __init__(self):
        self.now = T0

    def time(self):
        return self.now

    def sleep(self, s):
        self.now += s


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(ray_wait, "time", c)
    return c


def _gcs(monkeypatch, *answers, port_open=True):
    """The GCS port ``port_open``; ``alive_node_ips`` gives ``answers`` in turn (an exception
    is raised), the last one repeated. Returns the addresses it was asked."""
    asked = []

    def alive(address, timeout_s=5.0):
        asked.append(address)
        a = answers[min(len(asked), len(answers)) - 1]
        if isinstance(a, BaseException):
            raise a
        return list(a)
    monkeypatch.setattr(ray_wait, "alive_node_ips", alive)
    monkeypatch.setattr(ray_wait, "_port_open", lambda host, port: port_open)
    return asked


def _log(n_max=4):
    """A ``log`` for the wait that fails the test past ``n_max`` lines (a wait that logs
    without retrying never ends: the stand-in clock advances only in its sleeps)."""
    lines = []

    def log(line):
        lines.append(line)
        assert len(lines) <= n_max, lines
    return lines, log


def _log_file(tmp_path, name="ray.log", n=20):
    path = tmp_path / name
    path.write_text("".join(f"line {i}\n" for i in range(n)))
    return str(path)


def test_wait_retries_a_gcs_not_answering_and_returns_the_seconds_waited(clock, monkeypatch):
    """The GCS not answering yet, then only the head registered, then both: the wait logs
    the first, retries after each poll and returns once every node is there, the seconds it
    waited (two polls)."""
    asked = _gcs(monkeypatch, ConnectionError("starting"), ["10.0.0.1"],
                 ["10.0.0.2", "10.0.0.1"])
    lines, log = _log()
    took = wait_for_cluster(ADDR, [Node("h", "10.0.0.1"), Node("w", "10.0.0.2")], T0 + 30,
                            log=log)
    assert took == 2.0 and asked == [ADDR] * 3
    assert lines == [f"[ray_wait] GCS at {ADDR} not answering yet (ConnectionError)"]


def test_timeout_names_the_nodes_missing_and_how_long_it_waited(clock, monkeypatch):
    """Only the head ever registers: at the deadline the error counts the nodes registered
    and names each missing one with its IP (or "any IP")."""
    _gcs(monkeypatch, ["10.0.0.1"])
    nodes = [Node("h", "10.0.0.1"), Node("w", "10.0.0.2"), Node("x", None)]
    with pytest.raises(ClusterTimeout) as e:
        wait_for_cluster(ADDR, nodes, T0 + 10, log=_log()[1])
    assert str(e.value) == (f"Ray cluster at {ADDR} not complete in time (waited 10s, to the "
                            f"launch deadline): 1 of 3 nodes registered; missing: w (10.0.0.2), "
                            f"x (any IP)")


def test_head_timeout_names_how_long_it_waited_and_the_heads_log(clock, monkeypatch, tmp_path):
    """Nothing ever listens on the GCS port: the error names the head, the seconds waited
    and the last 15 lines of the head's log."""
    _gcs(monkeypatch, [], port_open=False)
    log = _log_file(tmp_path)
    with pytest.raises(ClusterTimeout) as e:
        wait_for_cluster(ADDR, [Node("n1", "10.0.0.1", None, log)], T0 + 5, log=_log()[1])
    tail = "\n".join(f"    | line {i}" for i in range(5, 20))
    assert str(e.value) == (f"Ray head on node n1 did not come up in time (waited 5s, to the "
                            f"launch deadline): nothing listening on {ADDR}; last lines of "
                            f"{log}:\n{tail}")


def test_a_node_whose_ray_start_exits_after_the_head_is_up_ends_the_wait(clock, monkeypatch,
                                                                        tmp_path):
    """The head's GCS answers (itself only) while a worker's ``ray start`` (no fixed IP, as
    `hacpo launch local` starts them) has exited: the wait ends at once, long before the
    deadline, naming the node, its pid and its log's last lines."""
    _gcs(monkeypatch, ["10.0.0.1"])
    p = subprocess.Popen(["true"])
    p.wait()
    log = _log_file(tmp_path, "ray-worker1.log", n=2)
    nodes = [Node("head", None), Node("worker1", None, p.pid, log)]
    with pytest.raises(ClusterTimeout) as e:
        wait_for_cluster(ADDR, nodes, T0 + 300, log=_log()[1])
    assert str(e.value) == (f"Ray worker on node worker1 exited before the cluster was up "
                            f"(pid {p.pid}); last lines of {log}:\n    | line 0\n    | line 1")
    assert clock.now < T0 + 300


def test_pid_out_of_reach_counts_as_alive(monkeypatch):
    """A pid this process may not signal (another user's), or a /proc that cannot be read
    (macOS): the process runs, as far as the wait can tell; it is not reported exited."""
    def denied(pid, sig):
        raise PermissionError(pid)
    with monkeypatch.context() as m:
        m.setattr(ray_wait.os, "kill", denied)
        assert ray_wait._pid_alive(12345)

    def no_proc(*a, **kw):
        raise FileNotFoundError(a[0])
    monkeypatch.setattr(ray_wait, "open", no_proc, raising=False)
    assert ray_wait._pid_alive(ray_wait.os.getpid())


def test_command_exit_status_and_messages(clock, monkeypatch, capsys):
    """``python -m hacpo.launch.ray_wait`` (what the sbatch script runs): once the cluster is
    up, exit 0 and a line naming the phase, the node count, the address and the wait; at the
    deadline, exit 3 and the error on stderr, labelled with the phase."""
    _gcs(monkeypatch, ["10.0.0.1"], ["10.0.0.1", "10.0.0.1"])
    argv = ["--address", ADDR, "--node", "h=10.0.0.1", "--node", "w=10.0.0.1", "--deadline",
            str(T0 + 3), "--phase", "ray cluster"]
    assert ray_wait.main(argv) == 0
    out, err = capsys.readouterr()
    assert out == f"[hacpo launch] ray cluster: 2 node(s) up at {ADDR} after waiting 1.0s\n"
    assert err == ""
    _gcs(monkeypatch, [])
    assert ray_wait.main(argv[:4] + ["--deadline", str(clock.now + 3), "--phase", "ray head"]) == 3
    out, err = capsys.readouterr()
    assert "ERROR" not in out
    assert err == (f"[hacpo launch] ERROR (ray head): Ray cluster at {ADDR} not complete in "
                   f"time (waited 3s, to the launch deadline): 0 of 1 nodes registered; "
                   f"missing: h (10.0.0.1)\n")


def test_alive_node_ips_keeps_the_alive_nodes_only(monkeypatch):
    """The GCS also lists nodes that died (a worker that stopped): they are not counted."""
    import ray._raylet
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    class Gcs:
        def __init__(self, address):
            assert address == ADDR

        def get_all_node_info(self, timeout):
            assert timeout == 2.5
            return {i: GcsNodeInfo(node_manager_address=ip, state=state) for i, (ip, state)
                    in enumerate([("10.0.0.1", GcsNodeInfo.ALIVE), ("10.0.0.2", GcsNodeInfo.DEAD),
                                  ("10.0.0.3", GcsNodeInfo.ALIVE)])}
    monkeypatch.setattr(ray._raylet, "GcsClient", Gcs)
    assert ray_wait.alive_node_ips(ADDR, timeout_s=2.5) == ["10.0.0.1", "10.0.0.3"]
