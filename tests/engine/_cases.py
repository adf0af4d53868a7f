"""Shared test inputs for update_learner: a learner view over a few prompts with self and
cross samples."""
import torch

from hacpo.engine.pool import LearnerView, score_responses
from hacpo.models.policy import PolicyConfig, build_policy


def char_policy(name: str, seed: int):
    """A one-layer plain-torch decoder over the char tokenizer (d_model 32, 2 heads)."""
    return build_policy(PolicyConfig(name=name, kind="decoder", tokenizer="char", d_model=32,
                                     n_layers=1, n_heads=2, max_len=64, seed=seed))


def learner_setup():
    """(policy "p", view, lp_old, prompt index of each sample): :func:`learner_case` over a
    :func:`char_policy` (torch's global seed set first)."""
    torch.manual_seed(0)
    pol = char_policy("p", 3)
    return (pol, *learner_case(pol))


def learner_case(pol, operands=((1, 2), (3, 4), (5, 6))):
    """3 prompts "a+b=" (one per pair in ``operands``) x (3 self + 2 cross) samples with random
    responses of 1..6 tokens. Old log-probs: self samples at ``pol``'s current log-probs (ratio
    1), cross samples 0.1 nats lower. Returns (view, lp_old, prompt index of each sample)."""
    tok = pol.tokenizer
    g = torch.Generator().manual_seed(1)
    prompts = [tok.prompt_ids(f"{a}+{b}=") for a, b in operands]
    p_of, p_ids, r_ids, is_self = [], [], [], []
    for p in range(len(prompts)):
        for s in range(5):
            L = 1 + int(torch.randint(0, 6, (1,), generator=g))
            p_of.append(p)
            p_ids.append(prompts[p])
            r_ids.append(torch.randint(4, tok.vocab_size, (L,), generator=g).tolist())
            is_self.append(s < 3)
    n = len(r_ids)
    lp_now, _ = score_responses(pol, p_ids, r_ids, micro_batch=64)
    is_self = torch.tensor(is_self)
    lp_old = lp_now - 0.1 * (~is_self).float()
    view = LearnerView(torch.arange(n), torch.linspace(-1, 1, n), torch.full((n,), 0.7),
                       is_self, p_ids, r_ids, {})
    return view, lp_old, torch.tensor(p_of)
