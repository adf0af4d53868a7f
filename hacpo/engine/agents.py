"""Agent groups: where each agent's trainable state (policy, optimizer, reference policy) lives
and runs. ``trainer_backend = "local"``: in the driver's process (:class:`LocalAgents`);
``"ray"``: one Ray actor per agent (:class:`hacpo.launch.ray_trainer.RayAgents`). Both offer the
same methods, so the driver's loop does not depend on the choice.

The driver always holds a :class:`~hacpo.models.policy.Policy` per agent (``policies``): its
tokenizer re-tokenizes cross samples and templates prompts, and rollout engines read its
weights. With local agents it *is* the trained policy; with Ray agents it is a CPU copy that
:meth:`pull_weights` refreshes after each update.
"""
from __future__ import annotations

from typing import Any

import torch

from hacpo.models.policy import Policy

from . import build
from .evaluate import evaluate_policy
from .pool import LearnerView, StepPool, compute_old_logprobs
from .run_config import TrainConfig
from .update import update_learner


class LocalAgents:
    """Every agent's policy, optimizer and reference policy in this process."""

    def __init__(self, cfg: TrainConfig, policies: list[Policy]):
        self.cfg = cfg
        self.policies = list(policies)
        self.names = [p.name for p in policies]
        # fp32 master weights for bfloat16 / float16 policies (update.MasterWeightAdamW)
        self.optims = build.build_optimizers(cfg, self.policies)
        self.refs = build.reference_policies(cfg, self.policies)

    def old_logprobs(self, pool: StepPool, prompt_ids, micro_batch: int, temperature: float,
                     sw) -> None:
        """pool.lp_old / old_token_logp from each generator's own forward pass."""
        compute_old_logprobs(pool, self.policies, prompt_ids, micro_batch, temperature,
                             timer=sw.scoped("time/old_logprobs/"))

    def update(self, k: int, view: LearnerView, pool: StepPool, *, generator: torch.Generator,
               nonfinite: dict, ratio_log: dict | None, sw) -> dict[str, float]:
        """Agent k's M minibatch updates (update.py); timings go to ``sw``."""
        cfg = self.cfg
        return update_learner(cfg.algorithm, self.policies[k], self.optims[k], view,
                              lp_old=pool.lp_old, old_token_logp=pool.old_token_logp,
                              prompt_of_sample=pool.prompt, generator=generator,
                              micro_batch=cfg.micro_batch,
                              grad_clip=cfg.agents[k].optim.grad_clip, nonfinite=nonfinite,
                              max_nonfinite=cfg.max_nonfinite, ref_policy=self.refs[k],
                              kl_coef=cfg.algorithm.loss.kl_coef, ratio_log=ratio_log,
                              temperature=score_temperature(cfg),
                              timer=sw.scoped("time/", f"/{self.names[k]}"))

    def pull_weights(self, k: int) -> None:
        """The driver's policy is the trained one: nothing to copy."""

    def state_dict(self, k: int) -> dict[str, Any]:
        r = self.refs[k]
        return {"model": self.policies[k].state_dict(), "optim": self.optims[k].state_dict(),
                **({"ref_model": r.state_dict()} if r is not None else {})}

    def load_state_dict(self, k: int, sd: dict[str, Any]) -> None:
        self.policies[k].load_state_dict(sd["model"])
        self.optims[k].load_state_dict(sd["optim"])
        if self.refs[k] is not None:
            self.refs[k].load_state_dict(sd["ref_model"])

    def checkpoint_saved(self) -> None:
        """Called after a checkpoint with the last ``state_dict`` s is on disk: nothing kept
        outside the checkpoint file here."""

    def evaluate(self, prompt_ids: list[list[list[int]]], golds: list[str], rc,
                 **kwargs) -> list[dict]:
        """evaluate_policy for every agent k on its tokenization ``prompt_ids[k]``."""
        return [evaluate_policy(p, prompt_ids[k], golds, rc, **kwargs)
                for k, p in enumerate(self.policies)]

    def close(self) -> None:
        """Nothing to release in-process."""


def update_agents(agents, views: list[LearnerView], pool: StepPool, *,
                  generator: torch.Generator, nonfinite: dict, ratio_logs: list[dict | None],
                  sw, timer, at_once: bool = True) -> list[dict[str, float]]:
    """Every agent's update of a step (agent k on ``views[k]``, ``timer(k)`` entered around
    it): the group's ``update_all`` where it has one and there are two agents or more (Ray
    actors and megatron groups update at once), else, or with ``at_once=False``
    (``agents_at_once``), ``update`` one agent after another (the same updates)."""
    if at_once and len(views) > 1 and hasattr(agents, "update_all"):
        return agents.update_all(views, pool, generator=generator, nonfinite=nonfinite,
                                 ratio_logs=ratio_logs, sw=sw, timer=timer)
    out = []
    for k, view in enumerate(views):
        with timer(k):
            out.append(agents.update(k, view, pool, generator=generator, nonfinite=nonfinite,
                                     ratio_log=ratio_logs[k], sw=sw))
    return out


def score_temperature(cfg: TrainConfig) -> float:
    """Log-probs for ratios are taken under the sampling distribution's temperature."""
    return cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0


def build_agents(cfg: TrainConfig, policies: list[Policy]):
    """The configured agent group (``trainer_backend``); Ray is imported only for "ray"."""
    if cfg.trainer_backend == "local":
        return LocalAgents(cfg, policies)
    if cfg.trainer_backend == "ray":
        if any(a.trainer == "megatron" for a in cfg.agents):   # tp x pp x dp rank actors
            from hacpo.launch.megatron_trainer import MegatronAgents
            return MegatronAgents(cfg, policies)
        from hacpo.launch.ray_trainer import RayAgents
        return RayAgents(cfg, policies)
    raise ValueError(f"unknown trainer_backend {cfg.trainer_backend!r}")
