"""The training loop's bookkeeping, checked against counts made by hand (a mutation audit found
these paths unchecked): which tokens of a response are scored and under which prompt and
temperature, which samples a learner's view keeps and with which advantage / omega / self flag,
the per-agent metrics of a step, the sampler's restored cursor, and held-out accuracy / pass@k
over more prompts than one sampling batch."""
import json
import math
from types import SimpleNamespace

import pytest
import torch

from hacpo.engine.capability import CapabilityTracker
from hacpo.engine.data import Example, PromptSampler
from hacpo.engine.evaluate import evaluate_policy
from hacpo.engine.pool import LearnerView, StepPool, compute_old_logprobs, learner_view
from hacpo.engine.rewards import RewardStats, register_reward
from hacpo.engine.run_config import load_config
from hacpo.engine.trainer import _step_metrics, _view_tokens, train
from hacpo.models.generation import Rollout
from hacpo.models.policy import PolicyConfig, build_policy
from hacpo.models.retokenize import RetokStats
from hacpo.models.tokenizer import CharTokenizer


def _char_policy(name, seed, max_len=48):
    return build_policy(PolicyConfig(name=name, kind="decoder", tokenizer="char", d_model=16,
                                     n_layers=1, n_heads=2, max_len=max_len, seed=seed))


def _reference_mean_logp(policy, prompt, scored, temperature):
    """Mean log-prob of the tokens ``scored`` after ``prompt``, from one unpadded forward."""
    ids = torch.tensor([prompt + scored])
    with torch.no_grad():
        logits = policy.forward_logits(ids, torch.ones_like(ids, dtype=torch.bool))[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    toks = [logp[len(prompt) + t - 1, tok] for t, tok in enumerate(scored)]
    return torch.stack(toks)


def test_old_logprobs_score_all_but_a_final_eos_under_the_generators_prompt_and_temperature():
    """SPEC "Sequence ratio": lp_old is the mean token log-prob under the generator, in its own
    tokenization (its own templated prompt), under the sampling temperature, with only a
    *final* EOS left out of the mean; an empty or EOS-only response cannot be scored (NaN)."""
    pols = [_char_policy("a", 1), _char_policy("b", 2)]
    tok = pols[0].tokenizer
    eos = tok.eos_id
    # each agent templates the same question its own way: other ids, other lengths
    prompt_ids = [[tok.prompt_ids("1+2?"), tok.prompt_ids("7-3?")],
                  [tok.prompt_ids("what is 1+2?"), tok.prompt_ids("what is 7-3, then?")]]
    e = tok.encode
    responses = [e("3") + [eos], [eos] + e("45"), e("12345"),   # agent 0
                 [eos], [], e("4") + [eos] + e("4") + [eos]]    # agent 1
    pool = StepPool(torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 1, 0, 1, 0, 1]),
                    responses, [""] * 6, [True] * 6, [False] * 6)
    T = 0.7
    # micro-batch 2: rows of different lengths are padded next to each other
    compute_old_logprobs(pool, pols, prompt_ids, micro_batch=2, temperature=T)
    scored = [1, 3, 5, 0, 0, 3]           # by hand: tokens before a final EOS
    for i, n in enumerate(scored):
        if n == 0:
            assert math.isnan(pool.lp_old[i]) and pool.old_token_logp[i].numel() == 0, i
            continue
        k, p = int(pool.agent[i]), int(pool.prompt[i])
        want = _reference_mean_logp(pols[k], prompt_ids[k][p], responses[i][:n], T)
        assert pool.old_token_logp[i].shape == (n,), i
        torch.testing.assert_close(pool.old_token_logp[i], want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool.lp_old[i], want.mean(), rtol=1e-4, atol=1e-5)


def test_old_logprobs_charge_each_generators_scoring_to_its_own_timer(monkeypatch):
    """``time/old_logprobs/<agent>``: each generator's forward pass runs inside ``timer`` of
    its name (a pass moved out of it left that agent's time ~0 with no test failing)."""
    from contextlib import contextmanager
    from hacpo.engine import pool as pool_mod
    pols = [_char_policy("a", 1), _char_policy("b", 2)]
    tok = pols[0].tokenizer
    prompt_ids = [[tok.prompt_ids("1+2?")], [tok.prompt_ids("what is 1+2?")]]
    pool = StepPool(torch.tensor([0, 1]), torch.tensor([0, 0]), [tok.encode("3"), tok.encode("4")],
                    [""] * 2, [True] * 2, [False] * 2)
    active, seen = [], []
    real = pool_mod.score_responses

    def spy(policy, *args, **kw):
        seen.append((policy.name, list(active)))
        return real(policy, *args, **kw)

    @contextmanager
    def timer(name):
        active.append(name)
        try:
            yield
        finally:
            active.pop()

    monkeypatch.setattr(pool_mod, "score_responses", spy)
    compute_old_logprobs(pool, pols, prompt_ids, micro_batch=2, timer=timer)
    assert seen == [("a", ["a"]), ("b", ["b"])]
    assert not torch.isnan(pool.lp_old).any()


def _two_char_pool():
    """Six samples of two agents; see the table in the test below."""
    tok = CharTokenizer()
    eos, e = tok.eos_id, tok.encode
    responses = [e("12") + [eos],        # 0 agent 0, prompt 0
                 [],                     # 1 agent 0, prompt 1: empty
                 e("3") + [eos],         # 2 agent 1, prompt 0
                 e("4545454545"),        # 3 agent 0, prompt 1: 10 tokens, no EOS
                 e("6"),                 # 4 agent 1, prompt 1: generator could not score it
                 e("78") + [eos]]        # 5 agent 1, prompt 0
    pool = StepPool(torch.tensor([0, 0, 1, 0, 1, 1]), torch.tensor([0, 1, 0, 1, 1, 0]),
                    responses, [tok.decode(r) for r in responses], [True, False, True, False,
                                                                    False, True],
                    [False, False, False, True, False, False],
                    lp_old=torch.tensor([-1.0, float("nan"), -2.0, -3.0, float("nan"), -1.5]))
    return tok, pool


def test_learner_view_keeps_each_samples_own_advantage_omega_and_self_flag():
    """learner_view over a permuted index: the kept samples carry the advantage and omega given
    at *their* position, is_self says whether the *pool* sample is the learner's, prompts are the
    learner's templated ones, cross responses are re-tokenized and cut only to what fits the
    learner's positions after its own prompt (max_new_tokens=2 is below their length, but the cut
    is at most max(4 * max_new_tokens, 16)), with the final EOS left out, and
    dropped samples are counted by cause."""
    tok, pool = _two_char_pool()
    learner = 1
    # the learner's max_len leaves 6 positions after its (longer) templated prompt 1: the
    # 10-token cross sample 3 is cut to 6 (the generator's shorter prompt would leave 15)
    pols = [SimpleNamespace(tokenizer=CharTokenizer(name="c0"), max_len=64),
            SimpleNamespace(tokenizer=tok, max_len=len(tok.prompt_ids("question y")) + 6)]
    prompt_ids = [[tok.prompt_ids("x"), tok.prompt_ids("y")],                # agent 0's
                  [tok.prompt_ids("question x"), tok.prompt_ids("question y")]]  # learner's
    idx = torch.tensor([5, 4, 3, 2, 1, 0])
    adv = (idx + 1).float() / 10          # the value at position j belongs to pool sample idx[j]
    omega = (idx + 1).float() * 10
    view = learner_view(pool, learner, idx, adv, omega, pols, prompt_ids, 2, RetokStats(), True)
    kept = [5, 3, 2, 0]                   # 4: no old log-prob, 1: empty
    assert view.idx.tolist() == kept
    torch.testing.assert_close(view.advantages, torch.tensor([0.6, 0.4, 0.3, 0.1]))
    torch.testing.assert_close(view.omega, torch.tensor([60.0, 40.0, 30.0, 10.0]))
    assert view.is_self.tolist() == [True, False, True, False]
    assert view.prompt_ids == [prompt_ids[1][0], prompt_ids[1][1], prompt_ids[1][0],
                               prompt_ids[1][0]]
    assert view.response_ids == [tok.encode("78"), tok.encode("454545"), tok.encode("3"),
                                 tok.encode("12")]
    assert view.dropped == {"empty": 1, "unencodable": 0, "no_old_logprob": 1}


def test_step_metrics_count_each_agents_own_samples():
    """The per-agent rows of a step's metrics, counted by hand from the pool: rewards, response
    tokens, EOS rate, truncations and unscoreable samples of that agent only; Phat after this
    step's update; omega[name -> other] = clamp(Phat(name) / Phat(other))."""
    tok, pool = _two_char_pool()
    pool.rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    tracker = CapabilityTracker(2)
    tracker.update(pool.rewards, pool.agent)
    ratios = tracker.ratios()
    m = _step_metrics(pool, tracker, ratios, ["a", "b"], RewardStats(), RetokStats())
    # agent 0: samples 0, 1, 3 -> rewards 1, 0, 0; lengths 3, 0, 10; EOS 1 of 3; 1 truncated;
    # 1 unscoreable (sample 1). agent 1: samples 2, 4, 5 -> rewards 1, 0, 1; lengths 2, 1, 3;
    # EOS 2 of 3; none truncated; 1 unscoreable (sample 4)
    assert m["reward/a"] == pytest.approx(1 / 3) and m["reward/b"] == pytest.approx(2 / 3)
    assert m["tokens/generated/a"] == 13 and m["tokens/generated/b"] == 6
    assert m["response_tokens/a"] == pytest.approx(13 / 3)
    assert m["response_tokens/b"] == pytest.approx(2.0)
    assert m["eos_rate/a"] == pytest.approx(1 / 3) and m["eos_rate/b"] == pytest.approx(2 / 3)
    assert m["truncated/a"] == 1 and m["truncated/b"] == 0
    assert m["unscoreable/a"] == 1 and m["unscoreable/b"] == 1
    # positive_rate: P(a) = 1/3, P(b) = 2/3 (SPEC "Capability"; one step: Phat = P)
    assert m["phat/a"] == pytest.approx(1 / 3) and m["phat/b"] == pytest.approx(2 / 3)
    assert m["omega/a->b"] == pytest.approx(0.5) and m["omega/b->a"] == pytest.approx(2.0)


def test_view_tokens_split_self_and_cross():
    view = LearnerView(idx=torch.arange(3), advantages=torch.zeros(3), omega=torch.ones(3),
                       is_self=torch.tensor([True, False, False]),
                       prompt_ids=[[1] * 4, [1] * 5, [1] * 6],
                       response_ids=[[7] * 2, [7] * 3, [7] * 1], dropped={})
    assert _view_tokens(view, "a") == {"tokens/scored_self/a": 2.0,
                                       "tokens/forward_self/a": 6.0,
                                       "tokens/scored_cross/a": 4.0,
                                       "tokens/forward_cross/a": 15.0}


def _examples(n):
    return [Example(id=str(i), prompt=f"p{i}", answer=str(i), source="t") for i in range(n)]


def test_sampler_restored_into_a_used_sampler_draws_the_states_batches():
    """load_state_dict into a sampler that already drew (other seed, same epoch number) yields
    the state's batches, not the old permutation it had cached."""
    exs = _examples(9)
    ref = PromptSampler(exs, seed=11)
    ref.next_batch(4)
    state = json.loads(json.dumps(ref.state_dict()))
    want = [e.id for e in ref.next_batch(10)]
    used = PromptSampler(exs, seed=5)
    used.next_batch(2)                     # caches seed 5's epoch-0 permutation
    used.load_state_dict(state)
    assert [e.id for e in used.next_batch(10)] == want


def test_sampler_restores_the_states_shuffle_setting():
    """A state of an unshuffled sampler continues in file order in any sampler it is loaded in."""
    exs = _examples(6)
    plain = PromptSampler(exs, seed=3, shuffle=False)
    assert [e.id for e in plain.next_batch(2)] == ["0", "1"]
    other = PromptSampler(exs, seed=3)     # shuffle=True
    other.load_state_dict(plain.state_dict())
    assert [e.id for e in other.next_batch(6)] == ["2", "3", "4", "5", "0", "1"]


class _EchoEngine:
    """A rollout engine whose samples for a prompt are given: prompt ``[j]`` (its one id is the
    problem's index) gets ``outcomes[j][m]`` as its m-th sample."""

    def __init__(self, tok, outcomes):
        self.tok, self.outcomes, self.calls = tok, outcomes, []

    def seed_agent(self, agent, seed):
        pass

    def generate(self, agent, prompt_ids, *, num_samples, max_new_tokens, temperature, top_p):
        self.calls.append(len(prompt_ids))
        index, resp, fin = [], [], []
        for b, (j,) in enumerate(prompt_ids):
            for m in range(num_samples):
                text = self.outcomes[j][m]
                ends = not text.endswith("~")        # "~": cut at max_new_tokens, no EOS
                index.append(b)
                resp.append(self.tok.encode(text.rstrip("~")) + ([self.tok.eos_id] if ends else []))
                fin.append(ends)
        return Rollout("p", [list(p) for p in prompt_ids], index, resp, [[] for _ in resp], fin,
                       [not f for f in fin])


class _TableReward:
    """reward = 1 for the gold text, 0.25 for "half", else 0 (the verifier is not under test)."""

    def score(self, texts, golds):
        r = [1.0 if t == g else 0.25 if t.startswith("half") else 0.0
             for t, g in zip(texts, golds)]
        return r, RewardStats(total=len(r))


def test_evaluation_over_several_sampling_batches_counts_each_problem_once():
    """evaluate_policy with batch=2 over 5 problems (3 engine calls): each sample is scored
    against its own problem's gold. avg@k = mean reward, pass@k counts a problem whose reward
    is above 0.5 in any of its k samples (a partial 0.25 is not a pass), stderr is the binomial
    sqrt(acc (1 - acc) / n), eos_rate is per sample."""
    tok = CharTokenizer()
    golds = ["0", "1", "2", "3", "4"]
    outcomes = [["0", "9"],          # problem 0: 1 of 2 right
                ["1", "1"],          # 1: both
                ["9", "half"],       # 2: none right, one partial (0.25)
                ["9~", "9"],         # 3: none, one cut
                ["4~", "half"]]      # 4: 1 right (cut at the limit), one partial
    engine = _EchoEngine(tok, outcomes)
    policy = SimpleNamespace(training=False, eval=lambda: None, train=lambda mode=True: None,
                             tokenizer=tok, name="p")
    out = evaluate_policy(policy, [[j] for j in range(5)], golds, _TableReward(),
                          max_new_tokens=4, samples=2, temperature=1.0, batch=2, engine=engine,
                          agent=0)
    assert engine.calls == [2, 2, 1]
    rewards = [[1, 0], [1, 1], [0, 0.25], [0, 0], [1, 0.25]]
    acc = sum(sum(r) / 2 for r in rewards) / 5
    assert out["accuracy"] == pytest.approx(acc) and out["n"] == 5
    # over the per-problem avg@2 (0.5, 1, 0.125, 0, 0.625; mean 0.45): population sd / sqrt(5)
    # (the binomial sqrt(p(1-p)/n) = 0.2225 holds for 0/1 rewards at k = 1 only)
    assert out["stderr"] == pytest.approx(math.sqrt(0.64375 / 5 / 5))
    assert out["pass@2"] == pytest.approx(3 / 5)          # problems 0, 1, 4
    assert out["eos_rate"] == pytest.approx(8 / 10)


def test_a_large_pass_k_is_sampled_in_bounded_calls(monkeypatch):
    """pass@k with a large k generated prompts x k responses in one call (128 x 100000 took
    22 GB before the kernel killed it): at most MAX_EVAL_ROWS per call now, fewer prompts and
    the samples in chunks, every problem still scored on its k samples in order."""
    from hacpo.engine import evaluate as ev

    class Counting(_EchoEngine):    # each call: the next samples of each prompt's outcomes
        def __init__(self, tok, outcomes):
            super().__init__(tok, outcomes)
            self.taken, self.rows = [0] * len(outcomes), []

        def generate(self, agent, prompt_ids, *, num_samples, **kw):
            index, resp = [], []
            for b, (j,) in enumerate(prompt_ids):
                for text in self.outcomes[j][self.taken[j]:self.taken[j] + num_samples]:
                    index.append(b)
                    resp.append(self.tok.encode(text) + [self.tok.eos_id])
                self.taken[j] += num_samples
            self.rows.append(len(resp))
            return Rollout("p", [list(p) for p in prompt_ids], index, resp, [[] for _ in resp],
                           [True] * len(resp), [False] * len(resp))

    monkeypatch.setattr(ev, "MAX_EVAL_ROWS", 4)
    tok = CharTokenizer()
    golds = ["0", "1", "2"]
    outcomes = [["9", "9", "9", "9", "9", "0"],       # right only in its 6th sample
                ["1", "9", "9", "9", "9", "9"],
                ["9"] * 6]
    engine = Counting(tok, outcomes)
    policy = SimpleNamespace(training=False, eval=lambda: None, train=lambda mode=True: None,
                             tokenizer=tok, name="p")
    out = evaluate_policy(policy, [[j] for j in range(3)], golds, _TableReward(),
                          max_new_tokens=4, samples=6, temperature=1.0, batch=128,
                          engine=engine, agent=0)
    assert engine.rows == [4, 2, 4, 2, 4, 2] and engine.taken == [6, 6, 6]
    assert out["pass@6"] == pytest.approx(2 / 3) and out["accuracy"] == pytest.approx(2 / 18)


@register_reward("_test_bookkeeping_by_length", in_process=True, overwrite=True)
def _reward_by_length(response, gold):
    """0, 0.5 or 1 by the response's and its gold answer's lengths: varied rewards from
    untrained agents, other ones for another gold."""
    return (0.0, 0.5, 1.0)[(len(response) + sum(map(ord, gold))) % 3]


def _spec_advantages(r, prompt, agent, learner, omega, eps=1e-6):
    """SPEC "Advantages for learner k", written out per group (learner's baseline for all)."""
    out = torch.zeros_like(r)
    for p in prompt.unique().tolist():
        g = (prompt == p).nonzero().flatten().tolist()
        rg = [float(r[i]) for i in g]
        w = [1.0 / float(omega[int(agent[i]), learner]) for i in g]
        if max(rg) == min(rg):
            mu = sum(rg) / len(rg)
        else:
            mu = sum(wi * ri for wi, ri in zip(w, rg)) / len(rg)
            if mu > 1:
                own = [ri for i, ri in zip(g, rg) if int(agent[i]) == learner]
                mu = sum(own) / len(own)
        mean = sum(rg) / len(rg)
        sigma = math.sqrt(sum((x - mean) ** 2 for x in rg) / (len(rg) - 1)) + eps
        for i, ri in zip(g, rg):
            out[i] = (ri - mu) / sigma
    return out


def test_each_learner_trains_on_its_steps_samples_with_its_own_advantages(tmp_path, monkeypatch):
    """One tiny3 step (3 agents, 3 tokenizers), the pool and the learners' views caught at the
    update: every reward is the verifier's for the sample's own prompt; Phat is this step's
    positive rate (SPEC: the tracker is updated before the advantages), omega[s, t] its
    clamped ratio; learner k's view flags its own samples, carries omega[source, k] and the
    SPEC advantages with k's baseline."""
    from hacpo.engine import trainer as tr
    seen = {"batches": [], "steps": []}
    real_next, real_update = PromptSampler.next_batch, tr.update_agents

    def next_batch(self, b):
        seen["batches"].append(real_next(self, b))
        return seen["batches"][-1]

    def update_agents(agents, views, pool, **kw):
        seen["steps"].append((views, pool))
        return real_update(agents, views, pool, **kw)

    from hacpo.engine import agents as ag
    real_learner = ag.update_learner

    def update_learner(algo, policy, *a, **kw):
        seen.setdefault("grad_clip", {})[policy.name] = kw["grad_clip"]
        return real_learner(algo, policy, *a, **kw)

    monkeypatch.setattr(PromptSampler, "next_batch", next_batch)
    monkeypatch.setattr(tr, "update_agents", update_agents)
    monkeypatch.setattr(ag, "update_learner", update_learner)
    cfg = load_config("tiny3", overrides={
        "out_dir": str(tmp_path / "run"), "cache_dir": str(tmp_path / "cache"), "threads": "1",
        "steps": "1", "plots": "false", "tensorboard": "false", "data.eval_size": "0",
        "reward.name": "_test_bookkeeping_by_length", "rollout.group_size": "3",
        "agents.1.optim.grad_clip": "0.5", "agents.2.optim.grad_clip": "2.0"})
    train(cfg, echo=lambda *_: None)
    (batch,), ((views, pool),) = seen["batches"], seen["steps"]
    n, N = 3, pool.num_samples
    assert N == n * len(batch) * 3
    want_r = [_reward_by_length(pool.texts[i], batch[int(pool.prompt[i])].answer)
              for i in range(N)]
    assert pool.rewards.tolist() == want_r
    P = torch.tensor([max(float((pool.rewards[pool.agent == a] > 0).float().mean()), 1e-8)
                      for a in range(n)])
    omega = (P[:, None] / P[None, :]).clamp(0.1, 10.0)
    assert len(set(P.tolist())) > 1, "agents of equal capability: omega cannot tell them apart"
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    for k, view in enumerate(views):
        src = pool.agent[view.idx]
        assert view.is_self.tolist() == (src == k).tolist()
        torch.testing.assert_close(view.omega, omega[src, k].float())
        want = _spec_advantages(pool.rewards, pool.prompt, pool.agent, k, omega)
        torch.testing.assert_close(view.advantages, want[view.idx], rtol=1e-5, atol=1e-5)
    names = [a.policy.name for a in cfg.agents]
    assert seen["grad_clip"] == {names[0]: cfg.agents[0].optim.grad_clip, names[1]: 0.5,
                                 names[2]: 2.0}
    for k, view in enumerate(views):
        for key, v in view.dropped.items():
            assert row[f"dropped/{names[k]}/{key}"] == v
    assert sum(row[f"dropped/{nm}/unencodable"] for nm in names) > 0, \
        "no cross sample dropped: the per-agent counts are not told apart"
    for s, a in enumerate(cfg.agents):
        for t, b in enumerate(cfg.agents):
            if s != t:
                assert row[f"omega/{a.policy.name}->{b.policy.name}"] == pytest.approx(
                    float(omega[s, t]))



def test_gspo2x_samples_twice_the_group_size(tmp_path):
    """SPEC: gspo2x draws 2G samples per prompt (HACPO's rollout cost), every one scored."""
    from hacpo.engine.compare import with_algorithm
    cfg = with_algorithm(load_config("tiny3", overrides={
        "out_dir": str(tmp_path / "run"), "cache_dir": str(tmp_path / "cache"), "threads": "1",
        "steps": "1", "plots": "false", "tensorboard": "false", "data.eval_size": "0",
        "rollout.group_size": "2", "prompts_per_step": "2"}), "gspo2x", {})
    train(cfg, echo=lambda *_: None)
    row = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert row["reward_fn/total"] == 3 * 2 * (2 * 2)     # agents x prompts x 2G


def test_build_pool_texts_leave_out_special_tokens():
    """The verifier reads a response's text without its EOS (or other special tokens)."""
    from hacpo.engine.pool import build_pool
    tok = CharTokenizer()
    e = tok.encode
    ro = Rollout("a", [[1]], [0, 0], [e("12") + [tok.eos_id], [tok.bos_id] + e("3")],
                 [[], []], [True, False], [False, True])
    pool = build_pool([(ro, tok)])
    assert pool.texts == ["12", "3"]
    assert pool.agent.tolist() == [0, 0] and pool.truncated == [False, True]


@register_reward("_test_string_reward", in_process=True, overwrite=True)
def _string_reward(response, gold):
    return "1"


def test_a_reward_returned_as_text_is_an_error():
    """A reward must be a number: the string "1" is refused (named), not read as 1.0."""
    from hacpo.engine.rewards import RewardComputer
    with RewardComputer("_test_string_reward") as rc:
        with pytest.raises(ValueError, match=r"returned '1' for item 0: not a number"):
            rc.score(["x"], ["1"])


def test_balanced_shares_deal_longest_first_to_the_fewest_tokens():
    """Longest-processing-time by hand: 10 -> share 0; then each 1 to the share with the fewest
    tokens (share 1), not round-robin by row count."""
    from hacpo.engine.batching import balanced_shares
    assert balanced_shares([10, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert balanced_shares([1, 5, 4, 3, 3], 2) == [[1, 4], [0, 2, 3]]   # 5+3 | 4+3+1


def test_sampler_state_checks():
    """A cursor past the last example, a state of examples with other answers, and an older
    state (no content digest) of other ids: each a ValueError, nothing restored."""
    exs = _examples(4)
    state = PromptSampler(exs, seed=1).state_dict()
    with pytest.raises(ValueError, match="invalid sampler position 4"):
        PromptSampler(exs, seed=1).load_state_dict({**state, "position": 4})
    other_answer = exs[:3] + [Example(id="3", prompt="p3", answer="33", source="t")]
    with pytest.raises(ValueError, match="other content"):
        PromptSampler(other_answer, seed=1).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "content"}
    other_ids = [Example(id=f"x{i}", prompt=f"p{i}", answer=str(i), source="t")
                 for i in range(4)]
    with pytest.raises(ValueError, match="different examples"):
        PromptSampler(other_ids, seed=1).load_state_dict(old)


def test_gsm8k_gold_is_after_the_last_marker_and_limit_is_exact(tmp_path):
    from hacpo.engine.data import load_examples, parse_gold
    assert parse_gold("so\n#### 3\nno, redo:\n#### 5", "gsm8k") == "5"
    # markers on one line: the answer ends at the next marker; an empty last one is passed over
    assert parse_gold("#### 3 was wrong; #### 5", "gsm8k") == "5"
    assert parse_gold("#### 4 ####", "gsm8k") == "4"
    path = tmp_path / "g.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n"
                            for i in range(3)))
    exs, _ = load_examples(path, limit=2)
    assert [e.answer for e in exs] == ["0", "1"]


def test_a_bad_reward_names_the_samples_own_prompt_and_agent():
    """score_batch: the verifier's error for item i is extended with sample i's prompt and
    agent (here the second agent's sample of prompt 1)."""
    from hacpo.engine.trainer import score_batch

    class BadSecond:
        def score(self, texts, golds):
            raise ValueError("reward 'x' returned 2.0 for item 2: rewards must be finite and "
                             "in [0, 1]")

    pool = StepPool(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 1]), [[5], [5], [5]],
                    ["a", "b", "c"], [False] * 3, [True] * 3)
    with pytest.raises(ValueError, match=r"item 2: .* \(prompt 1, agent second\)$"):
        score_batch(BadSecond(), pool, ["1", "2"], ["first", "second"])


def test_metrics_rows_are_strict_json_with_non_finite_values_as_null(tmp_path):
    from hacpo.engine.metrics import MetricsLogger

    def strict(c):
        raise ValueError(f"not JSON: {c}")

    log = MetricsLogger(str(tmp_path), tensorboard=False)
    log.log(0, {"a": float("nan"), "b": float("inf"), "c": 1.5})
    log.close()
    (line,) = open(tmp_path / "metrics.jsonl").read().splitlines()
    assert json.loads(line, parse_constant=strict) == {"step": 0, "a": None, "b": None, "c": 1.5}


def _quiet_tiny3(tmp_path, steps: int, **over):
    """tiny3 in ``tmp_path/run`` for ``steps`` steps: one thread, no plots, no held-out set."""
    return load_config("tiny3", overrides={
        "out_dir": str(tmp_path / "run"), "cache_dir": str(tmp_path / "cache"),
        "threads": "1", "steps": str(steps), "plots": "false", "tensorboard": "false",
        "data.eval_size": "0", **over})


def test_last_step_is_checkpointed_and_resume_keeps_the_nonfinite_count(tmp_path):
    """checkpoint_every=5 with steps=1: the run's last step is still checkpointed. A resume at
    steps equal to the checkpoint's step is allowed (nothing left to train), and a resume that
    trains on carries the checkpoint's count of non-finite updates (here set to 3 by hand)."""
    from hacpo.engine import checkpoint as ckpt

    def cfg(steps):
        return _quiet_tiny3(tmp_path, steps, checkpoint_every="5")

    path = str(tmp_path / "run" / "checkpoint.pt")
    train(cfg(1), echo=lambda *_: None)
    state = ckpt.load(path)
    assert state["step"] == 1 and state["nonfinite"] == {"streak": 0, "total": 0}
    state["nonfinite"] = {"streak": 0, "total": 3}
    ckpt.save_atomic(state, path)
    train(cfg(1), resume=True, echo=lambda *_: None)
    train(cfg(2), resume=True, echo=lambda *_: None)
    state = ckpt.load(path)
    assert state["step"] == 2 and state["nonfinite"]["total"] == 3


def test_resume_carries_a_nonfinite_streak_mid_way(tmp_path, monkeypatch):
    """A checkpoint written in the middle of a streak of non-finite updates: the resumed run
    goes on counting that streak (max_nonfinite=3, streak 2 saved: the first non-finite update
    after the resume stops the run, as it would have without the interruption), while a
    checkpoint with streak 0 needs 3 more. Non-finite updates are forced by reporting every
    update as non-finite to the streak counter."""
    from hacpo.engine import checkpoint as ckpt
    from hacpo.engine import update as upd

    def cfg(steps):
        return _quiet_tiny3(tmp_path, steps, max_nonfinite="3")

    path = str(tmp_path / "run" / "checkpoint.pt")
    train(cfg(1), echo=lambda *_: None)
    saved = ckpt.load(path)
    assert saved["step"] == 1 and saved["nonfinite"] == {"streak": 0, "total": 0}
    real = upd._count_nonfinite
    calls = []

    def all_nonfinite(nonfinite, max_nonfinite, name, finite, loss, grad_norm):
        calls.append(name)
        real(nonfinite, max_nonfinite, name, False, loss, grad_norm)

    monkeypatch.setattr(upd, "_count_nonfinite", all_nonfinite)
    for streak, expected_calls in ((2, 1), (0, 3)):
        state = dict(saved, nonfinite={"streak": streak, "total": 5})
        ckpt.save_atomic(state, path)
        calls.clear()
        with pytest.raises(upd.NonFiniteUpdateError, match=r"3 non-finite updates in a row") as e:
            train(cfg(2), resume=True, echo=lambda *_: None)
        assert len(calls) == expected_calls, (streak, calls, e.value)
