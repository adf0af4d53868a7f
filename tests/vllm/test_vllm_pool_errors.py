"""VLLMRolloutEngine's call loop against a stand-in engine actor in a real private Ray cluster
(no vLLM): an error the engine raises (bad weights, a wrong weights version) reaches the caller
as a RuntimeError naming the agent, the engine and the call, with the engine's message, and is
not mistaken for a death (no restart: it would fail again). A restarted engine that dies while
starting is another restart from the same budget; one that does not start in time is an error."""
import os
import time
import types

import pytest

from hacpo.launch import ray_cluster  # noqa: F401  (first: its environment precedes `import ray`)
from hacpo.launch.vllm_rollout import VLLMRolloutEngine


class _Engine:
    """Raises in every call, as VLLMWorker does on bad weights or a wrong version."""

    def load_weights(self, weights, *, version):
        raise RuntimeError("weight load for vLLM: weight 'w' (3,) does not fit: the served "
                           "model has no such weight")

    def pid(self):
        import os
        return os.getpid()


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


class _Starts:
    def info(self):
        return {"pid": os.getpid(), "vllm": "stand-in"}


class _DiesStarting(_Starts):
    def __init__(self):
        os._exit(1)          # as a killed (or OOM-killed) engine process while vLLM loads


class _StartsSlowly(_Starts):
    def __init__(self):
        time.sleep(60)


def test_restart_dying_while_starting_is_another_restart(cluster):
    import ray

    spawn = []              # the classes the next restarts start, in order
    pool = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    pool.policies, pool.python = [types.SimpleNamespace(name="llama")], "python"
    pool.actors = [[ray.remote(_Starts).options(num_cpus=0).remote()]]
    pool._new_actor = lambda k, j: ray.remote(spawn.pop(0)).options(
        num_cpus=0, max_restarts=0).remote()
    pool.start_timeout_s, pool.max_restarts = 30, 2
    pool.restarts, pool.timeouts = [[0]], [[0]]
    spawn[:] = [_DiesStarting, _Starts]
    pool._restart(0, 0, RuntimeError("engine killed"))
    assert pool.restarts == [[2]] and not spawn
    assert ray.get(pool.actors[0][0].info.remote())["vllm"] == "stand-in"
    # past the budget: the death while starting is the error, naming its cause
    pool.restarts, pool.max_restarts = [[0]], 1
    spawn[:] = [_DiesStarting]
    with pytest.raises(RuntimeError, match=r"^vLLM engine 0 of agent 0 \('llama'\) died while "
                                           r"restarting and has already been restarted 1 "
                                           r"times \(rollout.max_engine_restarts=1\): "
                                           r"ActorDiedError: "):
        pool._restart(0, 0, RuntimeError("engine killed"))
    # a restart that does not start within start_timeout_s stays an error (no further restart)
    pool.restarts, pool.max_restarts, pool.start_timeout_s = [[0]], 3, 2
    spawn[:] = [_StartsSlowly, _Starts]
    with pytest.raises(RuntimeError, match=r"^vLLM engine 0 of agent 0 \('llama'\) did not "
                                           r"start within 2 s$"):
        pool._restart(0, 0, RuntimeError("engine killed"))
    assert pool.restarts == [[1]] and spawn == [_Starts]
    ray.kill(pool.actors[0][0], no_restart=True)
