"""Held-out evaluation: greedy accuracy (avg@1) and sampled pass@k with the unbiased
estimator, using the same verifier as training."""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

from hacpo.models.generation import generate


def score_named(rc, texts: list[str], golds: list[str], where):
    """rc.score, with a bad-reward error extended by ``where(i)`` (its prompt and agent)."""
    try:
        return rc.score(texts, golds)
    except ValueError as e:
        # the item's index: RewardComputer's error holds it (its message may hold another
        # "item 7", in the reward's name or value); another scorer's message names it
        index = getattr(e, "item", None)
        if index is None:
            m = re.search(r"item (\d+)", str(e))
            if not m:
                raise
            index = int(m.group(1))
        raise ValueError(f"{e} ({where(index)})") from e


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021):
    1 - C(n-c, k) / C(n, k). Needs 1 <= k <= n and 0 <= c <= n (ValueError otherwise: with
    fewer samples than k there is no unbiased estimate)."""
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def mean_and_stderr(per_problem: Sequence[float]) -> tuple[float, float]:
    """Mean of per-problem scores (avg@k) and its standard error over problems: the population
    sd over sqrt(n), in float64 — for 0/1 rewards with k = 1 the binomial sqrt(p(1-p)/n); for
    rewards in between (``numeric_closeness``, a reward of one's own) or k > 1 the binomial
    form overstates it."""
    n = len(per_problem)
    m = sum(per_problem) / n
    return m, math.sqrt(sum((v - m) ** 2 for v in per_problem) / n / n)


MAX_EVAL_ROWS = 8192     # responses one evaluation call generates at most


def sample_and_score(policy, prompt_ids: list[list[int]], golds: list[str], reward_computer, *,
                     max_new_tokens: int, samples: int = 1, temperature: float = 0.0,
                     top_p: float = 1.0, batch: int = 128, seed: int = 0,
                     where=lambda i: f"prompt {i}", engine=None, agent: int | None = None):
    """Generate ``samples`` responses per prompt (batched) and score them with the verifier.

    The responses come from ``policy`` in-process (its KV-cache sampler, a generator seeded
    with ``seed``), or with ``engine`` from that rollout engine's agent ``agent``, its
    generator reseeded with ``seed`` (the caller restores the engine's state if training goes
    on; ``policy`` then only decodes and names): with the local engine, the same samples.
    Returns (rewards [n][samples], texts [n][samples], stats) with stats holding
    mean_response_tokens and eos_rate.
    ``where(prompt_index)`` names a prompt in errors."""
    if engine is not None and agent is None:
        raise ValueError("sampling with a rollout engine needs the agent index")
    was = policy.training
    policy.eval()
    gen = torch.Generator().manual_seed(seed)
    if engine is not None:
        engine.seed_agent(agent, seed)
    rewards: list[list[float]] = [[] for _ in prompt_ids]
    texts: list[list[str]] = [[] for _ in prompt_ids]
    lengths: list[int] = []
    eos = 0
    # at most MAX_EVAL_ROWS responses per generate call: ``batch`` prompts x ``samples`` (as
    # always up to it), else fewer prompts, and the samples in chunks (pass@k with a large k:
    # 128 prompts x 100000 samples at once took 22 GB before it was killed)
    per = max(1, min(batch, MAX_EVAL_ROWS // samples))
    chunk = min(samples, MAX_EVAL_ROWS)
    calls = [(s, k, min(chunk, samples - k)) for s in range(0, len(prompt_ids), per)
             for k in range(0, samples, chunk)]
    try:
        for s, _, n in calls:
            if engine is not None:
                ro = engine.generate(agent, prompt_ids[s:s + per], num_samples=n,
                                     max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p)
            else:
                ro = generate(policy, prompt_ids[s:s + per], num_samples=n,
                              max_new_tokens=max_new_tokens, temperature=temperature,
                              top_p=top_p, generator=gen)
            out = [policy.tokenizer.decode(r) for r in ro.response_ids]
            idx = [s + i for i in ro.prompt_index]
            r, _ = score_named(reward_computer, out, [golds[i] for i in idx],
                               lambda j: f"{where(idx[j])}, agent {policy.name}")
            for i, text, rew in zip(idx, out, r):
                rewards[i].append(float(rew))
                texts[i].append(text)
            lengths += ro.response_lengths
            eos += sum(ro.finished_eos)
    finally:
        policy.train(was)
    stats = {"mean_response_tokens": sum(lengths) / max(len(lengths), 1),
             "eos_rate": eos / max(len(lengths), 1)}
    return rewards, texts, stats


def evaluate_policy(policy, prompt_ids: list[list[int]], golds: list[str], reward_computer, *,
                    max_new_tokens: int, samples: int = 1, temperature: float = 0.0,
                    top_p: float = 1.0, batch: int = 128, seed: int = 0, engine=None,
                    agent: int | None = None) -> dict[str, float]:
    """Accuracy of ``policy`` on the prompts. samples=1 & temperature=0: greedy avg@1.
    With samples>1: avg@k (mean reward) and pass@k (unbiased, k = samples). ``engine`` /
    ``agent``: sample with that rollout engine's agent instead (:func:`sample_and_score`).
    ValueError on no prompts (an empty held-out set is the caller's to skip)."""
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("evaluate_policy: no prompts to evaluate (the held-out set is empty; "
                         "with data.eval_size=0 the evaluation is to be skipped)")
    if len(golds) != n:
        raise ValueError(f"evaluate_policy: {n} prompts but {len(golds)} gold answers")
    if samples < 1:
        raise ValueError(f"evaluate_policy: samples must be >= 1, got {samples}")
    rewards, _, stats = sample_and_score(
        policy, prompt_ids, golds, reward_computer, max_new_tokens=max_new_tokens,
        samples=samples, temperature=temperature, top_p=top_p, batch=batch, seed=seed,
        where=lambda i: f"held-out prompt {i}", engine=engine, agent=agent)
    if bad := [i for i, r in enumerate(rewards) if len(r) != samples]:
        raise RuntimeError(f"evaluate_policy: {len(bad)} prompt(s) (first: {bad[0]}) got "
                           f"{len(rewards[bad[0]])} responses, not {samples}")
    # in float64, summed per problem then over problems (as `hacpo eval` does): a float32
    # mean of n rewards is not k/n (0.372 read 0.37200000882), so the run's own accuracy and
    # `hacpo eval` of its checkpoint on its held-out set would differ in the last digits
    acc, se = mean_and_stderr([sum(r) / samples for r in rewards])
    out = {"accuracy": acc, "stderr": se, "n": n, **stats}
    if samples > 1:
        correct = [sum(x > 0.5 for x in r) for r in rewards]
        out[f"pass@{samples}"] = sum(pass_at_k(samples, c, samples) for c in correct) / n
    return out
