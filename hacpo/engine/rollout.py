"""Rollout engines: who generates an agent's responses. One interface, in-process sampler here
(the vLLM/Ray pool implements the same interface)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol, Sequence

import torch

from hacpo.models.generation import Rollout, generate
from hacpo.models.policy import Policy


class RolloutEngine(Protocol):
    def generate(self, agent: int, prompt_ids: Sequence[Sequence[int]], *, num_samples: int,
                 max_new_tokens: int, temperature: float, top_p: float) -> Rollout: ...

    def sync_weights(self, agent: int) -> None: ...

    def idle(self) -> None: ...   # the trainer is about to use the devices (colocated: sleep)

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


def generate_agents(engine: RolloutEngine, prompt_ids: Sequence[Sequence[Sequence[int]]], *,
                    timer: Callable[[int], object], **kwargs) -> list[Rollout]:
    """A step's rollouts: agent k samples for ``prompt_ids[k]`` (``kwargs``: ``generate``'s
    num_samples, max_new_tokens, temperature, top_p); ``timer(k)`` is entered around agent k's
    sampling (e.g. a Stopwatch key ``time/generate/<name>``).

    An engine whose agents sample on workers of their own (``concurrent_agents = True``: the
    Ray and vLLM pools, one or more actors per agent) samples every agent at once, each agent's
    calls (with their fault handling) from a driver thread of its own: the step waits for the
    slowest agent instead of the sum of all. The samples are those of one agent after another
    (each agent's draws come from its own generator and its own actors), and the per-agent
    times are each agent's wall time. Other engines (in-process: the agents share this
    process's CPUs) sample one agent after another. An agent's error is raised after every
    agent's call has ended (the first agent's, in agent order)."""
    n = len(prompt_ids)

    def one(k: int) -> Rollout:
        with timer(k):
            return engine.generate(k, prompt_ids[k], **kwargs)

    if n < 2 or not getattr(engine, "concurrent_agents", False):
        return [one(k) for k in range(n)]
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="hacpo-generate") as pool:
        futures = [pool.submit(one, k) for k in range(n)]
    return [f.result() for f in futures]      # every call has ended: the pool has joined


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
        for g, s in zip(self.generators, sd["generators"]):
            g.set_state(s)


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
