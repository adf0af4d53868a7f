"""The step's sample pool: every agent's responses to the step's prompts, their rewards, the
generators' old log-probs, and each learner's view of them (cross samples re-tokenized).

Sample i: agent[i] (who generated it), prompt[i] (index of its prompt in the step batch),
its response ids in the generator's tokenization, text, reward, and lp_old[i] — the mean token
log-prob under the generator at sampling time, computed by the generator's own forward pass
(final EOS excluded from the mean, SPEC "Sequence ratio").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hacpo.models.policy import Policy
from hacpo.models.retokenize import RetokStats, RetokStatus, retokenize

from .timing import null_timer


def scored_lengths(response_ids: list[list[int]], eos_id: int) -> list[int]:
    """How many leading tokens of each response count in the mean log-prob: all but a final
    EOS. 0 means the sample cannot be scored (empty or EOS-only)."""
    return [len(r) - (1 if r and r[-1] == eos_id else 0) for r in response_ids]


@torch.no_grad()
def score_responses(policy: Policy, prompts: list[list[int]], responses: list[list[int]],
                    micro_batch: int, *, temperature: float = 1.0):
    """Per-sample token log-probs of scoreable responses (no grad), in micro-batches.

    Returns (seq_mean [N] float32, token_logp list of [len_i] tensors); rows with no scored
    token get NaN / empty and must be dropped by the caller."""
    eos = policy.tokenizer.eos_id
    lens = scored_lengths(responses, eos)
    seq = torch.full((len(responses),), float("nan"))
    toks: list[torch.Tensor] = [torch.empty(0)] * len(responses)
    keep = [i for i, n in enumerate(lens) if n > 0]
    for s in range(0, len(keep), micro_batch):
        idx = keep[s:s + micro_batch]
        tl, mask = policy.response_logprobs([prompts[i] for i in idx],
                                            [responses[i][:lens[i]] for i in idx],
                                            temperature=temperature)
        seq[idx] = ((tl * mask).sum(-1) / mask.sum(-1)).float().cpu()
        for j, i in enumerate(idx):
            toks[i] = tl[j, :lens[i]].cpu()
    return seq, toks


@dataclass
class StepPool:
    """All agents' samples of one step (index order: agent-major, then prompt-major)."""
    agent: torch.Tensor                   # [N] long
    prompt: torch.Tensor                  # [N] long, index into the step's prompts
    response_ids: list[list[int]]         # generator's tokenization
    texts: list[str]
    finished_eos: list[bool]
    truncated: list[bool]
    rewards: torch.Tensor = None          # [N] float32
    lp_old: torch.Tensor = None           # [N] float32 (NaN: not scoreable)
    old_token_logp: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return len(self.response_ids)


def build_pool(rollouts) -> StepPool:
    agent, prompt, resp, texts, fin, trunc = [], [], [], [], [], []
    for k, (ro, tok) in enumerate(rollouts):
        agent += [k] * ro.num_samples
        prompt += list(ro.prompt_index)
        resp += ro.response_ids
        texts += [tok.decode(r, skip_special=True) for r in ro.response_ids]
        fin += ro.finished_eos
        trunc += ro.truncated
    return StepPool(torch.tensor(agent), torch.tensor(prompt), resp, texts, fin, trunc)


def compute_old_logprobs(pool: StepPool, policies: list[Policy],
                         prompt_ids: list[list[list[int]]], micro_batch: int,
                         temperature: float = 1.0, timer=null_timer) -> None:
    """lp_old from each generator's forward pass (no grad), in its own tokenization, under the
    sampling temperature (logits / T), as the ratio's numerator will be. ``timer(name)`` is
    entered around each generator's scoring."""
    lp = torch.full((pool.num_samples,), float("nan"))
    toks: list[torch.Tensor] = [torch.empty(0)] * pool.num_samples
    for k, policy in enumerate(policies):
        idx = (pool.agent == k).nonzero().flatten().tolist()
        with timer(policy.name):
            seq, tl = score_responses(policy, [prompt_ids[k][int(pool.prompt[i])] for i in idx],
                                      [pool.response_ids[i] for i in idx], micro_batch,
                                      temperature=temperature)
        lp[idx] = seq
        for j, i in enumerate(idx):
            toks[i] = tl[j]
    pool.lp_old, pool.old_token_logp = lp, toks


@dataclass
class LearnerView:
    """A learner's trainable samples: indices into the pool and its own token ids."""
    idx: torch.Tensor                     # [N_k] into the pool
    advantages: torch.Tensor              # [N_k]
    omega: torch.Tensor                   # [N_k]
    is_self: torch.Tensor                 # [N_k] bool
    prompt_ids: list[list[int]]           # learner's templated prompt per sample
    response_ids: list[list[int]]         # learner's tokenization (scored part only)
    dropped: dict[str, int]


def learner_view(pool: StepPool, learner: int, idx: torch.Tensor, adv: torch.Tensor,
                 omega: torch.Tensor, policies: list[Policy], prompt_ids, max_new_tokens: int,
                 retok_stats: RetokStats, drop_unencodable: bool) -> LearnerView:
    """Re-tokenize cross samples for the learner, drop samples with nothing to score.

    A cross sample is cut (``RetokStatus.TRUNCATED``) to what fits the learner's positions
    after its own prompt, and to ``max(4 * max_new_tokens, 16)`` tokens. With
    ``drop_unencodable``, samples flagged UNENCODABLE or INVALID_UTF8 are dropped (counted as
    ``unencodable``)."""
    tok = policies[learner].tokenizer
    room_of = policies[learner].max_len
    unencodable = RetokStatus.UNENCODABLE | RetokStatus.INVALID_UTF8
    keep, p_ids, r_ids = [], [], []
    dropped = {"empty": 0, "unencodable": 0, "no_old_logprob": 0}
    for j, i in enumerate(idx.tolist()):
        src = int(pool.agent[i])
        if src == learner:
            ids = pool.response_ids[i]
        else:
            room = room_of - len(prompt_ids[learner][int(pool.prompt[i])])
            ids, status = retokenize(pool.response_ids[i], policies[src].tokenizer, tok,
                                     max_len=max(min(max(max_new_tokens * 4, 16), room), 0))
            retok_stats.update(status, len(pool.response_ids[i]), len(ids))
            if status & unencodable and drop_unencodable:
                dropped["unencodable"] += 1
                continue
        n = scored_lengths([ids], tok.eos_id)[0]
        if n == 0:
            dropped["empty"] += 1
            continue
        if not torch.isfinite(pool.lp_old[i]):
            dropped["no_old_logprob"] += 1   # generator could not score it (empty response)
            continue
        keep.append(j)
        p_ids.append(prompt_ids[learner][int(pool.prompt[i])])
        r_ids.append(ids[:n])
    k = torch.tensor(keep, dtype=torch.long)
    return LearnerView(idx[k], adv[k], omega[k], pool.agent[idx[k]] == learner, p_ids, r_ids,
                       dropped)
