"""Rollout-engine and step-pool contracts a mutation audit of hacpo/engine/rollout.py and
hacpo/engine/pool.py found unchecked: each agent samples from an RNG of its own (seeded by
the run's seed and the agent), the in-process engine samples in eval mode from the agent's
own generator and leaves the policy's mode as it was, and the step pool records each sample's
agent and prompt across several agents' rollouts. Expected values are counted by hand or come
from a fresh generator, never from the code under test."""
import torch

from hacpo.engine.pool import build_pool
from hacpo.engine.rollout import LocalRolloutEngine, agent_generators
from hacpo.models.generation import Rollout, generate
from hacpo.models.policy import PolicyConfig, build_policy
from hacpo.models.tokenizer import CharTokenizer


def _char_policy(name, seed):
    return build_policy(PolicyConfig(name=name, kind="decoder", tokenizer="char", d_model=16,
                                     n_layers=1, n_heads=2, max_len=48, seed=seed))


def _draws(g: torch.Generator) -> list[float]:
    return torch.rand(8, generator=g).tolist()


def test_each_agent_has_its_own_rng_and_the_run_seed_picks_them():
    """Agents sharing one stream would sample correlated responses; a seed that does not
    reach the generators would make every run's samples the same."""
    runs = {seed: [_draws(g) for g in agent_generators(seed, 3)] for seed in (1, 2)}
    for seed, draws in runs.items():
        assert len({tuple(d) for d in draws}) == 3, seed        # agents differ pairwise
    assert all(a != b for a, b in zip(runs[1], runs[2]))       # the seed moves every agent
    again = [_draws(g) for g in agent_generators(1, 3)]
    assert again == runs[1]                                    # and is reproducible


def test_engine_state_restores_every_agents_own_generator():
    """A resumed run's engine (other seed) loads every agent's generator as it was saved,
    each agent its own, after the agents drew different amounts."""
    saved = LocalRolloutEngine([None] * 3, seed=1)
    for k, g in enumerate(saved.generators):
        torch.rand(k + 1, generator=g)
    resumed = LocalRolloutEngine([None] * 3, seed=2)
    resumed.load_state_dict(saved.state_dict())
    want = [_draws(g) for g in saved.generators]
    assert [_draws(g) for g in resumed.generators] == want
    assert len({tuple(d) for d in want}) == 3


def test_local_engine_samples_from_the_agents_own_generator():
    """Agent k's rollout equals generate() with a fresh copy of agent k's generator, and
    advances only agent k's generator; reseeding agent k touches only its generator."""
    pols = [_char_policy("a", 1), _char_policy("b", 1)]          # same weights: only RNG differs
    eng = LocalRolloutEngine(pols, seed=3)
    tok = pols[0].tokenizer
    prompts = [tok.prompt_ids("1+2?"), tok.prompt_ids("7-3?")]
    kw = dict(num_samples=3, max_new_tokens=6, temperature=1.0, top_p=1.0)
    before = [g.get_state() for g in eng.generators]
    got = eng.generate(1, prompts, **kw)
    want = generate(pols[1], prompts, generator=agent_generators(3, 2)[1], **kw)
    assert got.response_ids == want.response_ids
    assert torch.equal(eng.generators[0].get_state(), before[0])
    assert not torch.equal(eng.generators[1].get_state(), before[1])
    eng.seed_agent(1, 99)
    assert torch.equal(eng.generators[0].get_state(), before[0])
    assert _draws(eng.generators[1]) == _draws(torch.Generator().manual_seed(99))


def test_local_engine_samples_in_eval_mode_and_keeps_the_policys_mode():
    """A pretrained model may have dropout: sampling runs in eval mode, and the policy is left
    in the mode it was in (training mode between updates, eval mode in evaluation)."""
    pol = _char_policy("a", 1)
    seen = []
    hidden = pol.model.hidden

    def spy(*a, **k):
        seen.append(pol.model.training)
        return hidden(*a, **k)

    pol.model.hidden = spy
    eng = LocalRolloutEngine([pol], seed=0)
    prompts = [pol.tokenizer.prompt_ids("1+2?")]
    for mode in (True, False):
        pol.train(mode)
        seen.clear()
        eng.generate(0, prompts, num_samples=2, max_new_tokens=3, temperature=1.0, top_p=1.0)
        assert seen and not any(seen), mode
        assert pol.training == mode and pol.model.training == mode


def test_build_pool_records_each_samples_agent_and_prompt():
    """Two agents' rollouts, agent-major: agent k's samples carry k, and their prompt is the
    rollout's own prompt_index (prompt-major, G=2), not their position."""
    tok = CharTokenizer()
    e, eos = tok.encode, tok.eos_id
    ro0 = Rollout("a", [[1], [2]], [0, 0, 1, 1], [e("1"), e("2") + [eos], e("3"), []],
                  [[]] * 4, [False, True, False, False], [True, False, True, True])
    ro1 = Rollout("b", [[3], [4]], [0, 0, 1, 1], [e("4") + [eos], e("5"), e("6"), e("7")],
                  [[]] * 4, [True, False, False, False], [False, True, True, True])
    pool = build_pool([(ro0, tok), (ro1, tok)])
    assert pool.agent.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert pool.prompt.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert pool.texts == ["1", "2", "3", "", "4", "5", "6", "7"]
    assert pool.finished_eos == [False, True, False, False, True, False, False, False]
    assert pool.truncated == [True, False, True, True, False, True, True, True]
