"""A private Ray cluster's object store is sized for the run's weights: a weight sync keeps
the last synced copy (a restarted engine reloads it) while the next one is put, so a fixed
small store would spill every sync of a larger model to disk."""
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
    assert private_object_store_bytes(200 * MiB, big) == 600 * MiB        # 3x the weights
    assert private_object_store_bytes(20 * 1024 * MiB, big) == int(0.3 * big)   # the cap
    assert private_object_store_bytes(0) >= 256 * MiB                     # this machine


def test_weight_bytes_counts_every_policys_parameters():
    a = torch.nn.Linear(10, 3)                                           # 33 fp32
    b = torch.nn.Embedding(7, 4).to(torch.bfloat16)                      # 28 bf16
    assert weight_bytes([a, b]) == 33 * 4 + 28 * 2


@pytest.mark.skipif(ray.is_initialized(), reason="needs to start its own private cluster")
def test_private_cluster_gets_the_sized_store(caplog, monkeypatch):
    for memory, weights, want, warned in ((None, 200 * MiB, 600 * MiB, False),
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
