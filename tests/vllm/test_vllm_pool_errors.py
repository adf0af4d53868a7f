"""VLLMRolloutEngine's call loop against a stand-in engine actor in a real private Ray cluster
(no vLLM): an error the engine raises (bad weights, a wrong weights version) reaches the caller
as a RuntimeError naming the agent, the engine and the call, with the engine's message, and is
not mistaken for a death (no restart: it would fail again)."""
import types

import pytest

from hacpo.launch import ray_cluster  # first: its environment must precede `import ray`
from hacpo.launch.vllm_rollout import VLLMRolloutEngine


class _Engine:
    """Raises in every call, as VLLMWorker does on bad weights or a wrong version."""

    def load_weights(self, weights, *, version):
        raise RuntimeError("weight load for vLLM: weight 'w' (3,) does not fit: the served "
                           "model has no such weight")

    def pid(self):
        import os
        return os.getpid()


@pytest.fixture(scope="module")
def cluster():
    c = ray_cluster.connect("", num_cpus=2)
    try:
        yield c
    finally:
        c.shutdown()


def test_engine_error_names_agent_engine_and_call(cluster):
    import ray

    engines = [ray.remote(_Engine).options(num_cpus=0, max_restarts=0).remote()
               for _ in range(2)]
    pids = ray.get([e.pid.remote() for e in engines])
    pool = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    pool.actors, pool.policies = [engines], [types.SimpleNamespace(name="llama")]
    pool._weights, pool._version, pool.engines_per_agent = [None], [0], 2
    pool.call_timeout_s, pool.max_restarts = 0, 3
    pool.restarts, pool.timeouts = [[0, 0]], [[0, 0]]
    with pytest.raises(RuntimeError, match=r"^vLLM engine [01] of agent 0 \('llama'\): "
                                           r"load_weights failed: RuntimeError: weight load "
                                           r"for vLLM: weight 'w' \(3,\) does not fit"):
        pool._load(0, [{"w": None}])
    assert pool.restarts == [[0, 0]]                 # not restarted
    assert ray.get([e.pid.remote() for e in engines]) == pids   # the same engines, alive
