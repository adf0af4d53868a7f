"""Every module that uses Ray imports hacpo.launch.ray_cluster before ray, so a private
cluster binds to loopback also in a plain `hacpo train` process (the test suite's conftest sets
the variable itself, which hid a module that did not: `rollout.engine=ray` failed from the
command line). And a process joined to a cluster by one address accepts it again by that
address when the cluster reports another (its node IP)."""
import os
import subprocess
import sys

import pytest

from ._launch_helpers import REPO

MODULES = ["ray_rollout", "ray_trainer", "megatron_trainer", "vllm_rollout"]


@pytest.mark.parametrize("module", MODULES)
def test_ray_is_imported_after_the_loopback_setting(module):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    code = (f"import hacpo.launch.{module}\n"
            "from ray._private import ray_constants\n"
            "assert not ray_constants.ENABLE_RAY_CLUSTER, 'ray imported first'\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_joined_cluster_is_accepted_by_the_address_it_was_joined_by(monkeypatch):
    from hacpo.launch import ray_cluster

    import ray

    class Ctx:
        gcs_address = "192.0.2.2:45915"          # what the cluster reports for itself
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Ctx())
    monkeypatch.setattr(ray_cluster, "_joined", {"192.0.2.2:45915": "127.0.0.1:45915"})
    for same in ("127.0.0.1:45915", "192.0.2.2:45915", "auto", ""):
        c = ray_cluster.connect(same)
        assert c.address == "192.0.2.2:45915" and not c.owned and not c.connected_here
    with pytest.raises(RuntimeError, match=r"already connected to the Ray cluster at "
                                           r"'192.0.2.2:45915'; cannot also join "
                                           r"rollout.ray_address='127.0.0.1:1'"):
        ray_cluster.connect("127.0.0.1:1")
