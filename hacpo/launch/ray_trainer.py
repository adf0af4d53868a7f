"""Trainer groups as Ray actors: ``trainer_backend = "ray"``.

Per agent one :class:`TrainerActor` (a trainer group of one rank, DP = TP = PP = 1, on CPU) in
its own placement group holds that agent's policy, its AdamW optimizer and, when
``algorithm.loss.kl_coef > 0``, its frozen reference policy. The driver
(:mod:`hacpo.engine.trainer`) keeps the tokenizers and all math that is not per-agent
(rewards, capability, advantages, re-tokenization) and calls typed methods:

- ``old_logprobs``: the generator's own forward pass over its samples (all agents at once);
- ``update``: the M minibatch updates of :func:`hacpo.engine.update.update_learner` on the
  driver-built :class:`~hacpo.engine.pool.LearnerView`. The minibatch shuffle RNG and the
  non-finite-update streak are the driver's, shared by all learners in order. With two or
  more agents every actor updates at once (:meth:`RayAgents.update_all`): the driver draws
  every agent's minibatches in agent order and sends them, each actor returns the trace of
  its updates, and the driver counts the traces in agent order into the streak; with one,
  the RNG state goes with the request and comes back advanced. Either way the run is
  bit-for-bit the local backend's (given the same intra-op thread count: actors use
  ``threads``, or 1 if unset);
- ``weights``: after each update the driver copies the new weights into its own CPU policy
  (:meth:`RayAgents.pull_weights`), which is what every rollout engine reads. That is one
  state-dict transfer per agent and step: cheap for the CPU models this backend runs;
- ``state_dict`` / ``load_state_dict`` for checkpoints and ``--resume``;
- ``evaluate``: held-out evaluation where the weights are, with the run's reward.

Policies reach the actors pickled (``ray.put``), tokenizer and architecture included, as in
:mod:`hacpo.launch.ray_rollout`. Actors are not restarted (``max_restarts = 0``): an
optimizer's state cannot be rebuilt mid-step, so a dead actor is a clear error naming its
agent, and the run continues from its last checkpoint with ``--resume``. So is one that is
alive but does not answer a call within ``trainer_call_timeout_s`` (it is killed first).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

# first: its environment must precede `import ray`
from .ray_cluster import RayCluster, connect, weight_bytes

import ray  # noqa: E402
import torch
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hacpo.engine import build
from hacpo.engine.agents import score_temperature
from hacpo.engine.algorithm import split_minibatches
from hacpo.engine.evaluate import evaluate_policy
from hacpo.engine.pool import LearnerView, StepPool, score_responses
from hacpo.engine.rewards import RewardComputer, RewardSpec, get_reward_spec
from hacpo.engine.rollout import agents_at_once
from hacpo.engine.run_config import rollout_cpus, trainer_cpus
from hacpo.engine.timing import Stopwatch, device_sync
from hacpo.engine.update import NonFiniteUpdateError, replay_nonfinite, update_learner
from hacpo.models.policy import Policy

log = logging.getLogger("hacpo")


def draw_minibatches(cfg, view: LearnerView, pool: StepPool,
                     generator: torch.Generator) -> list[list[int]]:
    """Agent's M minibatches (rows of ``view``) drawn from ``generator`` exactly as
    :func:`~hacpo.engine.update.update_learner` draws them ([] and no draw without samples)."""
    if view.idx.numel() == 0:
        return []
    algo = cfg.algorithm
    M = algo.num_minibatches * algo.minibatch_factor
    return [mb.tolist() for mb in split_minibatches(pool.prompt[view.idx], view.is_self, M,
                                                    algo.minibatch_order, generator)]


def actor_update(get, actor, view: LearnerView, pool: StepPool, *, generator: torch.Generator,
                 nonfinite: dict, ratio_log: dict | None, sw) -> dict[str, float]:
    """One :meth:`TrainerActor.update` call (``get``: how the caller awaits its actors'
    calls): the run's shuffle RNG state and non-finite counters go with the request and come
    back advanced; its ratio log and stage seconds are taken."""
    m, state, nf, rl, times = get(actor.update.remote(
        view, pool.lp_old, pool.old_token_logp, pool.prompt, generator.get_state(),
        dict(nonfinite), ratio_log is not None))
    generator.set_state(state)
    nonfinite.clear()       # the actor's counters whole (a policy's streak it ended is gone)
    nonfinite.update(nf)
    if ratio_log is not None and rl:
        ratio_log.update(rl)
    for key, v in times.items():
        sw[key] = sw.get(key, 0.0) + v
    return m


def drawn_update_result(result, name: str, nonfinite: dict, max_nonfinite: int,
                        ratio_log: dict | None, sw) -> dict[str, float]:
    """The metrics of a :meth:`TrainerActor.update_drawn` result, its updates counted into the
    run's ``nonfinite`` (raising where one agent after another would), its ratio log and stage
    seconds taken."""
    m, trace, rl, times, _span = result
    for key, v in times.items():
        sw[key] = sw.get(key, 0.0) + v
    replay_nonfinite(trace, nonfinite, max_nonfinite, name)
    if m is None:
        raise RuntimeError(f"agent {name!r}: its trainer stopped on non-finite updates, but "
                           f"the run's count did not reach max_nonfinite={max_nonfinite}")
    if ratio_log is not None and rl:
        ratio_log.update(rl)
    return m


class TrainerActor:
    """One agent's trainer group (one rank): policy, optimizer, reference policy."""

    def __init__(self, policy: Policy, cfg, agent: int, threads: int,
                 reward: RewardSpec | None = None):
        torch.set_num_threads(threads)
        self.cfg = cfg
        # the driver's reward (a user's, registered in the driver's process only: this actor's
        # registry holds the built-in ones); None: cfg.reward.name from this process's registry
        self.reward = reward
        self.name = policy.name
        self.policy = policy
        one = dataclasses.replace(cfg, agents=[cfg.agents[agent]])
        self.optim = build.build_optimizers(one, [policy])[0]
        self.ref = build.reference_policies(one, [policy])[0]
        self.grad_clip = cfg.agents[agent].optim.grad_clip
        self._rc: RewardComputer | None = None

    def ready(self) -> int:
        return os.getpid()

    def old_logprobs(self, prompts: list[list[int]], responses: list[list[int]],
                     micro_batch: int, temperature: float
                     ) -> tuple[torch.Tensor, list[torch.Tensor], float]:
        """(seq_mean [N], token log-probs, seconds) of pool.score_responses."""
        t = time.perf_counter()
        seq, toks = score_responses(self.policy, prompts, responses, micro_batch,
                                    temperature=temperature)
        return seq, toks, time.perf_counter() - t

    def _learn(self, view: LearnerView, lp_old: torch.Tensor,
               old_token_logp: list[torch.Tensor], log_ratios: bool, **kw
               ) -> tuple[dict[str, float], dict | None, dict[str, float]]:
        """update_learner on this actor's policy (``kw``: how the minibatches come and the
        non-finite counters); returns (metrics, ratio log or None, stage seconds keyed
        ``time/<stage>/<agent>``)."""
        cfg = self.cfg
        sw = Stopwatch(device_sync(cfg.profile_sync))
        ratio_log = {} if log_ratios else None
        m = update_learner(cfg.algorithm, self.policy, self.optim, view, lp_old=lp_old,
                           old_token_logp=old_token_logp, micro_batch=cfg.micro_batch,
                           grad_clip=self.grad_clip, max_nonfinite=cfg.max_nonfinite,
                           ref_policy=self.ref, kl_coef=cfg.algorithm.loss.kl_coef,
                           ratio_log=ratio_log, temperature=score_temperature(cfg),
                           timer=sw.scoped("time/", f"/{self.name}"), **kw)
        return m, ratio_log, dict(sw)

    def update(self, view: LearnerView, lp_old: torch.Tensor,
               old_token_logp: list[torch.Tensor], prompt_of_sample: torch.Tensor,
               rng_state: torch.Tensor, nonfinite: dict, log_ratios: bool
               ) -> tuple[dict[str, float], torch.Tensor, dict, dict | None, dict[str, float]]:
        """update_learner; returns (metrics, advanced shuffle RNG state, non-finite counters,
        ratio log or None, stage seconds keyed ``time/<stage>/<agent>``)."""
        gen = torch.Generator()
        gen.set_state(rng_state)
        m, ratio_log, times = self._learn(view, lp_old, old_token_logp, log_ratios,
                                          prompt_of_sample=prompt_of_sample, generator=gen,
                                          nonfinite=nonfinite)
        return m, gen.get_state(), nonfinite, ratio_log, times

    def update_drawn(self, view: LearnerView, lp_old: torch.Tensor,
                     old_token_logp: list[torch.Tensor], minibatches: list[list[int]],
                     log_ratios: bool
                     ) -> tuple[dict[str, float] | None, list[dict], dict | None,
                                dict[str, float], tuple[float, float]]:
        """update_learner on minibatches the driver drew, from a non-finite streak of 0;
        returns (metrics, or None if it stopped at max_nonfinite in a row, the updates'
        trace for :func:`~hacpo.engine.update.replay_nonfinite`, ratio log or None, stage
        seconds, (start, end) wall clock of the call): what lets the driver run every
        agent's update at once."""
        start = time.time()
        trace: list[dict] = []
        try:
            m, ratio_log, times = self._learn(
                view, lp_old, old_token_logp, log_ratios, prompt_of_sample=None,
                generator=None, minibatches=minibatches, trace=trace,
                nonfinite={"streak": 0, "total": 0})
        except NonFiniteUpdateError:     # the driver's replay of the trace raises it
            m, ratio_log, times = None, None, {}
        return m, trace, ratio_log, times, (start, time.time())

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.policy.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.policy.state_dict(), "optim": self.optim.state_dict(),
                **({"ref_model": self.ref.state_dict()} if self.ref is not None else {})}

    def load_state_dict(self, sd: dict[str, Any]) -> int:
        self.policy.load_state_dict(sd["model"])
        self.optim.load_state_dict(sd["optim"])
        if self.ref is not None:
            self.ref.load_state_dict(sd["ref_model"])
        return os.getpid()

    def evaluate(self, prompt_ids: list[list[int]], golds: list[str],
                 kwargs: dict[str, Any]) -> dict:
        """evaluate_policy with the run's reward (a RewardComputer of this actor's own)."""
        if self._rc is None:
            r = self.cfg.reward
            self._rc = RewardComputer(self.reward or r.name, num_workers=r.num_workers,
                                      timeout_s=r.timeout_s)
        return evaluate_policy(self.policy, prompt_ids, golds, self._rc, **kwargs)

    def close(self) -> int:
        """Stop the reward workers, if any (before the actor is killed)."""
        if self._rc is not None:
            self._rc.close()
            self._rc = None
        return os.getpid()


class RayAgents:
    """The agent group over :class:`TrainerActor` s (see the module docstring); the same
    methods as :class:`hacpo.engine.agents.LocalAgents`.

    Args:
        cfg: the TrainConfig (``threads``, ``rollout.ray_address``, everything update needs).
        policies: the driver's policies (warm-started); each is pickled once for its actor and
            kept as the driver's CPU copy.
        timeout_s: how long to wait for the cluster and the placement groups.
        start_timeout_s: how long the actors may take to start.
    """

    def __init__(self, cfg, policies: list[Policy], *, timeout_s: float = 60.0,
                 start_timeout_s: float = 300.0):
        for p in policies:
            if p.output_weight.device.type != "cpu":
                raise ValueError(f"trainer_backend=ray trains on CPU actors, but policy "
                                 f"{p.name!r} is on {p.output_weight.device}")
        self.cfg = cfg
        self.policies = list(policies)
        self.names = [p.name for p in policies]
        self.threads = cfg.threads if cfg.threads > 0 else 1
        self._actors: list[Any] = []
        self._pgs: list[Any] = []
        self._closed = False
        need = trainer_cpus(cfg)       # threads per agent's actor
        # A private cluster holds the trainer groups and the remote rollout pool that joins it.
        self.cluster: RayCluster | None = None
        self.cluster = connect(cfg.rollout.ray_address, timeout_s=timeout_s,
                               num_cpus=max(need + rollout_cpus(cfg), os.cpu_count() or 1),
                               weights=weight_bytes(policies))
        try:
            self.cluster.require(
                "CPU", need,
                what=f"trainer_backend=ray needs {need} CPUs ({len(policies)} agents x "
                     f"{self.threads} CPU each, threads={cfg.threads})",
                hint="lower threads or add nodes")
            self._start(timeout_s, start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, timeout_s: float, start_timeout_s: float) -> None:
        remote_cls = ray.remote(TrainerActor)
        bundle = {"CPU": self.threads}
        reward = get_reward_spec(self.cfg.reward.name)    # the driver's, to every actor
        for k, pol in enumerate(self.policies):
            pg = self.cluster.reserve(        # one bundle per rank (DP=1)
                [bundle], timeout_s=timeout_s,
                what=f"agent {pol.name!r}: the placement group for its trainer actor x {bundle}",
                hint="lower threads or free resources")
            self._pgs.append(pg)
            self._actors.append(remote_cls.options(
                num_cpus=self.threads, max_restarts=0, max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=0),
            ).remote(ray.put(pol), self.cfg, k, self.threads, reward))
        for k, a in enumerate(self._actors):
            self.cluster.wait_started(a.ready.remote(), timeout_s=start_timeout_s,
                                      what=f"the trainer actor of agent {self.names[k]!r}")
        log.info("ray trainer groups: %d agents x 1 actor on %s", len(self._actors),
                 self.cluster.address)

    def actor(self, k: int):
        """Agent k's actor handle (for inspection and fault-injection tests)."""
        return self._actors[k]

    def _get(self, k: int, ref):
        """ray.get of agent k's call; a dead actor, or one that does not answer within
        ``trainer_call_timeout_s`` (0: no limit; it is killed), is a clear error, not a hang."""
        timeout_s = getattr(self.cfg, "trainer_call_timeout_s", 0)
        try:
            return ray.get(ref, timeout=timeout_s if timeout_s > 0 else None)
        except GetTimeoutError:
            ray.kill(self._actors[k], no_restart=True)
            raise RuntimeError(
                f"the trainer actor of agent {self.names[k]!r} did not answer a call within "
                f"trainer_call_timeout_s={timeout_s:g} s (alive but hung) and was killed; its "
                f"policy and optimizer state cannot be recovered mid-step: resume the run from "
                f"its last checkpoint with --resume (and raise trainer_call_timeout_s if its "
                f"steps are legitimately this slow)") from None
        except RayActorError as e:
            raise RuntimeError(
                f"the trainer actor of agent {self.names[k]!r} died ({type(e).__name__}); its "
                f"policy and optimizer state cannot be recovered mid-step: resume the run from "
                f"its last checkpoint with --resume") from e

    # -- the agent group ------------------------------------------------------------------------
    def old_logprobs(self, pool: StepPool, prompt_ids, micro_batch: int, temperature: float,
                     sw) -> None:
        """As pool.compute_old_logprobs, every generator's actor at once."""
        lp = torch.full((pool.num_samples,), float("nan"))
        toks: list[torch.Tensor] = [torch.empty(0)] * pool.num_samples
        idxs, refs = [], []
        for k, a in enumerate(self._actors):
            idx = (pool.agent == k).nonzero().flatten().tolist()
            idxs.append(idx)
            refs.append(a.old_logprobs.remote(
                [prompt_ids[k][int(pool.prompt[i])] for i in idx],
                [pool.response_ids[i] for i in idx], micro_batch, temperature))
        for k, (idx, ref) in enumerate(zip(idxs, refs)):
            seq, tl, seconds = self._get(k, ref)
            lp[idx] = seq
            for j, i in enumerate(idx):
                toks[i] = tl[j]
            key = f"time/old_logprobs/{self.names[k]}"
            sw[key] = sw.get(key, 0.0) + seconds
        pool.lp_old, pool.old_token_logp = lp, toks

    def update(self, k: int, view: LearnerView, pool: StepPool, *, generator: torch.Generator,
               nonfinite: dict, ratio_log: dict | None, sw) -> dict[str, float]:
        return actor_update(lambda ref: self._get(k, ref), self._actors[k], view, pool,
                            generator=generator, nonfinite=nonfinite, ratio_log=ratio_log, sw=sw)

    def update_all(self, views: Sequence[LearnerView], pool: StepPool, *,
                   generator: torch.Generator, nonfinite: dict,
                   ratio_logs: Sequence[dict | None], sw, timer) -> list[dict[str, float]]:
        """Every agent's :meth:`update` for two agents or more (agent k on ``views[k]``,
        ``timer(k)`` entered around its wait), all actors at once: the driver draws every
        agent's minibatches from ``generator`` in agent order (the draws of one agent after
        another), each actor runs its updates from a non-finite streak of 0 and returns their
        trace, awaited by a driver thread each (:func:`~hacpo.engine.rollout.agents_at_once`),
        and the driver counts the traces in agent order
        (:func:`~hacpo.engine.update.replay_nonfinite`: the same counters, and the error at the
        same update, as one agent after another; a later agent's actor may by then have run
        updates of a run that stops). Bit-for-bit the
        updates of one agent after another."""
        refs = [self._actors[k].update_drawn.remote(
                    v, pool.lp_old, pool.old_token_logp, draw_minibatches(self.cfg, v, pool,
                                                                          generator),
                    ratio_logs[k] is not None) for k, v in enumerate(views)]

        def wait(k: int):
            with timer(k):
                return self._get(k, refs[k])

        # in agent order, each result (or its actor's error) before the next: a streak that
        # stops the run at agent k is raised before a later agent's failure, as in sequence
        return [drawn_update_result(f.result(), self.names[k], nonfinite,
                                    self.cfg.max_nonfinite, ratio_logs[k], sw)
                for k, f in enumerate(agents_at_once(len(views), wait, name="update"))]

    def pull_weights(self, k: int) -> None:
        """Copy agent k's trained weights into the driver's policy (what engines read)."""
        self.policies[k].load_state_dict(self._get(k, self._actors[k].weights.remote()))

    def state_dict(self, k: int) -> dict[str, Any]:
        return self._get(k, self._actors[k].state_dict.remote())

    def load_state_dict(self, k: int, sd: dict[str, Any]) -> None:
        self._get(k, self._actors[k].load_state_dict.remote(sd))
        self.policies[k].load_state_dict(sd["model"])

    def checkpoint_saved(self) -> None:
        """Everything is inside the checkpoint file: nothing to clean up."""

    def evaluate(self, prompt_ids: list[list[list[int]]], golds: list[str], rc,
                 **kwargs) -> list[dict]:
        """evaluate_policy in every agent's actor at once (``rc`` is the driver's; each actor
        scores with its own RewardComputer of the same reward)."""
        refs = [a.evaluate.remote(prompt_ids[k], golds, kwargs)
                for k, a in enumerate(self._actors)]
        return [self._get(k, r) for k, r in enumerate(refs)]

    def close(self) -> None:
        """Stop the actors' reward workers, kill the actors, remove the placement groups,
        stop/leave the cluster. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if ray.is_initialized():
            for a in self._actors:
                try:
                    ray.get(a.close.remote(), timeout=30)
                except Exception as e:   # dead already
                    log.debug("trainer actor close: %s", e)
        RayCluster.release(self._actors, self._pgs)
        self._actors, self._pgs = [], []
        if self.cluster is not None:
            self.cluster.shutdown()
