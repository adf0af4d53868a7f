"""The launch tests' shared Ray fixture: one private local cluster per test module."""
import os

import pytest

from hacpo.launch import ray_cluster  # first: its environment must precede `import ray`

import ray


@pytest.fixture(scope="module")
def cluster():
    """A private cluster (loopback, own temp dir, 4 logical CPUs), gone after the module."""
    c = ray_cluster.connect("", num_cpus=4)
    try:
        assert c.owned and c.address.startswith("127.0.0.1:")    # loopback only
        yield c
    finally:
        c.shutdown()
    assert not ray.is_initialized()
    assert not os.path.exists(c.temp_dir)
