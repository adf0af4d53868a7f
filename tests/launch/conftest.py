"""The launch tests' shared Ray fixture: one private local cluster per test module."""
import os
import signal

import pytest

from hacpo.launch import ray_cluster  # first: its environment must precede `import ray`

import ray


@pytest.fixture(scope="module")
def cluster():
    """A private cluster (loopback, own temp dir, 4 logical CPUs), gone after the module."""
    before = signal.getsignal(signal.SIGTERM)
    c = ray_cluster.connect("", num_cpus=4)
    try:
        assert c.owned and c.address.startswith("127.0.0.1:")    # loopback only
        # ray.init's SIGTERM handler is not left behind, whatever was there (SIG_DFL too)
        assert signal.getsignal(signal.SIGTERM) == before
        # the GCS keeps a bounded record of task events (it grew ~30-40 KB every step)
        assert _gcs_env(c.temp_dir).get("RAY_task_events_max_num_task_in_gcs") == "10000"
        yield c
    finally:
        c.shutdown()
    assert not ray.is_initialized()
    assert not os.path.exists(c.temp_dir)


def _gcs_env(temp_dir: str) -> dict[str, str]:
    """The environment of the cluster's gcs_server (the process whose command line names
    ``temp_dir``)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            if "gcs_server" not in cmd or temp_dir not in cmd:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                pairs = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        return dict(p.split("=", 1) for p in pairs if "=" in p)
    raise AssertionError(f"no gcs_server process of the cluster in {temp_dir}")
