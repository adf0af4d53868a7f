"""A Ray-managed rollout pool: ``rollout.engine = "ray"``.

Per agent, ``rollout.engines_per_agent`` :class:`RolloutActor` s (one placement group per agent,
one bundle per actor) each hold a copy of that agent's :class:`~hacpo.models.policy.Policy` and
sample with the same :func:`hacpo.models.generation.generate` as the in-process engine.

- **Policy copies.** The driver's Policy object is pickled once into the object store and every
  actor unpickles it. Rebuilding it from its PolicyConfig on the actor would need the whole
  training corpus (reduced vocabularies are built from it) and the tokenizer files on every
  node; the pickle carries exactly the driver's tokenizer and architecture. Weights then come
  from :meth:`RayRolloutEngine.sync_weights`. The actor's constructor takes no object-store
  argument: Ray does not keep an actor's constructor arguments for its restarts (it says so
  with an ``E`` line, ray-project/ray#53727), so every call names the policy's ObjectRef
  (held by the driver; in a list, so Ray passes it unresolved) and a new or restarted actor
  fetches it once, before it answers ``ready`` or serves its first call.
- **Weights.** ``sync_weights(k)`` puts agent k's state dict into the object store once, in
  buckets of at most ``rollout.weight_bucket_mb`` (one ``ray.put`` each), and every actor of
  k copies them into its policy in place, fetching one bucket at a time (so an actor holds its
  policy plus one bucket, never a second state dict). Each request also names the weights
  version it must be served with, so an actor that was restarted while idle, or whose load
  failed part-way, catches up before it samples: no sample ever comes from stale or mixed
  weights.
- **Determinism.** The driver owns each agent's sampling RNG (a ``torch.Generator``; the same
  seeds as :class:`~hacpo.engine.rollout.LocalRolloutEngine`). A call whose prompts go to one
  actor sends the generator state with the request and takes back the advanced state, so
  the result is bit-for-bit the in-process engine's (given the same intra-op thread count:
  the actors use ``cfg.threads``, or 1 if unset). With S > 1 shards (contiguous slices of
  the prompts), the driver draws S seeds from the agent's generator, one per shard; the
  result depends on the seed and on S = min(engines_per_agent, prompts), never on timing.
- **Faults.** Actors run with Ray ``max_restarts = rollout.max_engine_restarts``. When an
  actor dies mid-call, Ray restarts it in its bundle, the driver re-sends the same request
  (same prompts, same RNG state, latest weights version) and keeps the other shards'
  results: no sample is lost or counted twice. Restarts are counted per actor
  (:meth:`RayRolloutEngine.stats`); one past the budget is an error naming agent and actor.
- **Hangs.** An actor that is alive but does not answer a call (generate or weight load)
  within ``rollout.call_timeout_s`` (0: no limit) is killed (``ray.kill``, Ray restarts it)
  and treated as one that died: the restart is counted against the same budget, the call is
  re-sent identically once the new process answers, and ``stats()["timeouts"]`` counts it.
  Past the budget the error names the agent, the actor, the timeout and its config key.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

# first: its environment must precede `import ray`
from .ray_cluster import RayCluster, call_deadline, connect, next_ready, weight_bytes

import ray  # noqa: E402
import torch
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hacpo.models.buckets import bucket_bytes_of, copy_buckets, weight_buckets
from hacpo.models.generation import Rollout, generate
from hacpo.engine.rollout import GeneratorState, agent_generators
from hacpo.models.policy import Policy

log = logging.getLogger("hacpo")

# After a hung actor is killed, its call must fail (the kill took) within this many seconds.
KILL_GRACE_S = 60.0


class RolloutActor:
    """One rollout engine: a policy copy that samples. Runs as a Ray actor (one CPU bundle).

    ``policy``: the Policy itself (in-process use); a Ray actor is created without it and
    gets it from the first call (``policy=[ObjectRef]``, see the module docstring)."""

    def __init__(self, threads: int, policy: Policy | None = None):
        torch.set_num_threads(threads)
        self.policy = None if policy is None else policy.eval()
        self.version = -1              # weights version loaded (-1: as pickled; None: unknown)
        self._pause: tuple[float, str] | None = None

    def _fetch_policy(self, policy: list | None) -> Policy:
        """This process's policy copy; the first call fetches it from ``policy`` = [ObjectRef
        of the pickled Policy] (a list, so Ray passes the ref unresolved)."""
        if self.policy is None:
            if not policy:
                raise RuntimeError("rollout actor has no policy: the call named none")
            self.policy = ray.get(policy[0]).eval()
            self.version = -1
        return self.policy

    def ready(self, policy: list | None = None) -> int:
        """This process's pid; with ``policy``, once it holds its policy copy."""
        if policy is not None:
            self._fetch_policy(policy)
        return os.getpid()

    def load_weights(self, version: int, refs: list, policy: list | None = None) -> int:
        """Copy weights ``version`` into the policy in place from ``refs`` (the ObjectRefs of
        its buckets, in a list so that Ray passes them unresolved), fetching one bucket at a
        time; every state-dict entry must come once with its shape (else a RuntimeError).
        Until it has finished, the version is unknown (None): a failure part-way leaves no
        claim of a version. Returns this process's pid."""
        pol = self._fetch_policy(policy)
        self.version = None
        copy_buckets(pol.state_dict(), (ray.get(r) for r in refs),
                     what=f"rollout actor of {pol.name!r}: weights version {version}")
        self.version = version
        return os.getpid()

    def generate(self, weights: list, prompt_ids: list[list[int]], rng_state: torch.Tensor,
                 kwargs: dict[str, Any], policy: list | None = None
                 ) -> tuple[Rollout, torch.Tensor, int, int]:
        """weights = [(version, [ObjectRef of each bucket])] (refs inside lists, so Ray passes
        them unresolved: they are fetched only when this actor's weights are behind).
        Returns (rollout, advanced RNG state, pid, weights version used)."""
        self._fetch_policy(policy)
        (version, refs), = weights
        if version != self.version:
            self.load_weights(version, refs)
        gen = torch.Generator()
        gen.set_state(rng_state)
        ro = generate(self.policy, prompt_ids, generator=gen, **kwargs)
        if self._pause is not None:    # test hook: die here, with the result computed
            seconds, marker = self._pause
            self._pause = None
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(seconds)
        return ro, gen.get_state(), os.getpid(), self.version

    def debug_pause_next_generate(self, seconds: float, marker_path: str) -> int:
        """Test hook: the next ``generate`` writes its pid to ``marker_path`` and sleeps
        ``seconds`` before returning (a window to kill it mid-call). Not kept across restarts."""
        self._pause = (float(seconds), marker_path)
        return os.getpid()


def shard_bounds(num_prompts: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal slices [(start, stop)] of ``num_prompts`` into at most
    ``num_shards`` non-empty shards (the first ones one longer)."""
    s = max(1, min(num_shards, num_prompts))
    q, r = divmod(num_prompts, s)
    out, start = [], 0
    for i in range(s):
        stop = start + q + (1 if i < r else 0)
        out.append((start, stop))
        start = stop
    return out


def merge_rollouts(parts: Sequence[Rollout], name: str) -> Rollout:
    """Concatenate shard rollouts (in prompt order) into one prompt-major Rollout."""
    prompt_ids, prompt_index, offset = [], [], 0
    for p in parts:
        prompt_ids += p.prompt_ids
        prompt_index += [i + offset for i in p.prompt_index]
        offset += len(p.prompt_ids)
    return Rollout(policy_name=name, prompt_ids=prompt_ids, prompt_index=prompt_index,
                   response_ids=[r for p in parts for r in p.response_ids],
                   sampler_logprobs=[r for p in parts for r in p.sampler_logprobs],
                   finished_eos=[r for p in parts for r in p.finished_eos],
                   truncated=[r for p in parts for r in p.truncated])


class RayRolloutEngine(GeneratorState):
    """``RolloutEngine`` over Ray actors (see the module docstring).

    Agents sample at once (``concurrent_agents``, :func:`hacpo.engine.rollout.generate_agents`):
    each agent's calls and counters are its own.

    Args:
        policies: the trainer's policies (pickled once per agent for the actors).
        cfg: the TrainConfig (``rollout.*``, ``seed``, ``threads``).
        timeout_s: how long to wait for the cluster to be reachable and for the placement
            groups' resources; past it, a clear error instead of a hang.
        start_timeout_s: how long the actors may take to start (unpickling a policy on a
            loaded node can be slow).
    """

    concurrent_agents = True

    def __init__(self, policies: Sequence[Policy], cfg, *, timeout_s: float = 60.0,
                 start_timeout_s: float = 300.0):
        r = cfg.rollout
        for p in policies:
            if p.output_weight.device.type != "cpu":
                raise ValueError(f"rollout.engine=ray samples on CPU actors, but policy "
                                 f"{p.name!r} is on {p.output_weight.device}; use "
                                 f"rollout.engine=local or vllm for accelerator policies")
        self.policies = list(policies)       # the trainer's: sync_weights reads them
        self.names = [p.name for p in policies]
        self.engines_per_agent = r.engines_per_agent
        self.max_restarts = r.max_engine_restarts
        self.bucket_bytes = bucket_bytes_of(r.weight_bucket_mb)
        self.generators = agent_generators(cfg.seed, len(policies))
        self.threads = cfg.threads if cfg.threads > 0 else 1
        self.cpus_per_actor = self.threads
        self._actors: list[list[Any]] = []
        self._pgs: list[Any] = []
        self._policy_refs: list[Any] = []
        # per agent: (version, ObjectRefs of the last synced weights' buckets)
        self._weights: list[tuple[int, list] | None] = [None] * len(policies)
        self._pids: list[list[int | None]] = []
        self._restarts = [[0] * r.engines_per_agent for _ in policies]
        self._timeouts = [[0] * r.engines_per_agent for _ in policies]
        self.call_timeout_s = r.call_timeout_s
        self.start_timeout_s = start_timeout_s
        self._retried_calls = [0] * len(policies)     # per agent: agents sample at once
        self._closed = False
        need = len(policies) * r.engines_per_agent * self.cpus_per_actor
        # A private cluster is sized to hold the pool (logical CPUs, possibly more than this
        # machine's cores: agents sample at once, so every actor may be busy, each with
        # `threads` threads); a joined cluster has the size it has.
        self.cluster: RayCluster | None = None
        self.cluster = connect(r.ray_address, timeout_s=timeout_s,
                               num_cpus=max(need, os.cpu_count() or 1),
                               weights=weight_bytes(policies))
        try:
            self.cluster.require(
                "CPU", need,
                what=f"rollout.engine=ray needs {need} CPUs ({len(policies)} agents x "
                     f"rollout.engines_per_agent={r.engines_per_agent} x "
                     f"{self.cpus_per_actor} CPU each)",
                hint="lower rollout.engines_per_agent or add nodes")
            self._start_actors(policies, timeout_s, start_timeout_s)
        except BaseException:
            self.close()
            raise

    # -- bring-up ---------------------------------------------------------------------------------
    def _start_actors(self, policies: Sequence[Policy], timeout_s: float,
                      start_timeout_s: float) -> None:
        remote_cls = ray.remote(RolloutActor)
        bundle = {"CPU": self.cpus_per_actor}
        for k, pol in enumerate(policies):
            pg = self.cluster.reserve(
                [bundle] * self.engines_per_agent, timeout_s=timeout_s,
                what=f"agent {pol.name!r}: the placement group for {self.engines_per_agent} "
                     f"rollout actors x {bundle}",
                hint="lower rollout.engines_per_agent or free resources")
            self._pgs.append(pg)
            # held here for the pool's life: every call names it, so a restarted actor
            # (created without arguments in the object store) fetches its policy from it
            self._policy_refs.append([ray.put(pol)])
            actors = [remote_cls.options(
                num_cpus=self.cpus_per_actor, max_restarts=self.max_restarts,
                max_task_retries=0,             # the engine retries, with the same RNG state
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=j),
            ).remote(self.threads) for j in range(self.engines_per_agent)]
            self._actors.append(actors)
        self._pids = [[None] * self.engines_per_agent for _ in policies]
        for k, actors in enumerate(self._actors):
            for j, a in enumerate(actors):
                self._pids[k][j] = self.cluster.wait_started(
                    a.ready.remote(self._policy_refs[k]), timeout_s=start_timeout_s,
                    what=f"rollout actor {j} of agent {self.names[k]!r}")
        log.info("ray rollout pool: %d agents x %d actors on %s", len(self._actors),
                 self.engines_per_agent, self.cluster.address)

    def actors(self, agent: int) -> list:
        """Agent ``agent``'s actor handles (for inspection and fault-injection tests)."""
        return list(self._actors[agent])

    # -- faults -----------------------------------------------------------------------------------
    def _died(self, agent: int, j: int, err: Exception) -> None:
        """Actor (agent, j) died during a call: count the restart Ray makes, or fail."""
        self._restarts[agent][j] += 1
        self._pids[agent][j] = None         # a new process is expected
        n = self._restarts[agent][j]
        if n > self.max_restarts:
            raise RuntimeError(
                f"rollout actor {j} of agent {self.names[agent]!r} died {n} times; "
                f"rollout.max_engine_restarts={self.max_restarts} exhausted (last error: "
                f"{type(err).__name__}: {err})") from err
        log.warning("rollout actor %d of agent %r died (%s); restart %d/%d, retrying its "
                    "request", j, self.names[agent], type(err).__name__, n, self.max_restarts)

    def _seen_pid(self, agent: int, j: int, pid: int) -> None:
        """A pid change not caused by a failed call is a restart while idle: count it too."""
        known = self._pids[agent][j]
        if known is not None and known != pid:
            self._restarts[agent][j] += 1
            if self._restarts[agent][j] > self.max_restarts:
                raise RuntimeError(
                    f"rollout actor {j} of agent {self.names[agent]!r} was restarted "
                    f"{self._restarts[agent][j]} times; rollout.max_engine_restarts="
                    f"{self.max_restarts} exhausted")
        self._pids[agent][j] = pid

    def _timed_out(self, agent: int, j: int, what: str) -> None:
        """Actor (agent, j) has not answered a ``what`` call within rollout.call_timeout_s:
        kill it and count the restart Ray makes (as for a dead actor), or fail."""
        self._timeouts[agent][j] += 1
        self._restarts[agent][j] += 1
        self._pids[agent][j] = None         # a new process is expected
        n = self._restarts[agent][j]
        actor = self._actors[agent][j]
        if n > self.max_restarts:
            ray.kill(actor, no_restart=True)     # hung: do not leave it holding its CPU
            raise RuntimeError(
                f"rollout actor {j} of agent {self.names[agent]!r} did not answer a {what} "
                f"call within rollout.call_timeout_s={self.call_timeout_s:g} s and was killed; "
                f"that is its restart {n} and rollout.max_engine_restarts={self.max_restarts} "
                f"is exhausted (raise rollout.call_timeout_s if calls are legitimately this "
                f"slow)")
        log.warning("rollout actor %d of agent %r did not answer a %s call within %g s "
                    "(rollout.call_timeout_s): killed it; restart %d/%d, retrying its request",
                    j, self.names[agent], what, self.call_timeout_s, n, self.max_restarts)
        ray.kill(actor, no_restart=False)        # Ray restarts it in its bundle

    def _await_restart(self, agent: int, j: int) -> None:
        """After a killed call has failed: wait until Ray's new process answers (within the
        start timeout), so the re-sent call's time limit does not include the restart."""
        what = f"restarted rollout actor {j} of agent {self.names[agent]!r}"
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                pid = ray.get(self._actors[agent][j].ready.remote(self._policy_refs[agent]),
                              timeout=max(0.1, deadline - time.monotonic()))
                break
            except ActorUnavailableError:          # still restarting
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} did not start within "
                                       f"{self.start_timeout_s:g} s") from None
                time.sleep(0.2)
            except (GetTimeoutError, RayActorError) as e:
                raise RuntimeError(f"{what} did not start within {self.start_timeout_s:g} s: "
                                   f"{type(e).__name__}: {e}") from e
        self._pids[agent][j] = pid

    def _call(self, agent: int, indices, submit, on_result, what: str) -> None:
        """``submit(j) -> ObjectRef`` for every actor index j in ``indices``; a call whose actor
        died, or did not answer within rollout.call_timeout_s (the actor is then killed), is
        re-sent, identical, once Ray has restarted it; ``on_result(j, value)``."""
        pending: dict[Any, int] = {}
        deadlines: dict[Any, float | None] = {}
        killed: set[int] = set()        # killed for a timeout; their call has not failed yet

        def send(j: int) -> None:
            ref = submit(j)
            pending[ref] = j
            deadlines[ref] = call_deadline(self.call_timeout_s)

        for j in indices:
            send(j)
        unavailable_since: dict[int, float] = {}
        while pending:
            ref, late = next_ready(pending, deadlines)
            j = pending[ref]
            if late:
                if j in killed:
                    raise RuntimeError(
                        f"rollout actor {j} of agent {self.names[agent]!r} was killed after "
                        f"not answering a {what} call within rollout.call_timeout_s="
                        f"{self.call_timeout_s:g} s, but its call has not failed "
                        f"{KILL_GRACE_S:g} s later: the kill did not take")
                self._timed_out(agent, j, what)
                killed.add(j)
                deadlines[ref] = time.monotonic() + KILL_GRACE_S
                continue
            del pending[ref], deadlines[ref]
            try:
                value = ray.get(ref)
            except RayActorError as e:
                if j in killed:                 # the kill took: counted in _timed_out
                    killed.discard(j)
                    self._await_restart(agent, j)
                elif isinstance(e, ActorUnavailableError):  # transient (e.g. restarting):
                    t0 = unavailable_since.setdefault(j, time.monotonic())   # not a new death
                    if time.monotonic() - t0 > 120:
                        raise RuntimeError(f"rollout actor {j} of agent "
                                           f"{self.names[agent]!r} unavailable for 120 s: "
                                           f"{e}") from e
                    time.sleep(0.2)
                else:
                    self._died(agent, j, e)
                self._retried_calls[agent] += 1
                send(j)
                continue
            unavailable_since.pop(j, None)
            on_result(j, value)
            if j in killed:     # answered just before the kill: keep it; the restart that
                killed.discard(j)   # follows is counted already, so its new pid is expected
                self._pids[agent][j] = None

    # -- RolloutEngine ----------------------------------------------------------------------------
    def idle(self) -> None:
        """The actors sample on CPUs: nothing to release."""

    def sync_weights(self, agent: int) -> None:
        """Put agent ``agent``'s current weights into the object store once, one object per
        bucket of ``rollout.weight_bucket_mb`` (kept until the next sync: a restarted actor
        loads them); all its actors load them (an actor that dies meanwhile loads them on
        restart, before it samples)."""
        version = 0 if self._weights[agent] is None else self._weights[agent][0] + 1
        sd = {k: v.detach().cpu() for k, v in self.policies[agent].state_dict().items()}
        refs = [ray.put(b) for b in weight_buckets(sd, self.bucket_bytes)]
        del sd
        self._weights[agent] = (version, refs)
        actors = self._actors[agent]

        policy = self._policy_refs[agent]

        def submit(j):
            return actors[j].load_weights.remote(version, refs, policy)
        self._call(agent, range(len(actors)), submit,
                   lambda j, pid: self._seen_pid(agent, j, pid), "load_weights")

    def generate(self, agent: int, prompt_ids, *, num_samples: int, max_new_tokens: int,
                 temperature: float, top_p: float) -> Rollout:
        if self._weights[agent] is None:
            raise RuntimeError(f"agent {self.names[agent]!r}: sync_weights({agent}) must be "
                               f"called before the first generate")
        prompts = [list(map(int, p)) for p in prompt_ids]
        if not prompts:
            raise ValueError("generate needs at least one prompt")
        bounds = shard_bounds(len(prompts), self.engines_per_agent)
        gen = torch.Generator()                 # the agent's state advances only on success
        gen.set_state(self.generators[agent].get_state())
        if len(bounds) == 1:
            states = [gen.get_state()]
        else:
            seeds = torch.randint(0, 2 ** 62, (len(bounds),), generator=gen).tolist()
            states = [torch.Generator().manual_seed(s).get_state() for s in seeds]
        kwargs = dict(num_samples=num_samples, max_new_tokens=max_new_tokens,
                      temperature=temperature, top_p=top_p)
        actors, weights = self._actors[agent], [self._weights[agent]]
        policy = self._policy_refs[agent]
        parts: list[Rollout | None] = [None] * len(bounds)
        new_states: list[torch.Tensor | None] = [None] * len(bounds)

        def submit(j):
            a, b = bounds[j]
            return actors[j].generate.remote(weights, prompts[a:b], states[j], kwargs, policy)

        def on_result(j, value):
            ro, state, pid, version = value
            self._seen_pid(agent, j, pid)
            if version != weights[0][0]:
                raise RuntimeError(f"rollout actor {j} of agent {self.names[agent]!r} sampled "
                                   f"with weights version {version}, expected "
                                   f"{weights[0][0]}")
            parts[j], new_states[j] = ro, state

        self._call(agent, range(len(bounds)), submit, on_result, "generate")
        self.generators[agent].set_state(new_states[0] if len(bounds) == 1 else gen.get_state())
        return parts[0] if len(parts) == 1 else merge_rollouts(parts, self.names[agent])

    def stats(self) -> dict:
        """Fault counters: total restarts (deaths and timeouts), per agent and actor; calls
        that timed out (rollout.call_timeout_s), in total and per agent and actor; calls
        re-sent."""
        return {"restarts": sum(map(sum, self._restarts)),
                "restarts_per_actor": {n: list(r) for n, r in zip(self.names, self._restarts)},
                "timeouts": sum(map(sum, self._timeouts)),
                "timeouts_per_actor": {n: list(r) for n, r in zip(self.names, self._timeouts)},
                "retried_calls": sum(self._retried_calls)}

    def close(self) -> None:
        """Kill the actors, remove the placement groups, stop/leave the cluster. Idempotent."""
        if self._closed:
            return
        self._closed = True
        RayCluster.release([a for actors in self._actors for a in actors], self._pgs)
        self._actors, self._pgs, self._policy_refs = [], [], []
        self._weights = [None] * len(self._weights)
        if self.cluster is not None:
            self.cluster.shutdown()
