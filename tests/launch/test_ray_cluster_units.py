"""ray_cluster's and ray_wait's contracts, each checked directly (the pool and trainer tests
reach them only through whole runs): require / reserve / wait_started name what is missing and
leave nothing reserved; shutdown leaves a reused connection alone; address parsing; the
cluster wait names a refused token at once and counts node multiplicity."""
import argparse
import os
import socket
import subprocess
import time

import pytest

from hacpo.launch import ray_cluster, ray_wait  # first: its environment must precede `import ray`
from hacpo.launch.ray_cluster import RayCluster, _host_port, call_deadline, wait_reachable
from hacpo.launch.ray_wait import (ClusterRefused, Node, _parse_node, _pid_alive, _unmatched,
                                   log_tail, wait_for_cluster)

import ray


# --------------------------------------------------------------------------------------------
# no cluster needed
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("address, want", [
    ("10.0.0.1:6379", ("10.0.0.1", 6379)), ("[::1]:6380", ("::1", 6380)),
    ("head:1", ("head", 1)), ("10.0.0.1", None), (":6379", None), ("10.0.0.1:", None),
    ("10.0.0.1:63x9", None), ("ray://h:10001", None), ("a/b:1", None)])
def test_host_port_accepts_only_host_colon_number(address, want):
    assert _host_port(address) == want


def test_wait_reachable_names_a_bad_address_and_an_unreachable_one():
    with pytest.raises(ValueError, match=r"rollout.ray_address '10.0.0.1:63x9' is not host:port"):
        wait_reachable("10.0.0.1:63x9", 1.0)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                   # nothing listens there now
    with pytest.raises(ConnectionError, match=rf"cannot reach the Ray cluster at "
                                              rf"'127.0.0.1:{port}' within 0.3 s"):
        wait_reachable(f"127.0.0.1:{port}", 0.3)


def test_call_deadline_zero_and_infinite_mean_no_limit():
    assert call_deadline(0) is None and call_deadline(float("inf")) is None
    t = time.monotonic()
    d = call_deadline(5.0)
    assert t + 5.0 <= d <= time.monotonic() + 5.0


def test_parse_node_spec():
    assert _parse_node("n1=10.0.0.1") == Node("n1", "10.0.0.1")
    assert _parse_node("n2=10.0.0.2:123") == Node("n2", "10.0.0.2", 123)
    assert _parse_node("n3=10.0.0.3:45:/tmp/a:b.log") == Node("n3", "10.0.0.3", 45, "/tmp/a:b.log")
    assert _parse_node("n4=10.0.0.4::/tmp/x.log") == Node("n4", "10.0.0.4", None, "/tmp/x.log")
    with pytest.raises(argparse.ArgumentTypeError, match=r"--node wants NAME=IP\[:PID\[:LOG\]\], got 'n5'"):
        _parse_node("n5")


def test_unmatched_counts_multiplicity_and_any_ip_nodes():
    nodes = [Node("h", "10.0.0.1"), Node("a", "10.0.0.1"), Node("b", None)]
    assert [n.name for n in _unmatched(nodes, ["10.0.0.1"])] == ["a", "b"]
    assert [n.name for n in _unmatched(nodes, ["10.0.0.1", "10.0.0.1"])] == ["b"]
    assert [n.name for n in _unmatched(nodes, ["10.0.0.1", "10.0.0.1", "x"])] == []
    assert [n.name for n in _unmatched([Node("b", None), Node("c", None)], ["x"])] == ["c"]


def test_a_refused_token_ends_the_wait_at_once(monkeypatch):
    """Waiting cannot help a token the GCS refuses: ClusterRefused on the first answer, long
    before the deadline (30 s away: a missed refusal ends as a plain ClusterTimeout)."""
    from ray.exceptions import AuthenticationError

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]

    def refuse(address, timeout_s=5.0):
        raise AuthenticationError("token mismatch")

    monkeypatch.setattr(ray_wait, "alive_node_ips", refuse)
    try:
        with pytest.raises(ClusterRefused, match=rf"the Ray cluster at 127.0.0.1:{port} refused "
                                                 rf"this process's authentication token"):
            wait_for_cluster(f"127.0.0.1:{port}", [Node("n1", "127.0.0.1")],
                             time.time() + 30, poll_s=0.05, log=lambda *_: None)
    finally:
        srv.close()


def test_sweep_leaves_this_process_own_cluster_dir(tmp_path):
    """Probing a lock this process holds would succeed (POSIX locks are per process) and
    closing the probe would drop the lock: the sweep must skip its own dirs, however old."""
    d = tmp_path / (ray_cluster.TEMP_PREFIX + "mine")
    d.mkdir()
    ray_cluster._hold_owner_lock(str(d))
    try:
        assert str(d) in ray_cluster._owner_fds
        old = time.time() - 10 * ray_cluster.STALE_AFTER_S
        os.utime(d / ray_cluster.OWNER_LOCK, (old, old))
        assert ray_cluster.sweep_dead_temp_dirs(str(tmp_path)) == []
        assert d.is_dir()
    finally:
        ray_cluster._release_owner_lock(str(d))
    assert ray_cluster.sweep_dead_temp_dirs(str(tmp_path)) == [str(d)]   # released: swept


def test_an_exited_unreaped_child_counts_as_exited():
    """A ``ray start`` child that exited but was not waited for is a zombie: os.kill(pid, 0)
    still succeeds, yet the node is gone."""
    p = subprocess.Popen(["sleep", "30"])
    try:
        assert _pid_alive(p.pid)
        p.kill()
        end = time.monotonic() + 30
        while time.monotonic() < end:               # until the kernel marks it a zombie
            with open(f"/proc/{p.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.02)
        assert not _pid_alive(p.pid)
    finally:
        p.kill()
        p.wait()


def test_log_tail_shows_the_last_lines(tmp_path):
    log = tmp_path / "ray.log"
    log.write_text("".join(f"line {i}\n" for i in range(20)))
    assert log_tail(str(log), n=3) == "    | line 17\n    | line 18\n    | line 19"
    (tmp_path / "empty.log").write_text("")
    assert log_tail(str(tmp_path / "empty.log")) == "    (empty so far)"
    assert log_tail(str(tmp_path / "missing.log")).startswith(
        f"    (log {tmp_path / 'missing.log'} unreadable: ")
    assert log_tail(None) == ""


# --------------------------------------------------------------------------------------------
# against a private cluster (4 logical CPUs, no GPU)
# --------------------------------------------------------------------------------------------
@ray.remote(num_cpus=0)
class _Starter:
    def __init__(self, fail: bool):
        if fail:
            raise RuntimeError("boom in __init__")

    def ready(self, delay: float = 0.0) -> int:
        time.sleep(delay)
        return 7


def _free_cpus_within(want: float, seconds: float = 10.0) -> float:
    end = time.monotonic() + seconds
    while True:
        free = ray.available_resources().get("CPU", 0)
        if free == want or time.monotonic() > end:
            return free
        time.sleep(0.1)


def test_require_names_what_is_missing(cluster):
    cluster.require("CPU", 4, what="x needs 4 CPUs", hint="h")      # exactly enough: fine
    with pytest.raises(RuntimeError, match=rf"^x needs 5 CPUs but the Ray cluster at "
                                           rf"{cluster.address} has 4; add CPUs$"):
        cluster.require("CPU", 5, what="x needs 5 CPUs", hint="add CPUs")
    with pytest.raises(RuntimeError, match=r"y needs 1 GPU but the Ray cluster at .* has 0; "):
        cluster.require("GPU", 1, what="y needs 1 GPU", hint="h")


def test_reserve_that_cannot_be_granted_is_removed_and_named(cluster):
    """A group not granted in time names what asked, the free CPUs and the hint, and is
    removed: it must not be granted later, behind the caller's back, once CPUs free up."""
    from ray.util.placement_group import remove_placement_group
    with pytest.raises(RuntimeError, match=rf"the pool's 2 bundles was not granted within "
                                           rf"0.5 s \(the Ray cluster at {cluster.address} has "
                                           rf"4 free CPUs of 4\); try fewer"):
        cluster.reserve([{"CPU": 3}, {"CPU": 3}], what="the pool's 2 bundles", hint="try fewer",
                        timeout_s=0.5)
    everything = cluster.reserve([{"CPU": 4}], what="all", hint="", timeout_s=60)
    assert _free_cpus_within(0) == 0
    with pytest.raises(RuntimeError, match=r"one more was not granted within 0.5 s \(.* has "
                                           r"0 free CPUs of 4\); h$"):
        cluster.reserve([{"CPU": 1}], what="one more", hint="h", timeout_s=0.5)
    remove_placement_group(everything)
    assert _free_cpus_within(4) == 4          # the timed-out group did not take one
    states = {t["state"] for t in ray.util.placement_group_table().values()}
    assert states == {"REMOVED"}


def test_reserve_short_of_gpus_names_the_free_gpus(cluster):
    """Bundles that ask for GPUs (megatron ranks on cuda) name the free GPUs too: the free
    CPUs alone pointed at the wrong resource."""
    with pytest.raises(RuntimeError, match=rf"^2 ranks was not granted within 0.5 s \(the Ray "
                                           rf"cluster at {cluster.address} has 4 free CPUs of 4 "
                                           rf"and 0 free GPUs of 0\); h$"):
        cluster.reserve([{"CPU": 1, "GPU": 1}, {"CPU": 1}], what="2 ranks", hint="h",
                        timeout_s=0.5)
    assert _free_cpus_within(4) == 4


def test_wait_started_names_a_dead_or_slow_actor(cluster):
    ok = _Starter.remote(False)
    assert RayCluster.wait_started(ok.ready.remote(), what="ok", timeout_s=60) == 7
    dead = _Starter.remote(True)
    with pytest.raises(RuntimeError, match=r"(?s)rollout actor a0 did not start within 60 s: .*"
                                           r"boom in __init__"):
        RayCluster.wait_started(dead.ready.remote(), what="rollout actor a0", timeout_s=60)
    with pytest.raises(RuntimeError, match=r"trainer t1 did not start within 0.3 s"):
        RayCluster.wait_started(ok.ready.remote(30), what="trainer t1", timeout_s=0.3)
    RayCluster.release([ok, dead, ok], [])      # twice / already dead: fine


def test_a_reused_connection_is_left_alone(cluster, monkeypatch):
    again = ray_cluster.connect("")
    assert (again.owned, again.connected_here) == (False, False)
    again.shutdown()
    again.shutdown()
    assert ray.is_initialized()
    RayCluster(cluster.address, owned=True, connected_here=False,
               temp_dir=cluster.temp_dir).shutdown()
    assert ray.is_initialized()
    assert os.path.isdir(cluster.temp_dir)
    # the address this process joined by names the cluster too (it may report another)
    monkeypatch.setitem(ray_cluster._joined, ray.get_runtime_context().gcs_address,
                        "head.example:6379")
    assert ray_cluster.connect("head.example:6379").connected_here is False
    assert ray_cluster.connect(cluster.address).owned is False
    with pytest.raises(RuntimeError, match=r"already connected to the Ray cluster at .*; cannot "
                                           r"also join rollout.ray_address='10.9.9.9:1'"):
        ray_cluster.connect("10.9.9.9:1")
