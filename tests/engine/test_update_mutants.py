"""Tests from a mutation audit of update.py / metrics.py / agents.py: each checks a behaviour
that a hand-made mutant of those files changed while every other test passed."""
import json

import pytest
import torch

from hacpo.engine import preset
from hacpo.engine.metrics import MetricsLogger
from hacpo.engine.update import UpdateMetrics, adamw, agent_streak, update_learner
from tests.engine._cases import char_policy, learner_setup


@pytest.fixture
def setup():
    return learner_setup()


def _rows(path, steps, last=""):
    with open(path, "w") as f:
        f.write("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in steps) + last)


def test_agent_streak_is_the_longer_of_the_runs_and_the_policys_own():
    """The streak a policy's next update starts from (megatron's agents update at once from
    it): its own when longer than the run's, the run's for a policy without one (and for an
    older checkpoint's counters, which hold the run's only)."""
    state = {"streak": 1, "total": 4, "agents": {"b": 3}}
    assert agent_streak(state, "b") == 3
    assert agent_streak(state, "a") == 1
    assert agent_streak({"streak": 2, "total": 2}, "b") == 2


def test_master_weights_survive_a_write_of_the_same_values():
    """A weight rewritten with the values it holds (the weights reloaded on resume) keeps its
    fp32 master: bfloat16 updates below half a weight's spacing go on accumulating, as they do
    without the write (a master taken from the rounded weight at each write never moves)."""
    def run(rewrite: bool):
        p = torch.nn.Parameter(torch.full((4,), 0.05, dtype=torch.bfloat16))
        opt = adamw([p], lr=1e-4)
        for _ in range(10):
            p.grad = torch.ones_like(p)
            opt.step()
            if rewrite:
                with torch.no_grad():
                    p.copy_(p.detach().clone())
        return p.detach().clone()

    plain = run(rewrite=False)
    assert (plain != torch.tensor(0.05, dtype=torch.bfloat16)).all()   # the updates added up
    torch.testing.assert_close(run(rewrite=True), plain, rtol=0, atol=0)


def test_master_weight_zero_grad_clears_the_low_precision_gradients():
    """zero_grad clears the bfloat16 weights' own gradients too: else each minibatch's backward
    adds to the gradients of the minibatches before."""
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.ones(2))
    opt = adamw([p, q], lr=1e-3)
    for set_to_none in (True, False):
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            assert p.grad is None and q.grad is None
        else:
            assert not p.grad.any() and not q.grad.any()


def test_master_weight_grad_scale_reaches_the_fp32_parameters():
    """A clip coefficient given to a MasterWeightAdamW over bfloat16 and fp32 parameters scales
    the fp32 parameters' gradients too (not only the masters' of the bfloat16 ones)."""
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.ones(2))
    opt = adamw([p, q], lr=1e-3)
    p.grad = torch.full_like(p, 2.0)
    q.grad = torch.full_like(q, 2.0)
    opt.step(grad_scale=torch.tensor(0.25))
    torch.testing.assert_close(q.grad, torch.full_like(q, 0.5), rtol=0, atol=0)


def test_resume_reports_the_steps_of_the_rows_it_drops(tmp_path):
    """A resume from step 2 keeps the rows of steps 0 and 1 and says which it dropped (the
    rows of 2 and 3, logged by the interrupted run after its checkpoint)."""
    path = tmp_path / "metrics.jsonl"
    _rows(path, [0, 1, 2, 3])
    log = MetricsLogger(str(tmp_path), start_step=2, tensorboard=False)
    assert log.dropped == [2, 3]
    assert [json.loads(ln)["step"] for ln in open(path)] == [0, 1]
    log.close()


def test_resume_over_an_unreadable_whole_last_row_is_an_error(tmp_path):
    """Only a last row cut short (no newline) is dropped on resume: a whole last line that is
    not a metrics row is an error naming the file and line, not silently dropped."""
    path = tmp_path / "metrics.jsonl"
    _rows(path, [0, 1], last="not json\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:line 3 is not a metrics row"):
        MetricsLogger(str(tmp_path), start_step=2, tensorboard=False)
    _rows(path, [0, 1], last='{"step": 2, "lo')            # cut short: dropped
    MetricsLogger(str(tmp_path), start_step=2, tensorboard=False).close()
    assert [json.loads(ln)["step"] for ln in open(path)] == [0, 1]


def test_token_metrics_are_pooled_over_tokens():
    """grpo's token_* means of a step weight each update by its response tokens (a mean over
    all the step's tokens), not each update alike."""
    pm = UpdateMetrics()
    pm.add({"token_ratio_mean": 1.0, "token_clip_frac": 0.0}, n_self=2, n_cross=0, n_tokens=2)
    pm.add({"token_ratio_mean": 2.0, "token_clip_frac": 1.0}, n_self=1, n_cross=1, n_tokens=6)
    assert pm.result() == pytest.approx({"token_ratio_mean": (2 * 1.0 + 6 * 2.0) / 8,
                                         "token_clip_frac": 6 / 8})


def test_resume_after_a_kept_last_row_without_newline_logs_on_a_line_of_its_own(tmp_path):
    """A kept row that was the file's last and has no newline (whole JSON: only the newline
    was lost) gets one, so the resumed run's first row starts a line of its own."""
    path = tmp_path / "metrics.jsonl"
    _rows(path, [0], last=json.dumps({"step": 1, "loss": 0.5}))
    log = MetricsLogger(str(tmp_path), start_step=2, tensorboard=False)
    log.log(2, {"loss": 0.25})
    log.close()
    assert [json.loads(ln)["step"] for ln in open(path)] == [0, 1, 2]


def test_update_counts_trace_and_pooling_weights(setup, monkeypatch):
    """The trained_* counts are the view's self and cross rows; the trace holds each update's
    own loss and grad norm (replayed into a NonFiniteUpdateError's message elsewhere); each
    applied update is pooled with its minibatch's self rows, cross rows and response tokens."""
    from hacpo.engine import update as upd

    pol, view, lp_old, p_of = setup
    added = []
    real_add = upd.UpdateMetrics.add

    def add(self, metrics, **counts):
        added.append(dict(counts, loss=metrics["loss"], grad_norm=metrics["grad_norm"]))
        real_add(self, metrics, **counts)

    monkeypatch.setattr(upd.UpdateMetrics, "add", add)
    trace = []
    m = update_learner(preset("hacpo", {"num_minibatches": 3}), pol,
                       torch.optim.SGD(pol.parameters(), lr=0.1), view, lp_old=lp_old,
                       old_token_logp=[], prompt_of_sample=p_of,
                       generator=torch.Generator().manual_seed(0), micro_batch=4,
                       grad_clip=0.0, nonfinite={"streak": 0, "total": 0}, max_nonfinite=3,
                       trace=trace)
    assert (m["trained_self"], m["trained_cross"], m["trained_samples"]) == (9.0, 6.0, 15.0)
    assert len(added) == len(trace) == 3
    assert [(t["loss"], t["grad_norm"]) for t in trace] == \
        [(a["loss"], a["grad_norm"]) for a in added]
    assert len({t["loss"] for t in trace}) == 3 and trace[0]["loss"] != trace[0]["grad_norm"]
    assert sum(a["n_self"] for a in added) == 9 and sum(a["n_cross"] for a in added) == 6
    assert sum(a["n_tokens"] for a in added) == sum(len(r) for r in view.response_ids)


def test_tensorboard_gets_the_rows_finite_numbers_only(tmp_path):
    """A row's NaN / inf values are null in metrics.jsonl and left out of TensorBoard (a gap,
    not a point at NaN); non-numbers are left out too."""
    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, k, v, step):
            self.scalars.append((k, v, step))

    log = MetricsLogger(str(tmp_path), tensorboard=False)
    log.tb = Writer()
    log.log(3, {"a": float("nan"), "b": float("inf"), "c": 1.5, "d": 2, "e": "x"})
    assert log.tb.scalars == [("c", 1.5, 3), ("d", 2, 3)]


def test_prompt_blocks_fill_up_to_the_micro_batch(setup):
    """With prompt states, whole prompt groups (5 rows each here) fill a block up to
    ``micro_batch`` rows: 3 groups in blocks of 10 and 5 rows (a block closed before it is
    full forwards more, smaller micro-batches), and a group larger than micro_batch alone."""
    from hacpo.engine.update import _micro_batches

    _, view, _, _ = setup
    rows = list(range(15))
    assert [len(b) for b in _micro_batches(view, rows, 10, by_prompt=True)] == [10, 5]
    assert [len(b) for b in _micro_batches(view, rows, 15, by_prompt=True)] == [15]
    assert [len(b) for b in _micro_batches(view, rows, 3, by_prompt=True)] == [5, 5, 5]
    blocks = _micro_batches(view, rows, 10, by_prompt=True)
    assert sorted(j for b in blocks for j in b) == rows
    assert all(len({tuple(view.prompt_ids[j]) for j in b}) == len(b) // 5 for b in blocks)


@pytest.mark.parametrize("share_prompts", [True, False])
def test_scoring_and_kl_reference_use_the_sampling_temperature(setup, share_prompts):
    """At temperature 2 the update scores the learner and its reference under temperature 2:
    self ratios against old log-probs taken at 2 are 1 (prompt states or whole sequences), and
    the kl metric is the mean over self rows of k3 between the two at 2, summed over every
    micro-batch (micro_batch=4 splits the 9 self rows unevenly)."""
    from hacpo.engine.losses import low_var_kl
    from hacpo.engine.pool import score_responses

    pol, view, _, p_of = setup
    pol.share_prompts = share_prompts
    ref = char_policy("ref", 4)
    lp_old, _ = score_responses(pol, view.prompt_ids, view.response_ids, micro_batch=64,
                                temperature=2.0)
    m = update_learner(preset("hacpo", {"num_minibatches": 1}), pol,
                       torch.optim.SGD(pol.parameters(), lr=0.0), view, lp_old=lp_old,
                       old_token_logp=[], prompt_of_sample=p_of,
                       generator=torch.Generator().manual_seed(0), micro_batch=4,
                       grad_clip=0.0, nonfinite={"streak": 0, "total": 0}, max_nonfinite=3,
                       ref_policy=ref, kl_coef=0.5, temperature=2.0)
    assert m["self_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    sel = [j for j in range(len(view.response_ids)) if bool(view.is_self[j])]
    prompts = [view.prompt_ids[j] for j in sel]
    resps = [view.response_ids[j] for j in sel]
    with torch.no_grad():
        tl, mask = pol.response_logprobs(prompts, resps, temperature=2.0)
        rtl, _ = ref.response_logprobs(prompts, resps, temperature=2.0)
        rtl1, _ = ref.response_logprobs(prompts, resps)
    kl = float(low_var_kl(tl, rtl, mask).mean())
    assert abs(float(low_var_kl(tl, rtl1, mask).mean()) - kl) > 1e-3   # temperature matters
    assert m["kl"] == pytest.approx(kl, rel=1e-5)


def test_amend_row_adds_to_its_steps_row_only_and_never_overwrites(tmp_path):
    """amend_row adds values to the row of its step; False, with the file unchanged, when that
    row is missing (not the next row's) or already holds one of the keys."""
    from hacpo.engine.metrics import amend_row, read_metrics

    path = tmp_path / "metrics.jsonl"
    _rows(path, [0, 1, 3])
    before = path.read_bytes()
    assert not amend_row(str(path), 2, {"eval/a/accuracy": 0.5})
    assert path.read_bytes() == before
    assert amend_row(str(path), 1, {"eval/a/accuracy": 0.5})
    assert [r.get("eval/a/accuracy") for r in read_metrics(str(path))] == [None, 0.5, None]
    after = path.read_bytes()
    assert not amend_row(str(path), 1, {"eval/a/accuracy": 0.75, "eval/b/accuracy": 1.0})
    assert path.read_bytes() == after


def test_local_agents_update_agent_k_with_its_own_state(monkeypatch):
    """LocalAgents.update(k) hands agent k's policy, optimizer, reference policy, grad clip and
    timer names to update_learner, the sampling temperature, and update_agents agent k's own
    ratio log."""
    from types import SimpleNamespace as NS

    from hacpo.engine import agents as ag
    from hacpo.engine.timing import Stopwatch

    seen = []

    def fake_update(algo, policy, optimizer, view, **kw):
        seen.append((policy, optimizer, kw))
        with kw["timer"]("optimizer"):
            return {}

    monkeypatch.setattr(ag, "update_learner", fake_update)
    la = ag.LocalAgents.__new__(ag.LocalAgents)
    la.cfg = NS(algorithm=NS(loss=NS(kl_coef=0.1)), micro_batch=4, max_nonfinite=3,
                rollout=NS(temperature=0.7),
                agents=[NS(optim=NS(grad_clip=1.0)), NS(optim=NS(grad_clip=2.0))])
    la.policies, la.names = ["pa", "pb"], ["a", "b"]
    la.optims, la.refs = ["oa", "ob"], ["ra", "rb"]
    pool = NS(lp_old=None, old_token_logp=[], prompt=None)
    sw = Stopwatch()
    logs = [{"k": 0}, {"k": 1}]
    ag.update_agents(la, ["va", "vb"], pool, generator=None, nonfinite={}, ratio_logs=logs,
                     sw=sw, timer=lambda k: sw(f"agent/{k}"))
    assert [(p, o, kw["ref_policy"], kw["grad_clip"], kw["ratio_log"]["k"], kw["temperature"])
            for p, o, kw in seen] == [("pa", "oa", "ra", 1.0, 0, 0.7),
                                      ("pb", "ob", "rb", 2.0, 1, 0.7)]
    assert {"time/optimizer/a", "time/optimizer/b"} <= set(sw)
    la.cfg.rollout.temperature = 0.0          # greedy sampling: scored at temperature 1
    assert ag.score_temperature(la.cfg) == 1.0


def test_a_new_run_starts_an_empty_metrics_file(tmp_path):
    """A run from step 0 in a dir holding an earlier run's metrics.jsonl (restarted without a
    checkpoint) starts the file anew: its rows are not appended to the earlier run's."""
    path = tmp_path / "metrics.jsonl"
    _rows(path, [0, 1, 2])
    log = MetricsLogger(str(tmp_path), tensorboard=False)
    log.log(0, {"loss": 0.25})
    log.close()
    assert [json.loads(ln) for ln in open(path)] == [{"step": 0, "loss": 0.25}]


def test_local_agents_state_round_trips_model_optimizer_and_reference():
    """LocalAgents.state_dict(k) holds agent k's weights, optimizer state and reference policy
    (the KL term's), and load_state_dict(k) restores all three."""
    from hacpo.engine import agents as ag

    def group(seed):
        torch.manual_seed(seed)
        la = ag.LocalAgents.__new__(ag.LocalAgents)
        la.policies = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
        la.refs = [torch.nn.Linear(2, 2), None]
        la.optims = [adamw(p.parameters(), lr=0.1) for p in la.policies]
        return la

    src, dst = group(0), group(1)
    for p, o in zip(src.policies, src.optims):
        p(torch.ones(2)).sum().backward()
        o.step()
    for k in (0, 1):
        dst.load_state_dict(k, src.state_dict(k))
        for a, b in zip(dst.policies[k].parameters(), src.policies[k].parameters()):
            assert torch.equal(a, b)
        assert str(dst.optims[k].state_dict()) == str(src.optims[k].state_dict())
    assert "ref_model" not in src.state_dict(1)
    for a, b in zip(dst.refs[0].parameters(), src.refs[0].parameters()):
        assert torch.equal(a, b)


def test_local_agents_evaluate_each_agent_on_its_own_tokenization(monkeypatch):
    """LocalAgents.evaluate runs agent k on ``prompt_ids[k]`` (its tokenizer's prompts), not
    on another agent's token ids."""
    from hacpo.engine import agents as ag

    calls = []
    monkeypatch.setattr(ag, "evaluate_policy",
                        lambda p, ids, golds, rc, **kw: calls.append((p, ids)) or {"p": p})
    la = ag.LocalAgents.__new__(ag.LocalAgents)
    la.policies = ["pa", "pb"]
    out = la.evaluate([[[1, 2]], [[3]]], ["4"], None)
    assert calls == [("pa", [[1, 2]]), ("pb", [[3]])]
    assert out == [{"p": "pa"}, {"p": "pb"}]
