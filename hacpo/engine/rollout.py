"""Rollout engines: who generates an agent's responses. One interface, in-process sampler here
(the vLLM/Ray pool implements the same interface)."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol, Sequence, TypeVar

import torch

from hacpo.models.generation import Rollout, generate
from hacpo.models.policy import Policy

T = TypeVar("T")


class RolloutEngine(Protocol):
    def generate(self, agent: int, prompt_ids: Sequence[Sequence[int]], *, num_samples: int,
                 max_new_tokens: int, temperature: float, top_p: float) -> Rollout: ...

    def sync_weights(self, agent: int) -> None: ...

    def idle(self) -> None: ...   # the trainer is about to use the devices (colocated: sleep)

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


def each_agent(n: int, fn: Callable[[int], T], *, at_once: bool, name: str) -> list[T]:
    """``[fn(0), ..., fn(n-1)]``: with ``at_once`` (and n >= 2) each call from a driver thread
    of its own (:func:`agents_at_once`), all started before any is awaited; else one after
    another. An agent's error is raised after every call has ended (the first agent's, in
    agent order)."""
    if n < 2 or not at_once:
        return [fn(k) for k in range(n)]
    return [f.result() for f in agents_at_once(n, fn, name=name)]


def agents_at_once(n: int, fn: Callable[[int], T], *, name: str) -> list[Future[T]]:
    """``fn(0), ..., fn(n-1)``, each from a driver thread of its own (named ``hacpo-<name>``),
    all started before any is awaited; returns their futures in agent order once every call
    has ended, so a caller that takes ``result()`` in that order sees agent k's result (or
    error) before agent k + 1's, whichever ended first."""
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"hacpo-{name}") as pool:
        futures = [pool.submit(fn, k) for k in range(n)]
    return futures                            # every call has ended: the pool has joined


def generate_agents(engine: RolloutEngine, prompt_ids: Sequence[Sequence[Sequence[int]]], *,
                    timer: Callable[[int], object], at_once: bool = True,
                    **kwargs) -> list[Rollout]:
    """A step's rollouts: agent k samples for ``prompt_ids[k]`` (``kwargs``: ``generate``'s
    num_samples, max_new_tokens, temperature, top_p); ``timer(k)`` is entered around agent k's
    sampling (e.g. a Stopwatch key ``time/generate/<name>``).

    An engine whose agents sample on workers of their own (``concurrent_agents = True``: the
    Ray and vLLM pools, one or more actors per agent) samples every agent at once, each agent's
    calls (with their fault handling) from a driver thread of its own: the step waits for the
    slowest agent instead of the sum of all. The samples are those of one agent after another
    (each agent's draws come from its own generator and its own actors), and the per-agent
    times are each agent's wall time. Other engines (in-process: the agents share this
    process's CPUs), or any with ``at_once=False`` (``agents_at_once``), sample one agent after
    another. An agent's error is raised after every agent's call has ended (the first
    agent's, in agent order)."""
    def one(k: int) -> Rollout:
        with timer(k):
            return engine.generate(k, prompt_ids[k], **kwargs)

    return each_agent(len(prompt_ids), one,
                      at_once=at_once and getattr(engine, "concurrent_agents", False),
                      name="generate")


def sync_agents(agents, engine: RolloutEngine, n: int, *, timer: Callable[[int], object],
                pull: bool = True, at_once: bool = True) -> None:
    """Every agent's trained weights to its rollout engines: agent k's ``agents.pull_weights(k)``
    (Ray / megatron trainers: into the driver's policy, which the engines read; ``pull=False``
    skips it, e.g. at start-up) then ``engine.sync_weights(k)``, ``timer(k)`` entered around
    both. With an engine whose agents have workers of their own (``concurrent_agents``) every
    agent's pull and sync run at once, each from a driver thread of its own (an agent's pull reads
    only its own trainer and writes only its own policy; its sync only its own engines), so the
    step waits for the slowest agent's weights instead of the sum; else (or with
    ``at_once=False``) one agent after another. An agent's error is raised after every agent's
    pull and sync has ended (the first agent's, in agent order). Where the trainer can put its
    weights into the object store itself (megatron groups: ``publish_weights``) and the engine
    can load them from there (vLLM: ``sync_published``), that replaces pull and sync: the
    weights go from the trainer's rank to the engines without passing through the driver,
    whose policy is refreshed later only if something reads it."""
    publish = (pull and hasattr(agents, "publish_weights")
               and hasattr(engine, "sync_published"))

    def one(k: int) -> None:
        with timer(k):
            refs = agents.publish_weights(k) if publish else None
            if refs is not None:          # trainer -> object store -> engines, not the driver
                engine.sync_published(k, refs)
                return
            if pull:
                agents.pull_weights(k)
            engine.sync_weights(k)

    each_agent(n, one, at_once=at_once and getattr(engine, "concurrent_agents", False),
               name="sync")


def agent_generators(seed: int, n: int) -> list[torch.Generator]:
    """Each agent's sampling RNG: the same seeds in every engine, so a run's samples depend on
    the seed, not on which engine draws them."""
    return [torch.Generator().manual_seed(seed * 1000 + 17 + k) for k in range(n)]


class GeneratorState:
    """The resumable state every engine shares: its per-agent ``generators``."""
    generators: list[torch.Generator]

    def state_dict(self) -> dict:
        return {"generators": [g.get_state() for g in self.generators]}

    def load_state_dict(self, sd: dict) -> None:
        states = sd["generators"]
        if len(states) != len(self.generators):   # zip would leave agents' RNGs unrestored
            raise ValueError(f"rollout engine state holds {len(states)} agents' generator "
                             f"states, this engine has {len(self.generators)} agents")
        for g, s in zip(self.generators, states):
            g.set_state(s)

    def seed_agent(self, agent: int, seed: int) -> None:
        """Reseed agent's generator (evaluation through the engine samples from ``seed``, as
        the in-process evaluation does; its caller saves and restores the state around it)."""
        self.generators[agent].manual_seed(seed)


class LocalRolloutEngine(GeneratorState):
    """Samples with the trainer's own policies (KV-cache sampler), one generator per agent.

    Sharing the policy objects means there is nothing to sync after an optimizer step."""

    def __init__(self, policies: Sequence[Policy], seed: int):
        self.policies = list(policies)
        self.generators = agent_generators(seed, len(policies))

    def generate(self, agent: int, prompt_ids, *, num_samples: int, max_new_tokens: int,
                 temperature: float, top_p: float) -> Rollout:
        policy = self.policies[agent]
        was_training = policy.training
        policy.eval()
        try:
            return generate(policy, prompt_ids, num_samples=num_samples,
                            max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=top_p, generator=self.generators[agent])
        finally:
            policy.train(was_training)

    def sync_weights(self, agent: int) -> None:
        """Weights are shared in-process."""

    def idle(self) -> None:
        """Nothing to release in-process."""

    def stats(self) -> dict:
        """No faults in-process."""
        return {}

    def close(self) -> None:
        """Nothing to release in-process."""
