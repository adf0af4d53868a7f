"""Held-out evaluation (hacpo/engine/evaluate.py) through a stand-in engine and a tiny char
policy: the sampling settings and seed reach the sampler, the policy's mode is restored, errors
name the held-out prompt and agent, a reward of exactly 0.5 is not a pass, bad inputs and a
wrong response count are refused. Micro-batching (hacpo/engine/batching.py): the tie rule of
balanced shares, negative rows and non-integer limits refused."""
import pytest
import torch

from hacpo.engine.batching import balanced_shares, pack_micro_batches
from hacpo.engine.evaluate import evaluate_policy, sample_and_score, score_named
from hacpo.models.generation import Rollout
from hacpo.models.tokenizer import CharTokenizer

from ._cases import char_policy
from .test_bookkeeping import _EchoEngine, _TableReward


class _Policy:
    """A stand-in policy (decodes, names, keeps a training flag) for engine sampling."""

    def __init__(self, training):
        self.training, self.tokenizer, self.name = training, CharTokenizer(), "p"

    def eval(self):
        self.training = False

    def train(self, mode=True):
        self.training = mode


class _Recording(_EchoEngine):
    """_EchoEngine that records its seeding, the sampling settings and the policy's mode."""

    def __init__(self, tok, outcomes, policy=None):
        super().__init__(tok, outcomes)
        self.policy, self.seeded, self.kw, self.modes = policy, [], [], []

    def seed_agent(self, agent, seed):
        self.seeded.append((agent, seed))

    def generate(self, agent, prompt_ids, **kw):
        self.kw.append((agent, kw))
        self.modes.append(self.policy.training)
        return super().generate(agent, prompt_ids, **kw)


class _Reward:
    """1 for the gold text, exactly 0.5 for "h", else 0; "bad" is refused as item j."""

    def score(self, texts, golds):
        for j, t in enumerate(texts):
            if t == "bad":
                raise ValueError(f"reward 'x' returned 2.0 for item {j}: out of range")
        return [1.0 if t == g else 0.5 if t == "h" else 0.0 for t, g in zip(texts, golds)], None


@pytest.mark.parametrize("training", [True, False])
def test_engine_gets_agent_seed_and_settings_and_the_policys_mode_is_restored(training):
    policy = _Policy(training)
    engine = _Recording(policy.tokenizer, [["0", "9"], ["1", "1"], ["9", "2"]], policy)
    out = evaluate_policy(policy, [[j] for j in range(3)], ["0", "1", "2"], _TableReward(),
                          max_new_tokens=5, samples=2, temperature=0.7, top_p=0.9, batch=2,
                          seed=7, engine=engine, agent=1)
    assert engine.seeded == [(1, 7)]
    settings = {"num_samples": 2, "max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9}
    assert engine.kw == [(1, settings)] * 2
    assert engine.modes == [False, False] and policy.training is training
    # responses "0"+EOS etc.: 2 tokens each; the mean is over responses, not over calls
    assert out["mean_response_tokens"] == pytest.approx(2.0)


def test_a_reward_of_exactly_half_is_not_a_pass():
    policy = _Policy(False)
    engine = _Recording(policy.tokenizer, [["h", "h"], ["9", "1"]], policy)
    out = evaluate_policy(policy, [[0], [1]], ["0", "1"], _Reward(), max_new_tokens=4,
                          samples=2, temperature=1.0, engine=engine, agent=0)
    assert out["pass@2"] == pytest.approx(0.5) and out["accuracy"] == pytest.approx(0.5)


def test_a_bad_reward_names_the_held_out_prompt_and_agent_across_calls():
    """Prompt 2 is item 0 of the second call (batch=2): the error names prompt 2."""
    outcomes = [["0"], ["1"], ["bad"]]
    policy = _Policy(False)
    with pytest.raises(ValueError, match=r"item 0: out of range \(held-out prompt 2, agent p\)$"):
        evaluate_policy(policy, [[j] for j in range(3)], ["0", "1", "2"], _Reward(),
                        max_new_tokens=4, batch=2, engine=_Recording(policy.tokenizer, outcomes,
                                                                     policy), agent=0)
    with pytest.raises(ValueError, match=r"item 0: out of range \(prompt 2, agent p\)$"):
        sample_and_score(policy, [[j] for j in range(3)], ["0", "1", "2"], _Reward(),
                         max_new_tokens=4, batch=2, engine=_Recording(policy.tokenizer,
                                                                      outcomes, policy), agent=0)


def test_a_reward_error_without_an_item_is_raised_unchanged():
    class Boom:
        def score(self, texts, golds):
            raise ValueError("boom")

    with pytest.raises(ValueError, match=r"^boom$"):
        score_named(Boom(), ["x"], ["1"], lambda i: f"prompt {i}")


def test_bad_calls_and_a_wrong_response_count_are_refused():
    policy = _Policy(False)
    engine = _Recording(policy.tokenizer, [["0"]], policy)
    with pytest.raises(ValueError, match="sampling with a rollout engine needs the agent index"):
        evaluate_policy(policy, [[0]], ["0"], _TableReward(), max_new_tokens=4, engine=engine)
    with pytest.raises(ValueError, match="samples must be >= 1, got 0"):
        evaluate_policy(policy, [[0]], ["0"], _TableReward(), max_new_tokens=4, samples=0,
                        engine=engine, agent=0)

    class Extra(_EchoEngine):       # prompt 1 gets one response more than asked for
        def generate(self, agent, prompt_ids, *, num_samples, **kw):
            ro = super().generate(agent, prompt_ids, num_samples=num_samples, **kw)
            return Rollout("p", ro.prompt_ids, ro.prompt_index + [1],
                           ro.response_ids + [ro.response_ids[-1]],
                           ro.sampler_logprobs + [[]], ro.finished_eos + [True],
                           ro.truncated + [False])

    with pytest.raises(RuntimeError, match=r"1 prompt\(s\) \(first: 1\) got 3 responses, not 2"):
        evaluate_policy(policy, [[0], [1]], ["0", "1"], _TableReward(), max_new_tokens=4,
                        samples=2, temperature=1.0,
                        engine=Extra(policy.tokenizer, [["0", "0"], ["1", "1"]]), agent=0)


def test_in_process_sampling_follows_the_seed():
    """Without an engine the policy samples with a generator seeded by ``seed``: the same seed
    gives the same samples whatever the global RNG did, another seed other ones."""
    pol = char_policy("p", 0)
    prompts = [pol.tokenizer.prompt_ids("1+2="), pol.tokenizer.prompt_ids("3+4=")]
    seen = []

    def texts(seed):
        torch.manual_seed(1000 + seed * 7 + len(seen))     # a different global RNG each call
        seen.append(seed)
        return sample_and_score(pol, prompts, ["3", "7"], _TableReward(), max_new_tokens=8,
                                samples=3, temperature=1.0, seed=seed)[1]

    assert texts(1) == texts(1) != texts(2)


def test_balanced_shares_break_a_token_tie_by_fewer_rows_before_the_lower_share():
    # 6 -> 0, 4 -> 1, 3 -> 2, 3 -> 2 (6), 1 -> 1, 1 -> 1 (6, three rows), 1 -> 0 (all at 6: the
    # fewest rows); the last 1: shares 1 and 2 at 6 tokens, share 2 has fewer rows (2 < 3)
    assert balanced_shares([6, 4, 3, 3, 1, 1, 1, 1], 3) == [[0, 6], [1, 4, 5], [2, 3, 7]]


def test_negative_rows_and_non_integer_limits_are_refused():
    with pytest.raises(ValueError, match="row -1 is out of range for 2 lengths"):
        balanced_shares([3, 4], 2, rows=[-1])
    with pytest.raises(ValueError, match="row -2 is out of range for 2 lengths"):
        pack_micro_batches([3, 4], 8, 4, rows=[0, -2])
    with pytest.raises(ValueError, match=r"parts must be an integer >= 1, got 2\.0"):
        balanced_shares([3, 4], 2.0)
    with pytest.raises(ValueError, match="parts must be an integer >= 1, got True"):
        balanced_shares([3, 4], True)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got True"):
        pack_micro_batches([3], True, 4)
    with pytest.raises(ValueError, match=r"max_rows must be an integer >= 1, got 2\.5"):
        pack_micro_batches([3], 8, 2.5)
