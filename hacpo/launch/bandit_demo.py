"""A seconds-long demo of the algorithm library on a toy problem (no language model).

Each agent is a tabular softmax policy over K candidate answers for each of P prompts (one
answer correct). Agents start with different skill (a different logit bonus on the correct
answer), sample G answers per prompt per step, and are trained with the chosen algorithm
through the same glue the trainer uses (capability tracker -> per-learner advantages ->
minibatch losses). A response is a single token, so its mean log-prob is log pi(answer).
"""
from __future__ import annotations

import torch

from hacpo.engine import CapabilityTracker, preset
from hacpo.engine.algorithm import learner_loss, learner_samples, sample_omega, split_minibatches


def run(algorithm: str = "hacpo", *, agents: int = 3, prompts: int = 64, answers: int = 8,
        group: int = 4, steps: int = 60, lr: float = 0.5, seed: int = 0, log_every: int = 10,
        echo=print) -> list[float]:
    cfg = preset(algorithm)
    g = torch.Generator().manual_seed(seed)
    correct = torch.randint(answers, (prompts,), generator=g)
    skill = torch.linspace(0.0, 1.5, agents)                       # agent k's head start
    logits = [(torch.randn(prompts, answers, generator=g) * 0.5).scatter_add(
        1, correct[:, None], torch.full((prompts, 1), float(s))).requires_grad_() for s in skill]
    opts = [torch.optim.SGD([w], lr=lr) for w in logits]
    tracker = CapabilityTracker(agents, **vars(cfg.capability))
    G = group * cfg.samples_per_prompt_factor
    M = cfg.num_minibatches * cfg.minibatch_factor
    for step in range(steps):
        # rollout: every agent samples G answers for every prompt from its frozen old policy
        with torch.no_grad():
            probs = [torch.softmax(w, -1) for w in logits]
            ans = torch.stack([torch.multinomial(p, G, replacement=True, generator=g)
                               for p in probs])                      # [n, P, G]
            old_lp = torch.stack([torch.log(p.gather(1, x)) for p, x in zip(probs, ans)])
        rewards = (ans == correct[None, :, None]).float().flatten()  # verifier
        agent = torch.arange(agents).repeat_interleave(prompts * G)
        prompt = torch.arange(prompts).repeat_interleave(G).repeat(agents)
        answer, old = ans.flatten(), old_lp.flatten()
        tracker.update(rewards, agent)
        ratios = tracker.ratios()
        for k in range(agents):
            idx, adv = learner_samples(cfg, rewards, prompt, agent, learner=k, ratios=ratios)
            is_self = agent[idx] == k
            omega = sample_omega(cfg, agent[idx], k, ratios)
            for m, mb in enumerate(split_minibatches(prompt[idx], is_self, M,
                                                     cfg.minibatch_order, g)):
                j = idx[mb]
                new = torch.log_softmax(logits[k], -1)[prompt[j], answer[j]]
                # single-token responses: the token-level (grpo) view is a [N, 1] matrix
                loss, _ = learner_loss(cfg, new_lp=new, old_lp=old[j], advantages=adv[mb],
                                       is_self=is_self[mb], omega=omega[mb], minibatch_index=m,
                                       token_logp=new[:, None], old_token_logp=old[j][:, None],
                                       mask=torch.ones(len(j), 1, dtype=torch.bool))
                opts[k].zero_grad()
                loss.backward()
                opts[k].step()
        if step % log_every == 0 or step == steps - 1:
            acc = [float(torch.softmax(w.detach(), -1).gather(1, correct[:, None]).mean()) for w in logits]
            echo(f"{algorithm:6s} step {step:3d}  expected accuracy per agent: "
                 + "  ".join(f"{a:.3f}" for a in acc))
    return acc
