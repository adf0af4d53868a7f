"""A private Ray cluster's object store is sized for the run's weights: a weight sync keeps
the last synced copy (a restarted engine reloads it) while the next one is put, so a fixed
small store would spill every sync of a larger model to disk. The cap follows this process's
cgroup memory limit where it is below the machine's memory."""
import os

import pytest
import torch

from hacpo.launch import ray_cluster  # first: its environment must precede `import ray`
from hacpo.launch.ray_cluster import private_object_store_bytes, weight_bytes

import ray

MiB = 2 ** 20


def test_store_size_rule():
    big = 64 * 1024 * MiB
    assert private_object_store_bytes(0, big) == 256 * MiB                # the floor
    assert private_object_store_bytes(10 * MiB, big) == 256 * MiB
    assert private_object_store_bytes(200 * MiB, big) == 800 * MiB        # 4x the weights
    assert private_object_store_bytes(20 * 1024 * MiB, big) == int(0.3 * big)   # the cap
    assert private_object_store_bytes(0) >= 256 * MiB                     # this machine


def test_weight_bytes_counts_every_policys_parameters():
    a = torch.nn.Linear(10, 3)                                           # 33 fp32
    b = torch.nn.Embedding(7, 4).to(torch.bfloat16)                      # 28 bf16
    assert weight_bytes([a, b]) == 33 * 4 + 28 * 2


@pytest.mark.skipif(ray.is_initialized(), reason="needs to start its own private cluster")
def test_private_cluster_gets_the_sized_store(caplog, monkeypatch):
    for memory, weights, want, warned in ((None, 150 * MiB, 600 * MiB, False),
                                          (2048 * MiB, 300 * MiB, int(0.3 * 2048 * MiB), True)):
        if memory is not None:          # a small machine: capped, and the run is told
            monkeypatch.setattr(ray_cluster, "_machine_memory", lambda: memory)
        caplog.clear()
        with caplog.at_level("WARNING", logger="hacpo"):
            c = ray_cluster.connect("", num_cpus=1, weights=weights)
        try:
            assert c.owned
            got = ray.cluster_resources()["object_store_memory"]
            assert abs(got - want) < 2 * MiB, (got / MiB, want / MiB)
        finally:
            c.shutdown()
        assert not ray.is_initialized() and not os.path.exists(c.temp_dir)
        assert ("syncs will spill to disk" in caplog.text) == warned, caplog.text


def test_memory_cap_follows_the_cgroup_limit(tmp_path, monkeypatch):
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    monkeypatch.setattr(ray_cluster, "_CGROUP_MEMORY_LIMITS", (str(v2), str(v1)))
    physical = ray_cluster._machine_memory()          # neither file exists: the machine's
    v2.write_text("max\n")                           # v2 without a limit
    v1.write_text(str(2 ** 62) + "\n")               # v1's "no limit" number
    assert ray_cluster._machine_memory() == physical
    v2.write_text(str(1024 * MiB) + "\n")            # a 1 GiB container / job
    assert ray_cluster._machine_memory() == 1024 * MiB
    assert private_object_store_bytes(10 * 1024 * MiB) == int(0.3 * 1024 * MiB)
