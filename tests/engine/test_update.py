"""update_learner: metrics are means over the right subsets whatever the micro-batching, the
gradient does not depend on the micro-batch size, the self/cross split or on prompts being
forwarded once for both parts (prompt states) versus whole sequences, and every stage is
charged to the timer."""
import math

import pytest
import torch

from hacpo.engine import preset
from hacpo.engine.pool import LearnerView, score_responses
from hacpo.engine.timing import Stopwatch
from hacpo.engine.update import update_learner
from tests.engine._cases import char_policy, learner_setup


@pytest.fixture
def setup():
    return learner_setup()


def _run(pol, view, lp_old, p_of, micro_batch, timer=None, algo="hacpo"):
    opt = torch.optim.SGD(pol.parameters(), lr=0.5)
    kw = {} if timer is None else {"timer": timer}
    m = update_learner(preset(algo, {"num_minibatches": 1}), pol, opt, view, lp_old=lp_old,
                       old_token_logp=[], prompt_of_sample=p_of,
                       generator=torch.Generator().manual_seed(0), micro_batch=micro_batch,
                       grad_clip=0.0, nonfinite={"streak": 0, "total": 0}, max_nonfinite=3, **kw)
    return m, torch.cat([p.detach().flatten() for p in pol.parameters()])


@pytest.mark.parametrize("micro_batch", [1, 4, 64])
def test_metrics_are_subset_means(setup, micro_batch):
    pol, view, lp_old, p_of = setup
    m, _ = _run(pol, view, lp_old, p_of, micro_batch)
    # before the step the learner is the generator of its self samples: ratio exactly 1;
    # cross ratios are exp(0.1) > 1, all above the stepwise upper bound 1
    assert m["self_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["cross_ratio_mean"] == pytest.approx(math.exp(0.1), abs=1e-4)
    assert m["self_count"] == 9 and m["cross_count"] == 6
    assert m["self_clip_frac"] == 0.0
    assert m["cross_clip_high_frac"] == 1.0 and m["cross_clip_low_frac"] == 0.0


def test_gradient_independent_of_micro_batch(setup):
    pol, view, lp_old, p_of = setup
    state = {k: v.clone() for k, v in pol.state_dict().items()}
    _, w1 = _run(pol, view, lp_old, p_of, micro_batch=1)
    pol.load_state_dict(state)
    _, w64 = _run(pol, view, lp_old, p_of, micro_batch=64)
    before = torch.cat([v.flatten() for k, v in state.items()
                        if k in dict(pol.named_parameters())])
    assert (w64 - before).abs().max() > 1e-3          # the step moved the weights
    torch.testing.assert_close(w1, w64, rtol=0, atol=2e-6)


@pytest.mark.parametrize("micro_batch", [1, 4, 64])
def test_shared_prompt_states_equal_whole_sequences(setup, micro_batch):
    """Prompts forwarded once per micro-batch for self and cross rows, with one backward through
    them, give the gradient of the whole-sequence forward (share_prompts=False)."""
    pol, view, lp_old, p_of = setup
    assert pol.supports_prompt_states
    state = {k: v.clone() for k, v in pol.state_dict().items()}
    m_shared, w_shared = _run(pol, view, lp_old, p_of, micro_batch)
    pol.load_state_dict(state)
    pol.share_prompts = False
    m_whole, w_whole = _run(pol, view, lp_old, p_of, micro_batch)
    before = torch.cat([v.flatten() for k, v in state.items()
                        if k in dict(pol.named_parameters())])
    assert (w_whole - before).abs().max() > 1e-3
    torch.testing.assert_close(w_shared, w_whole, rtol=0, atol=2e-6)
    assert m_shared["loss"] == pytest.approx(m_whole["loss"], abs=1e-6)
    # 3 prompts x 5 rows: each prompt forwarded once, also when its rows run in several
    # micro-batches (micro_batch=1, 4)
    plen = sum(len(view.prompt_ids[j]) for j in (0, 5, 10))
    assert m_shared["tokens_forward_prompt"] == plen
    assert m_whole["tokens_forward_prompt"] == 0


def test_stages_are_timed(setup):
    pol, view, lp_old, p_of = setup
    sw = Stopwatch()
    _run(pol, view, lp_old, p_of, micro_batch=5, timer=sw.scoped("time/", "/p"))
    assert set(sw) == {f"time/{k}/p" for k in ("score_prompt", "score_self", "score_cross",
                                                "backward_prompt", "backward_self",
                                                "backward_cross", "optimizer")}
    assert all(v > 0 for v in sw.values())
    pol.share_prompts = False          # whole sequences: no prompt pass
    sw = Stopwatch()
    _run(pol, view, lp_old, p_of, micro_batch=4, timer=sw.scoped("time/", "/p"))
    assert set(sw) == {f"time/{k}/p" for k in ("score_self", "score_cross", "backward_self",
                                                "backward_cross", "optimizer")}
    pol.share_prompts = True
    # gspo trains on self samples only: nothing is charged to cross scoring
    sw = Stopwatch()
    view_self = LearnerView(view.idx[:3], view.advantages[:3], view.omega[:3],
                            view.is_self[:3], view.prompt_ids[:3], view.response_ids[:3], {})
    _run(pol, view_self, lp_old, p_of, micro_batch=4, timer=sw.scoped("time/", "/p"),
         algo="gspo")
    assert "time/score_cross/p" not in sw and sw["time/score_self/p"] > 0


@pytest.mark.parametrize("algo", ["grpo", "gspo"])
def test_kl_term_is_aggregated_like_the_policy_loss(setup, algo):
    """The KL penalty is averaged as the loss is: over tokens for grpo's token-mean loss (before:
    per-sequence means divided by the token count, ~the mean response length too small), over
    sequences for gspo's sequence-mean loss. The update's loss (before its step) is the policy
    loss plus kl_coef times that mean."""
    from hacpo.engine import grpo_policy_loss, gspo_policy_loss, low_var_kl
    from hacpo.engine.pool import score_responses

    pol, view, lp_old, p_of = setup
    ref = char_policy("ref", 4)
    n = view.idx.numel()
    view = LearnerView(view.idx, view.advantages, view.omega, torch.ones(n, dtype=torch.bool),
                       view.prompt_ids, view.response_ids, {})      # self samples only
    _, old_tl = score_responses(pol, view.prompt_ids, view.response_ids, micro_batch=64)
    m = update_learner(preset(algo, {"num_minibatches": 1}), pol,
                       torch.optim.SGD(pol.parameters(), lr=0.0), view, lp_old=lp_old,
                       old_token_logp=old_tl, prompt_of_sample=p_of,
                       generator=torch.Generator().manual_seed(0), micro_batch=4,
                       grad_clip=0.0, nonfinite={"streak": 0, "total": 0}, max_nonfinite=3,
                       ref_policy=ref, kl_coef=0.5)
    with torch.no_grad():
        tl, mask = pol.response_logprobs(view.prompt_ids, view.response_ids)
        rtl, _ = ref.response_logprobs(view.prompt_ids, view.response_ids)
        d = (rtl - tl).clamp(-20, 20)
        k3 = (torch.exp(d) - d - 1).clamp(-10, 10) * mask
        if algo == "grpo":
            otl = torch.zeros_like(tl)
            for i, t in enumerate(old_tl):
                otl[i, :t.numel()] = t
            pg, _ = grpo_policy_loss(tl, otl, mask, view.advantages)
            kl = k3.sum() / mask.sum()                      # token mean
        else:
            pg, _ = gspo_policy_loss((tl * mask).sum(-1) / mask.sum(-1), lp_old,
                                     view.advantages)
            kl = low_var_kl(tl, rtl, mask).mean()           # sequence mean
        assert mask.sum(-1).float().std() > 0               # lengths differ: the two means do
    assert kl > 0.01
    assert m["loss"] == pytest.approx((pg + 0.5 * kl).item(), rel=1e-5, abs=1e-7)


def _subset_view(view, lp_old, p_of, keep):
    keep_t = torch.tensor(keep, dtype=torch.long)
    v = LearnerView(view.idx[keep_t], view.advantages[keep_t], view.omega[keep_t],
                    view.is_self[keep_t], [view.prompt_ids[j] for j in keep],
                    [view.response_ids[j] for j in keep], {})
    return v, lp_old, p_of


def test_metrics_pool_samples_over_uneven_minibatches(setup):
    """One minibatch per prompt, holding 2, 0 and 1 cross rows: the logged cross metrics are
    means over the step's 3 cross rows (not a mean of per-minibatch means, counting the empty
    one as 0), and the counts are the step's."""
    pol, view, lp_old, p_of = setup
    lp_old = lp_old.clone()
    lp_old[~view.is_self] += torch.tensor([0.0, 0.5, 0.0, 0.0, 1.0, 0.0])  # varied ratios
    # prompt 0: rows 0-4 (3 self, 2 cross); prompt 1: self rows 5-7 only; prompt 2: 10-13
    keep = [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13]
    v, _, _ = _subset_view(view, lp_old, p_of, keep)
    opt = torch.optim.SGD(pol.parameters(), lr=0.0)       # ratios stay as at the start
    m = update_learner(preset("hacpo", {"num_minibatches": 3}), pol, opt, v, lp_old=lp_old,
                       old_token_logp=[], prompt_of_sample=p_of,
                       generator=torch.Generator().manual_seed(0), micro_batch=4,
                       grad_clip=0.0, nonfinite={"streak": 0, "total": 0}, max_nonfinite=3)
    lp_now, _ = score_responses(pol, v.prompt_ids, v.response_ids, micro_batch=64)
    s = torch.exp(lp_now - lp_old[v.idx])
    cross = ~v.is_self
    assert m["cross_ratio_mean"] == pytest.approx(float(s[cross].mean()), abs=1e-5)
    assert m["self_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    # lower bounds 0.8, 0.825, 0.85 by minibatch: exp(-1 + 0.1) < all, exp(-0.4) < all
    assert m["cross_clip_low_frac"] == pytest.approx(2 / 3)
    assert m["cross_clip_high_frac"] == pytest.approx(1 / 3)
    assert m["self_count"] == 9 and m["cross_count"] == 3


def test_metrics_without_cross_rows_are_left_out_not_zero(setup):
    """A step whose cross samples were all dropped has no cross ratio: the cross means are left
    out (no value that step), not reported as 0."""
    pol, view, lp_old, p_of = setup
    keep = [j for j in range(len(view.response_ids)) if bool(view.is_self[j])]
    v, _, _ = _subset_view(view, lp_old, p_of, keep)
    opt = torch.optim.SGD(pol.parameters(), lr=0.0)
    m = update_learner(preset("hacpo", {"num_minibatches": 2}), pol, opt, v, lp_old=lp_old,
                       old_token_logp=[], prompt_of_sample=p_of,
                       generator=torch.Generator().manual_seed(0), micro_batch=4,
                       grad_clip=0.0, nonfinite={"streak": 0, "total": 0}, max_nonfinite=3)
    for key in ("cross_ratio_mean", "cross_clip_low_frac", "cross_clip_high_frac"):
        assert key not in m, key
    assert m["cross_lower_bound"] == pytest.approx(0.8125)     # mean of 0.8 and 0.825
    assert m["cross_count"] == 0 and m["self_count"] == 9
    assert m["self_ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_skipped_update_does_not_dilute_metrics():
    """Of two updates the first is non-finite and skipped: loss and ratio metrics are the
    applied update's, not halved by the skipped one."""
    class HalfNaN(torch.nn.Module):
        name = "half"

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def response_logprobs(self, prompts, resps, temperature=1.0):
            T = max(len(r) for r in resps)
            bad = torch.tensor([p == [9] for p in prompts])[:, None]
            x = torch.where(bad, torch.tensor(float("nan")), torch.tensor(0.0))
            return self.w * 1.0 + x.expand(len(resps), T), \
                torch.ones(len(resps), T, dtype=torch.bool)

    pol = HalfNaN()
    opt = torch.optim.SGD(pol.parameters(), lr=0.0)
    adv = torch.tensor([0.0, 0.0, 1.0, 3.0])
    view = LearnerView(torch.arange(4), adv, torch.ones(4), torch.ones(4, dtype=torch.bool),
                       [[9], [9], [1], [1]], [[2, 3]] * 4, {})
    state = {"streak": 0, "total": 0}
    m = update_learner(preset("gspo", {"num_minibatches": 2, "minibatch_order": "self_first"}),
                       pol, opt, view, lp_old=torch.zeros(4), old_token_logp=[],
                       prompt_of_sample=torch.tensor([0, 0, 1, 1]),
                       generator=torch.Generator().manual_seed(0), micro_batch=8,
                       grad_clip=0.0, nonfinite=state, max_nonfinite=3)
    assert m["skipped_updates"] == 1 and state == {"streak": 0, "total": 1}
    assert m["loss"] == pytest.approx(-2.0)           # -mean(1, 3) of the applied update
    assert m["self_ratio_mean"] == pytest.approx(1.0)


def test_empty_view_keeps_the_count_keys(setup):
    """A learner whose samples were all dropped logs the same count keys, as 0."""
    pol, view, lp_old, p_of = setup
    v, _, _ = _subset_view(view, lp_old, p_of, [])
    m = update_learner(preset("hacpo", {"num_minibatches": 2}), pol,
                       torch.optim.SGD(pol.parameters(), lr=0.0), v, lp_old=lp_old,
                       old_token_logp=[], prompt_of_sample=p_of,
                       generator=torch.Generator().manual_seed(0), micro_batch=4,
                       grad_clip=0.0, nonfinite={"streak": 0, "total": 0}, max_nonfinite=3)
    assert m == {"trained_samples": 0.0, "trained_self": 0.0, "trained_cross": 0.0,
                 "tokens_forward_prompt": 0.0}


def test_an_agent_whose_every_update_is_non_finite_stops_the_run():
    """The streak was the run's only (all agents' updates in order): an agent whose every
    update was skipped while another's were finite never stopped the run; each policy's own
    streak counts too. A checkpoint's counters without per-agent streaks (older) resume."""
    from hacpo.engine.update import NonFiniteUpdateError, replay_nonfinite
    ok = [{"finite": True, "loss": 1.0, "grad_norm": 1.0}]
    bad = [{"finite": False, "loss": float("nan"), "grad_norm": float("nan")}]
    state = {"streak": 0, "total": 0}            # as an older checkpoint holds them
    for _ in range(2):
        replay_nonfinite(ok, state, 3, "a")
        replay_nonfinite(bad, state, 3, "b")
    assert state == {"streak": 1, "total": 2, "agents": {"b": 2}}
    replay_nonfinite(ok, state, 3, "a")
    with pytest.raises(NonFiniteUpdateError, match=r"3 non-finite updates in a row for policy "
                                                   r"'b' \(of its own updates; other agents' "
                                                   r"between them were finite\)"):
        replay_nonfinite(bad, state, 3, "b")
    replay_nonfinite(ok, state, 3, "b")          # a finite update ends the policy's streak
    assert state == {"streak": 0, "total": 3}
